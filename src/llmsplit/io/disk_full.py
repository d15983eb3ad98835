"""A write that failed because the disk is full, said as such: "no space left on device at
PATH". torch reports a full disk under a checkpoint save as a RuntimeError of its zip
writer ("unexpected pos 704 vs 598"), and Python's own OSError names no path for a failed
write(2); either way the user has to guess which disk filled up."""

from __future__ import annotations

import errno
import os
from contextlib import contextmanager
from pathlib import Path

_FULL = (errno.ENOSPC, errno.EDQUOT)
# Less free space than this after a failed write: the write failed because the disk is full.
_NEARLY_FULL_BYTES = 1 << 20


class NoSpaceLeft(OSError):
    """`path`'s disk (or quota) is full. `details` carries the path to the launching process
    (see launch.worker_entry)."""

    def __init__(self, path: str | Path, doing: str):
        super().__init__(f"no space left on device at {path} ({doing}); free space on that disk or write "
                         f"the run elsewhere (--run-dir, checkpoint.dir)")
        self.errno = errno.ENOSPC
        self.details = {"path": str(path)}


@contextmanager
def writing(path: str | Path, doing: str):
    """Turn an exception raised inside into NoSpaceLeft(path) when the disk is full."""
    try:
        yield
    except NoSpaceLeft:
        raise
    except Exception as e:
        if not disk_full(e, path):
            raise
        raise NoSpaceLeft(path, doing) from e


def disk_full(error: BaseException, path: str | Path) -> bool:
    """Whether `error` (or one it wraps: a cause, a context, the per-rank failures of a
    torch.distributed.checkpoint save) is ENOSPC / EDQUOT, or `path`'s disk is now full."""
    pending, seen = [error], set()
    while pending:
        e = pending.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _FULL:
            return True
        wrapped = [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)  # dcp's CheckpointException: {rank: (exception, traceback)}
        if isinstance(failures, dict):
            wrapped += [f[0] if isinstance(f, tuple) and f else f for f in failures.values()]
        pending += [w for w in wrapped if isinstance(w, BaseException)]
    return free_bytes(path) < _NEARLY_FULL_BYTES


def free_bytes(path: str | Path) -> int:
    """Bytes an unprivileged write may still use on `path`'s disk (its nearest existing folder)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        st = os.statvfs(path)
    except OSError:
        return _NEARLY_FULL_BYTES  # cannot tell: not full
    return st.f_bavail * st.f_frsize
