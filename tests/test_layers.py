"""The layer rules of ARCHITECTURE.md, checked on the import statements themselves."""

import ast
from pathlib import Path

PKG = Path(__file__).parent.parent / "src" / "llmsplit"

# package folder -> llmsplit subpackages/modules it must never import
FORBIDDEN = {
    "models": {"config", "io", "data", "parallel", "train", "infer", "plan", "diagnose", "cli", "launch"},
    "parallel": {"train", "infer", "cli", "launch", "io", "data", "plan"},
    "train": {"infer", "cli", "launch", "plan", "diagnose"},
    "infer": {"train", "cli"},  # infer may start workers through launch.py
    "plan": {"train", "infer", "cli", "launch", "parallel", "data", "io"},
    "io": {"train", "infer", "cli", "launch", "parallel"},
    "data": {"train", "infer", "cli", "launch", "parallel"},
}


def _imported_llmsplit_modules(path: Path) -> set[str]:
    pkg_parts = path.relative_to(PKG.parent).with_suffix("").parts[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(pkg_parts[: len(pkg_parts) - node.level + 1])
                mod = base + (node.module.split(".") if node.module else [])
            else:
                mod = (node.module or "").split(".")
            if mod and mod[0] == "llmsplit":
                found.add(mod[1] if len(mod) > 1 else (node.names[0].name))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "llmsplit" and len(parts) > 1:
                    found.add(parts[1])
    return found


def test_layers_import_only_what_they_may():
    bad = []
    for folder, forbidden in FORBIDDEN.items():
        for path in (PKG / folder).glob("**/*.py") if (PKG / folder).exists() else []:
            hits = _imported_llmsplit_modules(path) & forbidden
            if hits:
                bad.append(f"{path.relative_to(PKG)} imports {sorted(hits)}")
    assert not bad, "\n".join(bad)


def test_nothing_imports_the_cli():
    for path in PKG.glob("**/*.py"):
        if path.name in ("cli.py", "__main__.py"):
            continue
        assert "cli" not in _imported_llmsplit_modules(path), path
