"""`python -m benchmarks.doc_attention`: attention over packed documents on this CPU, one
way against the other: SDPA with a boolean block-diagonal (document x causal) mask, and
FlexAttention with a document BlockMask, eager and compiled; SDPA causal over the same rows,
unpacked, as the floor. Median of 7 after 2 warm-ups, per call. FlexAttention has no backward
on CPU in torch 2.13 ("FlexAttention does not support backward on CPU"), so it cannot train
here at all; its forward is timed against SDPA's forward, and SDPA's forward + backward is
what training pays.

This is the measurement behind models/llama.py's choice of SDPA with a mask for packed rows."""

import statistics
import sys
import time

import torch
import torch.nn.functional as F


def documents(b: int, s: int, n_docs: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    doc = torch.zeros(b, s, dtype=torch.long)
    for r in range(b):
        cuts = torch.randperm(s - 1, generator=g)[:n_docs - 1].sort().values + 1
        doc[r, cuts] = 1
    return doc.cumsum(1)


def timed(fn, q, k, v, backward: bool = True) -> float:
    times = []
    for i in range(9):
        qq, kk, vv = (t.detach().requires_grad_(backward) for t in (q, k, v))
        t0 = time.perf_counter()
        out = fn(qq, kk, vv)
        if backward:
            out.sum().backward()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch.manual_seed(0)
    compiled_flex = torch.compile(flex_attention)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| b x heads x s x head_dim, documents per row | fwd+bwd: SDPA causal (no packing) | SDPA + mask | "
          "forward: SDPA + mask | flex eager | flex compiled | mask build: bool / BlockMask |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for b, h, s, d, n_docs in ((8, 8, 256, 32, 4), (4, 8, 1024, 64, 8), (1, 16, 2048, 64, 16)):
        q, k, v = (torch.randn(b, h, s, d) for _ in range(3))
        doc = documents(b, s, n_docs)
        t0 = time.perf_counter()
        dense = ((doc[:, :, None] == doc[:, None, :]) & torch.ones(s, s, dtype=torch.bool).tril())[:, None]
        t_dense = time.perf_counter() - t0

        def mask_mod(bi, hi, qi, ki):
            return (doc[bi, qi] == doc[bi, ki]) & (qi >= ki)

        t0 = time.perf_counter()
        block = create_block_mask(mask_mod, b, None, s, s, device="cpu")
        t_block = time.perf_counter() - t0
        results = [timed(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), q, k, v),
                   timed(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=dense), q, k, v),
                   timed(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=dense), q, k, v, False),
                   timed(lambda q, k, v: flex_attention(q, k, v, block_mask=block), q, k, v, False),
                   timed(lambda q, k, v: compiled_flex(q, k, v, block_mask=block), q, k, v, False)]
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=dense)
        err = (compiled_flex(q, k, v, block_mask=block) - ref).abs().max().item()
        cells = " | ".join(f"{t * 1e3:.1f} ms" for t in results)
        print(f"| {b}x{h}x{s}x{d}, {n_docs} | {cells} | {t_dense * 1e3:.2f} / {t_block * 1e3:.1f} ms |"
              f"  (flex vs SDPA max diff {err:.1e})")


if __name__ == "__main__":
    main(sys.argv[1:])
