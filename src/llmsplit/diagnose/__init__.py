"""Diagnosis: environment checks, and (later) OOM and hang explanations."""
