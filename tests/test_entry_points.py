"""`llmsplit.train(...)` and `llmsplit.plan(...)` are calls and packages at once: the names are
the packages (llmsplit.train.trainer, llmsplit.plan.api stay importable), made callable, with
the entry points' signatures and docstrings for help()."""

import importlib
import inspect
import subprocess
import sys

import llmsplit
import llmsplit.api


def test_train_and_plan_are_the_packages_and_callable():
    for name in ("train", "plan"):
        package = getattr(llmsplit, name)
        assert package is sys.modules[f"llmsplit.{name}"]
        assert hasattr(package, "__path__") and callable(package)
        entry = getattr(llmsplit.api, name)
        assert inspect.signature(package) == inspect.signature(entry)
        assert inspect.getdoc(entry) in package.__doc__  # what help() shows
    assert importlib.import_module("llmsplit.plan.api") is llmsplit.plan.api
    assert importlib.import_module("llmsplit.train.api") is llmsplit.train.api


def test_plan_called_as_the_package_gives_the_report():
    report = llmsplit.plan("tiny", 2, gpu="H100-80GB", top=1)
    assert report["hardware"]["count"] == 2 and report["model"]


def test_importing_llmsplit_leaves_the_entry_points_for_their_first_use():
    """The entry points import the trainer (and torch): `import llmsplit` does not import them."""
    code = "import sys, llmsplit; print('llmsplit.api' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False"]
