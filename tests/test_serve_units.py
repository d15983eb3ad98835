"""The pieces under `llmsplit serve`, without HTTP: the engine admitting sequences into a
running batch between steps, the scheduler's accounting (queue bound, cancel, exactly one
outcome per request), and chat templates from tokenizer files and GGUF metadata."""

import threading
import time

import pytest

pytest.importorskip("transformers")
pytest.importorskip("jinja2")

import llmsplit  # noqa: E402
from hf_models import make_hf_folder  # noqa: E402
from llmsplit.errors import ConfigError  # noqa: E402
from llmsplit.infer.chat import DEFAULT_STOP, TemplateError, chat_prompt  # noqa: E402
from llmsplit.infer.engine import SamplingParams  # noqa: E402
from llmsplit.infer.engine import block_manager  # noqa: E402
from llmsplit.infer.runner import paged_attention  # noqa: E402
from llmsplit.infer.engine.step import PackedStep  # noqa: E402
from llmsplit.infer.serve.engine_thread import EngineThread, QueueFull, Request, ShuttingDown  # noqa: E402
from llmsplit.io.tokenizer import ByteTokenizer, read_chat_template  # noqa: E402

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_hf_folder(tmp_path_factory.mktemp("serve_units") / "llama", num_hidden_layers=2)


@pytest.fixture(scope="module")
def model(folder):
    m = llmsplit.load(folder, max_batch=3, max_context=64)
    yield m
    m.close()


def alone(m, prompt: str, n: int) -> list[int]:
    seq = m.engine.new_sequence(m.tokenizer.encode(prompt), SamplingParams(n, ignore_eos=True))
    m.engine.generate([seq])
    return seq.tokens


def test_a_sequence_joins_a_running_batch_and_leaves_on_its_own(model):
    e = model.engine
    p = SamplingParams(12, ignore_eos=True)
    first = e.new_sequence(model.tokenizer.encode("The def statement"), p)
    e.add(first)
    for _ in range(4):
        e.step()
    late = e.new_sequence(model.tokenizer.encode("A class"), SamplingParams(5, ignore_eos=True))
    e.add(late)
    finished = e.step()  # the late one is prefilled and decoded in this very step, next to `first`
    assert e.running == [first, late] and not finished
    done = []
    while e.busy:
        done += e.step()
    assert done == [late, first]  # the shorter request left first, without waiting for the batch
    assert e.pool.free_blocks == e.pool.num_blocks
    # Sharing the batch at other positions changes no token.
    assert first.tokens == alone(model, "The def statement", 12)
    assert late.tokens == alone(model, "A class", 5)


def test_abort_returns_blocks_wherever_the_sequence_is(model):
    e = model.engine
    p = SamplingParams(40, ignore_eos=True)
    seqs = [e.new_sequence(model.tokenizer.encode(f"prompt {i}"), p) for i in range(5)]
    for s in seqs:
        e.add(s)
    e.step()
    assert len(e.running) == 3 and len(e.waiting) == 2  # max_batch 3
    e.abort(seqs[0])  # running
    e.abort(seqs[4])  # waiting
    assert seqs[0].finish_reason == "abort" and seqs[4] not in e.waiting
    while e.busy:
        e.step()
    assert [len(s.tokens) for s in seqs[1:4]] == [40, 40, 40]
    assert e.pool.free_blocks == e.pool.num_blocks


def test_scheduler_bounds_the_queue_and_answers_each_request_once(model):
    sched = EngineThread(model.engine, max_queue=2)
    events, lock = [], threading.Lock()
    ids = model.tokenizer.encode("x = 1")

    def submit(n):
        sink = lambda ev: (lock.acquire(), events.append((ev[2].id if ev[0] == "finish" else None, ev[0])),
                           lock.release())
        req = sched.submit([ids], SamplingParams(n, ignore_eos=True), sink)
        return req, req.seqs[0]

    reqs = [submit(30) for _ in range(5)]  # 3 run + 2 wait: the most this scheduler holds
    with pytest.raises(QueueFull):
        submit(30)
    sched.abort(reqs[4][0])  # still in the inbox or already waiting: either way it leaves
    sched.start()
    sched.abort(reqs[0][0])
    deadline = time.monotonic() + 60
    while sched.stats()["in_flight"] and time.monotonic() < deadline:
        time.sleep(0.05)
    sched.stop()
    seq_ids = [s.id for _, s in reqs]
    outcomes = {i: [ev for sid, ev in events if sid == i] for i in seq_ids}
    assert all(outcomes[i] == ["finish"] for i in seq_ids[1:4]), outcomes
    assert all(len(s.tokens) == 30 for _, s in reqs[1:4])
    assert outcomes[seq_ids[4]] == [] and outcomes[seq_ids[0]] in ([], ["finish"])  # an aborted request hears nothing more
    stats = sched.stats()
    assert (stats["running"], stats["waiting"], stats["kv_blocks_used"]) == (0, 0, 0)
    assert stats["kv_blocks_total"] == model.engine.pool.num_blocks


def test_stop_fails_what_is_in_flight_and_frees_it(model):
    sched = EngineThread(model.engine, max_queue=4)
    got = []
    sched.start()
    seq = sched.submit([model.tokenizer.encode("x")], SamplingParams(60, ignore_eos=True), got.append).seqs[0]
    while not seq.tokens:
        time.sleep(0.01)
    sched.stop()
    assert got == [("error", "the server is shutting down")]
    assert model.engine.pool.free_blocks == model.engine.pool.num_blocks and not model.engine.busy
    with pytest.raises(ShuttingDown):
        sched.submit([[1]], SamplingParams(2), got.append)


def test_drain_lets_short_requests_finish_and_aborts_the_rest_at_the_deadline(model, monkeypatch):
    sched = EngineThread(model.engine, max_queue=4)
    got, step = [], model.engine.step
    # 20 ms a step: the 60-token request outlasts the 0.3 s deadline, the 2-token one does not.
    monkeypatch.setattr(model.engine, "step", lambda: (time.sleep(0.02), step())[1])
    sched.start()
    prompt = model.tokenizer.encode("x")
    short = sched.submit([prompt], SamplingParams(2, ignore_eos=True), got.append).seqs[0]
    sched.submit([prompt], SamplingParams(60, ignore_eos=True), got.append)
    sched.drain(0.3)
    with pytest.raises(ShuttingDown, match="shutting down"):
        sched.submit([prompt], SamplingParams(2), got.append)
    deadline = time.monotonic() + 30
    while sched.stats()["in_flight"] and time.monotonic() < deadline:
        time.sleep(0.02)
    sched.stop()
    assert got == [("finish", 0, short), ("error", "the server is shutting down")]
    assert sched.stats()["kv_blocks_used"] == 0 and sched.failed_requests == 1


def test_chat_template_from_the_tokenizer_files(folder, tmp_path):
    from llmsplit.io.hf import HFWeights

    assert HFWeights(folder).tokenizer.chat_template is None
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": [{"name": "default", "template": "T"}]}')
    assert read_chat_template(tmp_path) == "T"
    (tmp_path / "chat_template.jinja").write_text(CHATML)  # newer transformers write this file instead
    assert read_chat_template(tmp_path) == CHATML
    tok = HFWeights(folder).tokenizer
    tok.chat_template = CHATML
    ids, stops = chat_prompt([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], tok)
    assert ids == tok.encode("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                             "<|im_start|>assistant\n")
    assert stops == []  # the template's own end-of-turn token ends the reply


def test_chat_template_from_gguf_metadata(folder, tmp_path):
    import json

    from llmsplit.io.gguf import gguf_tokenizer

    tj = json.loads((folder / "tokenizer.json").read_text())
    meta = {"tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.tokens": [t for t, _ in sorted(tj["model"]["vocab"].items(), key=lambda kv: kv[1])],
            "tokenizer.ggml.merges": [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]],
            "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.add_bos_token": True,
            "tokenizer.chat_template": "{{ bos_token }}{% for m in messages %}[{{ m['content'] }}]{% endfor %}"}
    tok = gguf_tokenizer(lambda key, default=None: meta.get(key, default), tmp_path / "m.gguf")
    ids, _ = chat_prompt([{"role": "user", "content": "Hi"}], tok)
    assert ids == [0, *tok.encode("[Hi]")[1:]]  # one BOS, not the template's plus the tokenizer's
    from llmsplit.io.tokenizer import load_tokenizer, save_tokenizer_files

    save_tokenizer_files(tok, tmp_path / "copy")  # a run's copy encodes as the GGUF file does
    copy = load_tokenizer(str(tmp_path / "copy"))
    assert copy.add_bos and copy.encode("Hi") == tok.encode("Hi") and copy.encode("Hi")[0] == 0


def test_default_chat_template_and_template_errors():
    tok = ByteTokenizer()
    ids, stops = chat_prompt([{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}], tok)
    assert tok.decode(ids) == "System: S\n\nUser: Hi\n\nAssistant:" and stops == DEFAULT_STOP
    tok.chat_template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}"
    with pytest.raises(TemplateError, match="first must be user"):
        chat_prompt([{"role": "assistant", "content": "x"}], tok)


def test_the_time_limit_stops_a_python_loop_in_its_thread():
    import asyncio

    from llmsplit.infer.serve.time_limit import OffLoop, TimeLimitExceeded

    def spin():
        while True:
            pass

    def workers():
        return [t for t in threading.enumerate() if t.name == "llmsplit-request-work"]

    async def settle():
        for _ in range(100):  # bounded: the interrupted thread ends within microseconds
            if not workers():
                return
            await asyncio.sleep(0.05)

    async def main():
        off = OffLoop(0.3)
        assert await off.run(sum, [1, 2]) == 3
        with pytest.raises(ValueError):  # the function's own error reaches the caller
            await off.run(int, "x")
        start = time.monotonic()
        with pytest.raises(TimeLimitExceeded):
            await off.run(spin)
        assert time.monotonic() - start < 5
        await settle()
        assert not workers()  # stopped, not left spinning
        task = asyncio.ensure_future(off.run(spin))  # a request whose client left is stopped too
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await settle()
        assert not workers() and off.active == 0

    asyncio.run(main())


def test_an_unexpected_error_is_a_500_counted_in_metrics_and_draining_is_a_503(model, monkeypatch):
    from starlette.testclient import TestClient

    from llmsplit.infer.serve.server import Server

    def broken(text):
        raise RuntimeError("tokenizer broke")

    monkeypatch.setattr(model.engine.tokenizer, "encode", broken)
    server = Server(model, "llama")
    with TestClient(server.app) as c:
        r = c.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        assert "tokenizer broke" in r.json()["error"]["message"]
        assert 'llmsplit_http_responses_total{status="500"} 1.0\n' in c.get("/metrics").text
        assert c.get("/health").json()["status"] == "ok"
        # A request that reaches a draining server (SIGTERM) is told to go elsewhere, not that it is busy.
        server.scheduler.drain(30)
        r = c.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down", r.text
        assert int(r.headers["Retry-After"]) >= 1


def test_logit_processors_follow_openai_and_vllm_formulas(model):
    import torch

    from llmsplit.infer.engine.sampler import process, sample_batch

    e = model.engine
    torch.manual_seed(0)
    logits = torch.randn(3, model.config.vocab_size) * 3
    params = [SamplingParams(8, presence_penalty=0.5, frequency_penalty=0.25, logit_bias={3: 5.0, 4: -100.0}),
              SamplingParams(8, repetition_penalty=1.5),
              SamplingParams(8, min_tokens=4, stop_token_ids=[9])]
    seqs = [e.new_sequence([1, 2, 2], p) for p in params]
    for seq in seqs:
        seq.tokens = [5, 6, 6]
    got = logits.clone()
    process(got, seqs, eos_ids={0})
    want = logits.clone()
    want[0, 5] -= 0.5 + 0.25
    want[0, 6] -= 0.5 + 0.5
    want[0, 3] += 5.0
    want[0, 4] -= 100.0
    for t in (1, 2, 5, 6):  # prompt and generated tokens: a positive logit divided, a negative multiplied
        want[1, t] = want[1, t] / 1.5 if want[1, t] > 0 else want[1, t] * 1.5
    want[2, [0, 9]] = float("-inf")  # three tokens generated, four asked for: no end yet
    assert torch.equal(got, want)
    seqs[2].tokens.append(7)
    after = logits[2:].clone()
    process(after, seqs[2:], eos_ids={0})
    assert torch.equal(after[0], logits[2])  # min_tokens reached: nothing masked
    # Log-probabilities are the model's own, before any processor.
    tokens, entries = sample_batch(logits.clone(), [e.new_sequence([1], SamplingParams(8, logprobs=2,
                                                                                         logit_bias={3: 100.0}))],
                                   eos_ids={0})
    assert tokens == [3] and entries[0][0] == pytest.approx(torch.log_softmax(logits[0], -1)[3].item())
    assert [t for t, _ in entries[0][1]] == logits[0].topk(2).indices.tolist()


def test_a_prompt_scored_from_near_its_end_is_scored_across_chunks(folder):
    import torch

    # Chunks of 8 tokens: the scored tokens (25-29) lie in a later chunk than the first.
    m = llmsplit.load(folder, max_batch=2, max_context=64, max_num_batched_tokens=8)
    try:
        ids = m.tokenizer.encode("The def statement binds a name to a function " * 4)[:30]
        seq = m.engine.new_sequence(ids, SamplingParams(1, ignore_eos=True, prompt_logprobs=1,
                                                        prompt_logprobs_from=25))
        m.engine.generate([seq])
        full = torch.log_softmax(m.logits(torch.tensor([ids]))[0], -1)
    finally:
        m.close()
    assert len(seq.prompt_logprobs) == 30 and seq.prompt_logprobs[0] is None
    for j in range(25, 30):
        assert seq.prompt_logprobs[j][0] == pytest.approx(full[j - 1, ids[j]].item(), abs=1e-4)


def test_a_million_messages_are_refused_before_they_are_parsed(model):
    import json
    import tracemalloc

    from starlette.testclient import TestClient

    from llmsplit.infer.serve.protocol import APIError
    from llmsplit.infer.serve.request_body import check_shape
    from llmsplit.infer.serve.server import Server

    body = json.dumps({"messages": [{"role": "user", "content": "x"}] * 10**6}).encode()  # 31 MiB
    server = Server(model, "llama", max_body=64 << 20)
    with TestClient(server.app) as c:
        start = time.perf_counter()
        r = c.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
        elapsed = time.perf_counter() - start
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
        assert "more than 10,000 messages; this server takes at most 10,000" in r.json()["error"]["message"]
        assert elapsed < 1.0, elapsed  # parsing them as pydantic models took 28 s
    # The count stops at the first item over the cap: what it builds does not grow with the body.
    tracemalloc.start()
    with pytest.raises(APIError, match="more than 10,000 messages"):
        check_shape(body, 10_000)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < len(body) / 20, f"{peak / 2**20:.1f} MiB for a {len(body) / 2**20:.0f} MiB body"


@pytest.mark.parametrize("flags,message", [
    (["--pp", "2", "--nnodes", "2"], "--nnodes > 1 needs --master-port"),
    (["--nnodes", "2", "--master-port", "1"], "needs --tp or --pp"),
    (["--pp", "2", "--nnodes", "3", "--master-port", "1"], "--nnodes 3 must divide the 2 workers"),
    (["--pp", "2", "--nnodes", "2", "--node-rank", "2", "--master-port", "1"], "--node-rank 2 must be between 0"),
    (["--pp", "2", "--nnodes", "2", "--node-rank", "1", "--master-port", "1", "--master-addr", "no.such.host."],
     "does not resolve"),
])
def test_serving_over_nodes_refuses_flags_that_cannot_form_a_job(folder, flags, message, capsys):
    from llmsplit import cli

    assert cli.main(["serve", "--model", str(folder), "--port", "0", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "Traceback" not in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("flags,warned", [(["--host", "0.0.0.0"], True), (["--host", "::"], True),
                                          (["--host", "0.0.0.0", "--api-key", "k"], False),
                                          (["--host", "127.0.0.1"], False), ([], False)])
def test_serving_beyond_this_machine_without_a_key_warns(flags, warned, monkeypatch, capsys):
    from llmsplit import cli
    from llmsplit.infer.serve import server

    monkeypatch.delenv("LLMSPLIT_API_KEY", raising=False)
    served = []
    monkeypatch.setattr(server, "serve", lambda *a, **kw: served.append(kw))  # no socket is opened
    assert cli.main(["serve", "--model", "m", *flags]) == 0 and served
    err = capsys.readouterr().err
    assert ("warning" in err and "--api-key" in err) == warned, err


@pytest.mark.parametrize("metrics_auth", [False, True])
def test_the_api_key_scheme_is_any_case_and_metrics_auth_closes_metrics(metrics_auth):
    """The scheme of `Authorization: Bearer KEY` is case-insensitive (RFC 7235; `bearer KEY`
    got a 401, issue 52). /metrics asks for the key only with --metrics-auth, /health never."""
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from llmsplit.infer.serve.edge import Gate

    app = Starlette(routes=[Route(path, lambda request: PlainTextResponse("ok"))
                            for path in ("/v1/models", "/metrics", "/health")])
    gate = Gate(app, api_key="k3y", max_body=1024, body_timeout=5, statuses={}, metrics_auth=metrics_auth)
    with TestClient(gate) as c:
        for given in ("Bearer k3y", "bearer k3y", "BEARER k3y", "bEaReR  k3y"):
            assert c.get("/v1/models", headers={"Authorization": given}).status_code == 200, given
        for given in ("Bearer nope", "bearer K3Y", "bearer", "Bearerk3y", "Basic k3y", "k3y", ""):
            assert c.get("/v1/models", headers={"Authorization": given}).status_code == 401, given
        assert c.get("/metrics").status_code == (401 if metrics_auth else 200)
        assert c.get("/metrics", headers={"Authorization": "bearer k3y"}).status_code == 200
        assert c.get("/health").status_code == 200


def test_metrics_auth_needs_an_api_key(monkeypatch, capsys):
    from llmsplit import cli
    from llmsplit.infer.serve import server

    monkeypatch.delenv("LLMSPLIT_API_KEY", raising=False)
    assert cli.main(["serve", "--model", "m", "--metrics-auth"]) == 2  # refused before the model is looked for
    err = capsys.readouterr().err.strip()
    assert "--metrics-auth needs --api-key" in err and "Traceback" not in err and len(err.splitlines()) == 1, err
    served = []
    monkeypatch.setattr(server, "serve", lambda *a, **kw: served.append(kw))  # no socket is opened
    assert cli.main(["serve", "--model", "m", "--api-key", "k", "--metrics-auth"]) == 0
    assert cli.main(["serve", "--model", "m", "--api-key", "k"]) == 0
    assert [kw["metrics_auth"] for kw in served] == [True, False]


def test_incremental_detokenization_equals_decoding_everything(model):
    """Each step decodes one token (issue 19: the engine re-decoded the whole text per
    token); the pieces, streamed or not, join to `decode` of all the ids, characters split
    over several tokens included (byte-level BPE here, UTF-8 bytes for the byte tokenizer)."""
    text = "Héllo wörld, 日本語 🎉 done"
    for tok in (model.tokenizer, ByteTokenizer()):
        ids = tok.encode(text)
        stream = tok.stream()
        pieces = [stream.step(i) for i in ids]
        assert "".join(pieces) == tok.decode(ids) == text
        assert "\ufffd" not in "".join(pieces[:-1])  # no half character ever comes out
    streamed = []
    seq = model.engine.new_sequence(model.tokenizer.encode("The def"), SamplingParams(40, ignore_eos=True))
    seq.on_text = streamed.append
    model.engine.generate([seq])
    assert "".join(streamed) == seq.text == model.tokenizer.decode(seq.tokens)
    # A stop string found in the newest text only, and cut there.
    stop = seq.text[5:9]
    seq2 = model.engine.new_sequence(model.tokenizer.encode("The def"), SamplingParams(40, ignore_eos=True, stop=[stop]))
    model.engine.generate([seq2])
    assert seq2.finish_reason == "stop" and seq2.text == seq.text[:seq.text.index(stop)]


def test_blocks_on_demand_preempt_the_newest_and_every_sequence_finishes(folder):
    """A KV pool of 4 blocks (64 tokens) for 4 sequences that each reach 40 tokens: blocks are
    taken as tokens arrive, the newest sequence is preempted when they run out and recomputed
    later (issue 19); every sequence gets the tokens it gets alone, and all blocks come back."""
    small = llmsplit.load(folder, max_batch=4, max_context=64, kv_tokens=64)
    prompts = ["The def statement", "A class is", "import os and sys", "for x in range"]
    params = SamplingParams(30, ignore_eos=True)
    seqs = [small.engine.new_sequence(small.tokenizer.encode(p), params) for p in prompts]
    small.engine.generate(seqs)
    assert small.engine.preemptions > 0 and small.engine.recomputed_tokens > 0
    assert small.engine.pool.free_blocks == small.engine.pool.num_blocks == 4
    assert [s.tokens for s in seqs] == [alone(small, p, 30) for p in prompts]
    # The pool holds at least one full context, so a request that fits the context fits the pool.
    with pytest.raises(ConfigError, match="kv_tokens 32 holds less than one sequence"):
        llmsplit.load(folder, max_context=64, kv_tokens=32)


def test_prompts_that_start_alike_share_cached_blocks(folder):
    """Prefix caching (on by default): full blocks are found by a hash chained over every token
    up to their end, shared while several sequences hold them, kept once freed and evicted
    oldest first when the pool needs room; the tokens are those computed without it."""
    cached = llmsplit.load(folder, max_batch=2, max_context=128, kv_tokens=128)  # 8 blocks of 16
    plain = llmsplit.load(folder, max_batch=2, max_context=128, kv_tokens=128, prefix_caching=False)
    system = cached.tokenizer.encode("You are a helpful assistant who answers questions about Python. " * 2)
    prompts = [system + cached.tokenizer.encode(q) for q in (" What is a class?", " What is a def?")]
    params = SamplingParams(12, ignore_eos=True)

    def run(m, together: bool) -> list[list[int]]:
        seqs = [m.engine.new_sequence(p, params) for p in prompts]
        for group in ([seqs] if together else [[s] for s in seqs]):
            m.engine.generate(group)
        return [s.tokens for s in seqs]

    want = run(plain, together=False)
    pool = cached.engine.pool
    assert run(cached, together=False) == want
    shared = (len(system) // 16) * 16  # the second prompt found the first's full blocks of the system text
    assert pool.hit_tokens >= shared > 0 and plain.engine.pool.hit_tokens == 0
    hits = pool.hit_tokens
    assert run(cached, together=True) == want  # both running at once, holding the same blocks
    assert pool.hit_tokens - hits >= 2 * shared
    # Other prompts fill the pool: the cached blocks are evicted, oldest first, and nothing fails.
    for i in range(6):
        other = cached.tokenizer.encode(f"{i} different words about lists, tuples and sets number {i} ")
        assert alone(cached, cached.tokenizer.decode(other), 20) == alone(plain, plain.tokenizer.decode(other), 20)
    assert pool.free_blocks == pool.num_blocks


def test_a_long_prompt_is_prefilled_in_chunks_while_the_batch_keeps_decoding(folder):
    """--max-num-batched-tokens 16: a 150-token prompt arriving while another sequence decodes
    is filled 15 tokens a step (the decode takes its share first), and the running sequence
    gets a token in every one of those steps (issue 19: a long prompt stalled every stream);
    both get the tokens they get unchunked."""
    chunked = llmsplit.load(folder, max_batch=2, max_context=256, max_num_batched_tokens=16)
    e = chunked.engine
    running = e.new_sequence(chunked.tokenizer.encode("The def"), SamplingParams(40, ignore_eos=True))
    e.add(running)
    for _ in range(3):
        e.step()
    long_prompt = [3 + (i * 7) % 300 for i in range(150)]
    arriving = e.new_sequence(long_prompt, SamplingParams(8, ignore_eos=True))
    e.add(arriving)
    steps = 0
    while not arriving.tokens:
        before = len(running.tokens)
        e.step()
        steps += 1
        assert len(running.tokens) == before + 1  # the stream never stalls
    assert steps == -(-150 // 15)
    while e.busy:
        e.step()
    whole = llmsplit.load(folder, max_batch=2, max_context=256)
    assert running.tokens == alone(whole, "The def", 40)
    assert arriving.tokens == whole.engine.generate([whole.engine.new_sequence(long_prompt, SamplingParams(
        8, ignore_eos=True))])[0].tokens
    with pytest.raises(ConfigError, match="max_num_batched_tokens 1 is less than max_batch 2"):
        llmsplit.load(folder, max_batch=2, max_num_batched_tokens=1)


def test_a_long_prompt_is_not_starved_by_a_stream_of_short_ones(folder, monkeypatch):
    """Shortest first, but a context that waited while STARVE_TOKENS (here 64) tokens of
    others were filled goes first: a 100-token prompt under a new 12-token prompt every step."""
    import llmsplit.infer.engine.scheduler as engine

    monkeypatch.setattr(engine, "STARVE_TOKENS", 64)
    m = llmsplit.load(folder, max_batch=16, max_context=128, max_num_batched_tokens=16)
    e = m.engine
    long_one = e.new_sequence([3 + i % 200 for i in range(100)], SamplingParams(1, ignore_eos=True))
    e.add(long_one)
    steps = 0
    while not long_one.tokens:  # (each short one is done the step after it is filled: a batch slot frees)
        e.add(e.new_sequence([5 + (steps + j) % 250 for j in range(12)], SamplingParams(1, ignore_eos=True)))
        e.step()
        steps += 1
        assert steps < 40, "the long prompt was starved"
    # Alone it takes 7 steps of 16; waits of 64 tokens at most between its chunks bound it.
    assert steps <= 7 * (1 + 64 // 12 + 1), steps


@pytest.mark.parametrize("in_place", [True, False])
def test_prompts_are_prefilled_together_in_the_decodes_forward(folder, monkeypatch, in_place):
    """Each step is one forward: prompts arriving together are prefilled side by side, packed
    in one row with the running sequences' decode tokens, under --max-num-batched-tokens;
    every request's greedy tokens are those it gets alone (issue 19, item 3). With the paged
    kernel the decodes are one part; on the gather path they run in parts of similar lengths
    (a part costing 8 key slots here, so that they split)."""
    if in_place and not paged_attention.available():
        pytest.skip("no C++ compiler to build the paged kernel")
    monkeypatch.setattr(block_manager, "PART_COST_SLOTS", 8)
    if not in_place:
        monkeypatch.setattr(paged_attention, "applies", lambda *a: False)
        monkeypatch.setattr(paged_attention, "available", lambda: False)
    m = llmsplit.load(folder, max_batch=6, max_context=256, max_num_batched_tokens=64)
    e, forwards, decode_parts = m.engine, [], []
    forward = e.runner.forward

    def counted(tokens, step, last_only, **kw):
        forwards.append((tokens.shape[1], len(step.parts) if isinstance(step, PackedStep) else 0))
        decode_parts.append(sum(p.slots.numel() == p.gather.shape[0] for p in step.parts)
                            if isinstance(step, PackedStep) else 1)
        return forward(tokens, step, last_only, **kw)

    monkeypatch.setattr(e.runner, "forward", counted)
    prompts = [[3 + (i * 7 + j * 5) % 300 for j in range(n)] for i, n in enumerate((5, 40, 90, 17, 33, 120))]
    news = (12, 6, 10, 9, 4, 8)
    seqs = [e.new_sequence(p, SamplingParams(n, ignore_eos=True)) for p, n in zip(prompts, news)]
    for seq in seqs[:2]:
        e.add(seq)
    steps, first = 0, {}
    while e.busy or steps < 3:
        if steps == 3:  # the first two are decoding by now; four more arrive together
            for seq in seqs[2:]:
                e.add(seq)
        e.step()
        steps += 1
        first.update({s.id: steps for s in seqs if s.tokens and s.id not in first})
    assert len(forwards) == steps  # one forward a step, never a chunk on its own
    # The shortest of those arriving together are filled first (prompts of 17, 33, 90, 120 tokens).
    arrived = [seqs[i] for i in (3, 4, 2, 5)]
    assert [first[s.id] for s in arrived] == sorted(first[s.id] for s in arrived), first
    assert first[seqs[3].id] < first[seqs[2].id], first
    assert max(n for n, _ in forwards) <= 64
    assert max(parts for _, parts in forwards) >= 3  # the decodes and two prompts' chunks at least
    assert max(decode_parts) == 1 if in_place else max(decode_parts) >= 2
    whole = llmsplit.load(folder, max_batch=1, max_context=256)
    for prompt, n, seq in zip(prompts, news, seqs):
        assert seq.tokens == whole.engine.generate([whole.engine.new_sequence(prompt, SamplingParams(
            n, ignore_eos=True))])[0].tokens
    assert e.pool.free_blocks == e.pool.num_blocks


def test_tool_calls_written_in_the_text_become_openais_tool_calls():
    """tool_choice "auto": calls the model writes as its template asks (<tool_call> JSON) come
    back as OpenAI's tool_calls, the text around them as the content; a template that
    renders tools is given them."""
    from types import SimpleNamespace

    from llmsplit.infer.chat import render_chat
    from llmsplit.infer.serve.replies import Reply
    from llmsplit.infer.serve.tool_calls import PARSERS

    def reply(text):
        seq = SimpleNamespace(text=text, finish_reason="stop", prompt=[1], tokens=[2])
        return Reply("m", True, [seq], tools=PARSERS["hermes"]).message(seq)

    message, finish = reply('Checking. <tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>')
    assert finish == "tool_calls" and message["content"] == "Checking."
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["function"] == {"name": "get_time", "arguments": '{"zone": "utc"}'}
    assert reply("<tool_call>{oops}</tool_call>") == ({"role": "assistant", "content": "<tool_call>{oops}</tool_call>"},
                                                     "stop")
    tok = ByteTokenizer()
    tok.chat_template = "{% for t in tools %}{{ t.function.name }};{% endfor %}{{ messages[0].content }}"
    tools = [{"type": "function", "function": {"name": "get_time"}}]
    assert render_chat([{"role": "user", "content": "hi"}], tok, tools=tools) == "get_time;hi"
