"""The same logits and greedy tokens whatever the layout: whole on CPU, cpu + disk under a
small budget, a batch against one prompt at a time, tensor parallel and pipeline workers;
a worker that dies while loading is named by rank."""

import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")

import llmsplit  # noqa: E402
from hf_models import make_hf_folder  # noqa: E402
from llmsplit.errors import ConfigError  # noqa: E402
from llmsplit.infer.engine import SamplingParams  # noqa: E402

PROMPTS = [[5, 17, 42, 99, 7, 3, 250], [12, 8], [200, 201, 202, 203, 204], [77]]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    # An odd vocabulary and a tied head: --tp 2 pads the vocabulary shards and shares one of them.
    return make_hf_folder(tmp_path_factory.mktemp("split") / "llama", vocab_size=321, tie=True)


@pytest.fixture(scope="module")
def reference(folder):
    m = llmsplit.load(folder, device_map="cpu")
    out = run(m)
    m.close()
    return out


def run(m, batched: bool = True):
    ids = torch.tensor([PROMPTS[0] * 2, PROMPTS[2] + PROMPTS[0] + PROMPTS[1]])
    params = SamplingParams(10, ignore_eos=True)
    if batched:
        seqs = [m.engine.new_sequence(p, params) for p in PROMPTS]
        m.engine.generate(seqs)
    else:
        seqs = []
        for p in PROMPTS:
            seqs.append(m.engine.new_sequence(p, params))
            m.engine.generate(seqs[-1:])
    assert m.engine.pool.free_blocks == m.engine.pool.num_blocks  # every block returned
    return m.logits(ids), [s.tokens for s in seqs]


def assert_same(got, want):
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=0)
    assert got[1] == want[1]


def test_one_prompt_at_a_time_equals_the_batch(folder, reference):
    m = llmsplit.load(folder, device_map="cpu")
    assert_same(run(m, batched=False), reference)
    m2 = llmsplit.load(folder, device_map="cpu", max_batch=2)  # waits for blocks/slots to free up
    assert_same(run(m2), reference)


@pytest.mark.parametrize("kv_dtype", ["int8", "bfloat16"])
def test_a_narrow_kv_cache(folder, reference, kv_dtype):
    """--kv-dtype int8 / bfloat16: the batch (fused prefill and decode steps) gives the float
    cache's greedy tokens, logits to int8 / bfloat16 rounding, in the bytes placement counted:
    head_dim 16 here, so int8's 16 bytes and a 4-byte scale a (token, head) against 64 (0.31x;
    0.27x at SmolLM2's 64), bfloat16's 32 (0.5x)."""
    m, ref = llmsplit.load(folder, device_map="cpu", kv_dtype=kv_dtype), llmsplit.load(folder, device_map="cpu")
    assert run(m)[1] == reference[1]
    # Speculative proposals verified over the narrow cache: the same tokens (the rows it keeps, exactly).
    assert run(llmsplit.load(folder, device_map="cpu", kv_dtype=kv_dtype, speculative="ngram"))[1] == reference[1]
    ids = torch.tensor(PROMPTS[2] + PROMPTS[0] + PROMPTS[1] + PROMPTS[0])

    def through_the_cache(model):  # in chunks of 4: each reads the earlier chunks' keys from the pool
        pool, out = model.engine.pool, []
        for start in range(0, ids.numel(), 4):
            chunk = ids[start:start + 4]
            pool.append(0, chunk.numel())
            out.append(model.runner.forward(chunk[None], pool.step([0], chunk.numel()), last_only=False)[0])
        pool.free(0)
        return torch.cat(out)

    want, got = through_the_cache(ref), through_the_cache(m)
    assert 0 < (got - want).abs().max() < 0.01 * want.abs().max()
    fp32 = ref.placement.usage["cpu"]["kv_cache"]
    hd = m.config.head_dim
    narrow = fp32 * (hd + 4) // (4 * hd) if kv_dtype == "int8" else fp32 // 2
    assert m.placement.usage["cpu"]["kv_cache"] == m.runner.cache.nbytes() == narrow
    with pytest.raises(ConfigError, match="--kv-dtype 'int4' is not one of: int8, bfloat16"):
        llmsplit.load(folder, kv_dtype="int4")


def test_embeddings_are_transformers_last_hidden_state_pooled(folder):
    """`embed`: the final hidden states (after the last norm) at the last token or averaged,
    normalized: transformers' last_hidden_state, pooled the same way."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    m = llmsplit.load(folder, device_map="cpu", pooling="mean")
    with torch.no_grad():
        states = [hf.model(torch.tensor([p])).last_hidden_state[0] for p in PROMPTS]
    for pooling, pool in (("last", lambda h: h[-1]), (None, lambda h: h.mean(0))):  # None: the load's (mean)
        want = torch.stack([torch.nn.functional.normalize(pool(h), dim=0) for h in states])
        torch.testing.assert_close(m.embed(PROMPTS, pooling), want, atol=1e-5, rtol=0)
    with pytest.raises(ConfigError, match="--pooling 'max' is not one of: last, mean"):
        llmsplit.load(folder, pooling="max")


def test_cpu_plus_disk_under_a_small_budget(folder, reference, tmp_path):
    m = llmsplit.load(folder, max_memory={"cpu": "900KiB"}, offload_dir=tmp_path / "off", max_context=64)
    where = list(m.device_map.values())
    assert "cpu" in where and "disk" in where, m.device_map
    assert len(list((tmp_path / "off").glob("*.safetensors"))) == where.count("disk")
    assert_same(run(m), reference)
    m.close()


@pytest.mark.slow
# tp x pp with speculative decoding, a draft model (the model itself, whole in this process)
# proposing: its proposals verified across the workers give the same tokens.
@pytest.mark.parametrize("layout", [{"tp": 2}, {"pp": 2}, {"tp": 2, "pp": 2, "speculative": "draft"}])
def test_worker_processes(folder, reference, layout):
    m = llmsplit.load(folder, **{**layout, **({"speculative": str(folder)} if "speculative" in layout else {})})
    try:
        piece = m.engine.runner.runner.model
        if layout == {"tp": 2}:  # rank 0 holds rows 0..160 of the 321 (one shared tensor: the head is tied)
            assert piece.tok_embeddings.weight.shape[0] == 161 and piece.output.weight is piece.tok_embeddings.weight
        if "pp" in layout:  # rank 0 is stage 0: the embedding and layers 0, 1 of the 4, no head
            assert piece.output is None and sorted(int(i) for i in piece.layers) == [0, 1]
        assert_same(run(m), reference)
        assert m.generate("The def statement", max_new_tokens=6) == llmsplit.load(folder).generate(
            "The def statement", max_new_tokens=6)
        if "speculative" in layout:
            assert m.engine.speculation.accepted > 0
        with pytest.raises(ConfigError, match="embeddings need the model in one process"):
            m.embed([PROMPTS[0]])
    finally:
        m.close()


@pytest.mark.slow
def test_compiled_decode_step(folder, tmp_path):
    """compile=True compiles the decode graphs at load (one sequence; a batch in the masked
    form) and gives the same tokens and logits as eager; then realistic requests (prompts of
    1 to 1,000 tokens, 1 to 256 new tokens, batch 1 and batched, sequences joining and
    leaving at different positions) compile nothing more (issue 23: the first real request
    after a ~200-token prompt recompiled, 7-42 s). Two LoRA adapters (of other ranks and
    modules) are served over it, each request on one of them or on the base: every mix of
    adapters in a batch runs in the same two graphs. The compiled model speculates (n-gram):
    its proposals are verified as rows of the batched graph (no third graph), and the tokens
    stay those of the eager model without speculation."""
    import random

    from hf_models import make_peft_folder
    from torch._dynamo.utils import counters

    long = make_hf_folder(tmp_path / "long", max_position_embeddings=1536)
    lora = {"a": str(make_peft_folder(tmp_path / "a", long, ("q_proj", "down_proj"), 4, seed=1)),
            "b": str(make_peft_folder(tmp_path / "b", long, ("v_proj", "o_proj", "up_proj"), 8, seed=2))}
    counters.clear()
    compiled = llmsplit.load(long, device_map="cpu", compile=True, max_context=1280, max_batch=4, lora=lora,
                             speculative="ngram")
    assert counters["stats"]["unique_graphs"] == 2
    eager = llmsplit.load(long, device_map="cpu", max_context=1280, max_batch=4, lora=lora)
    answers = [eager.engine.new_sequence([5, 17, 42], SamplingParams(8, ignore_eos=True), k) for k in range(3)]
    assert len({tuple(s.tokens) for s in eager.engine.generate(answers)}) == 3  # the adapters change the answers
    rng, adapter = random.Random(0), random.Random(1)
    for i in range(20):
        requests = [([rng.randrange(3, 300) for _ in range(rng.choice([1, 2, 3, 40, 200, 1000]))] + [7, 8, 9] * 5,
                     SamplingParams(rng.choice([1, 2, 9, 30, 256 if i % 5 == 0 else 3]), ignore_eos=True),
                     adapter.randrange(3)) for _ in range([1, 2, 4, 3][i % 4])]
        got, want = ([s.tokens for s in e.engine.generate([e.engine.new_sequence(*r) for r in requests])]
                     for e in (compiled, eager))
        assert got == want, f"request {i}"
    assert counters["stats"]["unique_graphs"] == 2, "a request compiled a graph after load"
    assert compiled.engine.speculation.verify_steps > 0
    with pytest.raises(ConfigError, match="compile"):
        llmsplit.load(folder, max_memory={"cpu": "900KiB"}, offload_dir=tmp_path / "off", max_context=64,
                      compile=True)
    with pytest.raises(ConfigError, match="compile"):
        llmsplit.load(folder, tp=2, compile=True)


# Run as a script: rank 1 dies while it loads its piece (spawned followers import this
# module again as their __main__, so they get the replaced Runner too); rank 0 loads.
DYING_RANK_1 = """
import os, sys
import torch.distributed as dist
import llmsplit
import llmsplit.infer.runner.split as split
from llmsplit.launch import LaunchError

loading = split.Runner
def runner(*args, **kwargs):
    if dist.get_rank() == 1 and sys.argv[2] == "exit":
        os._exit(3)
    if dist.get_rank() == 1:
        raise RuntimeError("disk on fire")
    return loading(*args, **kwargs)
split.Runner = runner

if __name__ == "__main__":
    if sys.argv[2] == "raise":  # through the command line: one line on stderr, exit status 1
        from llmsplit.cli import main
        sys.exit(main(["generate", "--model", sys.argv[1], "--tp", "2", "hi"]))
    try:
        llmsplit.load(sys.argv[1], tp=2)
    except LaunchError as e:
        print(e)
"""


@pytest.mark.slow
@pytest.mark.parametrize("how,reported", [("exit", "exit code 3"), ("raise", "RuntimeError: disk on fire")])
def test_a_worker_that_dies_while_loading_is_named(folder, tmp_path, how, reported):
    script = tmp_path / "dying_rank_1.py"
    script.write_text(DYING_RANK_1)
    # Rank 0 watches the follower: it does not wait out the process group's 10-minute timeout.
    out = subprocess.run([sys.executable, str(script), str(folder), how], capture_output=True, text=True, timeout=120)
    if how == "exit":
        assert out.stdout.strip() == f"worker rank 1 failed while loading the model: {reported}", out.stderr
    else:  # `llmsplit generate --tp 2`: the worker's own error in one line, no traceback
        assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
        assert (f"llmsplit: generate failed: worker rank 1 failed while loading the model: {reported}"
                in out.stderr.splitlines()), out.stderr
