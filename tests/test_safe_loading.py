"""Loading untrusted files never unpickles code: the only unpickling readers in llmsplit
are the restricted ones in io/dcp_files.py (checkpoints); everything else reads
safetensors, GGUF, JSON, TOML or raw token arrays. This guards against a new
`torch.load` / `pickle.load` / plain `dcp.load` slipping in elsewhere."""

from __future__ import annotations

import re
from pathlib import Path

import llmsplit

SRC = Path(llmsplit.__file__).parent
UNPICKLING = re.compile(r"\btorch\.load\(|\bpickle\.loads?\(|\bUnpickler\b|\bdcp\.load\(|\bFileSystemReader\(")


def test_only_the_restricted_checkpoint_reader_unpickles():
    offenders = [f"{path.relative_to(SRC)}:{n}: {line.strip()}"
                 for path in sorted(SRC.rglob("*.py")) if path.name != "dcp_files.py"
                 for n, line in enumerate(path.read_text().splitlines(), 1) if UNPICKLING.search(line)]
    assert offenders == [], "read checkpoints through llmsplit.io.dcp_files:\n" + "\n".join(offenders)

