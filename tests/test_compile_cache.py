"""--compile auto (infer/compile_cache.py, issue 46 item 1): the artifact is handed to torch only
when whole and built for this key (a truncated, corrupt or foreign one is ignored and rebuilt),
one build runs per key, a killed build leaves the eager path and the next load builds again,
and a real round: eager at first, the background build stored, swapped in with the same tokens,
the next load compiled from the cache."""

import json
import os
import signal
import time

import pytest

pytest.importorskip("transformers")

import llmsplit  # noqa: E402
from hf_models import make_hf_folder  # noqa: E402
from llmsplit.errors import ConfigError  # noqa: E402
from llmsplit.infer import compile_cache  # noqa: E402
from llmsplit.infer.config import InferConfig  # noqa: E402


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the build process inherits it
    return tmp_path / "cache" / "llmsplit" / "compiled"


KEY = {"format": compile_cache.FORMAT, "model": {"dim": 64}, "machine": "here"}


def test_only_a_whole_artifact_built_for_the_key_is_used(cache):
    path = compile_cache.store(KEY, b"graphs" * 100)
    assert compile_cache.find(KEY) == b"graphs" * 100
    assert compile_cache.find({**KEY, "machine": "elsewhere"}) is None  # another key: another file
    data = path.read_bytes()
    path.write_bytes(data[:-10])  # truncated
    assert compile_cache.find(KEY) is None
    path.write_bytes(data[:-1] + b"X")  # one byte changed
    assert compile_cache.find(KEY) is None
    header = json.loads(data.split(b"\n", 1)[0])
    path.write_bytes(json.dumps({**header, "key": {**KEY, "machine": "elsewhere"}}).encode() + b"\n" +
                     data.split(b"\n", 1)[1])  # a file renamed from another key
    assert compile_cache.find(KEY) is None
    path.write_bytes(b"not json\n")
    assert compile_cache.find(KEY) is None
    assert [p.name for p in cache.iterdir() if ".tmp" in p.name] == []  # written under a temporary name, renamed


def _started(proc, key) -> None:
    deadline = time.monotonic() + 60
    while not compile_cache.building(key) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)  # until the builder holds its lock (or has ended)


def test_one_build_at_a_time_and_a_killed_build_leaves_nothing(cache, tmp_path):
    held = compile_cache._lock(KEY)
    assert compile_cache.building(KEY) and compile_cache.start_build("x", InferConfig(), KEY, 64) is None
    held.close()
    assert not compile_cache.building(KEY)
    folder = make_hf_folder(tmp_path / "llama", num_hidden_layers=1)
    for _ in range(2):  # killed while it compiles: no artifact, no failure marked, so the next load builds again
        proc = compile_cache.start_build(str(folder), InferConfig(max_batch=1), KEY, 64)
        _started(proc, KEY)
        assert proc.poll() is None
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        assert compile_cache.find(KEY) is None and not compile_cache.building(KEY)  # the OS released the lock
    # A build that fails is marked, and not started again for the same key.
    proc = compile_cache.start_build(str(tmp_path / "nowhere"), InferConfig(), KEY, 64)
    assert proc.wait() != 0 and (cache / f"{compile_cache._name(KEY)}.failed").exists()
    assert "does not exist" in (cache / f"{compile_cache._name(KEY)}.log").read_text()
    assert compile_cache.start_build(str(folder), InferConfig(), KEY, 64) is None


def test_bad_compile_values_name_the_flag(monkeypatch):
    with pytest.raises(ConfigError, match="--compile 'later' is not one of: auto, now, off"):
        InferConfig(compile="later")
    monkeypatch.setenv("LLMSPLIT_COMPILE", "sometimes")
    with pytest.raises(ConfigError, match="LLMSPLIT_COMPILE='sometimes' is not one of: auto, now, off"):
        InferConfig()
    monkeypatch.setenv("LLMSPLIT_COMPILE", "auto")
    assert InferConfig().compile == "auto" and InferConfig(compile=True).compile == "now"
    assert InferConfig(compile=False).compile == "off"


@pytest.mark.slow
def test_auto_runs_eager_then_swaps_in_the_background_build(cache, tmp_path):
    folder = make_hf_folder(tmp_path / "llama", num_hidden_layers=2)
    plain = llmsplit.load(folder, max_batch=1, max_context=64, compile="off")
    want = plain.generate("The def statement", max_new_tokens=12, ignore_eos=True)
    m = llmsplit.load(folder, max_batch=1, max_context=64, compile="auto")
    assert m.compile_pending is not None and m.runner._decode is None  # eager while the build runs
    assert plain.decode_mode == "eager" and m.decode_mode == "eager until the background compile is stored"
    assert m.generate("The def statement", max_new_tokens=12, ignore_eos=True) == want
    deadline = time.monotonic() + 600
    while compile_cache.find(m.compile_pending) is None and time.monotonic() < deadline:
        time.sleep(1)
    assert compile_cache.find(m.compile_pending) is not None, (cache / "..").resolve()
    assert m.compile_when_ready() and m.runner._decode is not None and m.compile_pending is None
    assert m.decode_mode == "compiled"  # what serve's start line says
    assert m.generate("The def statement", max_new_tokens=12, ignore_eos=True) == want
    started = time.monotonic()
    again = llmsplit.load(folder, max_batch=1, max_context=64, compile="auto")  # from the artifact, at load
    assert again.compile_pending is None and again.runner._decode is not None
    assert again.generate("The def statement", max_new_tokens=12, ignore_eos=True) == want
    print(f"load from the artifact: {time.monotonic() - started:.1f} s")
    for model in (plain, m, again):
        model.close()


def test_a_server_swaps_the_compiled_step_in_once_stored_and_idle(cache, monkeypatch):
    """serve's watcher (serve/compile_watch.py): nothing is asked of the engine before the artifact
    exists; then it asks on the engine thread until the engine is idle and the swap is done."""
    import threading
    from concurrent.futures import Future

    from llmsplit.infer.serve import compile_watch

    monkeypatch.setattr(compile_watch, "POLL_S", 0.01)
    answers = [False, False, True]  # busy twice, then swapped

    class Model:
        compile_pending = KEY

        def compile_when_ready(self, artifact=None):
            assert artifact == b"graphs"  # read once by the watcher, handed over at every try
            return answers.pop(0)

    class Scheduler:
        calls = 0

        def call(self, fn):
            Scheduler.calls += 1
            done = Future()
            done.set_result(fn())
            return done

    stop = threading.Event()
    thread = compile_watch.watch_compile(Model(), Scheduler(), stop)
    time.sleep(0.2)
    assert Scheduler.calls == 0 and thread.is_alive()  # no artifact yet: the engine is left alone
    compile_cache.store(KEY, b"graphs")
    thread.join(5)
    assert not thread.is_alive() and Scheduler.calls == 3 and answers == []
    Model.compile_pending = None
    assert compile_watch.watch_compile(Model(), Scheduler(), stop) is None  # nothing to wait for


def test_the_key_is_the_same_in_every_process():
    """(The CPU flags are a set: joined unsorted, every process hashed its own order and every
    load started a new build.)"""
    import subprocess
    import sys

    code = ("import json, torch; from llmsplit.infer import compile_cache; from llmsplit.infer.config import "
            "InferConfig; from llmsplit.models.presets import preset_config; print(json.dumps(compile_cache.build_key("
            "preset_config('tiny'), InferConfig(), torch.float32, 'none', torch.device('cpu'), (8, 128))))")
    keys = [json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                      env={**os.environ, "PYTHONHASHSEED": seed}).stdout) for seed in ("1", "2")]
    assert keys[0] == keys[1]
