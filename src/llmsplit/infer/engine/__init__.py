"""The engine's room: requests only, no model code and no HTTP. `Engine.step()` is
schedule -> run -> sample -> emit; start reading at engine.py."""

from .engine import Engine
from .sequence import SamplingParams, Sequence

__all__ = ["Engine", "SamplingParams", "Sequence"]
