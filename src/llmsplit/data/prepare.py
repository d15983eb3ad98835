"""`llmsplit prepare`: tokenize text or JSONL files into one memory-mappable token file; with
`data_format="chat"`, conversations in the model's chat template with their loss mask."""

from __future__ import annotations

from pathlib import Path

from ..errors import ConfigError
from ..io.token_file import write_token_file
from .chat import encode_chat_files
from .corpus import encode_with_offsets, expand_glob, read_documents


def prepare(inputs: list[str], out: str | Path, tokenizer, data_format: str = "text",
            loss_on: str = "assistant") -> dict:
    files: list[Path] = []
    for item in inputs:
        p = Path(item)
        files.extend([p] if p.is_file() else expand_glob(item, key="input"))
    out = Path(out)
    if out.is_dir():
        raise ConfigError(f"--out {str(out)!r} is a folder; pass a file name such as {str(out / 'tokens.bin')!r}")
    if not out.parent.exists():
        raise ConfigError(f"--out {str(out)!r}: folder {str(out.parent)!r} does not exist; create it first")
    mask = None
    if data_format == "chat":
        docs = encode_chat_files(files, tokenizer, loss_on)
        tokens, mask, offsets = docs.tokens, docs.mask, docs.offsets
    else:
        tokens, offsets = encode_with_offsets([d for f in files for d in read_documents(f)], tokenizer)
    if len(tokens) == 0:
        raise ConfigError("the input files hold no text; pass files with content")
    header = write_token_file(out, tokens, tokenizer=tokenizer.name, vocab_size=tokenizer.vocab_size,
                              documents=len(offsets) - 1, fingerprint=tokenizer.fingerprint, mask=mask,
                              offsets=offsets, data_format=data_format,
                              loss_on=loss_on if data_format == "chat" else None)
    info = dict(header, files=len(files))
    if mask is not None:
        info["loss_fraction"] = float(mask.mean())
    return info
