"""Shared helpers: run the real command line in a subprocess and read what it wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from llmsplit.train.api import WORKER_MODULES

# Small enough for a 2-core CI machine, big enough to exercise every code path.
TINY = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=128",
        "data.seq_len=32", "train.global_batch=8", "train.micro_batch=2", "train.steps=4", "train.warmup_steps=2"]


# ~23M parameters, short sequences: model state (16 bytes a parameter under DDP) dominates
# the peak, which is what the planner and OOM tests need to see.
MEDIUM_TOML = """
[model]
preset = "tiny"
dim = 512
n_layers = 8
n_heads = 8
n_kv_heads = 4
ffn_dim = 1376
max_seq_len = 128
[data]
seq_len = 64
[train]
steps = 2
global_batch = 8
micro_batch = 2
warmup_steps = 1
"""


def run_cli(*args: str, check: bool = True, timeout: float = 300, env: dict | None = None,
            input: str | None = None) -> subprocess.CompletedProcess:
    """`python -m llmsplit ARGS` as a child process with its own environment, stdin, stdout,
    stderr and exit status. The child is forked from a template process that has already
    imported torch and llmsplit (see _forked_cli), which saves the 3-5 s of imports that
    each of the suite's ~150 command lines would otherwise pay; LLMSPLIT_TEST_EXEC=1 runs
    each through a fresh interpreter instead."""
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    if os.environ.get("LLMSPLIT_TEST_EXEC") == "1" or sys.platform != "linux":
        proc = subprocess.run([sys.executable, "-m", "llmsplit", *args], capture_output=True, text=True,
                              timeout=timeout, env=full_env, input=input)
    else:
        proc = _forked_cli(list(args), full_env, timeout, input)
    if check and proc.returncode != 0:
        raise AssertionError(f"llmsplit {' '.join(args)} exited {proc.returncode}\n"
                             f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}")
    return proc


def train(run_dir: Path, *sets: str, nproc: int = 1, extra: tuple[str, ...] = (), **kw) -> subprocess.CompletedProcess:
    args = ["train", "--nproc", str(nproc), "--run-dir", str(run_dir)]
    for s in sets:
        args += ["--set", s]
    return run_cli(*args, *extra, **kw)


class Trace(list):
    """A run's loss at every step (the list), and its gradient norm at every step (`grad_norms`),
    sliced together: AdamW rescales each update, so a gradient off by a constant factor (a
    missing divide-by-dp, a gradient summed twice) barely moves the loss; the norm shows it."""

    def __init__(self, losses, grad_norms):
        super().__init__(losses)
        self.grad_norms = list(grad_norms)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return Trace(list.__getitem__(self, index), self.grad_norms[index])
        return list.__getitem__(self, index)


def losses(run_dir: Path) -> Trace:
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return Trace([r["loss"] for r in rows], [r.get("grad_norm") for r in rows])


def assert_close_losses(got: list[float], want: list[float], rtol: float = 1e-5) -> None:
    """Loss at every step within `rtol` (relative); for two runs' `Trace`s, the gradient norm too."""
    assert len(got) == len(want), (got, want)
    for step, (a, b) in enumerate(zip(got, want), 1):
        assert abs(a - b) <= rtol * abs(b), f"step {step}: {a} vs {b} (rel {abs(a - b) / abs(b):.2e})"
    if isinstance(got, Trace) and isinstance(want, Trace):
        for step, (a, b) in enumerate(zip(got.grad_norms, want.grad_norms), 1):
            if a is None or b is None:
                continue  # a step that logged no norm (none does today)
            assert abs(a - b) <= rtol * abs(b), (f"step {step}: grad norm {a} vs {b} "
                                                 f"(rel {abs(a - b) / max(abs(b), 1e-30):.2e})")


def dump_grads(run_dir: Path, step: int = 1) -> dict:
    """The environment (for `train(..., env=)`) under which a run writes step `step`'s gradients,
    every rank its own file, into `grads_dir(run_dir)` (src/llmsplit/train/grad_dump.py)."""
    return {"LLMSPLIT_DUMP_GRADS": str(grads_dir(run_dir)), "LLMSPLIT_DUMP_GRADS_STEP": str(step)}


def grads_dir(run_dir: Path) -> Path:
    """Beside the run folder, not in it: the run's own files stay as the trainer writes them."""
    return Path(run_dir).with_name(Path(run_dir).name + "-grads")


def gradients(folder: Path) -> dict:
    """{plain parameter name: gradient} merged over the ranks' files of a dump; a parameter
    that several ranks hold (data-parallel replicas, tensor-parallel ranks after the gather)
    must have the same gradient on each."""
    import torch

    files = sorted(Path(folder).glob("rank*.pt"))
    assert files, f"no gradients were dumped into {folder}"
    merged, source = {}, {}
    for f in files:
        for name, grad in torch.load(f, weights_only=True).items():
            if name in merged:
                _assert_close_tensor(grad, merged[name], 1e-5, 1e-8, f"{name}: {f.name} vs {source[name]}")
                continue
            merged[name], source[name] = grad, f.name
    return merged


def assert_same_gradients(got_dir: Path, want_dir: Path, rtol: float = 1e-5, atol: float = 1e-8) -> None:
    """Every parameter's gradient in the dump `got_dir` equals the one in `want_dir` (one
    process's): the same names, and per tensor ‖got − want‖ ≤ rtol·‖want‖ + atol (L2 norms; the
    floor `atol` for the gradients that are zero or nearly, as a LoRA A-side's at step 1). The
    message names the worst parameter by relative error."""
    got, want = gradients(got_dir), gradients(want_dir)
    assert set(got) == set(want), (f"gradients of different parameters: only in {got_dir}: "
                                   f"{sorted(set(got) - set(want))}; only in {want_dir}: {sorted(set(want) - set(got))}")
    shapes = {name: (tuple(got[name].shape), tuple(want[name].shape)) for name in want}
    assert all(a == b for a, b in shapes.values()), {name: s for name, s in shapes.items() if s[0] != s[1]}
    errors = {name: _tensor_error(got[name], want[name]) for name in want}
    failed = {name: e for name, e in errors.items() if e[0] > rtol * e[1] + atol}
    if failed:
        worst = max(failed, key=lambda n: failed[n][0] / max(failed[n][1], atol))
        diff, norm = failed[worst]
        raise AssertionError(f"{len(failed)} of {len(want)} gradients differ; worst {worst}: ‖got − want‖ = {diff:.3e}, "
                             f"‖want‖ = {norm:.3e} (rel {diff / max(norm, atol):.2e} > rtol {rtol:g})")


def _tensor_error(got, want) -> tuple[float, float]:
    """‖got − want‖ and ‖want‖ (L2, in float64)."""
    return float((got.double() - want.double()).norm()), float(want.double().norm())


def _assert_close_tensor(got, want, rtol: float, atol: float, what: str) -> None:
    assert got.shape == want.shape, f"{what}: shapes {tuple(got.shape)} vs {tuple(want.shape)}"
    diff, norm = _tensor_error(got, want)
    assert diff <= rtol * norm + atol, f"{what}: ‖got − want‖ = {diff:.3e}, ‖want‖ = {norm:.3e}"


# Modules the template process imports once: what `llmsplit train` holds when its workers'
# server forks them (the program's own imports, then the server's, launch/forkserver.py), and no
# more, so that a test's workers inherit what a user's do and measure the same peaks
# (torch.distributed.pipelining, for one, brings torch.onnx and more along with torch._dynamo).
# Importing them starts no thread and runs no OpenMP op, so a fork of the template is as safe
# to compute in as a fresh `python -m llmsplit`.
TEMPLATE_IMPORTS = ["torch", "llmsplit.cli", "llmsplit.api", "llmsplit.train.api", *WORKER_MODULES]
_template = None


def _cli_template():
    """A multiprocessing forkserver preloaded with TEMPLATE_IMPORTS, started on first use."""
    global _template
    if _template is None:
        import multiprocessing

        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(TEMPLATE_IMPORTS)
        _template = ctx
    return _template


def _forked_cli(args: list[str], env: dict, timeout: float, input: str | None) -> subprocess.CompletedProcess:
    import signal
    import tempfile

    with tempfile.TemporaryDirectory(prefix="llmsplit-cli-") as tmp:
        paths = {name: os.path.join(tmp, name) for name in ("stdin", "stdout", "stderr")}
        for name, text in (("stdin", input or ""), ("stdout", ""), ("stderr", "")):
            with open(paths[name], "w") as f:
                f.write(text)
        child = _cli_template().Process(target=cli_child, args=(args, env, os.getcwd(), paths))
        child.start()
        child.join(timeout)
        if child.is_alive():  # kill it and whatever it started (its own session)
            try:
                os.killpg(child.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            child.join()
            raise subprocess.TimeoutExpired(["llmsplit", *args], timeout)
        out, err = (open(paths[name], encoding="utf-8", errors="replace").read() for name in ("stdout", "stderr"))
        return subprocess.CompletedProcess(["llmsplit", *args], child.exitcode, out, err)


def cli_child(args: list[str], env: dict, cwd: str, paths: dict) -> None:
    """In the forked child: become what `python -m llmsplit ARGS` would be (own session,
    environment, directory, stdin/stdout/stderr), then run the program's main."""
    os.setsid()
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for fd, name, mode in ((0, "stdin", os.O_RDONLY), (1, "stdout", os.O_WRONLY), (2, "stderr", os.O_WRONLY)):
        target = os.open(paths[name], mode)
        os.dup2(target, fd)
        os.close(target)
    sys.stdin = open(0, closefd=False)
    sys.argv = ["llmsplit", *args]
    from llmsplit.cli import main

    try:
        code = main()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    raise SystemExit(code)
