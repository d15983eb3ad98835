"""Small C kernels built at first use: the one way llmsplit builds and loads native code.

Where PyTorch has no kernel for a job (paged decode attention, infer/paged_attention.py) or
its kernel is far from what the memory allows (an int4 matmul at one row, quant/kernels.py),
the job is a short C file next to its Python module. It is built with the C compiler
torch.compile itself builds CPU kernels with (`cc`, or `$CC`), for this CPU (-march=native),
against the OpenMP runtime torch loaded (so its threads are torch's own pool), into a cache
folder keyed by the source, the flags and the CPU: well under a second, once a machine.
Plain C through ctypes rather than a torch C++ extension, whose headers take about a minute
to compile. Where a kernel cannot be built (no compiler, a torch without libgomp, an
unwritable cache) `library` returns None and the caller keeps PyTorch's path, which gives
the same values to float rounding; `LLMSPLIT_NATIVE=0` asks for that everywhere, and each
kernel has its own switch too.
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
from pathlib import Path

import torch

log = logging.getLogger("llmsplit.native")

FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math",
         "-fopenmp", "-fPIC", "-shared"]

_lock = threading.Lock()
_built: dict[Path, ctypes.CDLL | None] = {}


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "llmsplit" / "kernels"


def _cpu_flags() -> str:
    try:
        return next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return ""


def _compile(source: Path, fallback: str) -> ctypes.CDLL | None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    gomp = Path(torch.__file__).parent / "lib" / "libgomp.so.1"
    if compiler is None or not gomp.exists():
        log.info("%s not built (%s); %s", source.name, "no C compiler" if compiler is None else "torch has no libgomp",
                 fallback)
        return None
    text = source.read_bytes()
    flags = [*FLAGS, f"-L{gomp.parent}", f"-Wl,-rpath,{gomp.parent}"]
    key = hashlib.sha256(b"\0".join([text, " ".join([compiler, *flags]).encode(), _cpu_flags().encode()]))
    target = cache_dir() / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        # Built beside the target and renamed into place: workers that start together never
        # load a half-written library.
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            done = subprocess.run([compiler, *flags, str(source), "-o", tmp, "-lm"], capture_output=True, text=True,
                                  timeout=300)
            if done.returncode != 0:
                log.warning("%s did not compile; %s:\n%s", source.name, fallback, done.stderr[-2000:])
                return None
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return ctypes.CDLL(str(target))


def library(source: Path, signatures: dict[str, tuple[list, type | None]], switch: str,
            fallback: str) -> ctypes.CDLL | None:
    """The built library of C file `source`, once a process, its functions typed from
    `signatures` (name -> (argtypes, restype)); None where it cannot be built, or when the
    environment variable `switch` or LLMSPLIT_NATIVE is "0". `fallback` says, in the log,
    what runs instead."""
    if source not in _built:
        with _lock:
            if source not in _built:
                lib = None
                if os.environ.get(switch, "1") != "0" and os.environ.get("LLMSPLIT_NATIVE", "1") != "0":
                    try:
                        lib = _compile(source, fallback)
                        for name, (argtypes, restype) in signatures.items() if lib is not None else ():
                            fn = getattr(lib, name)
                            fn.argtypes, fn.restype = argtypes, restype
                    except (OSError, subprocess.SubprocessError) as e:  # an unwritable cache, a hung compiler
                        log.warning("%s unavailable (%s); %s", source.name, e, fallback)
                _built[source] = lib
    return _built[source]


def forget(source: Path) -> None:
    """Build `source` again at its next use (tests: a changed environment)."""
    with _lock:
        _built.pop(source, None)
