"""The token file that `llmsplit prepare` writes and training memory-maps.

Layout: 8-byte magic, u32 format version, u32 length of a JSON header, the JSON header
(tokenizer and its fingerprint, vocab size, dtype, token and document counts, data format),
zero padding to 64 bytes, then the tokens as little-endian uint16 or uint32. Format 2 adds,
each section padded to 64 bytes: the loss mask (one uint8 per token, chat data only; the header's
"mask" says whether it is there) and the document offsets (documents + 1 little-endian int64:
document i is tokens[offsets[i]:offsets[i+1]]). Format 1 files (tokens only) are still read.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np

from ..errors import ConfigError

MAGIC = b"LLMSTOK1"
VERSION = 2
_READABLE = (1, 2)
_ALIGN = 64


def _pad(n: int) -> int:
    return (-n) % _ALIGN


def write_token_file(path: str | Path, tokens: np.ndarray, *, tokenizer: str, vocab_size: int,
                     documents: int, fingerprint: str | None = None, mask: np.ndarray | None = None,
                     offsets: np.ndarray | None = None, data_format: str = "text", loss_on: str | None = None) -> dict:
    """`tokenizer` names the tokenizer for people; `fingerprint` (its content hash) is what
    training compares, so the same file named by another path is not a mismatch."""
    dtype = np.uint16 if vocab_size <= 65536 else np.uint32
    if offsets is None:
        offsets = np.asarray([0, len(tokens)])
    assert len(offsets) == documents + 1 and (mask is None or len(mask) == len(tokens))
    header = {"tokenizer": tokenizer, "tokenizer_fingerprint": fingerprint, "vocab_size": int(vocab_size),
              "dtype": np.dtype(dtype).name, "n_tokens": len(tokens), "documents": int(documents),
              "format": data_format, "mask": mask is not None}
    if loss_on is not None:
        header["loss_on"] = loss_on  # which tokens the mask keeps: "assistant" or "all"
    blob = json.dumps(header).encode()
    prefix = MAGIC + struct.pack("<II", VERSION, len(blob)) + blob
    sections = [np.asarray(tokens, dtype=dtype).astype(np.dtype(dtype).newbyteorder("<")).tobytes()]
    if mask is not None:
        sections.append(np.asarray(mask, dtype=np.uint8).tobytes())
    sections.append(np.asarray(offsets, dtype="<i8").tobytes())
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(prefix + b"\0" * _pad(len(prefix)))
        for data in sections:
            f.write(data + b"\0" * _pad(len(data)))
    os.replace(tmp, path)  # a half-written file is never taken for a token file
    return header


def read_token_file(path: str | Path, key: str = "data.source") -> tuple[np.ndarray, dict]:
    """Memory-map the tokens of a token file; ConfigError if it is not one."""
    tokens, _, _, header = read_token_documents(path, key)
    return tokens, header


def read_token_documents(path: str | Path, key: str = "data.source"):
    """(tokens, loss mask or None, document offsets or None, header), all memory-mapped."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{key}={str(path)!r} does not exist; pass \"builtin\", \"text:GLOB\", a .jsonl file or a "
                          f"token file written by `llmsplit prepare`")
    damaged = (f"{key}={str(path)!r} is truncated or damaged (%s); write it again with `llmsplit prepare`")
    with open(path, "rb") as f:
        head = f.read(16)
        if len(head) < 16 or head[:8] != MAGIC:
            raise ConfigError(f"{key}={str(path)!r} is not a token file written by `llmsplit prepare`; "
                              f"use \"text:{path}\" to read plain text")
        version, n = struct.unpack("<II", head[8:16])
        if version not in _READABLE:
            raise ConfigError(f"{key}={str(path)!r} is token file format {version}; this llmsplit reads formats "
                              f"{', '.join(map(str, _READABLE))}: write it again with `llmsplit prepare`")
        try:
            header = json.loads(f.read(n))
            n_tokens, dtype = int(header["n_tokens"]), np.dtype(header["dtype"])
            n_docs, has_mask = int(header.get("documents", 0)), bool(header.get("mask", False))
        except (ValueError, KeyError, TypeError):
            raise ConfigError(damaged % "unreadable header") from None
    offset = 16 + n + _pad(16 + n)
    sizes = [n_tokens * dtype.itemsize]
    if version >= 2:
        sizes += ([n_tokens] if has_mask else []) + [(n_docs + 1) * 8]
    starts = []
    for size in sizes:
        starts.append(offset)
        offset += size + (_pad(size) if version >= 2 else 0)
    if path.stat().st_size != offset:
        raise ConfigError(damaged % f"{path.stat().st_size} bytes, header says {offset}")
    tokens = np.memmap(path, dtype=dtype.newbyteorder("<"), mode="r", offset=starts[0], shape=(n_tokens,))
    if version < 2:
        return tokens, None, None, header
    mask = np.memmap(path, dtype=np.uint8, mode="r", offset=starts[1], shape=(n_tokens,)) if has_mask else None
    offsets = np.memmap(path, dtype="<i8", mode="r", offset=starts[-1], shape=(n_docs + 1,))
    if offsets[0] != 0 or offsets[-1] != n_tokens or np.any(np.diff(offsets) < 0):
        raise ConfigError(damaged % "document offsets out of order")
    return tokens, mask, offsets, header
