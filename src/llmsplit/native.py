"""Small native kernels built at first use: the one way llmsplit builds and loads native code.

Where PyTorch has no kernel for a job (paged decode attention, infer/paged_attention.py) or
its kernel is far from what the memory allows (an int4 matmul at one row, quant/kernels.py),
the job is a short source file next to its Python module, built for this CPU (-march=native)
against the OpenMP runtime torch loaded (so its threads are torch's own pool), into a cache
folder keyed by the source, the compiler and its flags, the CPU and torch's version:
once a machine. Two kinds:
- `library`: plain C through ctypes, built with the C compiler torch.compile itself builds
  CPU kernels with (`cc`, or `$CC`), well under a second. For a kernel Python calls a few
  times a step.
- `torch_ops`: C++ that registers an operator's CPU kernel (TORCH_LIBRARY_IMPL) against
  torch's own headers (`c++`, or `$CXX`; ~5 s, including only torch/library.h and ATen's
  core, not the whole extension API), loaded into torch's dispatcher. For a kernel called
  ~100 times a step, from eager code and from compiled graphs alike, where a ctypes call
  from Python would cost more than the kernel.
Where a kernel cannot be built (no compiler, a torch without libgomp or headers, an
unwritable cache) the caller keeps PyTorch's path, which gives the same values to float
rounding; `LLMSPLIT_NATIVE=0` asks for that everywhere, and each kernel has its own switch too.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
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

_lock = threading.Lock()
_built: dict[Path, object | None] = {}  # source -> what its loader returned


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "llmsplit" / "kernels"


def _cpu_flags() -> str:
    try:
        return next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return ""


def _torch_flags() -> list[str]:
    """Compiling and linking against the torch this process imported (C++ only)."""
    root = Path(torch.__file__).parent
    return ["-std=c++20", f"-I{root / 'include'}", f"-I{root / 'include' / 'torch' / 'csrc' / 'api' / 'include'}",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}", "-lc10", "-ltorch_cpu"]


def _compile(source: Path, fallback: str, cxx: bool) -> Path | None:
    """The built shared library of `source`, from the cache or compiled now; None if it cannot be."""
    compiler = os.environ.get("CXX" if cxx else "CC") or next(
        filter(None, map(shutil.which, ("c++", "g++") if cxx else ("cc", "gcc"))), None)
    gomp = Path(torch.__file__).parent / "lib" / "libgomp.so.1"
    headers = Path(torch.__file__).parent / "include" / "torch" / "library.h"
    missing = (("no C++ compiler" if cxx else "no C compiler") if compiler is None
               else "torch has no libgomp" if not gomp.exists()
               else "torch has no C++ headers" if cxx and not headers.exists() else None)
    if missing:
        log.info("%s not built (%s); %s", source.name, missing, fallback)
        return None
    text = source.read_bytes()
    flags = [*FLAGS, f"-L{gomp.parent}", f"-Wl,-rpath,{gomp.parent}", *(_torch_flags() if cxx else [])]
    # torch's version too: a C++ kernel built against one torch's headers must not load into another.
    key = hashlib.sha256(b"\0".join([text, " ".join([compiler, *flags, torch.__version__]).encode(),
                                     _cpu_flags().encode()]))
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


def _once(source: Path, switch: str, fallback: str, load: Callable[[Path], object]) -> object | None:
    """`load(built library)` of `source`, memoised per process; None where it cannot be built,
    or when the environment variable `switch` or LLMSPLIT_NATIVE is "0"."""
    if source not in _built:
        with _lock:
            if source not in _built:
                loaded = None
                if os.environ.get(switch, "1") != "0" and os.environ.get("LLMSPLIT_NATIVE", "1") != "0":
                    try:
                        built = _compile(source, fallback, cxx=source.suffix == ".cpp")
                        loaded = load(built) if built is not None else None
                    # An unwritable cache, a hung compiler, a library the loader or torch refuses.
                    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                        log.warning("%s unavailable (%s); %s", source.name, e, fallback)
                _built[source] = loaded
    return _built[source]


def library(source: Path, signatures: dict[str, tuple[list, type | None]], switch: str,
            fallback: str) -> ctypes.CDLL | None:
    """The built library of C file `source`, once a process, its functions typed from
    `signatures` (name -> (argtypes, restype)); None where it cannot be built, or when the
    environment variable `switch` or LLMSPLIT_NATIVE is "0". `fallback` says, in the log,
    what runs instead."""
    def load(path: Path) -> ctypes.CDLL:
        lib = ctypes.CDLL(str(path))
        for name, (argtypes, restype) in signatures.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, restype
        return lib

    return _once(source, switch, fallback, load)


def torch_ops(source: Path, switch: str, fallback: str) -> bool:
    """Whether C++ file `source` is built and loaded into torch's dispatcher (its operator
    kernels registered), once a process; False where it cannot be built, or when `switch` or
    LLMSPLIT_NATIVE is "0". A library torch loaded stays loaded: after `forget`, a switched-off
    kernel is still registered, and its callers must ask this function, not the dispatcher."""
    def load(path: Path) -> Path:
        torch.ops.load_library(str(path))
        return path

    return _once(source, switch, fallback, load) is not None


def forget(source: Path) -> None:
    """Build `source` again at its next use (tests: a changed environment)."""
    with _lock:
        _built.pop(source, None)
