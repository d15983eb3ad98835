"""`llmsplit serve` as users run it: a subprocess on a random 127.0.0.1 port, spoken to with
the official `openai` client and plain HTTP. Answers match `llmsplit generate`, concurrent
clients are batched without losing anyone, bad requests get OpenAI-shaped 4xx errors while
the server keeps serving (unsupported fields, hostile chat templates, half-sent headers
included), departed clients free their KV blocks, and SIGTERM drains."""

import json
import os
import re
import signal
import socket
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

import llmsplit  # noqa: E402
import torch  # noqa: E402
from hf_models import make_hf_folder  # noqa: E402
from helpers import run_cli  # noqa: E402
from netns import hosts  # noqa: E402
from llmsplit.launch import free_port  # noqa: E402

KEY = "sk-test-key"
PROMPT = "The def statement"
LONG = 1000  # tokens: a generation that takes more than a second
TIMEOUT = 4  # --request-timeout of the servers here, in seconds
TEMPLATE_TIMEOUT = 2  # --template-timeout of the shared server
# ChatML, plus three traps a hostile model file could set, sprung by the last message: a loop of
# 10^10 empty iterations (stopped by the time limit), a string doubled 40 times (1 TiB: stopped
# by the memory limit) and one C-level power that would run for hours (refused by the sandbox
# before it starts).
CHAT_TEMPLATE = (
    "{% if messages[-1]['content'] == 'spin' %}{% for i in range(100000) %}{% for j in range(100000) %}"
    "{% endfor %}{% endfor %}{% endif %}"
    "{% if messages[-1]['content'] == 'double' %}{% set ns = namespace(s='x') %}{% for i in range(40) %}"
    "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{% endif %}"
    "{% if messages[-1]['content'] == 'power' %}{{ 9 ** (9 ** 9) }}{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    # A long context, so that a generation lasts long enough to be interrupted.
    path = make_hf_folder(tmp_path_factory.mktemp("serve") / "llama", num_hidden_layers=2,
                          max_position_embeddings=1024)
    (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return path


@contextmanager
def live_server(folder, tmp_path, *flags, prefix=()):
    """Start `llmsplit serve --port 0` (after the command `prefix`: another host's network
    namespace), yield (base URL, process); SIGTERM it at the end."""
    log = tmp_path / f"serve-{time.monotonic_ns()}.log"
    with open(log, "w") as err:
        proc = subprocess.Popen([*prefix, sys.executable, "-m", "llmsplit", "serve", "--model", str(folder), "--port", "0",
                                 "--request-timeout", str(TIMEOUT), *flags], stdout=subprocess.DEVNULL, stderr=err,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        deadline = time.monotonic() + 120
        while not (m := re.search(r"at (http://[\d.]+:\d+)/v1", log.read_text())):
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
    with live_server(folder, tmp_path_factory.mktemp("log"), "--api-key", KEY, "--metrics-auth", "--max-batch", "4",
                     "--max-queue", "32", "--max-request-size", "64KiB", "--max-request-items", "100",
                     "--template-timeout", str(TEMPLATE_TIMEOUT), "--template-max-bytes", "256MiB",
                     # Every request of this file through speculative decoding: greedy answers are the same.
                     "--speculative", "ngram") as (url, proc, log):
        SERVER_PID[url] = proc.pid
        yield url
    assert proc.returncode == 0, log.read_text()  # SIGTERM drained and exited cleanly


SERVER_PID = {}  # the shared server's process, by URL


def client(url, **kw):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60, **kw)


def metrics(url) -> dict[str, float]:
    # The key, for the servers with --metrics-auth; its scheme in lower case, as RFC 7235 allows.
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"bearer {KEY}"}, timeout=10).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^llmsplit_(\w+(?:\{[^}]*\})?) (\S+)$", text, re.M)}


def wait_idle(url, timeout=20.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        if m["kv_blocks_used"] == m["requests_running"] == m["requests_waiting"] == 0 or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


def wait_for(condition, timeout=30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


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
    assert r.choices[0].text + "\n" == want  # the server speculates (--speculative ngram), generate does not
    before = metrics(server)  # a prompt that repeats: proposals found and taken
    client(server).completions.create(model="llama", prompt="a b c d a b c d a b c d", max_tokens=24, temperature=0,
                                  extra_body={"ignore_eos": True})
    after = metrics(server)
    assert after["speculative_proposed_tokens_total"] > before["speculative_proposed_tokens_total"]
    assert 0 < after["speculative_acceptance_rate"] <= 1 and after["speculative_tokens_per_step"] > 1


def test_log_probabilities_score_the_prompt_as_a_full_forward_does(server, folder):
    import torch

    import llmsplit

    c = client(server)
    ids = folder_tokens(folder, PROMPT)
    # lm-eval's loglikelihood request: the prompt scored, nothing generated.
    r = c.completions.create(model="llama", prompt=PROMPT, max_tokens=0, echo=True, logprobs=2)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == PROMPT and r.usage.completion_tokens == 0 and r.choices[0].finish_reason == "length"
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    m = llmsplit.load(folder)
    try:
        full = torch.log_softmax(m.logits(torch.tensor([ids]))[0], -1)
        texts = [m.tokenizer.decode([i]) for i in range(full.shape[-1])]
    finally:
        m.close()
    want = [full[i - 1, ids[i]].item() for i in range(1, len(ids))]
    assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1:], want)) < 1e-4
    for i in range(1, len(ids)):  # the two likeliest, and the prompt's own token
        assert set(lp.top_logprobs[i]) == {texts[t] for t in full[i - 1].topk(2).indices.tolist()} | {lp.tokens[i]}
    # Generated tokens: greedy, so each is the likeliest; streamed, the same values in pieces.
    g = c.completions.create(model="llama", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=1, echo=True,
                             extra_body={"ignore_eos": True})
    glp = g.choices[0].logprobs
    assert g.choices[0].text.startswith(PROMPT) and len(glp.tokens) == len(ids) + 5
    assert glp.token_logprobs[:len(ids)] == lp.token_logprobs
    assert all(glp.top_logprobs[i][glp.tokens[i]] == max(glp.top_logprobs[i].values()) for i in range(len(ids), len(ids) + 5))
    chunks = list(c.completions.create(model="llama", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=1,
                                       stream=True, extra_body={"ignore_eos": True}))
    streamed = [v for ch in chunks if ch.choices and ch.choices[0].logprobs for v in ch.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(glp.token_logprobs[len(ids):], abs=1e-5)
    chat = c.chat.completions.create(model="llama", messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                     temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and "".join(x.token for x in content) == chat.choices[0].message.content
    assert all(len(x.top_logprobs) == 2 and x.top_logprobs[0].token == x.token for x in content)


def test_sampling_controls_change_the_tokens_as_they_say(server):
    c = client(server)
    base = dict(model="llama", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=0)
    plain = c.completions.create(**base, extra_body={"ignore_eos": True}).choices[0].logprobs.tokens
    # A +100 bias makes a token the greedy choice every time; stop_token_ids ends before it.
    forced = c.completions.create(**base, logit_bias={"7": 100}, extra_body={"ignore_eos": True})
    assert len(set(forced.choices[0].logprobs.tokens)) == 1
    stopped = c.completions.create(**base, extra_body={"ignore_eos": True, "logit_bias": {"7": 100},
                                                       "stop_token_ids": [7]})
    assert stopped.choices[0].text == "" and stopped.choices[0].finish_reason == "stop"
    # A strong presence penalty forbids repeating a generated token.
    repeated = len(plain) - len(set(plain))
    fresh = c.completions.create(**base, presence_penalty=2, extra_body={"ignore_eos": True,
                                                                         "repetition_penalty": 2}).choices[0]
    assert len(set(fresh.logprobs.tokens)) >= len(set(plain)) and (repeated == 0 or fresh.logprobs.tokens != plain)


def test_n_samples_share_the_prompt_and_repeat_their_seeds(server):
    c = client(server)
    prompt = PROMPT + " of a function in Python binds its name to the code that the body of the definition holds"
    base = dict(model="llama", prompt=prompt, max_tokens=6, temperature=1.0, extra_body={"ignore_eos": True})
    before = metrics(server)
    many = c.completions.create(**base, n=3, seed=11, logprobs=0)
    hits = metrics(server)["prefix_cache_hits_total"] - before["prefix_cache_hits_total"]
    assert [ch.index for ch in many.choices] == [0, 1, 2] and many.usage.completion_tokens == 18
    assert hits >= 2 * 16, hits  # samples 1 and 2 took the first's full prompt blocks from the cache
    # Sample i draws from seed + i: the same text as a single request with that seed.
    alone = [c.completions.create(**base, seed=11 + i).choices[0].text for i in range(3)]
    assert [ch.text for ch in many.choices] == alone
    # best_of: the likeliest of the samples (by the sum of their tokens' log-probabilities).
    sums = [sum(ch.logprobs.token_logprobs) for ch in many.choices]
    best = c.completions.create(**base, n=1, best_of=3, seed=11)
    assert [ch.text for ch in best.choices] == [alone[sums.index(max(sums))]]
    chat = c.chat.completions.create(model="llama", messages=[{"role": "user", "content": "Hi"}], n=2, max_tokens=4,
                                     seed=3, extra_body={"ignore_eos": True})
    streamed = {0: "", 1: ""}
    for chunk in c.chat.completions.create(model="llama", messages=[{"role": "user", "content": "Hi"}], n=2,
                                           max_tokens=4, seed=3, stream=True, extra_body={"ignore_eos": True}):
        for ch in chunk.choices:
            streamed[ch.index] += ch.delta.content or ""
    assert [streamed[0], streamed[1]] == [ch.message.content for ch in chat.choices]


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
    # Latency histograms (prometheus_client): one first token per sequence, the rest between tokens.
    count = lambda m, name: m.get(f"{name}_count", 0)  # noqa: E731
    assert count(after, "time_to_first_token_seconds") - count(before, "time_to_first_token_seconds") == n
    assert count(after, "inter_token_latency_seconds") - count(before, "inter_token_latency_seconds") == \
        n * (max_tokens - 1)
    assert after['time_to_first_token_seconds_bucket{le="+Inf"}'] == count(after, "time_to_first_token_seconds")
    assert httpx.get(f"{server}/metrics", headers={"Authorization": f"Bearer {KEY}"},
                     timeout=10).headers["content-type"].startswith("text/plain; version=")
    assert httpx.get(f"{server}/metrics", timeout=10).status_code == 401  # --metrics-auth
    assert httpx.get(f"{server}/health", timeout=10).status_code == 200  # open always


CHAT = "/v1/chat/completions"


def chat_body(content="Hi", **fields):
    return {"messages": [{"role": "user", "content": content}], **fields}


@pytest.mark.parametrize("name,kwargs,status", [
    ("malformed JSON", dict(content=b'{"prompt": "x", max_tokens: }'), 400),
    ("not an object", dict(json=["x"]), 400),
    ("negative max_tokens", dict(json={"model": "llama", "prompt": "x", "max_tokens": -3}, param="max_tokens"), 400),
    ("temperature out of range", dict(json={"prompt": "x", "temperature": -1}, param="temperature"), 400),
    ("unknown model", dict(json={"model": "gpt-4o", "prompt": "x"}, param="model"), 404),
    ("prompt longer than the context", dict(json={"prompt": "word " * 1200}, param="prompt"), 400),
    ("max_tokens beyond the context", dict(json={"prompt": "x", "max_tokens": 5000}, param="max_tokens"), 400),
    ("more prompts than the server holds", dict(json={"prompt": ["x"] * 37}, param="prompt"), 400),  # 4 + 32
    ("token id outside the vocabulary", dict(json={"prompt": [1, 2, 10**6]}, param="prompt"), 400),
    ("seed of 2**64", dict(json={"prompt": "x", "seed": 2**64}, param="seed"), 400),
    ("seed below -2**63", dict(json={"prompt": "x", "seed": -2**63 - 1}, param="seed"), 400),
    ("lone surrogate in the prompt", dict(content=b'{"prompt": "a\\ud800b"}', param="prompt"), 400),
    ("lone surrogate in a message", dict(content=b'{"messages": [{"role": "user", "content": "\\udfff"}]}',
                                         path=CHAT, param="messages.0.content"), 400),
    ("huge body", dict(json={"prompt": "x" * 100_000}), 413),
    ("wrong API key", dict(json={"prompt": "x"}, headers={"Authorization": "Bearer nope"}), 401),
    ("no API key", dict(json={"prompt": "x"}, headers={"Authorization": ""}), 401),
    ("chat without messages", dict(json={"messages": []}, path=CHAT, param="messages"), 400),
    ("chat with a bad role", dict(json={"messages": [{"role": "wizard", "content": "x"}]}, path=CHAT), 400),
    # An allow list: a field this server does not know is named, not dropped (also in a message).
    ("unknown field", dict(json={"prompt": "x", "frobnicate": 1}, param="frobnicate"), 400),
    ("unknown message field", dict(json={"messages": [{"role": "user", "content": "x", "voice": "a"}]}, path=CHAT,
                                   param="messages.0.voice"), 400),
    # Counted before the body is parsed (--max-request-items 100).
    ("too many messages", dict(json={"messages": [{"role": "user", "content": "x"}] * 101}, path=CHAT,
                               param="messages"), 400),
    ("too many content parts", dict(json={"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}] * 60}
                                                       ] * 2}, path=CHAT, param="messages"), 400),
    ("too many input items", dict(json={"input": [{"role": "user", "content": "x"}] * 101}, path="/v1/responses",
                                  param="input"), 400),
    ("too many tools", dict(json=chat_body(tools=[{"type": "function", "function": {"name": "f"}}] * 101), path=CHAT,
                            param="tools"), 400),
    ("template with a C-level power", dict(json=chat_body("power"), path=CHAT, param="messages"), 400),
    ("unknown route", dict(json={}, path="/v1/audio/speech"), 404),
    ("embeddings of nothing", dict(json={"input": []}, path="/v1/embeddings", param="input"), 400),
    ("embeddings with a token id past the vocabulary", dict(json={"input": [10**9]}, path="/v1/embeddings",
                                                             param="input"), 400),
    # Fields that would change the answer and are not implemented: refused, never ignored.
    *[(f"unsupported {field}", dict(json={"prompt": "x", field: value}, param=field), 400) for field, value in [
        ("suffix", "!")]],
    *[(f"unsupported chat {field}", dict(json=chat_body(**{field: value}), path=CHAT, param=field), 400)
      for field, value in [
        ("functions", [{"name": "f"}]), ("modalities", ["text", "audio"]), ("audio", {"voice": "alloy", "format": "wav"})]],
    # Hostile or out-of-range values of the implemented ones: a 400 naming the field.
    *[(f"bad {field}", dict(json={"prompt": "x", **{field: value}}, param=field), 400) for field, value in [
        ("logprobs", 21), ("logit_bias", {"1000000": 5}), ("logit_bias", {"5": 101}), ("presence_penalty", 2.5),
        ("frequency_penalty", -3), ("repetition_penalty", 0), ("min_p", 1.5), ("stop_token_ids", [-1])]],
    ("min_tokens above max_tokens", dict(json={"prompt": "x", "max_tokens": 2, "min_tokens": 3}, param="min_tokens"),
     400),
    ("max_tokens 0 without echo", dict(json={"prompt": "x", "max_tokens": 0}, param="max_tokens"), 400),
    ("top_logprobs of 10**4", dict(json=chat_body(logprobs=True, top_logprobs=10**4), path=CHAT,
                                   param="top_logprobs"), 400),
    ("top_logprobs without logprobs", dict(json=chat_body(top_logprobs=2), path=CHAT, param="top_logprobs"), 400),
    ("n of 10**6", dict(json={"prompt": "x", "n": 10**6}, param="n"), 400),
    ("best_of below n", dict(json={"prompt": "x", "n": 3, "best_of": 2}, param="best_of"), 400),
    ("best_of streamed", dict(json={"prompt": "x", "best_of": 2, "stream": True}, param="best_of"), 400),
    ("n beyond what the server holds", dict(json={"prompt": "x", "n": 37}, param="prompt"), 400),  # 4 + 32
    ("unknown response_format", dict(json=chat_body(response_format={"type": "yaml"}), path=CHAT,
                                     param="response_format.type"), 400),
    ("tool_choice without tools", dict(json=chat_body(tool_choice="required"), path=CHAT, param="tool_choice"), 400),
])
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, name, kwargs, status):
    path, param = kwargs.pop("path", "/v1/completions"), kwargs.pop("param", None)
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json", **kwargs.pop("headers", {})}
    r = httpx.post(f"{server}{path}", headers=headers, timeout=30, **kwargs)
    assert r.status_code == status, (name, r.text)
    err = r.json()["error"]
    assert err["message"] and err["type"], name
    if param:
        assert err["param"] == param, (name, err)
    assert httpx.get(f"{server}/health", timeout=10).json()["status"] == "ok"


def test_default_values_of_unsupported_fields_are_accepted(server):
    # Clients that send every field with its default must not be refused.
    body = chat_body(max_tokens=2, n=1, logprobs=False, top_logprobs=0, presence_penalty=0, frequency_penalty=0.0,
                     logit_bias={}, tools=[], response_format={"type": "text"}, seed=2**64 - 1, modalities=["text"],
                     audio=None, user="u-1", metadata={"k": "v"}, store=False, parallel_tool_calls=True)
    body["messages"][0]["name"] = "ada"  # fields that change nothing in the answer are accepted
    r = httpx.post(f"{server}{CHAT}", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 200, r.text


def test_a_looping_chat_template_is_stopped_while_the_server_keeps_answering(server):
    before = metrics(server)
    got = {}
    spin = threading.Thread(target=lambda: got.update(r=httpx.post(
        f"{server}{CHAT}", json=chat_body("spin"), headers={"Authorization": f"Bearer {KEY}"}, timeout=60)))
    start = time.monotonic()
    spin.start()
    wait_for(lambda: metrics(server)["requests_preparing"] == 1)
    health_s = []
    while spin.is_alive() and len(health_s) < 200:  # bounded: the template is stopped after TIMEOUT s
        t = time.monotonic()
        assert httpx.get(f"{server}/health", timeout=10).json()["status"] == "ok"
        health_s.append(time.monotonic() - t)
        time.sleep(0.2)
    spin.join(60)
    error = got["r"].json()["error"]
    assert got["r"].status_code == 400 and error["code"] == "template_limit", got["r"].text
    assert f"ran for more than {TEMPLATE_TIMEOUT} s" in error["message"] and "--template-timeout" in error["message"]
    assert TEMPLATE_TIMEOUT - 0.5 < time.monotonic() - start < TEMPLATE_TIMEOUT + 20
    assert len(health_s) >= 3 and max(health_s) < 3, health_s  # answered all along, not after the template
    r = client(server).chat.completions.create(model="llama", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=2)
    assert r.choices[0].message.role == "assistant"
    assert metrics(server)['http_responses_total{status="400"}'] > before.get('http_responses_total{status="400"}', 0)


def test_a_template_that_doubles_a_string_is_stopped_at_its_memory_limit(server):
    def kib(field: str) -> int:
        status = open(f"/proc/{SERVER_PID[server]}/status").read()
        return int(re.search(rf"^{field}:\s+(\d+) kB", status, re.M).group(1))

    rss, peak = kib("VmRSS"), kib("VmHWM")
    start = time.monotonic()
    r = httpx.post(f"{server}{CHAT}", json=chat_body("double"), headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    error = r.json()["error"]
    assert r.status_code == 400 and error["code"] == "template_limit", r.text
    assert "needed more than 256 MiB of memory" in error["message"] and "--template-max-bytes" in error["message"]
    assert time.monotonic() - start < TEMPLATE_TIMEOUT  # the memory limit, not the time limit, stopped it
    # The string grew in the template's own process: the server's memory never held it.
    assert kib("VmHWM") - peak < 64 << 10 and kib("VmRSS") - rss < 64 << 10, (rss, kib("VmRSS"), peak, kib("VmHWM"))
    r = httpx.post(f"{server}{CHAT}", json=chat_body("hi", max_tokens=2), headers={"Authorization": f"Bearer {KEY}"},
                   timeout=60)
    assert r.status_code == 200, r.text  # a fresh template process took the stopped one's place


def test_requests_that_never_finish_arriving_are_cut_off(server):
    host, port = server.removeprefix("http://").split(":")
    silent, half_head, slow_body = (socket.create_connection((host, int(port)), timeout=30) for _ in range(3))
    half_head.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # no blank line: the head never ends
    slow_body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
                      b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"pro")
    start = time.monotonic()
    assert httpx.get(f"{server}/health", timeout=10).status_code == 200  # meanwhile, others are served
    for sock in (silent, half_head):
        assert sock.recv(1024) == b""  # closed by the server
    answer = b""
    for _ in range(10):  # the head and the body of the answer may come in separate packets
        answer += slow_body.recv(4096)
        if b"request_timeout" in answer:
            break
    assert answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer, answer
    assert time.monotonic() - start < TIMEOUT + 20
    for sock in (silent, half_head, slow_body):
        sock.close()


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
    after = wait_idle(server, timeout=2)  # leaving the `with` closed the connection mid-stream: freed at once
    assert after["kv_blocks_used"] == 0
    assert after["generated_tokens_total"] - before["generated_tokens_total"] < LONG  # aborted, not run to the end
    assert after["requests_finished_total"] == before["requests_finished_total"]


def test_a_client_timing_out_on_a_plain_request_frees_its_blocks(server):
    before = metrics(server)
    body = {"model": "llama", "prompt": "x", "max_tokens": LONG, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=0.2)
    after = wait_idle(server, timeout=2)
    assert after["kv_blocks_used"] == 0
    assert after["generated_tokens_total"] - before["generated_tokens_total"] < LONG


def test_an_ollama_client_leaving_frees_its_blocks(server):
    # Ollama has no ignore_eos: take a prompt whose greedy answer runs 64 tokens without an end,
    # which a random model's greedy loop then keeps doing (the same tokens each time).
    body = {"model": "llama", "raw": True, "stream": False, "options": {"temperature": 0, "num_predict": 64}}
    ask = lambda p: httpx.post(f"{server}/api/generate", json={**body, "prompt": p},  # noqa: E731
                               headers={"Authorization": f"Bearer {KEY}"}, timeout=60).json()["done_reason"]
    prompt = next((p for p in ("x", "Hi", "a", "b", "c", "d") if ask(p) == "length"), None)
    assert prompt is not None, "no prompt runs on without an end"
    before = metrics(server)
    body = {**body, "prompt": prompt, "stream": True, "options": {"temperature": 0, "num_predict": LONG}}
    with httpx.stream("POST", f"{server}/api/generate", json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=30) as r:
        # Not the first line: a random model's text can be bytes that only decode at the end.
        assert r.status_code == 200 and r.headers["content-type"] == "application/x-ndjson"
        wait_for(lambda: metrics(server)["kv_blocks_used"] > 0)  # it is generating now
    assert wait_idle(server, timeout=2)["kv_blocks_used"] == 0  # left mid-stream: freed at once
    with pytest.raises(httpx.ReadTimeout):  # a plain request (stream false) given up on
        httpx.post(f"{server}/api/generate", json={**body, "stream": False}, headers={"Authorization": f"Bearer {KEY}"},
                   timeout=0.2)
    after = wait_idle(server, timeout=2)
    assert after["kv_blocks_used"] == 0
    assert after["generated_tokens_total"] - before["generated_tokens_total"] < 2 * LONG  # aborted, not run out
    assert after["requests_finished_total"] == before["requests_finished_total"]


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

        # SIGTERM while a stream is in flight and a chat template spins: the stream still ends
        # properly, the template is stopped at its time limit, then the process exits 0.
        spun = {}
        spin = threading.Thread(target=lambda: spun.update(r=httpx.post(f"{url}{CHAT}", json=chat_body("spin"),
                                                                        timeout=60)))
        spin.start()
        wait_for(lambda: metrics(url)["requests_preparing"] == 1)
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
        spin.join(10)
        assert spun["r"].status_code == 400 and spun["r"].json()["error"]["code"] == "request_timeout"
        assert "stopped after answering" in log.read_text()


# Bounded values only: a random model held to a grammar would otherwise write a string forever.
WEATHER = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                            "city": {"type": "string", "maxLength": 6}},
           "required": ["unit", "days", "city"], "additionalProperties": False}


def follows_weather(value) -> bool:
    return (isinstance(value, dict) and set(value) == {"unit", "days", "city"} and value["unit"] in (
        "celsius", "fahrenheit") and type(value["days"]) is int and 1 <= value["days"] <= 7
        and isinstance(value["city"], str) and len(value["city"]) <= 6)


def test_response_format_holds_the_answer_to_its_schema(server):
    pytest.importorskip("xgrammar")
    c = client(server)
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER}}
    for seed in range(3):  # sampled, not greedy: each seed walks another path through the grammar
        got = c.chat.completions.create(model="llama", messages=[{"role": "user", "content": "Weather?"}],
                                        response_format=fmt, temperature=1.0, seed=seed, max_tokens=60)
        assert got.choices[0].finish_reason == "stop" and follows_weather(json.loads(got.choices[0].message.content))
    plain = c.completions.create(model="llama", prompt=PROMPT, max_tokens=60, temperature=0,
                                 extra_body={"response_format": fmt})  # vLLM's extension of completions
    assert follows_weather(json.loads(plain.choices[0].text))
    obj = c.chat.completions.create(model="llama", messages=[{"role": "user", "content": "JSON"}], max_tokens=12,
                                    temperature=0, response_format={"type": "json_object"})
    assert obj.choices[0].message.content.startswith("{")  # an object from its first token on
    with pytest.raises(openai.BadRequestError, match="cannot be compiled"):
        c.chat.completions.create(model="llama", messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                  response_format={"type": "json_schema", "json_schema": {
                                      "name": "bad", "schema": {"type": "no-such-type"}}})


def test_tool_calls_come_back_in_openais_shape(server):
    pytest.importorskip("xgrammar")
    c = client(server)
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "The forecast",
                                               "parameters": WEATHER}},
             {"type": "function", "function": {"name": "get_time", "parameters": {
                 "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]}}}]
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    named = c.chat.completions.create(model="llama", messages=messages, tools=tools, max_tokens=80, temperature=0,
                                      tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = named.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert follows_weather(json.loads(call.function.arguments))
    stream = c.chat.completions.create(model="llama", messages=messages, tools=tools, max_tokens=80, temperature=1,
                                       seed=3, tool_choice="required", stream=True)
    deltas = [ch for chunk in stream for ch in chunk.choices]
    (streamed,) = [d.delta.tool_calls for d in deltas if d.delta.tool_calls]
    assert deltas[-1].finish_reason == "tool_calls" and streamed[0].function.name in ("get_weather", "get_time")
    json.loads(streamed[0].function.arguments)
    # This test model's template does not render tools: the model could not see them.
    with pytest.raises(openai.BadRequestError, match="does not render tools"):
        c.chat.completions.create(model="llama", messages=messages, tools=tools, max_tokens=4)


def ollama_client(url):
    ollama = pytest.importorskip("ollama")
    # The shared server runs with --api-key, which guards Ollama's /api/ routes as it does /v1.
    return ollama, ollama.Client(host=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)


def test_responses_api_answers_as_chat_completions_does(server):
    c = client(server)
    eos = {"ignore_eos": True}
    chat = c.chat.completions.create(model="llama", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                     temperature=0, extra_body=eos)
    r = c.responses.create(model="llama", input="Hi", max_output_tokens=4, temperature=0, extra_body=eos)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == "llama"
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert item.status == "incomplete"
    assert r.output_text == chat.choices[0].message.content
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, 4)
    assert r.usage.total_tokens == r.usage.input_tokens + 4 and r.max_output_tokens == 4 and r.temperature == 0
    # instructions are a system message before the input; a list of messages with input_text parts
    system = c.chat.completions.create(model="llama", max_tokens=4, temperature=0, extra_body=eos, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    listed = c.responses.create(model="llama", instructions="Be brief.", max_output_tokens=4, temperature=0,
                                extra_body=eos, input=[{"role": "user", "content": [
                                    {"type": "input_text", "text": "H"}, {"type": "input_text", "text": "i"}]}])
    assert listed.output_text == system.choices[0].message.content and listed.instructions == "Be brief."
    events = list(c.responses.create(model="llama", input="Hi", max_output_tokens=4, temperature=0, stream=True,
                                     extra_body=eos))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]  # OpenAI's last event for a response cut by max_output_tokens
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == r.output_text == events[-1].response.output_text and kinds.count("response.output_text.delta") > 1


def test_responses_api_structured_output_and_refusals(server):
    c = client(server)
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        c.responses.create(model="llama", input="Hi", max_output_tokens=2, previous_response_id="resp_123")
    with pytest.raises(openai.BadRequestError, match="tools is not supported on /v1/responses yet; use /v1/chat/"):
        c.responses.create(model="llama", input="Hi", max_output_tokens=2, tools=[
            {"type": "function", "name": "f", "parameters": {"type": "object"}}])
    kept = c.responses.create(model="llama", input="Hi", max_output_tokens=2, tools=[], store=True)
    assert kept.status == "incomplete" or kept.status == "completed"  # empty tools and store: accepted
    bad = httpx.post(f"{server}/v1/responses", headers={"Authorization": f"Bearer {KEY}"}, timeout=30,
                     json={"model": "llama", "input": "Hi", "max_output_tokens": 2, "frobnicate": 1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "frobnicate"
    pytest.importorskip("xgrammar")
    fmt = {"type": "json_schema", "name": "weather", "schema": WEATHER, "strict": True}
    for seed in range(2):
        got = c.responses.create(model="llama", input="Weather?", text={"format": fmt}, temperature=1.0,
                                 max_output_tokens=60, extra_body={"seed": seed})
        assert got.status == "completed" and follows_weather(json.loads(got.output_text))
    obj = c.responses.create(model="llama", input="JSON", max_output_tokens=12, temperature=0,
                             text={"format": {"type": "json_object"}})
    assert obj.output_text.startswith("{")


def test_ollama_client_lists_shows_and_answers_as_llmsplit_generate_does(server, folder):
    ollama, c = ollama_client(server)
    (card,) = c.list().models
    assert card.model == "llama" and card.size > 0 and len(card.digest) == 64 and card.details.family == "llama"
    shown = c.show("llama:latest")  # Ollama's default tag names the same model
    assert shown.modelinfo["llama.context_length"] == 1024 and shown.capabilities == ["completion"]
    assert [m.context_length for m in c.ps().models] == [1024]
    assert httpx.get(f"{server}/api/version", timeout=10).status_code == 401  # the key guards /api/ too
    # raw: the prompt as it is, as `llmsplit generate` takes it; temperature 0 is greedy there too.
    want = run_cli("generate", "--model", str(folder), PROMPT, "--max-new-tokens", "12").stdout
    options = {"temperature": 0, "num_predict": 12}
    whole = c.generate(model="llama", prompt=PROMPT, raw=True, options=options)
    assert whole.response + "\n" == want and whole.done and whole.done_reason in ("stop", "length")
    assert whole.prompt_eval_count == len(folder_tokens(folder, PROMPT)) and whole.eval_count <= 12
    assert whole.total_duration >= whole.prompt_eval_duration + whole.eval_duration and whole.load_duration == 0
    assert whole.prompt_eval_duration > 0 and (whole.eval_duration > 0 or whole.eval_count <= 1)  # the engine's times
    parts = list(c.generate(model="llama", prompt=PROMPT, raw=True, options=options, stream=True))
    assert "".join(p.response for p in parts) == whole.response
    assert parts[-1].done and not any(p.done for p in parts[:-1])
    assert parts[-1].eval_count == whole.eval_count and parts[-1].done_reason == whole.done_reason
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is def?"}]
    chat = c.chat(model="llama", messages=messages, options={"temperature": 0, "num_predict": 10})
    assert chat.message.role == "assistant" and 0 < chat.eval_count <= 10
    streamed = list(c.chat(model="llama", messages=messages, options={"temperature": 0, "num_predict": 10},
                           stream=True))
    assert "".join(p.message.content for p in streamed) == chat.message.content
    assert streamed[-1].done and streamed[-1].eval_count == chat.eval_count
    # The OpenAI route renders the same template: the same greedy answer.
    same = client(server).chat.completions.create(model="llama", messages=messages, max_tokens=10, temperature=0)
    assert same.choices[0].message.content == chat.message.content


def test_embeddings_from_openai_and_ollama_clients_are_the_models_pooled_hidden_states(server, folder):
    """/v1/embeddings (float and base64, text and token ids) and Ollama's /api/embed and
    /api/embeddings: the last token's final hidden state, normalized, as `LoadedModel.embed`
    gives it (which equals transformers' last_hidden_state: tests/test_infer_split.py)."""
    ollama, oc = ollama_client(server)
    texts = ["The def statement", "A function in Python"]
    ids = [folder_tokens(folder, t) for t in texts]
    want = llmsplit.load(folder, max_context=64).embed(ids)
    c = client(server)
    for fmt in ("float", openai.NOT_GIVEN):  # not given: the client asks for base64 and decodes it itself
        r = c.embeddings.create(model="llama", input=texts, encoding_format=fmt)
        got = torch.tensor([d.embedding for d in r.data])
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
        assert [d.index for d in r.data] == [0, 1] and r.usage.prompt_tokens == sum(map(len, ids))
    by_ids = c.embeddings.create(model="llama", input=ids[1])
    torch.testing.assert_close(torch.tensor(by_ids.data[0].embedding), want[1], atol=1e-6, rtol=0)
    torch.testing.assert_close(torch.tensor(oc.embed(model="llama", input=texts).embeddings), want, atol=1e-6, rtol=0)
    torch.testing.assert_close(torch.tensor(oc.embeddings(model="llama", prompt=texts[0]).embedding), want[0],
                               atol=1e-6, rtol=0)
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        c.embeddings.create(model="llama", input="x", dimensions=8)
    with pytest.raises(openai.BadRequestError, match="has 2000 tokens; the context holds"):
        c.embeddings.create(model="llama", input=[5] * 2000)


def test_ollama_options_format_and_refusals(server):
    ollama, c = ollama_client(server)
    ask = lambda seed: c.generate(model="llama", prompt=PROMPT, raw=True,  # noqa: E731
                                  options={"temperature": 1.0, "top_k": 0, "seed": seed, "num_predict": 12}).response
    assert ask(7) == ask(7) != ask(8)
    for bad, named in [({"frobnicate": 1}, "options.frobnicate"), ({"mirostat": 2}, "options.mirostat"),
                       ({"num_ctx": 10**6}, "options.num_ctx"), ({"repeat_penalty": 3}, "options.repeat_penalty"),
                       ({"repeat_penalty": 1.1, "repeat_last_n": 64}, "options.repeat_last_n"),
                       ({"typical_p": 0.5}, "options.typical_p")]:
        with pytest.raises(ollama.ResponseError, match=named) as caught:
            c.generate(model="llama", prompt="x", options=bad)
        assert caught.value.status_code == 400
    for field in ({"template": "{{ .Prompt }}"}, {"think": True}):
        with pytest.raises(ollama.ResponseError, match=next(iter(field))) as caught:
            c.generate(model="llama", prompt="x", **field)
        assert caught.value.status_code == 400
    r = httpx.post(f"{server}/api/generate", content=b'{"prompt": "\\ud800"}',
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    assert r.status_code == 400 and "lone surrogate" in r.json()["error"]  # Ollama's error shape
    with pytest.raises(ollama.ResponseError, match="'nope' does not exist") as caught:
        c.chat(model="nope", messages=[{"role": "user", "content": "x"}])
    assert caught.value.status_code == 404
    with pytest.raises(ollama.ResponseError, match="serves the models it was started with") as caught:
        c.pull(model="llama3")
    assert caught.value.status_code == 501
    # Ignored: where the model runs and how long it stays loaded (the server decided those).
    kept = c.generate(model="llama", prompt="x", keep_alive="5m", options={"num_thread": 8, "num_predict": 2})
    assert kept.done
    pytest.importorskip("xgrammar")
    fmt = c.chat(model="llama", messages=[{"role": "user", "content": "Weather?"}], format=WEATHER,
                 options={"temperature": 0, "num_predict": 60})
    assert fmt.done_reason == "stop" and follows_weather(json.loads(fmt.message.content))
    obj = c.generate(model="llama", prompt="JSON", format="json", options={"temperature": 0, "num_predict": 12})
    assert obj.response.startswith("{")  # an object from its first token on


def test_sigterm_aborts_what_outlasts_the_drain_timeout(folder, tmp_path):
    with live_server(folder, tmp_path, "--drain-timeout", "0.5") as (url, proc, log):
        body = {"prompt": "x", "max_tokens": LONG, "ignore_eos": True}
        plain = {}
        asking = threading.Thread(target=lambda: plain.update(r=httpx.post(f"{url}/v1/completions", json=body,
                                                                           timeout=60)))
        asking.start()
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data:"))
            wait_for(lambda: metrics(url)["requests_running"] == 2)
            signalled = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in (first, *lines) if line]
        asking.join(30)
        assert proc.wait(30) == 0, log.read_text()
        took = time.monotonic() - signalled
    # Both were cut at the deadline, each told so: the stream by an error event, the plain one by a 503.
    assert rest[-1] == "data: [DONE]" and "shutting down" in rest[-2], rest[-3:]
    assert plain["r"].status_code == 503 and "shutting down" in plain["r"].json()["error"]["message"]
    assert took < 5, took


@pytest.mark.slow
def test_serving_split_over_two_nodes_answers_like_one_process(server, folder, tmp_path):
    """--tp 2 --pp 2 over two hosts of their own network stacks (network namespaces, tests/netns.py;
    loopback where they cannot be made), started as users start them: node 0 serves HTTP and
    holds the first stage (ranks 0-1, a tensor-parallel pair with a local follower), node 1 runs
    the second stage's ranks 2-3; both exit 0 once node 0 is stopped."""
    want = client(server).completions.create(model="llama", prompt=PROMPT, max_tokens=24, temperature=0,
                                             extra_body={"ignore_eos": True}).choices[0].text
    with hosts(2) as made:
        _serve_on_two_nodes(folder, tmp_path, want, made)


def _serve_on_two_nodes(folder, tmp_path, want: str, made) -> None:
    prefixes, master = ([p for p, _ in made], made[0][1]) if made else ([[], []], "127.0.0.1")
    split = ("--tp", "2", "--pp", "2", "--nnodes", "2", "--master-addr", master, "--master-port", str(free_port()))
    node1_log = tmp_path / "node1.log"
    with open(node1_log, "w") as err:  # started first: it waits for node 0's store to come up
        node1 = subprocess.Popen([*prefixes[1], sys.executable, "-m", "llmsplit", "serve", "--model", str(folder),
                                  *split, "--node-rank", "1"], stdout=subprocess.DEVNULL, stderr=err)
    try:
        with live_server(folder, tmp_path, *split, "--node-rank", "0", "--api-key", KEY, "--host", master,
                         prefix=prefixes[0]) as (url, proc, log):
            c = client(url)
            got = c.completions.create(model="llama", prompt=PROMPT, max_tokens=24, temperature=0,
                                       extra_body={"ignore_eos": True})
            assert got.choices[0].text == want and got.usage.completion_tokens == 24
            stream = c.chat.completions.create(model="llama", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=6, stream=True, extra_body={"ignore_eos": True})
            assert sum(1 for chunk in stream for ch in chunk.choices if ch.finish_reason == "length") == 1
        assert proc.returncode == 0, log.read_text()
        assert node1.wait(60) == 0, node1_log.read_text()
        assert "runs its workers for node 0" in node1_log.read_text()
    finally:
        if node1.poll() is None:
            node1.kill()
