"""Tokenizers: a byte-level default that needs no files, and any `tokenizer.json`
through the `tokenizers` library, with what `transformers` saves next to it
(tokenizer_config.json's special tokens, the chat template).

A tokenizer is known by its content (`fingerprint`), never by the path it was named with:
'smol/tokenizer.json', its absolute path and a run folder's copy of it are one tokenizer.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import shutil
from functools import cached_property
from pathlib import Path

from ..errors import ConfigError

# Names that mark the end of a document in the common Llama-family vocabularies.
_EOS_NAMES = ("</s>", "<|end_of_text|>", "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<eos>")
_BOS_NAMES = ("<s>", "<|begin_of_text|>", "<|im_start|>", "<bos>")


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; 256 and 257 mark the start and end of a document."""

    name = "byte"
    fingerprint = vocab_fingerprint = "byte"
    chat_template = None  # no model-specific chat format: the server uses its plain default
    vocab_size = 258
    bos_id = 256
    eos_id = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def token_text(self, i: int | None) -> str:
        return ""  # the document markers have no text form

    def stream(self) -> "ByteStream":
        return ByteStream()


class ByteStream:
    """Incremental decoding of byte ids: text comes out once its UTF-8 character is complete."""

    def __init__(self):
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def step(self, i: int) -> str:
        return self._utf8.decode(bytes([i])) if 0 <= i < 256 else ""


class HFTokenizer:
    """A `tokenizer.json` file (as Hugging Face `transformers` writes it)."""

    add_bos = False  # GGUF files say whether the model expects a leading BOS; tokenizer.json does not
    chat_template: str | None = None  # Jinja source, from tokenizer_config.json or GGUF metadata

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer

        self._setup(Tokenizer.from_file(str(path)), str(path))

    @classmethod
    def from_tokenizer(cls, tok, name: str) -> "HFTokenizer":
        """Wrap a `tokenizers.Tokenizer` built in memory (e.g. from GGUF metadata)."""
        self = cls.__new__(cls)
        self._setup(tok, name)
        return self

    def _setup(self, tok, name: str) -> None:
        self.name = name
        self._tok = tok
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_id = self._first_id(_EOS_NAMES)
        self.bos_id = self._first_id(_BOS_NAMES)

    @cached_property
    def fingerprint(self) -> str:
        """A hash of the vocabulary, merges and pipeline as `tokenizers` serializes them, so
        the same tokenizer read from two paths (or a copy) compares equal."""
        return "sha256:" + hashlib.sha256(self._tok.to_str().encode()).hexdigest()

    @cached_property
    def vocab_fingerprint(self) -> str:
        """A hash of the token -> id map alone: two tokenizers that give the same token the
        same id (one read from tokenizer.json, one built from a GGUF's metadata, whose pipelines
        serialize differently) compare equal, as a draft model and the model it drafts for must."""
        vocab = sorted(self._tok.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1])
        return "sha256:" + hashlib.sha256(json.dumps(vocab).encode()).hexdigest()

    def _first_id(self, names):
        for n in names:
            i = self._tok.token_to_id(n)
            if i is not None:
                return i
        return None

    def encode(self, text: str) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if self.add_bos and self.bos_id is not None else ids

    def decode(self, ids) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def token_text(self, i: int | None) -> str:
        """The text of one token (e.g. "<s>"), which chat templates write into the prompt."""
        return "" if i is None else self._tok.id_to_token(i) or ""

    def stream(self) -> "HFStream":
        return HFStream(self._tok)

    @property
    def backend(self):
        """The `tokenizers.Tokenizer` itself (what a grammar library reads the vocabulary from)."""
        return self._tok


class HFStream:
    """Incremental decoding with `tokenizers`' own DecodeStream: each step costs one token,
    not a decode of everything generated so far, and a character split over several tokens
    (byte fallback, multi-byte UTF-8) comes out whole once its last token arrives. The
    concatenated pieces equal `decode` of all the ids."""

    def __init__(self, tok):
        from tokenizers.decoders import DecodeStream

        self._tok, self._stream = tok, DecodeStream(skip_special_tokens=True)

    def step(self, i: int) -> str:
        return self._stream.step(self._tok, i) or ""


def load_tokenizer(spec: str, key: str = "data.tokenizer"):
    """`"byte"`, a path to a tokenizer.json (or a folder holding one), or a .gguf file (the
    tokenizer its metadata describes)."""
    if spec == "byte":
        return ByteTokenizer()
    path = Path(spec)
    if path.suffix == ".gguf" and path.is_file():
        from .gguf import GGUFWeights

        return GGUFWeights(path).tokenizer
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise ConfigError(f"{key}={spec!r} is neither \"byte\" nor an existing tokenizer.json file")
    try:
        tok = HFTokenizer(path)
    except Exception as e:  # the tokenizers library raises its own Exception type
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"{key}={spec!r} is not a tokenizer.json that the tokenizers library can read "
                          f"({first[:120]}); pass \"byte\" or a valid tokenizer.json") from None
    _use_tokenizer_config(tok, path.parent)
    return tok


# What `transformers` saves with a tokenizer; runs and exports carry all of them.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def copy_tokenizer_files(tokenizer_json: str | Path, dest: str | Path) -> None:
    """Copy a tokenizer.json and the files saved next to it into the folder `dest`."""
    src = Path(tokenizer_json).parent
    Path(dest).mkdir(parents=True, exist_ok=True)
    shutil.copyfile(tokenizer_json, Path(dest) / "tokenizer.json")
    for name in TOKENIZER_FILES[1:]:
        if (src / name).is_file():
            shutil.copyfile(src / name, Path(dest) / name)


def save_tokenizer_files(tok: HFTokenizer, dest: str | Path) -> None:
    """Write a tokenizer built in memory (from GGUF metadata) as the files a folder holds:
    tokenizer.json, and tokenizer_config.json naming its end of turn and chat template."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    tok._tok.save(str(dest / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": tok.token_text(tok.eos_id) or None,
              "bos_token": tok.token_text(tok.bos_id) or None, "add_bos_token": tok.add_bos}
    if tok.chat_template:
        config["chat_template"] = tok.chat_template
    (dest / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


def _tokenizer_config(folder: Path) -> dict:
    try:
        raw = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return {}
    return raw if isinstance(raw, dict) else {}


def _use_tokenizer_config(tok: HFTokenizer, folder: Path) -> None:
    """The special tokens tokenizer_config.json names win over the guess from the vocabulary:
    an instruct model's end of turn (SmolLM2's `<|im_end|>`, 2) is not its `<|endoftext|>` (0)."""
    config = _tokenizer_config(folder)
    for attr, key in (("eos_id", "eos_token"), ("bos_id", "bos_token")):
        token = config.get(key)
        token = token.get("content") if isinstance(token, dict) else token  # older files: an AddedToken
        i = tok._tok.token_to_id(token) if isinstance(token, str) else None
        if i is not None:
            setattr(tok, attr, i)
    # transformers' key for "prepend BOS"; a run's copy of a GGUF tokenizer carries the file's
    # tokenizer.ggml.add_bos_token here, so the copy encodes as the file does.
    if isinstance(config.get("add_bos_token"), bool):
        tok.add_bos = config["add_bos_token"]
    tok.chat_template = read_chat_template(folder)


def read_chat_template(folder: Path) -> str | None:
    """The chat template `transformers` saved next to a tokenizer: `chat_template.jinja`
    (transformers >= 4.43) or the `chat_template` key of tokenizer_config.json, which older
    versions wrote as a string or as a list of named templates."""
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text()
    raw = _tokenizer_config(folder).get("chat_template")
    if isinstance(raw, list):
        named = {t.get("name"): t.get("template") for t in raw if isinstance(t, dict)}
        raw = named.get("default", next(iter(named.values()), None))
    return raw if isinstance(raw, str) else None
