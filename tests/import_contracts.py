"""An import-linter contract type for what its built-in types do not check: the names an
import statement takes. `from ..infer.placement import _usage` is an ordinary import of
a module, so no module-level contract sees that it reaches into another module's private
helpers; this one reads the names off each `from X import ...` of the root packages.

Registered in pyproject.toml ([tool.importlinter] contract_types); `lint-imports` run
from the repository root finds it as `tests.import_contracts`.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

from importlinter import Contract, ContractCheck, fields, output


def is_private(name: str) -> bool:
    """`_usage` and `__mangled` are private; `__version__` and `__all__` are not."""
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _source_file(module: str) -> Path:
    root, *rest = module.split(".")
    # find_spec of a top-level name locates it without running its __init__.
    folder = Path(importlib.util.find_spec(root).submodule_search_locations[0]).joinpath(*rest)
    return folder / "__init__.py" if (folder / "__init__.py").is_file() else folder.with_suffix(".py")


def _base_module(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute name of X in `from X import ...` written in `importer`."""
    if not node.level:
        return node.module or ""
    parts = importer.split(".")
    # In a package's __init__, `.` is the package itself; in a module, its parent.
    keep = len(parts) - node.level + (1 if is_package else 0)
    return ".".join(parts[:keep] + ([node.module] if node.module else []))


class PrivateNamesContract(Contract):
    """No module of the root packages imports a private name (`_x`) that another of their
    modules defines. Private submodules (`pkg._impl`) are the built-in private_modules
    contract's business and are skipped here; so are other packages' private names."""

    type_name = "private_names"

    broken_contract_guidance = fields.TextField(required=False)

    def check(self, graph, verbose: bool) -> ContractCheck:
        violations = []
        # Other packages' modules are in the graph too (include_external_packages), squashed.
        ours = {m for m in graph.modules if not graph.is_module_squashed(m)}
        for importer in sorted(ours):
            path = _source_file(importer)
            output.verbose_print(verbose, f"Reading the imports of {importer} ({path})")
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if not isinstance(node, ast.ImportFrom):
                    continue
                base = _base_module(importer, path.name == "__init__.py", node)
                if base not in ours:  # another package's module
                    continue
                for alias in node.names:
                    if is_private(alias.name) and f"{base}.{alias.name}" not in ours:
                        violations.append({"importer": importer, "line": node.lineno,
                                           "module": base, "name": alias.name})
        return ContractCheck(kept=not violations, metadata={"violations": violations})

    def render_broken_contract(self, check: ContractCheck) -> None:
        for v in check.metadata["violations"]:
            output.print_error(f"{v['importer']} imports {v['name']} from {v['module']} (l.{v['line']})",
                               bold=False)
        if self.broken_contract_guidance:
            output.new_line()
            output.print(self.broken_contract_guidance)
