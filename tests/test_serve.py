"""`llmsplit serve` as users run it: a subprocess on a random 127.0.0.1 port, spoken to with
the official `openai` client and plain HTTP. Answers match `llmsplit generate`, concurrent
clients are batched without losing anyone, bad requests get OpenAI-shaped 4xx errors while
the server keeps serving, departed clients free their KV blocks, and SIGTERM drains."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import pytest

pytest.importorskip("transformers")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from hf_models import make_hf_folder  # noqa: E402
from helpers import run_cli  # noqa: E402

KEY = "sk-test-key"
PROMPT = "The def statement"
LONG = 1000  # tokens: a generation that takes more than a second


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    # A long context, so that a generation lasts long enough to be interrupted.
    return make_hf_folder(tmp_path_factory.mktemp("serve") / "llama", num_hidden_layers=2,
                          max_position_embeddings=1024)


@contextmanager
def live_server(folder, tmp_path, *flags):
    """Start `llmsplit serve --port 0`, yield (base URL, process); SIGTERM it at the end."""
    log = tmp_path / f"serve-{time.monotonic_ns()}.log"
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "llmsplit", "serve", "--model", str(folder), "--port", "0",
                                 *flags], stdout=subprocess.DEVNULL, stderr=err,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        deadline = time.monotonic() + 120
        while not (m := re.search(r"at (http://127\.0\.0\.1:\d+)/v1", log.read_text())):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        yield m.group(1), proc, log
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                raise


@pytest.fixture(scope="module")
def server(folder, tmp_path_factory):
    with live_server(folder, tmp_path_factory.mktemp("log"), "--api-key", KEY, "--max-batch", "4",
                     "--max-queue", "32", "--max-request-size", "64KiB") as (url, proc, log):
        yield url
    assert proc.returncode == 0, log.read_text()  # SIGTERM drained and exited cleanly


def client(url, **kw):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60, **kw)


def metrics(url) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^llmsplit_(\w+(?:\{[^}]*\})?) (\S+)$", text, re.M)}


def wait_idle(url, timeout=20.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        if m["kv_blocks_used"] == m["requests_running"] == m["requests_waiting"] == 0 or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


def test_openai_client_models_completions_chat_and_streaming(server, folder):
    c = client(server)
    assert [m.id for m in c.models.list().data] == ["llama"]
    r = c.completions.create(model="llama", prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8
    assert r.usage.prompt_tokens == len(folder_tokens(folder, PROMPT))

    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is def?"}]
    chat = c.chat.completions.create(model="llama", messages=messages, max_tokens=10, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 10
    pieces, finish, usage = [], None, None
    for chunk in c.chat.completions.create(model="llama", messages=messages, max_tokens=10, temperature=0,
                                           stream=True, stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True}):
        if chunk.usage:
            usage = chunk.usage
        for ch in chunk.choices:
            pieces.append(ch.delta.content or "")
            finish = ch.finish_reason or finish
    assert "".join(pieces) == chat.choices[0].message.content and finish == "length"
    assert usage.completion_tokens == 10 and usage.prompt_tokens == chat.usage.prompt_tokens


def folder_tokens(folder, text):
    from llmsplit.io.tokenizer import HFTokenizer

    return HFTokenizer(folder / "tokenizer.json").encode(text)


def test_greedy_output_equals_llmsplit_generate(server, folder):
    want = run_cli("generate", "--model", str(folder), PROMPT, "--max-new-tokens", "12", "--ignore-eos").stdout
    r = client(server).completions.create(model="llama", prompt=PROMPT, max_tokens=12, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert r.choices[0].text + "\n" == want


def test_seeded_sampling_repeats(server):
    c = client(server)
    ask = lambda seed: c.completions.create(model="llama", prompt=PROMPT, max_tokens=12, temperature=1.0,  # noqa: E731
                                            top_p=0.9, seed=seed, extra_body={"ignore_eos": True}).choices[0].text
    assert ask(7) == ask(7) != ask(8)


def test_many_concurrent_clients_each_get_every_token(server):
    before = metrics(server)
    n, max_tokens, results, errors = 20, 12, {}, []
    c = client(server)

    def one(i):
        try:
            r = c.completions.create(model="llama", prompt=f"{i} + {i} =", max_tokens=max_tokens, temperature=0.8,
                                     seed=i, extra_body={"ignore_eos": True})
            results[i] = r
        except Exception as e:  # collected and reported below: a thread cannot fail the test itself
            errors.append(repr(e))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and sorted(results) == list(range(n)), errors
    assert all(r.usage.completion_tokens == max_tokens and r.choices[0].finish_reason == "length"
               for r in results.values())
    assert len({r.id for r in results.values()}) == n  # nobody got someone else's answer
    after = wait_idle(server)
    assert after["kv_blocks_used"] == 0 and after["requests_running"] == after["requests_waiting"] == 0
    assert after["requests_finished_total"] - before["requests_finished_total"] == n
    assert after["generated_tokens_total"] - before["generated_tokens_total"] == n * max_tokens
    assert after["generated_tokens_per_second"] > 0


@pytest.mark.parametrize("name,kwargs,status", [
    ("malformed JSON", dict(content=b'{"prompt": "x", max_tokens: }'), 400),
    ("not an object", dict(json=["x"]), 400),
    ("negative max_tokens", dict(json={"model": "llama", "prompt": "x", "max_tokens": -3}), 400),
    ("temperature out of range", dict(json={"prompt": "x", "temperature": -1}), 400),
    ("n > 1", dict(json={"prompt": "x", "n": 2}), 400),
    ("unknown model", dict(json={"model": "gpt-4o", "prompt": "x"}), 404),
    ("prompt longer than the context", dict(json={"prompt": "word " * 1200}), 400),
    ("token id outside the vocabulary", dict(json={"prompt": [1, 2, 10**6]}), 400),
    ("huge body", dict(json={"prompt": "x" * 100_000}), 413),
    ("wrong API key", dict(json={"prompt": "x"}, headers={"Authorization": "Bearer nope"}), 401),
    ("no API key", dict(json={"prompt": "x"}, headers={"Authorization": ""}), 401),
    ("chat without messages", dict(json={"messages": []}, path="/v1/chat/completions"), 400),
    ("chat with a bad role", dict(json={"messages": [{"role": "wizard", "content": "x"}]},
                                  path="/v1/chat/completions"), 400),
    ("unknown route", dict(json={}, path="/v1/embeddings"), 404),
])
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, name, kwargs, status):
    path = kwargs.pop("path", "/v1/completions")
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json", **kwargs.pop("headers", {})}
    r = httpx.post(f"{server}{path}", headers=headers, timeout=30, **kwargs)
    assert r.status_code == status, (name, r.text)
    err = r.json()["error"]
    assert err["message"] and err["type"], name
    assert httpx.get(f"{server}/health", timeout=10).json()["status"] == "ok"


def test_the_openai_client_sees_typed_errors(server):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client(server).completions.create(model="other", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client(server).completions.create(model="llama", prompt="x", max_tokens=-1)


def test_a_client_leaving_mid_stream_frees_its_blocks(server):
    before = metrics(server)
    body = {"model": "llama", "prompt": "x", "max_tokens": LONG, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=30) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        assert metrics(server)["kv_blocks_used"] > 0  # it is generating now
    after = wait_idle(server)  # leaving the `with` closed the connection mid-stream
    assert after["kv_blocks_used"] == 0
    assert after["generated_tokens_total"] - before["generated_tokens_total"] < LONG  # aborted, not run to the end
    assert after["requests_finished_total"] == before["requests_finished_total"]


def test_a_client_timing_out_on_a_plain_request_frees_its_blocks(server):
    before = metrics(server)
    body = {"model": "llama", "prompt": "x", "max_tokens": LONG, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=0.2)
    after = wait_idle(server)
    assert after["kv_blocks_used"] == 0
    assert after["generated_tokens_total"] - before["generated_tokens_total"] < LONG


def test_full_queue_gets_429_and_sigterm_drains(folder, tmp_path):
    with live_server(folder, tmp_path, "--max-batch", "1", "--max-queue", "1") as (url, proc, log):
        body = {"prompt": "x", "max_tokens": LONG, "ignore_eos": True}
        replies, start = [], threading.Barrier(4)

        def ask():
            start.wait()
            replies.append(httpx.post(f"{url}/v1/completions", json=body, timeout=120))

        threads = [threading.Thread(target=ask) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        codes = sorted(r.status_code for r in replies)
        # One runs and one waits; the others arrive while both are still generating.
        assert codes == [200, 200, 429, 429], codes
        for r in replies:
            if r.status_code == 429:
                assert int(r.headers["Retry-After"]) >= 1 and r.json()["error"]["code"] == "queue_full"
            else:
                assert r.json()["usage"]["completion_tokens"] == LONG

        # SIGTERM while a stream is in flight: the stream still ends properly, then the process exits 0.
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "max_tokens": 100, "stream": True},
                          timeout=60) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data:"))
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in (first, *lines) if line]
        assert rest[-1] == "data: [DONE]"
        chunks = [json.loads(line[6:]) for line in rest if line.startswith("data: {")]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert proc.wait(60) == 0, log.read_text()
        assert "stopped after answering" in log.read_text()


@pytest.mark.slow
def test_tensor_parallel_serving_answers_like_one_process(server, folder, tmp_path):
    want = client(server).completions.create(model="llama", prompt=PROMPT, max_tokens=8, temperature=0,
                                             extra_body={"ignore_eos": True}).choices[0].text
    with live_server(folder, tmp_path, "--tp", "2", "--api-key", KEY) as (url, proc, log):
        c = client(url)
        got = c.completions.create(model="llama", prompt=PROMPT, max_tokens=8, temperature=0,
                                   extra_body={"ignore_eos": True})
        assert got.choices[0].text == want
        stream = c.chat.completions.create(model="llama", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                           stream=True, extra_body={"ignore_eos": True})
        assert sum(1 for chunk in stream for ch in chunk.choices if ch.finish_reason == "length") == 1
    assert proc.returncode == 0, log.read_text()
