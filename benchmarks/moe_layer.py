"""`python -m benchmarks.moe_layer`: one mixture-of-experts layer, forward + backward, on this
CPU in one process: llmsplit's MoE (tokens sorted by expert, F.grouped_mm over each expert's
rows) against transformers' MixtralSparseMoeBlock holding the same weights, with its "eager"
experts (a loop over the experts that got tokens) and, where it runs, its own "grouped_mm"
experts; same shapes and the same tokens.
Outputs are checked equal first; then the median of 7 timed calls after 2 warm-ups, as tokens/s.

`--ep 2` adds the issue's comparison: the same layer under expert parallel on 2 gloo workers of
one thread each (parallel/expert_parallel.py: each worker routes half the tokens and holds half
the experts; rows go to their expert's worker and back by all-to-all; the router's gradient is
averaged as data parallel would), against transformers' per-expert loop in this one process on
every core. The two alternate, round by round (the workers wait, idle, while the peer runs), and
the medians over the rounds are compared.

The peer runs on whatever transformers is installed (not a test dependency); the sizes are
Mixtral's shape scaled down to fit a 2-core machine."""

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


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


def _ep_worker(rank: int, world: int, port: int, shape: tuple, x: torch.Tensor, want: torch.Tensor, go, done):
    """One expert-parallel worker: its half of the tokens through the layer, timed on command."""
    from torch.distributed.device_mesh import init_device_mesh

    from llmsplit.parallel.expert_parallel import apply_ep

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    ours, _ = layers(*shape, "eager")
    apply_ep(ours, init_device_mesh("cpu", (world,), mesh_dim_names=("ep",)))
    mine = x.chunk(world, dim=1)[rank]

    def step(xi):
        out = ours(xi)
        out.float().pow(2).mean().backward()
        dist.all_reduce(ours.router.weight.grad)  # data parallel's share of the layer: the router
        return out

    with torch.no_grad():
        torch.testing.assert_close(ours(mine), want.chunk(world, dim=1)[rank], atol=1e-4, rtol=1e-4)
    while go.get():
        times = []
        for i in range(9):
            xi = mine.detach().requires_grad_()
            dist.barrier()
            t0 = time.perf_counter()
            step(xi)
            dist.barrier()  # the step ends when the slower worker is done
            if i >= 2:
                times.append(time.perf_counter() - t0)
        if rank == 0:
            done.put(statistics.median(times))
    dist.destroy_process_group()


def expert_parallel_rounds(shape: tuple, x: torch.Tensor, world: int, rounds: int) -> list[tuple[float, float]]:
    """(ours on `world` workers, transformers' eager loop here) median times, per round, alternating."""
    from llmsplit.launch import free_port

    _, peer = layers(*shape, "eager")
    with torch.no_grad():
        want = peer(x)
        want = want[0] if isinstance(want, tuple) else want
    ctx = mp.get_context("spawn")
    go, done = [ctx.Queue() for _ in range(world)], ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_ep_worker, args=(r, world, port, shape, x, want, go[r], done)) for r in range(world)]
    for p in procs:
        p.start()
    out = []
    for _ in range(rounds):
        for q in go:
            q.put(True)
        ours_s = done.get()
        out.append((ours_s, timed(peer, x)))
        print(f"round {len(out)}: ours {out[-1][0]:.4f} s, transformers {out[-1][1]:.4f} s", file=sys.stderr, flush=True)
    for q in go:
        q.put(False)
    for p in procs:
        p.join()
    return out


def main(argv: list[str]) -> int:
    quick = "--quick" in argv
    dim, ffn, experts, k, tokens = (128, 256, 8, 2, 512) if quick else (512, 1792, 8, 2, 4096)
    x = torch.randn(1, tokens, dim)
    if "--ep" in argv:
        world = int(argv[argv.index("--ep") + 1])
        rounds = expert_parallel_rounds((dim, ffn, experts, k), x, world, 3)
        ours_s = statistics.median(r[0] for r in rounds)
        peer_s = statistics.median(r[1] for r in rounds)
        print(f"MoE layer, {experts} experts top-{k}, dim {dim}, ffn {ffn}, {tokens} tokens, torch {torch.__version__}, "
              f"load average {' '.join(open('/proc/loadavg').read().split()[:3])}")
        print("| round | llmsplit ep=%d, %d workers x 1 thread (s) | transformers eager, 1 process x %d threads (s) |"
              % (world, world, torch.get_num_threads()) + "\n|---|---|---|")
        for i, (a, b) in enumerate(rounds, 1):
            print(f"| {i} | {a:.4f} | {b:.4f} |")
        print(f"median: llmsplit {tokens / ours_s:,.0f} tokens/s, transformers {tokens / peer_s:,.0f} tokens/s, "
              f"ratio {peer_s / ours_s:.2f}x")
        return 0
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
