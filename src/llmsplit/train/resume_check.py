"""What a checkpoint was trained on, and whether a resume continues with the same.

A checkpoint's train_state.json records the inputs that decide what the next steps see:
the sequence length, global batch and seed (the data sampler's position is a function of
them and the step), and fingerprints of the tokenizer and the data source, by content so
that the same file named two ways (a relative and an absolute path, a moved copy) is the
same. A resume that changes any of them is refused with the old and new values unless the
user asks for it (`--resume-changed`), and then summary.json records what changed.
"""

from __future__ import annotations

from pathlib import Path

from ..config import Config
from ..io.checksums import content_fingerprint

RESUME_CHANGED_FLAG = "--resume-changed"


def run_inputs(cfg: Config) -> dict:
    """The fingerprints a checkpoint records: {"tokenizer": {...}, "data_source": {...}}."""
    return {"tokenizer": _tokenizer_print(cfg.data.tokenizer), "data_source": _source_print(cfg.data.source)}


def _tokenizer_print(spec: str) -> dict:
    from ..io.tokenizer import load_tokenizer

    return {"name": spec, "fingerprint": load_tokenizer(spec).fingerprint}


def _source_print(source: str) -> dict:
    if source == "builtin":
        return {"name": "builtin"}
    if source.startswith("text:"):
        from ..data.corpus import expand_glob

        files = expand_glob(source[len("text:"):])
    else:
        files = [Path(source)]
    return {"name": source, "files": len(files), "content": content_fingerprint(files)}


def resume_changes(train_state: dict, cfg: Config) -> dict[str, dict]:
    """{config key: {"then": value, "now": value}} for every input that differs between the
    checkpoint (its train_state.json) and `cfg`. A checkpoint from before the fingerprints
    were recorded is compared on the numbers it has."""
    data = train_state.get("data") or {}
    now = {"data.seq_len": cfg.data.seq_len, "train.global_batch": cfg.train.global_batch, "train.seed": cfg.train.seed}
    then = {"data.seq_len": data.get("seq_len"), "train.global_batch": data.get("global_batch"),
            "train.seed": data.get("seed")}
    inputs = train_state.get("inputs") or {}
    if inputs:
        fresh = run_inputs(cfg)
        now.update({"data.tokenizer": fresh["tokenizer"], "data.source": fresh["data_source"]})
        then.update({"data.tokenizer": inputs.get("tokenizer"), "data.source": inputs.get("data_source")})
    return {key: {"then": then[key], "now": now[key]} for key in now
            if then[key] is not None and _differ(then[key], now[key])}


def _differ(then, now) -> bool:
    if isinstance(then, dict) and isinstance(now, dict):  # a fingerprint: the name may differ, the content not
        return {k: v for k, v in then.items() if k != "name"} != {k: v for k, v in now.items() if k != "name"}
    return then != now


def describe(changes: dict[str, dict]) -> str:
    return "; ".join(f"{key} {_shown(c['then'])} then, {_shown(c['now'])} now" for key, c in changes.items())


def _shown(value) -> str:
    if not isinstance(value, dict):
        return str(value)
    marks = [f"{k} {str(v)[:20]}" for k, v in value.items() if k != "name"]  # enough of a hash to tell them apart
    return repr(value.get("name")) + (f" ({', '.join(marks)})" if marks else "")
