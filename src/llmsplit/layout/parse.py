"""`--layout zero=3,tp=2,pp=1` (the [parallel]/[memory] keys, plus micro_batch) as a Layout."""

from __future__ import annotations

from dataclasses import fields, replace

from ..errors import ConfigError
from .spec import Layout


LAYOUT_KEYS = {f.name for f in fields(Layout)}


def parse_layout(text: str, base: Layout | None = None) -> Layout:
    """`zero=3,tp=2,pp=1` (the [parallel]/[memory] keys, plus micro_batch) → Layout."""
    values = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        if "=" not in item:
            raise ConfigError(f"--layout item {item!r} must look like KEY=VALUE, e.g. --layout zero=3,tp=2")
        key, raw = (s.strip() for s in item.split("=", 1))
        key = key.split(".")[-1]  # accept parallel.tp as well as tp
        if key not in LAYOUT_KEYS:
            raise ConfigError(f"--layout key {key!r} is not one of: {', '.join(sorted(LAYOUT_KEYS))}")
        values[key] = _value(key, raw)
    return replace(base or Layout(), **values)


def _value(key: str, raw: str):
    if key in ("pp_schedule", "activation_checkpoint", "offload", "cp_mode"):
        return raw.strip('"\'')
    if key == "sequence_parallel":
        if raw.lower() not in ("true", "false"):
            raise ConfigError(f"--layout sequence_parallel={raw!r} must be true or false")
        return raw.lower() == "true"
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"--layout {key}={raw!r} must be an integer") from None
