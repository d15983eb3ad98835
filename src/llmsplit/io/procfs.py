"""Sizes Linux reports in /proc (MemTotal, MemAvailable, a process's VmHWM), read one way."""

from __future__ import annotations


def proc_bytes(path: str, field: str) -> int | None:
    """The `field:` line of a /proc file such as /proc/meminfo or /proc/self/status, given
    there in kB, as bytes; None where the file or the line does not exist (not Linux)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
