"""One run per folder: the process that launches a run holds an exclusive lock on its
folder for the whole job, so that a second run (or a `--resume auto` of the same run)
cannot write the same `.step_N.tmp` and metrics.jsonl at the same time.

The lock is `flock` on RUN_DIR/.lock, which holds the holder's pid, host and command line
for the message the second run prints. The kernel releases an flock when its holder exits
or dies, so a lock file left by a dead process (a kill -9, a power cut) is simply taken
again: there is no stale lock to clean up. The launcher holds it while it waits for its
workers; workers forked straight from it (LLMSPLIT_START_METHOD=fork) share the lock too (an
flock belongs to the open file, which they inherit), while workers from the forkserver or
started by exec (spawn, torchrun) do not see the descriptor at all.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from ..errors import ConfigError

LOCK_FILE = ".lock"


@contextmanager
def holding(run_dir: str | Path):
    """Hold `run_dir`'s lock inside the block (creating the folder); ConfigError naming the
    holder when another process has it."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _in_use(run_dir, fd) from None
        command = " ".join(["llmsplit", *sys.argv[1:]])
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                  "command": command if len(command) <= 160 else command[:160] + " ..."}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder).encode() + b"\n", 0)
        yield
    finally:
        os.close(fd)  # releases the lock


def check_free(run_dir: str | Path) -> None:
    """ConfigError naming the holder when a live process holds `run_dir`'s lock; nothing is
    created (a refused command leaves no folder behind)."""
    path = Path(run_dir) / LOCK_FILE
    if not path.is_file():
        return
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _in_use(Path(run_dir), fd) from None
    finally:
        os.close(fd)


def _in_use(run_dir: Path, fd: int) -> ConfigError:
    try:
        holder = json.loads(os.pread(fd, 4096, 0))
        who = (f"process {holder['pid']} on {holder['host']}, started {holder['started']}: "
               f"{holder['command']}")
    except (OSError, ValueError, KeyError, TypeError):
        who = "a process that has not yet written its name"
    return ConfigError(f"--run-dir {str(run_dir)!r} is in use by another run ({who}); wait for it to end, or pass "
                       f"another --run-dir")
