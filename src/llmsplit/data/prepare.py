"""`llmsplit prepare`: tokenize text or JSONL files into one memory-mappable token file."""

from __future__ import annotations

from pathlib import Path

from ..config import ConfigError
from ..io.token_file import write_token_file
from .corpus import encode_documents, expand_glob, read_documents


def prepare(inputs: list[str], out: str | Path, tokenizer) -> dict:
    files: list[Path] = []
    for item in inputs:
        p = Path(item)
        files.extend([p] if p.is_file() else expand_glob(item, key="input"))
    out = Path(out)
    if out.is_dir():
        raise ConfigError(f"--out {str(out)!r} is a folder; pass a file name such as {str(out / 'tokens.bin')!r}")
    if not out.parent.exists():
        raise ConfigError(f"--out {str(out)!r}: folder {str(out.parent)!r} does not exist; create it first")
    docs = [d for f in files for d in read_documents(f)]
    tokens = encode_documents(docs, tokenizer)
    if len(tokens) == 0:
        raise ConfigError("the input files hold no text; pass files with content")
    header = write_token_file(out, tokens, tokenizer=tokenizer.name, vocab_size=tokenizer.vocab_size,
                              documents=len(docs), fingerprint=tokenizer.fingerprint)
    return dict(header, files=len(files))
