"""Parallelism applied to a plain model: one function per technique (see apply.py)."""
