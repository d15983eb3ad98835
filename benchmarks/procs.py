"""Running a baseline's launcher from a benchmark without hanging on its teardown."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def run_until_results(cmd: list[str], out: Path, *, env: dict, log=subprocess.DEVNULL,
                      grace_s: float = 10.0, timeout_s: float = 1800.0) -> int:
    """Run `cmd` (a launcher and its workers) in its own process group; once `out` exists,
    give it `grace_s` to exit, then stop the group. Returns the exit status (0 when the
    results were written and the group had to be stopped).

    Seen on this 2-core VM with torchrun (plain HF DDP) and `accelerate launch` (4 workers):
    rank 0 wrote its results, the other ranks exited, and rank 0 stayed blocked for good in
    gloo's teardown (`destroy_process_group`). The measurement is complete by then, so the
    benchmark must not wait on it: a teardown that finishes does so within a second, so 10 s
    of grace is ample (it was 60 s, a minute of every quick run in the test suite).

    torchrun starts each worker in a session of its own, out of reach of the launcher's
    group: a worker stuck that way outlived its launcher and kept a core busy through the
    next benchmarks. So the launcher's descendants are noted while it runs, and any still
    alive at the end are stopped too.

    A teardown can also crash instead of hang: in CI a plain torchrun + DDP run exited 1 once
    in some hundred runs, as the tp test workers do ('terminate called without an active
    exception' at interpreter exit, after their results: a gloo worker thread decrefs a
    finished collective's tensors while the interpreter finalizes; tests/test_parallel_units.py). Rank 0 writes `out` only after the
    last step's collectives, so once it exists every rank has done every step: such an exit
    is reported, with the log's tail, and the results are kept."""
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT if log is not subprocess.DEVNULL
                            else subprocess.DEVNULL, start_new_session=True)
    seen: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while proc.poll() is None:
            seen.update(_descendants(proc.pid))
            if out.exists():
                try:
                    return _after_results(proc.wait(timeout=grace_s), cmd, log)
                except subprocess.TimeoutExpired:
                    print(f"{_name(cmd)}: results written but the workers did not exit; stopping them",
                          file=sys.stderr)
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    return 0
            if time.monotonic() > deadline:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                raise subprocess.TimeoutExpired(cmd, timeout_s)
            time.sleep(0.5)
        return _after_results(proc.returncode, cmd, log) if out.exists() else proc.returncode
    finally:
        _stop_leftovers(seen)


def run_logged(cmd: list[str], out: Path | None, *, env: dict, log_path: Path, timeout_s: float = 1800.0) -> None:
    """`cmd` with its output in `log_path`, through `run_until_results` when it writes results to
    `out` (a peer's launcher, which may hang or crash in teardown), else to its end; a failure
    raises with the log's tail."""
    with open(log_path, "w") as f:
        if out is None:
            code = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
        else:
            code = run_until_results(cmd, out, env=env, log=f, timeout_s=timeout_s)
    if code:
        raise RuntimeError(f"{' '.join(cmd[:6])} ... exited {code}:\n{Path(log_path).read_text()[-2000:]}")


def _name(cmd: list[str]) -> str:
    """The script a launcher command runs (`python -m torch.distributed.run ... SCRIPT`), for messages."""
    return Path(cmd[2] if len(cmd) > 2 else cmd[0]).name


def _after_results(code: int, cmd: list[str], log) -> int:
    """0 for a launcher that failed only after its results were written (see run_until_results)."""
    if code:
        name = getattr(log, "name", None)
        tail = Path(name).read_text()[-1500:] if isinstance(name, str) and os.path.isfile(name) else ""
        print(f"{_name(cmd)}: results written, then the launcher exited {code} in teardown; keeping the results\n"
              f"{tail}", file=sys.stderr)
    return 0


def _stat_fields(pid: int | str) -> list[str] | None:
    """/proc/PID/stat after the command name: [state, ppid, ...]; index 19 is the start time,
    which with the pid names one process for good. None once the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _start_time(pid: int) -> str | None:
    fields = _stat_fields(pid)
    return fields[19] if fields else None


def _descendants(root: int) -> dict[int, str]:
    """{pid: start time} of every live descendant of `root` (Linux /proc; empty elsewhere)."""
    children: dict[int, list[tuple[int, str]]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        fields = _stat_fields(entry) if entry.isdigit() else None
        if fields:
            children.setdefault(int(fields[1]), []).append((int(entry), fields[19]))
    found, todo = {}, [root]
    while todo:
        for pid, start in children.get(todo.pop(), []):
            found[pid] = start
            todo.append(pid)
    return found


def _stop_leftovers(seen: dict[int, str]) -> None:
    for pid, start in seen.items():
        if _start_time(pid) == start:  # still the same process, not a reused pid
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
