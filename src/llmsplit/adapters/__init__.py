"""Adapters applied from outside the plain model (LoRA)."""
