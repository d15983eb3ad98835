"""The layer rules of ARCHITECTURE.md, as import-linter contracts ([tool.importlinter] in
pyproject.toml): `lint-imports` follows every chain of imports, not only the direct ones."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).parent.parent
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
CONTRACTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def lint_imports(cwd: Path) -> subprocess.CompletedProcess:
    """`lint-imports` with the contracts of cwd/pyproject.toml on the `llmsplit` found first from `cwd`."""
    # PYTHONPATH: the custom contract type (tests/import_contracts.py); COLUMNS: no wrapped lines.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "COLUMNS": "250"}
    return subprocess.run([str(LINT_IMPORTS), "--no-cache"],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_the_package_keeps_every_contract():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


# Imports appended to files of a copy of the package: at least one breaks each contract.
PLANTED = [
    ("launch/__init__.py", "from ..train import hangs"),  # the chain issue 16 found: infer -> launch -> train
    ("models/__init__.py", "from ..config import Config"),
    ("unplaced.py", '"""A new package nobody has placed in a layer yet."""'),
    ("plan/__init__.py", "from ..io import weights"),
    ("errors.py", "import torch"),
    ("train/__init__.py", "from .. import plan"),
    ("__init__.py", "from . import cli"),
    ("infer/_planted.py", "x = 1"),
    ("diagnose/__init__.py", "from ..infer._planted import x"),
    ("diagnose/__init__.py", "from ..launch import _planted_helper"),
    ("infer/engine/__init__.py", "from ..runner import kv_cache"),
    ("infer/runner/__init__.py", "from ..engine import scheduler"),
    ("infer/serve/__init__.py", "from ..runner import runner"),
    ("infer/engine/sequence.py", "import fastapi"),
]
# What the report must then say, planted import by planted import.
REPORTED = [
    "llmsplit.launch is not allowed to import llmsplit.train",
    "llmsplit.infer is not allowed to import llmsplit.train",  # through launch: transitive
    "llmsplit.models is not allowed to import llmsplit.config",
    "- llmsplit.unplaced",  # under "not listed as layers"
    "llmsplit.plan is not allowed to import llmsplit.io",
    "llmsplit.errors is not allowed to import torch",
    "llmsplit.train is not allowed to import llmsplit.plan",
    "- llmsplit -> llmsplit.cli",
    "- llmsplit.diagnose -> llmsplit.infer._planted",
    "llmsplit.diagnose imports _planted_helper from llmsplit.launch",
    "llmsplit.infer.engine is not allowed to import llmsplit.infer.runner",
    "llmsplit.infer.runner is not allowed to import llmsplit.infer.engine",
    "llmsplit.infer.serve is not allowed to import llmsplit.infer.runner",
    "llmsplit.infer.engine is not allowed to import fastapi",
]


def test_every_contract_breaks_on_a_planted_import(tmp_path):
    copy = tmp_path / "llmsplit"
    shutil.copytree(ROOT / "src" / "llmsplit", copy, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    for name, line in PLANTED:
        with open(copy / name, "a") as f:
            f.write(f"\n{line}\n")
    result = lint_imports(tmp_path)
    report = result.stdout + result.stderr
    assert result.returncode != 0, report
    kept = [c["name"] for c in CONTRACTS if not re.search(re.escape(c["name"]) + r"\s+BROKEN", report)]
    assert not kept, f"not broken by any planted import: {kept}\n{report}"
    missing = [line for line in REPORTED if line not in report]
    assert not missing, f"{missing}\n{report}"
