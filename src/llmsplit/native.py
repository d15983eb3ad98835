"""Small native kernels built at first use: the one way llmsplit builds and loads native code.

Where PyTorch has no kernel for a job (paged attention, infer/runner/paged_attention.py) or its
kernel is far from what the memory allows (an int4 matmul of few rows, quant/kernels.py),
the job is a short C++ source file next to its Python module that registers an operator's CPU
kernel (TORCH_LIBRARY_IMPL), built for this CPU (-march=native) against torch's own headers
(`c++`, or `$CXX`; ~5 s, including only torch/library.h and ATen's core, not the whole
extension API) and the OpenMP runtime torch loaded (so its threads are torch's own pool), into
a cache folder keyed by the source and the local headers it includes, the compiler (path and
version) and its flags, the CPU and torch's version: once a machine. `torch_ops` loads it into torch's
dispatcher, so eager code and compiled graphs call the same kernel, without a trip through
Python (a ctypes library, as the paged kernel was first, cannot be called from a graph).
Where a kernel cannot be built (no compiler, a torch without libgomp or headers, an
unwritable cache) the caller keeps PyTorch's path, which gives the same values to float
rounding; `LLMSPLIT_NATIVE=0` asks for that everywhere, and each kernel has its own switch too.
`LLMSPLIT_NATIVE_GENERIC=1` builds the code a CPU without AVX-512 runs (`-mno-avx512f` after
`-march=native`, a library of its own in the cache), so that the kernels' other branches are
compiled and checked against the reference on a machine with AVX-512 too (the tests do).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger("llmsplit.native")

FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math",
         "-fopenmp", "-fPIC", "-shared"]
GENERIC = "LLMSPLIT_NATIVE_GENERIC"

_lock = threading.Lock()
_built: dict[Path, Path | None] = {}  # source -> its loaded library (None: not built)
_constants: list[Callable[[], bool]] = []  # every process_constant, for constants_for_compile


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "llmsplit" / "kernels"


def _cpu_flags() -> str:
    try:
        return next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return ""


def cpu_flags() -> set[str]:
    """The CPU's instruction-set flags as /proc/cpuinfo names them ("avx512f", "amx_int8", ...);
    empty where it cannot be read."""
    line = _cpu_flags()
    return set(line.split(":", 1)[1].split()) if ":" in line else set()


def _torch_flags() -> list[str]:
    """Compiling and linking against the torch this process imported (C++ only)."""
    root = Path(torch.__file__).parent
    return ["-std=c++20", f"-I{root / 'include'}", f"-I{root / 'include' / 'torch' / 'csrc' / 'api' / 'include'}",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}", "-lc10", "-ltorch_cpu"]


def _text(source: Path) -> bytes:
    """The source and the local headers it includes (`#include "name"`, its own folder), so
    that a change to either builds it again."""
    text = source.read_bytes()
    headers = re.findall(rb'^#include "([^"]+)"', text, flags=re.MULTILINE)
    return b"\0".join([text, *((source.parent / h.decode()).read_bytes() for h in headers)])


@functools.cache
def _compiler_version(compiler: str) -> str:
    """The first line of `compiler --version` (e.g. "c++ (Debian 14.2.0-19) 14.2.0"); "" if it
    will not say (then the build that follows reports why it fails, if it does)."""
    try:
        out = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    return (out.stdout.splitlines() or [""])[0]


def _compile(source: Path, fallback: str) -> Path | None:
    """The built shared library of `source`, from the cache or compiled now; None if it cannot be."""
    compiler = os.environ.get("CXX") or next(filter(None, map(shutil.which, ("c++", "g++"))), None)
    gomp = Path(torch.__file__).parent / "lib" / "libgomp.so.1"
    headers = Path(torch.__file__).parent / "include" / "torch" / "library.h"
    missing = ("no C++ compiler" if compiler is None else "torch has no libgomp" if not gomp.exists()
               else "torch has no C++ headers" if not headers.exists() else None)
    if missing:
        log.info("%s not built (%s); %s", source.name, missing, fallback)
        return None
    text = _text(source)
    generic = ["-mno-avx512f"] if os.environ.get(GENERIC) == "1" else []  # every AVX-512 subset off
    flags = [*FLAGS, *generic, f"-L{gomp.parent}", f"-Wl,-rpath,{gomp.parent}", *_torch_flags()]
    # torch's version too: a C++ kernel built against one torch's headers must not load into another;
    # and the compiler's own (its path stays the same when the system upgrades it).
    key = hashlib.sha256(b"\0".join([text, " ".join([compiler, _compiler_version(compiler), *flags,
                                                     torch.__version__]).encode(), _cpu_flags().encode()]))
    target = cache_dir() / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        # Built beside the target and renamed into place: workers that start together never
        # load a half-written library.
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            done = subprocess.run([compiler, str(source), *flags, "-o", tmp, "-lm"], capture_output=True, text=True,
                                  timeout=300)
            if done.returncode != 0:
                log.warning("%s did not compile; %s:\n%s", source.name, fallback, done.stderr[-2000:])
                return None
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return target


def torch_ops(source: Path, switch: str, fallback: str) -> bool:
    """Whether C++ file `source` is built and loaded into torch's dispatcher (its operator
    kernels registered), once a process; False where it cannot be built, or when `switch` or
    LLMSPLIT_NATIVE is "0". A library torch loaded stays loaded: after `forget`, a switched-off
    kernel is still registered, and its callers must ask this function, not the dispatcher."""
    if source not in _built:
        with _lock:
            if source not in _built:
                loaded = None
                if os.environ.get(switch, "1") != "0" and os.environ.get("LLMSPLIT_NATIVE", "1") != "0":
                    try:
                        loaded = _compile(source, fallback)
                        if loaded is not None:
                            torch.ops.load_library(str(loaded))
                    # An unwritable cache, a hung compiler, a library the loader or torch refuses.
                    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                        log.warning("%s unavailable (%s); %s", source.name, e, fallback)
                        loaded = None
                _built[source] = loaded
    return _built[source] is not None


def process_constant(ask: Callable[[], bool]) -> Callable[[], bool]:
    """`ask()` answered once a process (its `cache_clear` asks again: tests), and a constant to
    torch.compile once `constants_for_compile` has run, so that a compiled step calls it instead
    of breaking its graph there. A dict rather than functools.cache: dynamo traces through a
    cache wrapper into the function (and warns), where it takes an `assume_constant_result`
    function's answer as it is. Not marked here: `torch.compiler.assume_constant_result` imports
    torch._dynamo and sympy (1.3 s and 74 MiB of RSS a process on 2 cores), which an eager
    generate or serve never needs."""
    answers: dict[str, bool] = {}

    @functools.wraps(ask)
    def answer() -> bool:
        if "answer" not in answers:
            answers["answer"] = ask()
        return answers["answer"]

    answer.cache_clear = answers.clear
    _constants.append(answer)
    return answer


def constants_for_compile() -> None:
    """Mark every `process_constant` for torch.compile: called before a graph is compiled."""
    for answer in _constants:
        torch.compiler.assume_constant_result(answer)


def forget(source: Path) -> None:
    """Build `source` again at its next use (tests: a changed environment)."""
    with _lock:
        _built.pop(source, None)
