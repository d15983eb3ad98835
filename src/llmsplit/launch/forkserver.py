"""The CPU workers' forkserver, forked from the `llmsplit` program at its start.

Python's forkserver (multiprocessing.forkserver) starts as a fresh interpreter that imports
torch and the workers' modules (`set_forkserver_preload`) before it forks any worker: 2.3 s
of every `llmsplit train` on a 2-core machine, paid again although the launching process
has imported torch already. A fork of the launching process *is* such a server, with less
left to import, as long as the fork is made while the process is in the state the server's
own forks of workers rely on: no thread of its that could hold a lock at the moment of the
fork (glibc's resolver lock inside the elastic agent's TCPStore thread, an OpenMP team, a
tokenizers pool), which the child would then wait on forever, and nothing open that the
workers must not hold (the run folder's lock, launch/../train/run_lock.py). The program's
start (`claim_process_for_launching`, before it computes anything) is that moment: the
process has imported modules and nothing else, and its only threads are those imports
started (numpy's OpenBLAS pool, fork-safe through its own atfork handler), which Python's
forkserver has as well when it forks workers, having imported the same modules.

Only the start differs from Python's: the server runs Python's own loop (`forkserver.main`),
which forks the workers and reports their exit codes; `launch` then finds it running, as it
finds the server of an earlier launch from the same process. A library caller (whose process
may run anything), a CUDA machine (spawn), and a Python whose forkserver internals differ
from what this module knows (3.14 added an authentication key) get Python's usual server.
Measured: `llmsplit train --nproc 2`, 4 tiny steps, 8.0-8.6 → 5.8 s; in the test suite,
whose command lines are forked from a process with the workers' modules imported, 4.3 → 0.8 s.
"""

from __future__ import annotations

import os
import socket
import sys
import threading


def _knows(server) -> bool:
    """Linux (macOS's system libraries are not safe to use in a forked child, which is why
    Python spawns there), and a forkserver that keeps the fields this module sets, no more."""
    fields = ("_forkserver_address", "_forkserver_alive_fd", "_forkserver_pid", "_lock")
    return (sys.platform == "linux" and sys.version_info < (3, 14) and all(hasattr(server, name) for name in fields)
            and not hasattr(server, "_forkserver_authkey"))


def fork_forkserver(preload: list[str]) -> bool:
    """Fork this process into the workers' forkserver, which then imports `preload` (the
    workers' modules, shared by every worker it forks); False where Python's own server is
    left to start at the first launch instead. Call it only before the process computes
    anything (see above)."""
    from multiprocessing import connection, forkserver, resource_tracker

    server = forkserver._forkserver
    if not _knows(server) or server._forkserver_pid is not None or threading.active_count() > 1:
        return False
    with server._lock:
        resource_tracker.ensure_running()  # a process of its own, shared with the workers as usual
        with socket.socket(socket.AF_UNIX) as listener:
            address = connection.arbitrary_address("AF_UNIX")
            listener.bind(address)
            os.chmod(address, 0o600)
            listener.listen()
            # Every client holds the write end; the server stops at EOF on the read end,
            # once this process and all the workers it started have exited.
            alive_r, alive_w = os.pipe()
            sys.stdout.flush()  # else the server's copy of unwritten output would reach each worker's exit
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _serve(listener.fileno(), alive_r, alive_w, preload)
            os.close(alive_r)
        server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, pid
    return True


def _serve(listener_fd: int, alive_r: int, alive_w: int, preload: list[str]) -> None:
    """The forked server: Python's forkserver loop, then `os._exit`, so that nothing the
    launching process registered (atexit handlers, temporary folders' finalizers) runs a
    second time here."""
    from multiprocessing import forkserver

    code = 0
    try:
        os.close(alive_w)
        forkserver.main(listener_fd, alive_r, preload)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0
    except BaseException:  # noqa: BLE001 - say why, then leave without the parent's exit handlers
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        os._exit(code)
