"""Inference: loading trained models and generating text."""
