"""The run configuration as TOML: read from a file with `KEY=VALUE` overrides on top (names
and types checked as they are set), and written back (a run's config.toml)."""

from __future__ import annotations

import sys
from dataclasses import fields
from pathlib import Path
from typing import NoReturn

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from ..errors import ConfigError
from .keys import closest_key
from .sections import Config


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a TOML file (optional) and apply `KEY=VALUE` overrides, checking names and types."""
    raw: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist; pass an existing .toml file to --config")
        try:
            raw = tomllib.loads(p.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"config file {str(path)!r} is not valid TOML ({e}); fix the syntax") from None
    return config_from_dict(raw, overrides)


def config_from_toml(text: str) -> Config:
    return config_from_dict(tomllib.loads(text))


def config_from_dict(raw: dict, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    cfg = Config()
    for section, values in raw.items():
        if not isinstance(values, dict):
            raise ConfigError(f"top-level key {section!r} in the config file must be a [section]; "
                              f"known sections: {', '.join(_sections())}")
        for key, value in values.items():
            set_key(cfg, f"{section}.{key}", value)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r} must look like KEY=VALUE, e.g. --set train.steps=10")
        key, text = item.split("=", 1)
        set_key(cfg, key.strip(), _parse_value(text.strip()))
    return cfg


# Keys whose name is a Python keyword, held by a field of another name.
KEYWORD_KEYS = {"checkpoint.async": "checkpoint.async_save"}


def set_key(cfg: Config, dotted: str, value) -> None:
    dotted = KEYWORD_KEYS.get(dotted, dotted)
    section_name, _, key = dotted.partition(".")
    if section_name not in _sections() or not key:
        _refuse_key(dotted, f"keys look like SECTION.KEY with SECTION one of {', '.join(_sections())}")
    section = getattr(cfg, section_name)
    known = {f.name: f for f in fields(section)}
    if key not in known:
        _refuse_key(dotted, f"{section_name} has: {', '.join(known)}")
    setattr(section, key, _coerce(dotted, value, known[key].type))
    cfg.explicit.add(dotted)


def _refuse_key(dotted: str, known: str) -> NoReturn:
    """An unknown key, in one sentence with the key it likeliest meant (a typo), else what is known."""
    guess = closest_key(dotted)
    if guess:
        raise ConfigError(f"unknown config key {dotted!r}; did you mean {guess}? ({known})")
    raise ConfigError(f"unknown config key {dotted!r}; {known}")


def _sections() -> list[str]:
    return [f.name for f in fields(Config)]


def _parse_value(text: str):
    """A --set value is read as a TOML value when it is one, else as a bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _coerce(key: str, value, annotation):
    if annotation.startswith("list["):
        return _coerce_list(key, value, annotation)
    typ = _base_type(annotation)
    optional = annotation.endswith("| None")
    if value is None or (optional and isinstance(value, str) and value.lower() in ("none", "")):
        if optional:
            return None
        raise ConfigError(f"{key} cannot be empty")
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise ConfigError(f"{key} must be true or false, got {value!r}")
    if typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key} must be an integer, got {value!r}")
    if typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{key} must be a number, got {value!r}")
    if typ is str:
        if isinstance(value, (str, Path)):
            return str(value)
        raise ConfigError(f"{key} must be a string, got {value!r}")
    raise AssertionError(f"unhandled type {annotation} for {key}")


def _coerce_list(key: str, value, annotation: str) -> list:
    """A TOML list (in a file, or `--set KEY=[...]`), each item of the list's item type. A lone
    value is a list of one, so `--set grpo.rewards=rewards.py:correct` needs no shell quoting."""
    item = annotation[len("list["):-1]
    if isinstance(value, tuple):
        value = list(value)
    if not isinstance(value, list):
        value = [value]
    try:
        return [_coerce(key, v, item) for v in value]
    except ConfigError:
        raise ConfigError(f"{key} must be a list of {_ITEM_NAMES[item]}, e.g. {key}={_EXAMPLES[item]}; "
                          f"got {value!r}") from None


_ITEM_NAMES = {"str": "strings", "float": "numbers", "int": "integers"}
_EXAMPLES = {"str": '["a", "b"]', "float": "[1.0, 0.5]", "int": "[1, 2]"}


def _base_type(annotation: str):
    # Field annotations are strings here (`from __future__ import annotations`): "int | None".
    name = annotation.split("|")[0].strip()
    return {"bool": bool, "int": int, "float": float, "str": str}[name]


def to_toml(cfg: Config) -> str:
    """The resolved config as TOML (keys that are unset are left out)."""
    lines = []
    for section, values in cfg.to_dict().items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            if value is not None:
                lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(value) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    escaped = str(value).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'
