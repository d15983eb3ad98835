"""Running a baseline's launcher from a benchmark without hanging on its teardown."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def run_until_results(cmd: list[str], out: Path, *, env: dict, log=subprocess.DEVNULL,
                      grace_s: float = 60.0, timeout_s: float = 1800.0) -> int:
    """Run `cmd` (a launcher and its workers) in its own process group; once `out` exists,
    give it `grace_s` to exit, then stop the group. Returns the exit status (0 when the
    results were written and the group had to be stopped).

    Seen on this 2-core VM with torchrun (plain HF DDP) and `accelerate launch` (4 workers):
    rank 0 wrote its results, the other ranks exited, and rank 0 stayed blocked for good in
    gloo's teardown (`destroy_process_group`). The measurement is complete by then, so the
    benchmark must not wait on it."""
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT if log is not subprocess.DEVNULL
                            else subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None:
        if out.exists():
            try:
                return proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                print(f"{Path(cmd[2] if len(cmd) > 2 else cmd[0]).name}: results written but the workers did not "
                      f"exit; stopping them", file=sys.stderr)
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return 0
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise subprocess.TimeoutExpired(cmd, timeout_s)
        time.sleep(0.5)
    return proc.returncode
