"""Token sources: the built-in corpus, token files from `llmsplit prepare`, text globs."""

from __future__ import annotations

import glob
import json
from pathlib import Path

import numpy as np

from ..errors import ConfigError
from ..io.token_file import read_token_file


def builtin_documents() -> list[str]:
    """Python's own help topics (`pydoc_data.topics`): ~465k characters of English
    shipped with the standard library, so the default run needs no download."""
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)]


def expand_glob(pattern: str, key: str = "data.source") -> list[Path]:
    files = sorted(Path(p) for p in glob.glob(pattern, recursive=True) if Path(p).is_file())
    if not files:
        raise ConfigError(f"{key}={'text:' + pattern!r} matches no files; check the glob pattern")
    return files


def read_documents(path: Path) -> list[str]:
    """A .jsonl file gives one document per line (its "text" field); any other file is one document."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise ConfigError(f"cannot read {str(path)!r} ({e.strerror}); check the path and its permissions") from None
    if path.suffix != ".jsonl":
        return [text]
    docs = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            raise ConfigError(f"{str(path)!r} line {n} is not valid JSON; each line of a .jsonl file "
                              f"must be an object with a \"text\" field") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            raise ConfigError(f"{str(path)!r} line {n} has no string \"text\" field")
        docs.append(obj["text"])
    return docs


def encode_documents(docs: list[str], tokenizer) -> np.ndarray:
    """Concatenate documents, each followed by the end-of-document token when there is one."""
    return encode_with_offsets(docs, tokenizer)[0]


def encode_with_offsets(docs: list[str], tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """`encode_documents`, and where each document starts (then the total)."""
    eos = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
    ids: list[int] = []
    offsets = [0]
    for d in docs:
        ids.extend(tokenizer.encode(d))
        ids.extend(eos)
        offsets.append(len(ids))
    return np.asarray(ids, dtype=np.int64), np.asarray(offsets, dtype=np.int64)


def check_source(source: str, tokenizer) -> None:
    """Cheap checks a launcher runs before any worker starts."""
    if source == "builtin":
        return
    if source.startswith("text:"):
        expand_glob(source[len("text:"):])
    elif source.endswith(".jsonl"):
        if not Path(source).is_file():
            raise ConfigError(f"data.source={source!r} does not exist; pass an existing .jsonl file")
    else:
        check_tokenizer(source, read_token_file(source)[1], tokenizer)


def check_tokenizer(source: str, header: dict, tokenizer) -> None:
    """Refuse a token file made with another tokenizer. Tokenizers are compared by content:
    the file named by another path (relative, absolute, a run's copy) is the same tokenizer."""
    named = str(header.get("tokenizer"))
    made_with = header.get("tokenizer_fingerprint") or _fingerprint_of(named)
    if made_with != tokenizer.fingerprint:
        raise ConfigError(f"data.source={source!r} was tokenized with {named!r}, another tokenizer "
                          f"than data.tokenizer={tokenizer.name!r}; set data.tokenizer to the one `llmsplit prepare` "
                          f"used, or prepare the data again with --tokenizer {tokenizer.name}")


def _fingerprint_of(name: str) -> str:
    """For token files written before they recorded a fingerprint: the named tokenizer's, if
    it can still be read, else its name."""
    from ..io.tokenizer import load_tokenizer

    try:
        return load_tokenizer(name).fingerprint
    except ConfigError:
        return name


def load_tokens(source: str, tokenizer) -> np.ndarray:
    """All training tokens as a 1-D integer array (memory-mapped for token files)."""
    if source == "builtin":
        return encode_documents(builtin_documents(), tokenizer)
    if source.startswith("text:"):
        docs = [d for f in expand_glob(source[len("text:"):]) for d in read_documents(f)]
        return encode_documents(docs, tokenizer)
    if source.endswith(".jsonl"):  # tokenized at start, like "text:FILE.jsonl"
        return encode_documents(read_documents(Path(source)), tokenizer)
    tokens, header = read_token_file(source)
    check_tokenizer(source, header, tokenizer)
    return tokens
