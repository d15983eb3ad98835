"""The token file that `llmsplit prepare` writes and training memory-maps.

Layout: 8-byte magic, u32 format version, u32 length of a JSON header, the JSON header
(tokenizer and its fingerprint, vocab size, dtype, token and document counts), zero padding to 64 bytes,
then the tokens as little-endian uint16 or uint32.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np

from ..config import ConfigError

MAGIC = b"LLMSTOK1"
VERSION = 1
_ALIGN = 64


def write_token_file(path: str | Path, tokens: np.ndarray, *, tokenizer: str, vocab_size: int,
                     documents: int, fingerprint: str | None = None) -> dict:
    """`tokenizer` names the tokenizer for people; `fingerprint` (its content hash) is what
    training compares, so the same file named by another path is not a mismatch."""
    dtype = np.uint16 if vocab_size <= 65536 else np.uint32
    header = {"tokenizer": tokenizer, "tokenizer_fingerprint": fingerprint, "vocab_size": int(vocab_size),
              "dtype": np.dtype(dtype).name,
              "n_tokens": int(len(tokens)), "documents": int(documents)}
    blob = json.dumps(header).encode()
    prefix = MAGIC + struct.pack("<II", VERSION, len(blob)) + blob
    pad = (-len(prefix)) % _ALIGN
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(prefix + b"\0" * pad)
        f.write(np.asarray(tokens, dtype=dtype).astype(np.dtype(dtype).newbyteorder("<")).tobytes())
    os.replace(tmp, path)  # a half-written file is never taken for a token file
    return header


def read_token_file(path: str | Path, key: str = "data.source") -> tuple[np.ndarray, dict]:
    """Memory-map the tokens of a token file; ConfigError if it is not one."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{key}={str(path)!r} does not exist; pass \"builtin\", \"text:GLOB\" or a token "
                          f"file written by `llmsplit prepare`")
    with open(path, "rb") as f:
        head = f.read(16)
        if len(head) < 16 or head[:8] != MAGIC:
            raise ConfigError(f"{key}={str(path)!r} is not a token file written by `llmsplit prepare`; "
                              f"use \"text:{path}\" to read plain text")
        version, n = struct.unpack("<II", head[8:16])
        if version != VERSION:
            raise ConfigError(f"{key}={str(path)!r} is token file format {version}; this llmsplit reads format "
                              f"{VERSION}: write it again with `llmsplit prepare`")
        try:
            header = json.loads(f.read(n))
            n_tokens, dtype = int(header["n_tokens"]), np.dtype(header["dtype"])
        except (ValueError, KeyError, TypeError):
            raise ConfigError(f"{key}={str(path)!r} is truncated or damaged (unreadable header); write it again "
                              f"with `llmsplit prepare`") from None
    offset = 16 + n + ((-(16 + n)) % _ALIGN)
    expected = offset + n_tokens * dtype.itemsize
    if path.stat().st_size != expected:
        raise ConfigError(f"{key}={str(path)!r} is truncated or damaged ({path.stat().st_size} bytes, header "
                          f"says {expected}); write it again with `llmsplit prepare`")
    tokens = np.memmap(path, dtype=dtype.newbyteorder("<"), mode="r", offset=offset, shape=(n_tokens,))
    return tokens, header
