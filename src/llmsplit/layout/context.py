"""The rules of context parallel (`parallel.cp`, parallel/context_parallel.py): each sequence is
cut into 2 × cp equal chunks, rank r of the cp group holding chunks r and 2·cp−1−r, and
attention crosses the shards as a ring or by all-to-all over the heads.

Pipeline stages combine with it: each cp rank of a stage sends its share of every micro-batch
to the same cp rank of the next, and every stage gets the share's global positions and
documents with its micro-batch (`ParallelModel.pipeline_step`). Mixture-of-experts layers and
expert parallel do too: routing is per token, the experts' token counts sum the ranks' disjoint
shares (a balancing loss, train.moe_aux_loss, is each rank's over its tokens, as under data
parallel), and an expert's replicas include the cp ranks (mesh.py's "expert_dp"). Sliding
windows are masks over global positions, per block of the ring. What cp does not combine with
yet is refused here by name rather than left to fail inside a collective: Gemma 2's capped
scores, which the ring's kernels do not apply; and the training runs whose rows it would cut
(DPO's pairs, GRPO's completions, a teacher's inputs) or compile (train.compile).
"""

from __future__ import annotations

from ..errors import ConfigError
from ..models.llama import LlamaConfig
from .spec import Layout, Workload


def check_context_parallel(model: LlamaConfig | None, layout: Layout, work: Workload | None) -> None:
    cp = layout.cp
    if cp == 1:
        return
    said = f"parallel.cp={cp}"
    if work is not None and work.mode == "infer":
        raise ConfigError(f"{said} splits training sequences; inference does not split a prompt over ranks yet "
                          f"(leave parallel.cp at 1 with --mode infer)")
    if work is not None:
        _check_training(work, said)
    if model is not None:
        _check_model(model, layout, said)
    if work is not None and work.seq_len % (2 * cp):
        fits = [d for d in range(1, work.seq_len // 2 + 1) if work.seq_len % (2 * d) == 0][:12]
        raise ConfigError(f"data.seq_len={work.seq_len} is not divisible by 2 × {said} = {2 * cp}: context parallel "
                          f"cuts each sequence into 2 × cp equal chunks, one from the front and one from the back "
                          f"for each rank; use a data.seq_len that is a multiple of {2 * cp} or parallel.cp in "
                          f"{', '.join(map(str, fits))}")


def _check_training(work: Workload, said: str) -> None:
    """The training runs cp does not split yet (here, so that `--auto`'s search leaves cp out
    for them rather than propose a layout that validation then refuses)."""
    if work.rows_per_sample > 1:  # DPO: a pair's log-probability sums over its whole reply, which cp would cut
        raise ConfigError(f"train.objective=\"dpo\" does not combine with {said} yet; set parallel.cp=1")
    if work.rollout_rows:
        raise ConfigError(f"train.objective=\"grpo\" with {said} is not built yet (issue 47); set parallel.cp=1")
    if work.teacher_params:
        raise ConfigError(f"train.teacher with {said} is not built yet (the teacher sees whole rows); set "
                          f"parallel.cp=1")
    if work.compile:
        raise ConfigError(f"train.compile=true does not combine with {said} yet (the ring's communication inside "
                          f"each block); set train.compile=false or parallel.cp=1")


def _check_model(model: LlamaConfig, layout: Layout, said: str) -> None:
    if model.attn_softcap is not None:
        raise ConfigError(f"{said} does not combine with model.attn_softcap={model.attn_softcap} yet (the "
                          f"context-parallel attention's kernels take no cap on the scores); set parallel.cp=1")
    if layout.cp_mode != "alltoall" or model.n_heads % layout.tp:
        return  # (heads that tp does not divide are refused by the tensor-parallel rule)
    heads = model.n_heads // layout.tp
    if heads % layout.cp:
        per = f" ({heads} per tensor-parallel rank)" if layout.tp > 1 else ""
        fits = [d for d in range(1, heads + 1) if heads % d == 0]
        raise ConfigError(f"parallel.cp_mode=\"alltoall\" gives each of the {said} ranks a share of the attention "
                          f"heads, and model.n_heads={model.n_heads}{per} does not divide by {layout.cp}; use "
                          f"parallel.cp in {', '.join(map(str, fits))} or parallel.cp_mode=\"ring\"")
