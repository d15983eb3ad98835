"""Chat templates rendered in child processes, where a time limit and a memory limit really stop
them: the one way templates run for `generate --chat`, `serve` and training data.

Why a process, not a thread with counters: a template arrives with downloaded model files and
runs in Jinja's sandbox, but the sandbox bounds neither time nor memory. A string doubled 40
times (`{% set ns.s = ns.s ~ ns.s %}` in a loop) reaches gigabytes in seconds through Jinja's
concatenation, which compiles to a plain join that no sandbox hook intercepts; `'x'.center(n)`,
`replace`, `format` widths and `join` grow memory inside single C calls. An in-process bound would
need a check on every operation that allocates. A process is stopped by the kernel instead:
RLIMIT_AS caps what it may map (an allocation past the cap fails, and the child reports it), and
SIGKILL ends it at the time limit wherever it is, in Python or in C. What the template built
dies with it, so the parent's memory (a server holding a model) never holds it.

Children are started on first use (0.08 s), one per render running at once, kept idle and
reused; one that hit a limit is killed and a fresh one takes its place. The round trip costs
0.14 ms a render (an 11-message conversation: 0.16 ms against 0.02 ms in-process). A child reads requests from its
stdin and exits when that closes, so it never outlives its parent, however the parent ended.

Wire format (both ends are this module): a request is 8 bytes of length and JSON (the messages
are JSON already, from a body or a data file); a reply is one byte of kind, 8 bytes of length
and the payload: T text, E the template's own error, M the memory limit was hit.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError

DEFAULT_SECONDS = 10.0
DEFAULT_MAX_BYTES = 1 << 30
MOST_IDLE = 4  # children kept for reuse; the server renders at most 4 requests at once
POLL_S = 0.1  # the longest a waiting thread stays in one select(): an exception raised in it lands by then
_SRC = str(Path(__file__).resolve().parents[2])  # the folder holding this llmsplit package


class TemplateError(ValueError):
    """The messages do not fit the model's template (e.g. roles that must alternate)."""


class TemplateLimitError(TemplateError):
    """The template ran past its time or memory limit and was stopped."""


@dataclass(frozen=True)
class TemplateLimits:
    """How long one render may run and how much memory its process may use beyond the
    interpreter's own; `*_name` is how the caller raises each (a flag, a parameter), named
    when the limit is hit, or None where the limit is fixed."""
    seconds: float = DEFAULT_SECONDS
    max_bytes: int = DEFAULT_MAX_BYTES
    seconds_name: str | None = "--template-timeout"
    bytes_name: str | None = "--template-max-bytes"

    def __post_init__(self):
        if not self.seconds > 0:
            raise ConfigError(f"{self.seconds_name or 'the template time limit'} {self.seconds} must be positive")
        if self.max_bytes < 1 << 20:
            raise ConfigError(f"{self.bytes_name or 'the template memory limit'} {self.max_bytes} is below 1MiB; "
                              f"a template needs more than that to render anything")

    def hit(self, what: str, name: str | None) -> TemplateLimitError:
        how = f"{name} raises the limit" if name else "fix chat_template in the model's tokenizer files"
        return TemplateLimitError(f"the model's chat template {what} and was stopped ({how})")


def render(request: dict, limits: TemplateLimits) -> str:
    """The text `request` renders to (chat_template.render_request runs it in the child)."""
    try:
        payload = json.dumps(request).encode()
    except (TypeError, ValueError) as e:
        raise TemplateError(f"the messages are not JSON values ({e})") from None
    pool = _pool(limits.max_bytes)
    child = pool.take()
    try:
        kind, body = child.ask(payload, limits.seconds)
    except TimeoutError:
        child.kill()
        raise limits.hit(f"ran for more than {limits.seconds:g} s", limits.seconds_name) from None
    except BaseException:  # the child died, or this thread was stopped (serve's time limit): never reuse it
        child.kill()
        raise
    if kind == b"M":
        child.kill()  # a MemoryError may have left its interpreter in any state
        raise limits.hit(f"needed more than {_mib(limits.max_bytes)} of memory", limits.bytes_name)
    pool.give_back(child)
    if kind == b"E":
        raise TemplateError(body.decode())
    return body.decode("utf-8", "surrogatepass")


def _mib(n: int) -> str:
    return f"{n / (1 << 30):g} GiB" if n >= 1 << 30 else f"{n / (1 << 20):g} MiB"


class _Child:
    def __init__(self, max_bytes: int):
        # PYTHONPATH: the child imports the same llmsplit as this process, installed or not.
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [_SRC, os.environ.get("PYTHONPATH")])))
        self.proc = subprocess.Popen([sys.executable, "-m", "llmsplit.io.template_process", str(max_bytes)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, close_fds=True)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def ask(self, payload: bytes, seconds: float) -> tuple[bytes, bytes]:
        deadline = time.monotonic() + seconds
        try:
            self.proc.stdin.write(len(payload).to_bytes(8, "big") + payload)
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise self._died() from None
        head = self._read(9, deadline)
        return head[:1], self._read(int.from_bytes(head[1:], "big"), deadline)

    def _read(self, n: int, deadline: float) -> bytes:
        fd, chunks, got = self.proc.stdout.fileno(), [], 0
        while got < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            ready, _, _ = select.select([fd], [], [], min(left, POLL_S))
            if ready:
                chunk = os.read(fd, min(n - got, 1 << 20))
                if not chunk:
                    raise self._died()
                chunks.append(chunk)
                got += len(chunk)
        return b"".join(chunks)

    def _died(self) -> TemplateError:
        code = self.proc.wait()
        how = f"signal {-code}" if code < 0 else f"exit code {code}"
        return TemplateError(f"the process rendering the chat template ended ({how}) before it answered")

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
        self.proc.wait()
        self.close()

    def close(self) -> None:
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass


class _Pool:
    def __init__(self, max_bytes: int):
        self.max_bytes, self.idle, self.lock = max_bytes, [], threading.Lock()

    def take(self) -> _Child:
        with self.lock:
            while self.idle:
                child = self.idle.pop()
                if child.alive():
                    return child
                child.kill()
        return _Child(self.max_bytes)

    def give_back(self, child: _Child) -> None:
        with self.lock:
            if len(self.idle) < MOST_IDLE:
                self.idle.append(child)
                return
        child.close()  # its stdin closes: it exits by itself

    def close(self) -> None:
        with self.lock:
            idle, self.idle = self.idle, []
        for child in idle:
            child.close()
            try:
                child.proc.wait(1)
            except subprocess.TimeoutExpired:
                child.kill()


_pools: dict[int, _Pool] = {}
_pools_lock = threading.Lock()


def _pool(max_bytes: int) -> _Pool:
    with _pools_lock:
        if max_bytes not in _pools:
            _pools[max_bytes] = _Pool(max_bytes)
        return _pools[max_bytes]


@atexit.register
def close_all() -> None:
    """End the idle children (they would end anyway once this process's pipes close)."""
    with _pools_lock:
        pools = list(_pools.values())
    for pool in pools:
        pool.close()


# ---------------------------------------------------------------- the child


def _cap_memory(max_bytes: int) -> None:
    import resource

    try:
        with open("/proc/self/status") as f:  # what the interpreter maps already, in kB
            base = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    except (OSError, StopIteration):
        base = 256 << 20  # not Linux: RLIMIT_AS may not be enforced anyway
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = base + max_bytes
    resource.setrlimit(resource.RLIMIT_AS, (cap if hard == resource.RLIM_INFINITY else min(cap, hard), hard))


def serve_renders(max_bytes: int) -> None:
    from .chat_template import render_request

    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything printed goes to stderr, never into the replies
    inp = sys.stdin.buffer
    _cap_memory(max_bytes)
    reserve = bytearray(4 << 20)  # given back on MemoryError, so that the reply can still be sent

    def reply(kind: bytes, payload: bytes) -> None:
        out.write(kind + len(payload).to_bytes(8, "big") + payload)
        out.flush()

    while len(head := inp.read(8)) == 8:
        try:
            request = json.loads(inp.read(int.from_bytes(head, "big")))
            text = render_request(request).encode("utf-8", "surrogatepass")
        except MemoryError:
            del reserve
            reply(b"M", b"")
            os._exit(0)
        except TemplateError as e:
            reply(b"E", str(e).encode("utf-8", "replace"))
            continue
        reply(b"T", text)


if __name__ == "__main__":
    # Run as the package's module, not as __main__: the classes the template code raises
    # (TemplateError) must be the ones `serve_renders` catches.
    from llmsplit.io.template_process import serve_renders

    serve_renders(int(sys.argv[1]))
