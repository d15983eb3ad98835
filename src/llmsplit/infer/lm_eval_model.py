"""lm-evaluation-harness over llmsplit's engine, in-process: `llmsplit eval` (extra [eval]).

A model backend (lm-eval's `TemplateLM`) that scores with the engine's prompt log-probabilities
(engine.py `_score_prompt`) and generates with its batch, so a fine-tune is scored where it was
trained, split the same way (`--tp`, offload, GGUF, a run folder). lm-eval's own `hf` backend pads
every choice of a multiple-choice question to a batch and recomputes their shared context each
time; here each choice is a sequence whose context blocks come from the first choice's, through
the prefix cache (the others are its `parent`'s samples: Scheduler._admit), so a question's
context is computed once and only the choices' tokens after it are computed again.

Tokens are encoded as lm-eval's `hf` backend encodes them by default (no BOS added), so the
log-likelihoods are those of that backend on the same Hugging Face folder.
"""

from __future__ import annotations

from lm_eval.api.model import TemplateLM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from .engine import SamplingParams


class LlmsplitLM(TemplateLM):
    """`model`: what `llmsplit.load` returns (kept open by the caller)."""

    def __init__(self, model):
        super().__init__()
        self.model, self.engine = model, model.engine
        self.max_length = self.engine.max_context - 1  # a scored sequence still computes one token after
        self._eot = min(self.engine.eos_ids) if self.engine.eos_ids else 0

    @property
    def eot_token_id(self) -> int:
        return self._eot

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        ids = self.model.tokenizer.encode(string)
        bos = getattr(self.model.tokenizer, "bos_id", None)
        if not add_special_tokens and ids and getattr(self.model.tokenizer, "add_bos", False) and ids[0] == bos:
            ids = ids[1:]  # as lm-eval's hf backend encodes by default: no BOS
        return ids

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(log-likelihood of each continuation, whether greedy decoding would write it): the
        continuation's tokens scored in one sequence with its context, the choices of one
        context sharing its blocks."""
        seqs, firsts = [], {}
        for _, context, continuation in requests:
            tokens = (context + continuation)[-self.max_length:]
            params = SamplingParams(1, ignore_eos=True, prompt_logprobs=1,
                                    prompt_logprobs_from=max(1, len(tokens) - len(continuation)))
            seq = self.engine.new_sequence(tokens, params)
            key = tuple(context)
            if key in firsts:
                seq.parent = firsts[key]  # starts once the first choice's context is in the cache
            else:
                firsts[key] = seq
            seqs.append(seq)
        self.engine.generate(_in_windows(seqs, self.engine.max_batch))
        out = []
        for seq, (_, _, continuation) in zip(seqs, requests):
            n = min(len(continuation), len(seq.prompt) - 1)
            scored = seq.prompt_logprobs[-n:]
            out.append((sum(lp for lp, _ in scored),
                        all(top[0][0] == token for (_, top), token in zip(scored, seq.prompt[-n:]))))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Perplexity tasks: each document scored in windows of the context, as lm-eval's
        backends split it."""
        pairs, owner = [], []
        for i, (text,) in enumerate(req.args for req in requests):
            windows = get_rolling_token_windows(self.tok_encode(text), self.eot_token_id, self.max_length, 1)
            for context, continuation in map(make_disjoint_window, windows):
                pairs.append((None, context, continuation))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owner, self._loglikelihood_tokens(pairs)):
            totals[i] += logprob
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled, when the task asks) continuations up to the task's stop strings,
        requests with the same settings generated together."""
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(repr(sorted(req.args[1].items())), []).append(i)
        out = [""] * len(requests)
        for members in groups.values():
            kwargs = requests[members[0]].args[1]
            until = kwargs.get("until") or []
            most = min(int(kwargs.get("max_gen_toks", 256)), self.engine.max_context // 2)
            params = SamplingParams(most, float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0,
                                    stop=[until] if isinstance(until, str) else list(until))
            room = self.engine.max_context - most  # the context's last tokens that leave room to generate
            seqs = [self.engine.new_sequence(self.tok_encode(requests[i].args[0])[-room:], params) for i in members]
            self.engine.generate(seqs)
            for i, seq in zip(members, seqs):
                out[i] = seq.text
        return out


def _in_windows(seqs: list, width: int) -> list:
    """The order to run `seqs` in: the first choices of `width` contexts, then their other
    choices, then the next `width` contexts'. The batch fills with many contexts at once, each
    context's other choices come up once it is cached, and it is used while still cached
    (a task of thousands of questions would evict the first contexts before their choices ran)."""
    firsts, others = [s for s in seqs if s.parent is None], {}
    for s in seqs:
        if s.parent is not None:
            others.setdefault(id(s.parent), []).append(s)
    order = []
    for i in range(0, len(firsts), width):
        window = firsts[i:i + width]
        order += window + [s for first in window for s in others.get(id(first), [])]
    return order
