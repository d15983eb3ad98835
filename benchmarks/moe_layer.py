"""`python -m benchmarks.moe_layer`: one mixture-of-experts layer, forward + backward, on this
CPU in one process: llmsplit's MoE (tokens sorted by expert, F.grouped_mm over each expert's
rows) against transformers' MixtralSparseMoeBlock holding the same weights, with its "eager"
experts (a loop over the experts that got tokens) and, where it runs, its own "grouped_mm"
experts; same shapes and the same tokens.
Outputs are checked equal first; then the median of 7 timed calls after 2 warm-ups, as tokens/s.

The peer runs on whatever transformers is installed (not a test dependency); the sizes are
Mixtral's shape scaled down to fit a 2-core machine."""

import statistics
import sys
import time

import torch


def layers(dim: int, ffn: int, experts: int, k: int, implementation: str):
    import transformers

    from llmsplit.models.llama import LlamaConfig
    from llmsplit.models.moe import MoE

    hf_cfg = transformers.MixtralConfig(hidden_size=dim, intermediate_size=ffn, num_local_experts=experts,
                                        num_experts_per_tok=k)
    hf_cfg._experts_implementation = implementation
    torch.manual_seed(0)
    peer = transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock(hf_cfg).float()
    with torch.no_grad():  # the block alone is not initialised by a PreTrainedModel
        for p in peer.parameters():
            p.normal_(0.0, 0.05)
    ours = MoE(LlamaConfig(dim=dim, n_heads=8, ffn_dim=ffn, n_experts=experts, experts_per_token=k))
    state = peer.state_dict()
    with torch.no_grad():
        ours.router.weight.copy_(state["gate.weight"])
        if "experts.gate_up_proj" in state:  # transformers 5: experts fused as [E, 2 ffn, dim]
            gate, up = state["experts.gate_up_proj"].chunk(2, dim=1)
            down = state["experts.down_proj"]
        else:
            gate = torch.stack([state[f"experts.{e}.w1.weight"] for e in range(experts)])
            up = torch.stack([state[f"experts.{e}.w3.weight"] for e in range(experts)])
            down = torch.stack([state[f"experts.{e}.w2.weight"] for e in range(experts)])
        for p, w in ((ours.w1, gate), (ours.w3, up), (ours.w2, down)):
            p.copy_(w.reshape(p.shape))
    return ours, peer


def timed(fn, x: torch.Tensor) -> float:
    times = []
    for i in range(9):
        xi = x.detach().requires_grad_()
        t0 = time.perf_counter()
        out = fn(xi)
        out = out[0] if isinstance(out, tuple) else out
        out.float().pow(2).mean().backward()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str]) -> int:
    quick = "--quick" in argv
    dim, ffn, experts, k, tokens = (128, 256, 8, 2, 512) if quick else (512, 1792, 8, 2, 4096)
    x = torch.randn(1, tokens, dim)
    rows = []
    for implementation in ("eager", "grouped_mm"):
        ours, peer = layers(dim, ffn, experts, k, implementation)
        with torch.no_grad():
            want = peer(x)
            want = want[0] if isinstance(want, tuple) else want
            torch.testing.assert_close(ours(x), want, atol=1e-4, rtol=1e-4)
        if not rows:
            rows.append(("llmsplit MoE (F.grouped_mm)", timed(ours, x)))
        rows.append((f"transformers MixtralSparseMoeBlock, experts {implementation!r}", timed(peer, x)))
    print(f"MoE layer, {experts} experts top-{k}, dim {dim}, ffn {ffn}, {tokens} tokens, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    print("| implementation | forward + backward (s) | tokens/s | peer time / ours |\n|---|---|---|---|")
    for name, t in rows:
        print(f"| {name} | {t:.4f} | {tokens / t:,.0f} | {t / rows[0][1]:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
