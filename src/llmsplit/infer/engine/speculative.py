"""Speculative decoding: several tokens proposed cheaply, then checked by the model in one
forward, so that a decode step can produce more than one token for one read of the weights
(batch-1 decode is bound by that read). The engine feeds a sequence's newest token and its k
proposals as k + 1 one-token rows over the paged cache (block_manager.BlockPool.rows), so row
i of the logits is, bit for bit, what a decode step gives after the sequence plus the first i
proposals (engine.Engine._verify).

Proposals come from prompt lookup (`ngram`, as vLLM's `method: "ngram"` and llama.cpp's
`--spec-type ngram-simple`): the last n tokens of the sequence (n from NGRAM_MAX down to
NGRAM_MIN) are looked for earlier in its prompt and output, and the tokens that followed
their latest occurrence are proposed. No second model; it pays off when the output quotes its
input (editing code, answering from a document, summaries that quote). Or from a draft model
(`--speculative PATH`, as llama.cpp's `-md` and vLLM's draft models): a smaller model with the
same tokenizer continues each context greedily for k tokens, run by an engine of its own over
its own paged KV cache (`DraftProposals`); it pays off on open-ended text too, as far as the
draft agrees with the model.

Acceptance keeps the output exactly the model's own: each row samples its token as a decode
step would (argmax, or a draw from the sequence's own generator, after its processors and
grammar), and the walk goes on while the token equals the proposal. A sampled row thus takes a
proposal with probability p(proposal), as the rejection rule of Leviathan et al. 2023 / Chen
et al. 2023 does for a proposal drawn from a point mass, and draws the same random numbers in
the same order as decoding without speculation: a seeded request gives the same text with it
or without it, whatever it is batched with. A draft proposes its argmax, a point mass too, so
the same rule holds for it. (Drawing the draft's tokens from its own distribution and taking
them by the rule's ratio with a residual draw accepts more at high temperatures, but the
random numbers then depend on the proposals: a seeded request would no longer repeat its
text with and without speculation. Not done.)
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

from .sequence import SamplingParams

NGRAM_MIN, NGRAM_MAX = 2, 4  # lengths of the suffix looked up, longest first
# Speculation runs while at most this many sequences decode at once: with more, a step's
# forward already reads the weights for many tokens (no longer bandwidth-bound) and the
# proposals' rows would cost more than they save (vLLM turns it off by batch size likewise).
SPECULATE_UP_TO = 4
# A proposer that is rarely right costs more than it saves (a draft's k steps and the verifying
# rows buy nothing): when fewer than MIN_ACCEPTANCE of the last WINDOW proposals were taken,
# speculation rests for a number of steps, doubled each time it is still poor on return (up to
# MAX_REST), so that a poor draft costs little (a 15.7M draft distilled too briefly for
# SmolLM2-135M took 5%: 0.29x the decode speed without the rest) and a good phase resumes it.
WINDOW, MIN_ACCEPTANCE, FIRST_REST, MAX_REST = 64, 0.15, 16, 1024


@dataclass
class Speculation:
    """What the engine speculates with (InferConfig checks the values), and what it has done
    (for /metrics and --verbose)."""
    method: str = "ngram"  # or "draft <path>"
    tokens: int = 4  # proposals per sequence and step (k)
    draft: DraftProposals | None = None  # with a draft model
    proposed: int = 0  # proposals verified since start
    accepted: int = 0  # of them, taken as the model's own
    verify_steps: int = 0  # sequence-steps that verified proposals
    emitted: int = 0  # tokens those steps produced (accepted + one from the model each)
    rests: int = 0  # times speculation paused for poor acceptance
    _recent: tuple[int, int] = (0, 0)  # (proposed, accepted) since the window started
    _resting: int = 0  # steps left to rest
    _next_rest: int = FIRST_REST

    def resting(self) -> bool:
        """Whether this step goes without speculation (one step of a rest spent)."""
        if self._resting:
            self._resting -= 1
            return True
        return False

    def propose(self, wants: list[tuple[list[int], int]]) -> list[list[int]]:
        """For each (context, room): up to min(k, room) tokens that may follow the context."""
        if self.draft is not None:
            return self.draft.propose([(context, min(self.tokens, room)) for context, room in wants])
        return [ngram_proposal(context, min(self.tokens, room)) for context, room in wants]

    def count(self, proposed: int, accepted: int, emitted: int) -> None:
        self.proposed += proposed
        self.accepted += accepted
        self.verify_steps += 1
        self.emitted += emitted
        recent = (self._recent[0] + proposed, self._recent[1] + accepted)
        if recent[0] < WINDOW:
            self._recent = recent
            return
        self._recent = (0, 0)
        if recent[1] < MIN_ACCEPTANCE * recent[0]:
            self._resting, self.rests = self._next_rest, self.rests + 1
            self._next_rest = min(2 * self._next_rest, MAX_REST)
        else:
            self._next_rest = FIRST_REST

    def stats(self) -> dict:
        return {"speculative_proposed_tokens": self.proposed, "speculative_accepted_tokens": self.accepted,
                "speculative_verify_steps": self.verify_steps, "speculative_emitted_tokens": self.emitted}

    def summary(self) -> str:
        """One line for `generate --verbose` and serve's log."""
        if not self.verify_steps:
            return f"speculative {self.method}: nothing proposed"
        rate = self.accepted / max(1, self.proposed)
        rested = f", rested {self.rests} times for poor acceptance" if self.rests else ""
        return (f"speculative {self.method}: {self.accepted}/{self.proposed} proposals accepted ({rate:.0%}), "
                f"{self.emitted / self.verify_steps:.2f} tokens per verifying step{rested}")


class DraftProposals:
    """A draft model's proposals: its greedy continuation of each context, computed by an
    engine of its own (the draft's `LoadedModel.engine`, its own paged KV pool) for all the
    sequences that speculate at once. Each step's contexts start as the last step's did plus
    the tokens the model took: the draft's sequences leave their blocks committed to its prefix
    cache as they end (Scheduler.release), so a step recomputes only the part block past them
    and the new tokens, then decodes k - 1 more."""

    def __init__(self, loaded):
        self.loaded = loaded  # kept: closing it frees the draft's runner
        self.engine = loaded.engine

    def propose(self, wants: list[tuple[list[int], int]]) -> list[list[int]]:
        engine, seqs, order = self.engine, [], []
        for i, (context, k) in enumerate(wants):
            # Past the draft's own context (a draft may hold fewer positions), nothing is proposed.
            if k > 0 and len(context) + k <= engine.max_context:
                # seed 0: a seed per sequence would read the OS's entropy, and greedy draws nothing
                seqs.append(engine.new_sequence(context, SamplingParams(k, seed=0, ignore_eos=True)))
                order.append(i)
        proposals = [[] for _ in wants]
        for i, seq in zip(order, engine.generate(seqs)):
            proposals[i] = seq.tokens
        return proposals


def ngram_proposal(context: list[int], k: int) -> list[int]:
    """The k tokens (or fewer) that followed the latest earlier occurrence of the context's
    last n tokens, n from NGRAM_MAX down to NGRAM_MIN; [] when none occurs. Searched as bytes
    (`bytes.rfind`, in C: a Python loop over a long context would cost a millisecond a step)."""
    if k < 1 or len(context) <= NGRAM_MIN:
        return []
    tokens = array("i", context)
    data, width = tokens.tobytes(), tokens.itemsize
    for n in range(min(NGRAM_MAX, len(context) - 1), NGRAM_MIN - 1, -1):
        suffix = data[-n * width:]
        end = len(data) - width  # the match must end before the context's last token
        while True:
            at = data.rfind(suffix, 0, end)
            if at < 0 or at % width == 0:
                break
            end = at + len(suffix) - 1  # a hit across token boundaries: look further back
        if at >= 0:
            follow = at // width + n
            return context[follow:follow + k]
    return []
