"""Speculative decoding (engine/speculative.py): prompt-lookup proposals, and the engine's
output identical to decoding one token at a time, greedy and seeded sampling (whose random
draws it makes in the same order: the strongest form of "distributed as without it"), with
logit processors, log-probabilities, stop strings and limits. (--tp/--pp: tests/test_infer_split.py; int8 KV: the same file; offload
and `generate --verbose`: tests/test_infer_cli.py; the server and /metrics: tests/test_serve.py.)"""

import pytest
import torch

pytest.importorskip("transformers")

import llmsplit  # noqa: E402
from hf_models import make_hf_folder  # noqa: E402
from llmsplit.errors import ConfigError  # noqa: E402
from llmsplit.infer.engine import SamplingParams  # noqa: E402
from llmsplit.infer.engine.block_manager import BlockPool  # noqa: E402
from llmsplit.infer.engine.speculative import ngram_proposal  # noqa: E402


def test_prompt_lookup_proposes_what_followed_the_latest_occurrence():
    assert ngram_proposal([1, 2, 3, 4, 5, 1, 2, 3], 3) == [4, 5, 1]  # the longest suffix (1 2 3) first
    assert ngram_proposal([1, 2, 9, 7, 1, 2, 8, 5, 1, 2], 2) == [8, 5]  # its latest occurrence
    assert ngram_proposal([1, 2, 3, 9, 1, 2], 10) == [3, 9, 1, 2]  # no more than followed
    assert ngram_proposal([5, 6, 7, 8], 4) == []  # no repeat
    assert ngram_proposal([1, 2, 1, 2], 0) == []
    # Token ids are searched as 4-byte words: a byte pattern across two ids is not a match.
    assert ngram_proposal([256, 1, 7, 256, 1], 2) == [7, 256]
    assert ngram_proposal([1, 256, 0, 0, 1, 0], 2) == []


def test_truncating_returns_the_blocks_past_the_kept_tokens():
    pool = BlockPool(8, 4)
    pool.append(1, 6)
    pool.append(1, 5)  # 11 tokens: 3 blocks
    assert pool.free_blocks == 5
    pool.truncate(1, 7)
    assert pool.lengths[1] == 7 and len(pool.tables[1]) == 2 and pool.free_blocks == 6
    pool.truncate(1, 9)  # never grows
    assert pool.lengths[1] == 7


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = make_hf_folder(tmp_path_factory.mktemp("speculative") / "llama", num_hidden_layers=2)
    plain = llmsplit.load(folder, max_batch=4, max_context=128)
    spec = llmsplit.load(folder, max_batch=4, max_context=128, speculative="ngram", speculative_tokens=5)
    yield plain, spec
    plain.close()
    spec.close()


PROMPTS = ["The def statement", "a b c d a b c d a b c", "x = [1, 2, 3]\ny = [1, 2,", "hello hello hello hello",
           "0123456789 0123456789 01234"]
CASES = [dict(), dict(repetition_penalty=1.3), dict(frequency_penalty=0.5, presence_penalty=0.3),
         dict(logprobs=3), dict(stop=["c d"]), dict(min_tokens=5), dict(logit_bias={5: 3.0}),
         dict(temperature=1.0, logit_bias={5: 6.0}, seed=3), dict(temperature=1.0, top_k=8, top_p=0.9, min_p=0.05, seed=4)]


def generate(m, prompts, **params):
    seqs = [m.engine.new_sequence(m.tokenizer.encode(p), SamplingParams(**{"max_new_tokens": 40, **params}))
            for p in prompts]
    m.engine.generate(seqs)
    assert m.engine.pool.free_blocks == m.engine.pool.num_blocks  # every block returned, proposals' too
    return seqs


@pytest.mark.parametrize("params", CASES, ids=[",".join(c) or "greedy" for c in CASES])
def test_the_output_is_the_same_with_and_without_speculation(models, params):
    plain, spec = models
    before = spec.engine.speculation.accepted
    # All five together (one waits for a slot: max_batch 4); greedy also one at a time.
    for batch in ([PROMPTS], [[p] for p in PROMPTS] if not params else []):
        for prompts in batch:
            want, got = generate(plain, prompts, **params), generate(spec, prompts, **params)
            assert [s.tokens for s in got] == [s.tokens for s in want]
            assert [s.text for s in got] == [s.text for s in want]
            assert [s.finish_reason for s in got] == [s.finish_reason for s in want]
            for a, b in zip(got, want):  # log-softmax of one row or of a batch's: the same to rounding
                assert [[i for i, _ in top] for _, top in a.logprobs] == [[i for i, _ in top] for _, top in b.logprobs]
                torch.testing.assert_close(torch.tensor([[lp, *(v for _, v in top)] for lp, top in a.logprobs]),
                                           torch.tensor([[lp, *(v for _, v in top)] for lp, top in b.logprobs]),
                                           atol=1e-5, rtol=0)
    if not any(name.endswith("penalty") or name == "top_k" for name in params):  # (they stray from repeats)
        assert spec.engine.speculation.accepted > before  # proposals were taken, not only made


def test_limits_hold_under_speculation(models):
    """A sequence never proposes past max_new_tokens or its context."""
    plain, spec = models
    for n in (1, 2, 3, 7):
        assert [len(s.tokens) for s in generate(spec, PROMPTS[1:2], max_new_tokens=n, ignore_eos=True)] == [n]
    long = generate(spec, [PROMPTS[3] * 8], max_new_tokens=120, ignore_eos=True)[0]
    assert long.finish_reason == "length" and long.length == 128
    stats = spec.engine.stats()
    assert stats["speculative_accepted_tokens"] <= stats["speculative_proposed_tokens"]
    # Each verifying step gives its accepted proposals and the model's own token (but one that ended the sequence).
    assert stats["speculative_accepted_tokens"] < stats["speculative_emitted_tokens"] <= (
        stats["speculative_accepted_tokens"] + stats["speculative_verify_steps"])


def test_bad_speculative_settings_name_the_flag():
    from llmsplit.infer.config import InferConfig

    with pytest.raises(ConfigError, match=r"--speculative-tokens 0 must be in \[1, 16\]"):
        InferConfig(speculative="ngram", speculative_tokens=0)
    with pytest.raises(ConfigError, match=r"--speculative-tokens 1000000 must be in \[1, 16\]"):
        InferConfig(speculative="ngram", speculative_tokens=10**6)
    with pytest.raises(ConfigError, match="--speculative is empty; pass ngram or a draft model's path"):
        InferConfig(speculative=" ")


@pytest.fixture(scope="module")
def drafted(tmp_path_factory, models):
    """The models' folder drafted for by another model with the same tokenizer (one layer,
    other random weights: it disagrees often) and by itself (it always agrees)."""
    root = tmp_path_factory.mktemp("drafts")
    folder = make_hf_folder(root / "llama", num_hidden_layers=2)
    other = make_hf_folder(root / "draft", num_hidden_layers=1, seed=1)
    loads = [llmsplit.load(folder, max_batch=4, max_context=128, speculative=str(d), speculative_tokens=3)
             for d in (other, folder)]
    yield loads
    for m in loads:
        m.close()


@pytest.mark.parametrize("params", CASES[:1] + CASES[-2:], ids=["greedy", "sampled", "sampled-top-k-p"])
def test_a_draft_models_proposals_leave_the_output_unchanged(models, drafted, params):
    plain, _ = models
    want = generate(plain, PROMPTS, **params)
    for m in drafted:
        got = generate(m, PROMPTS, **params)
        assert [s.tokens for s in got] == [s.tokens for s in want]
        draft_pool = m.engine.speculation.draft.engine.pool
        assert draft_pool.free_blocks == draft_pool.num_blocks  # the draft's sequences ended and left nothing held
    other, itself = (m.engine.speculation for m in drafted)
    assert itself.accepted > 0 and other.proposed > 0
    if not params:  # a draft that is the model proposes what it decodes greedily: all taken
        assert itself.accepted == itself.proposed


def test_a_draft_with_another_tokenizer_is_refused_naming_both(tmp_path):
    from hf_models import train_tokenizer

    folder = make_hf_folder(tmp_path / "llama", num_hidden_layers=1)
    draft = make_hf_folder(tmp_path / "draft", num_hidden_layers=1)
    train_tokenizer(vocab_size=300).save(str(draft / "tokenizer.json"))
    with pytest.raises(ConfigError, match=r"--speculative '.*draft' has another tokenizer \(.*300 tokens\) than the "
                                          r"model \(.*320 tokens\); a draft model must share"):
        llmsplit.load(folder, max_context=64, speculative=str(draft))
    with pytest.raises(ConfigError, match="--speculative '.*nowhere' does not exist"):
        llmsplit.load(folder, max_context=64, speculative=str(tmp_path / "nowhere"))


def test_speculation_rests_while_proposals_are_rarely_taken():
    from llmsplit.infer.engine.speculative import FIRST_REST, WINDOW, Speculation

    spec = Speculation()
    for _ in range(WINDOW // 4):
        spec.count(4, 0, 1)  # a window of proposals, none taken
    assert spec.rests == 1 and all(spec.resting() for _ in range(FIRST_REST)) and not spec.resting()
    for _ in range(WINDOW // 4):
        spec.count(4, 0, 1)  # still poor on return: a longer rest
    assert sum(spec.resting() for _ in range(4 * FIRST_REST)) == 2 * FIRST_REST
    for _ in range(WINDOW // 4):
        spec.count(4, 3, 4)  # good again: no rest, and the next rest starts short
    assert not spec.resting() and spec.rests == 2
    assert "rested 2 times for poor acceptance" in spec.summary()
