"""Context parallel attention: one sequence split over the ranks of a cp process group.

Causal load balancing: the sequence is cut into 2*cp equal chunks and rank r holds chunks r
and 2*cp-1-r, one from the front and one from the back, so every rank has the same number of
(query, key) pairs under the causal mask. Positions (RoPE) stay global: `shard_positions`.

Two ways to attend across the split, behind `context_attention`:
- "ring": key/value blocks travel around the group; each rank merges the partial results of
  its queries by their log-sum-exp. Backward by hand (`_RingAttention`): dq stays home, dk/dv
  travel the ring back to their owners.
- "alltoall" (Ulysses): an all-to-all turns sequence shards into head shards, each rank runs
  plain SDPA over the whole sequence for its heads, and a second all-to-all turns it back.

Written by hand because torch's own `context_parallel` (DTensor) has no sharding rule for the
CPU flash kernel and its SDPA ring takes no attention mask (packed documents). This ring is one
loop on every device; only the block kernel is chosen per device (`_KERNELS`).

Training installs it from outside the plain model (`apply_context_parallel`) and gives each
rank its share of every row (`shard_rows`).
"""

from __future__ import annotations

from functools import partial
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..models.llama import Transformer, document_ids

aten = torch.ops.aten


# ---- load-balanced sharding (pure) ---------------------------------------------------------

def _chunk_order(cp: int) -> list[int]:
    """Global chunk indices in the order the ranks' shards, concatenated by rank, hold them."""
    return [c for r in range(cp) for c in (r, 2 * cp - 1 - r)]


def shard_sequence(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """Rank `rank`'s share of `x` along `dim`: chunks rank and 2*cp-1-rank of 2*cp."""
    assert x.shape[dim] % (2 * cp) == 0, (x.shape, dim, cp)
    chunks = x.chunk(2 * cp, dim)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim)


def unshard_sequence(shards: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Every rank's shard (in rank order) -> the whole sequence in its global order."""
    cp = len(shards)
    balanced = torch.cat(shards, dim).chunk(2 * cp, dim)
    where = {c: i for i, c in enumerate(_chunk_order(cp))}
    return torch.cat([balanced[where[c]] for c in range(2 * cp)], dim)


def shard_positions(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """The global positions of rank's tokens, for RoPE: rotations must not restart per shard."""
    return shard_sequence(torch.arange(seq_len, device=device), cp, rank, dim=0)


def gather_sequence(x: torch.Tensor, group: dist.ProcessGroup, dim: int = 1) -> torch.Tensor:
    """All ranks' shards of `x` -> the whole sequence on every rank (no gradient)."""
    shards = [torch.empty_like(x) for _ in range(group.size())]
    dist.all_gather(shards, x.contiguous(), group=group)
    return unshard_sequence(shards, dim)


# ---- block kernels, one pair per device --------------------------------------------------

class _Kernel(NamedTuple):
    # forward(q, k, v, causal, allowed, scale) -> (out, lse [b, h, s] fp32)
    forward: Callable
    # backward(dout, q, k, v, out, lse, causal, allowed, scale) -> (dq, dk, dv)
    backward: Callable


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # Both kernels take a float mask of q's dtype (the CPU flash kernel refuses a boolean one).
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, float("-inf"))


def _cpu_forward(q, k, v, causal, allowed, scale):
    # Takes fewer kv heads than q heads as it is (checked against SDPA with enable_gqa).
    bias = None if allowed is None else _additive(allowed, q.dtype)
    return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=bias, scale=scale)


def _cpu_backward(dout, q, k, v, out, lse, causal, allowed, scale):
    bias = None if allowed is None else _additive(allowed, q.dtype)
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, attn_mask=bias, scale=scale)


def _cuda_bias(allowed, q, k):
    # The memory-efficient kernel reads the bias with rows aligned to 16 elements and wants it
    # as [b, h, sq, sk]; SDPA's own wrapper pads and expands the same way (preprocess_mask).
    if allowed is None:
        return None
    sk = allowed.shape[-1]
    padded = torch.full((*allowed.shape[:-1], -(-sk // 16) * 16), float("-inf"), dtype=q.dtype, device=q.device)
    padded[..., :sk].masked_fill_(allowed, 0.0)
    return padded[..., :sk].expand(q.shape[0], q.shape[1], q.shape[2], sk)


def _cuda_forward(q, k, v, causal, allowed, scale):
    # Memory-efficient rather than flash: it takes fp32 and a bias (document masks), both of
    # which the ring needs; it wants as many kv heads as q heads.
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    out, lse, _, _ = aten._scaled_dot_product_efficient_attention(
        q, k, v, _cuda_bias(allowed, q, k), True, 0.0, causal, scale=scale)
    return out, lse[..., :q.shape[2]]  # its lse rows are padded to a multiple of 32


def _cuda_backward(dout, q, k, v, out, lse, causal, allowed, scale):
    hkv, rep = k.shape[1], q.shape[1] // k.shape[1]
    ke, ve = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    # The padded, dense layout it reads (torch's context_parallel saw wrong gradients from a
    # strided lse chunk); the CPU kernel reads a strided one correctly.
    lse = F.pad(lse, (0, -(-lse.shape[-1] // 32) * 32 - lse.shape[-1]))
    seed = torch.zeros((), dtype=torch.long, device=q.device)  # unused without dropout
    dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
        dout, q, ke, ve, _cuda_bias(allowed, q, ke), out, lse, seed, seed, 0.0, [True, True, True, False],
        causal, scale=scale)
    return dq, dk.unflatten(1, (hkv, rep)).sum(2), dv.unflatten(1, (hkv, rep)).sum(2)


_KERNELS = {"cpu": _Kernel(_cpu_forward, _cpu_backward), "cuda": _Kernel(_cuda_forward, _cuda_backward)}


# ---- the ring ------------------------------------------------------------------------------

def _global_chunk(rank: int, local: int, cp: int) -> int:
    return rank if local == 0 else 2 * cp - 1 - rank


def _blocks(rank: int, src: int, cp: int) -> list[tuple[int, int, bool]]:
    """(local query chunk, local key chunk of `src`, diagonal?) for every block a causal mask
    leaves any pair in: a query chunk sees earlier chunks whole, its own chunk causally, and
    later chunks not at all. Diagonal blocks first: their every row attends at least to
    itself, so the running log-sum-exp a query chunk starts from is finite."""
    blocks = []
    for qi in (0, 1):
        for kj in (0, 1):
            gq, gk = _global_chunk(rank, qi, cp), _global_chunk(src, kj, cp)
            if gq >= gk:
                blocks.append((qi, kj, gq == gk))
    return sorted(blocks, key=lambda blk: not blk[2])


def _allowed(docs, window, rank, qi, src, kj, cp, c, diagonal, device):
    """[b or 1, 1, c, c] boolean mask of a block under packed documents and a sliding window
    (keys fewer than `window` positions back); None where neither cuts into the block (the
    diagonal then takes the kernel's own causal mask)."""
    gq, gk = _global_chunk(rank, qi, cp), _global_chunk(src, kj, cp)
    near = None
    if window is not None:
        offsets = torch.arange(c, device=device)
        near = ((gq - gk) * c + offsets[:, None] - offsets[None, :]) < window
        near = None if bool(near.all()) else near
    if docs is None and near is None:
        return None
    allowed = torch.ones(c, c, dtype=torch.bool, device=device) if docs is None else \
        docs[:, gq * c:(gq + 1) * c, None] == docs[:, None, gk * c:(gk + 1) * c]
    if diagonal:
        allowed = allowed & torch.ones(c, c, dtype=torch.bool, device=device).tril()
    if near is not None:
        allowed = allowed & near
    return allowed[:, None] if allowed.dim() == 3 else allowed[None, None]


def _block_forward(kernel, q, k, v, diagonal, allowed, scale):
    out, lse = kernel.forward(q, k, v, diagonal and allowed is None, allowed, scale)
    out, lse = out.float(), lse.float()
    if allowed is not None:
        # A row the mask empties (a query whose document starts after this key chunk) comes
        # back from the CPU kernel as out 0, lse 0; its lse must be -inf or the merge weighs
        # that zero row as if it held real keys.
        alive = allowed.any(-1)  # [b, 1, c]
        lse = lse.masked_fill(~alive, float("-inf"))
        out = out.masked_fill(~alive[..., None], 0.0)
    return out, lse


def _merge(acc, out, lse):
    """Fold one block's (out, lse) into a query chunk's running result, in fp32. The sigmoid
    form (ring-flash-attention, as torch's context_parallel uses) needs no max subtraction and
    keeps a block row at lse -inf from changing anything."""
    if acc is None:
        return out, lse
    acc_out, acc_lse = acc
    acc_out = acc_out - torch.sigmoid(lse - acc_lse)[..., None] * (acc_out - out)
    acc_lse = acc_lse - F.logsigmoid(acc_lse - lse)
    return acc_out, acc_lse


class _Shift:
    """`x` sent to the next rank of the ring while the previous rank's arrives."""

    def __init__(self, x: torch.Tensor, group: dist.ProcessGroup, tag: int):
        cp, rank = group.size(), group.rank()
        self.buffer = torch.empty_like(x)
        # Distinct tags keep the kv and dk/dv messages apart on gloo, where both can be in flight
        # between the same two ranks at once; NCCL keeps them apart by their order.
        self.works = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, x, dist.get_global_rank(group, (rank + 1) % cp), group, tag),
            dist.P2POp(dist.irecv, self.buffer, dist.get_global_rank(group, (rank - 1) % cp), group, tag),
        ])

    def wait(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        return self.buffer


def _ring_forward(q, k, v, group, scale, docs, window):
    kernel, cp, rank = _KERNELS[q.device.type], group.size(), group.rank()
    c = q.shape[2] // 2
    queries = q.chunk(2, 2)
    acc = [None, None]
    kv = torch.stack([k, v])
    for step in range(cp):
        src = (rank - step) % cp
        incoming = _Shift(kv, group, tag=0) if step + 1 < cp else None  # overlaps the blocks below
        keys, values = kv[0].chunk(2, 2), kv[1].chunk(2, 2)
        for qi, kj, diagonal in _blocks(rank, src, cp):
            allowed = _allowed(docs, window, rank, qi, src, kj, cp, c, diagonal, q.device)
            if allowed is not None and not bool(allowed.any()):
                continue  # a block wholly outside the window
            out, lse = _block_forward(kernel, queries[qi], keys[kj], values[kj], diagonal, allowed, scale)
            acc[qi] = _merge(acc[qi], out, lse)
        if incoming is not None:
            kv = incoming.wait()
    out = torch.cat([acc[0][0], acc[1][0]], 2).to(q.dtype)
    return out, torch.cat([acc[0][1], acc[1][1]], 2)


def _ring_backward(dout, q, k, v, out, lse, group, scale, docs, window):
    """Each block's gradients from the merged out and lse (softmax over all keys) are exactly
    its share of the whole: dq sums over blocks here; dk/dv of each kv shard accumulate in fp32
    on a buffer that follows the shard round the ring and arrives home after the last step."""
    kernel, cp, rank = _KERNELS[q.device.type], group.size(), group.rank()
    c = q.shape[2] // 2
    parts = [t.chunk(2, 2) for t in (dout, q, out, lse)]
    dq = torch.zeros_like(q, dtype=torch.float32)
    kv, travelling = torch.stack([k, v]), None
    for step in range(cp):
        src = (rank - step) % cp
        incoming = _Shift(kv, group, tag=0) if step + 1 < cp else None
        dkv = torch.zeros_like(kv, dtype=torch.float32)
        for qi, kj, diagonal in _blocks(rank, src, cp):
            allowed = _allowed(docs, window, rank, qi, src, kj, cp, c, diagonal, q.device)
            if allowed is not None and not bool(allowed.any()):
                continue
            rows, keys = slice(qi * c, (qi + 1) * c), slice(kj * c, (kj + 1) * c)
            g_out, g_q, g_o, g_lse = (p[qi] for p in parts)
            gq, gk, gv = kernel.backward(g_out, g_q, kv[0, :, :, keys], kv[1, :, :, keys], g_o, g_lse,
                                         diagonal and allowed is None, allowed, scale)
            dq[:, :, rows] += gq
            dkv[0, :, :, keys] += gk
            dkv[1, :, :, keys] += gv
        if travelling is not None:
            dkv += travelling.wait()  # what the ranks before added to this shard's gradients
        travelling = _Shift(dkv, group, tag=1) if cp > 1 else None
        if incoming is not None:
            kv = incoming.wait()
    dkv = travelling.wait() if cp > 1 else dkv
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, scale, docs, window):
        out, lse = _ring_forward(q, k, v, group, scale, docs, window)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.scale, ctx.docs, ctx.window = group, scale, docs, window
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(dout.contiguous(), q, k, v, out, lse, ctx.group, ctx.scale, ctx.docs,
                                    ctx.window)
        return dq, dk, dv, None, None, None, None


# ---- all-to-all (Ulysses) ------------------------------------------------------------------

class _AllToAll(torch.autograd.Function):
    """x [cp, ...]: row i goes to rank i, row i of the result came from rank i. Exchanging
    rows is its own transpose, so the backward is the same exchange of the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _AllToAll.apply(grad, ctx.group), None


def _seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[b, h, s/cp, d] load-balanced shard -> [b, h/cp, s, d], all positions in global order."""
    cp = group.size()
    b, h, s, d = x.shape
    send = x.reshape(b, cp, h // cp, s, d).transpose(0, 1)
    shards = _AllToAll.apply(send, group)  # [cp (source rank), b, h/cp, s, d]
    return unshard_sequence(list(shards.unbind(0)), dim=2)


def _heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    cp = group.size()
    send = torch.stack([shard_sequence(x, cp, r, dim=2) for r in range(cp)])
    shards = _AllToAll.apply(send, group)  # [cp (head group), b, h/cp, s/cp, d]
    return torch.cat(list(shards.unbind(0)), 1)


def _alltoall_attention(q, k, v, group, scale, docs, window):
    cp = group.size()
    assert q.shape[1] % cp == 0, f"alltoall needs heads ({q.shape[1]}) divisible by cp ({cp})"
    if k.shape[1] % cp:
        # Too few kv heads to split: each rank needs the kv heads its q heads read, so widen
        # them to one per q head (autograd sums the copies' gradients back).
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    q, k, v = (_seq_to_heads(t, group) for t in (q, k, v))
    mask, s = None, q.shape[2]
    if docs is not None or (window is not None and window < s):
        at = torch.arange(s, device=q.device)
        mask = at[:, None] >= at[None, :]
        if window is not None:
            mask = mask & (at[:, None] - at[None, :] < window)
        mask = (mask & (docs[:, :, None] == docs[:, None, :]))[:, None] if docs is not None else mask
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return _heads_to_seq(out, group)


# ---- the entry point -----------------------------------------------------------------------

def context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup,
                      mode: str = "ring", scale: float | None = None,
                      doc_ids: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
    """Causal attention of this rank's load-balanced shard of the sequence, in place of SDPA.

    q [b, h, s_local, d], k and v [b, h_kv, s_local, d] (h a multiple of h_kv), each holding
    chunks rank and 2*cp-1-rank of the sequence (`shard_sequence`); returns this rank's rows
    of the output, [b, h, s_local, d]. doc_ids [b, s_local], sharded the same way: a query
    attends only to earlier keys of its own document (packed rows). `window`: only to keys
    fewer than this many positions back (a sliding-window layer)."""
    assert q.shape[2] % 2 == 0 and q.shape[1] % k.shape[1] == 0, (q.shape, k.shape)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    docs = None if doc_ids is None else gather_sequence(doc_ids, group, dim=1)
    if mode == "ring":
        assert q.device.type in _KERNELS, f"no ring attention kernel for {q.device.type}"
        return _RingAttention.apply(q, k, v, group, scale, docs, window)
    assert mode == "alltoall", f"unknown context parallel mode {mode!r}"
    return _alltoall_attention(q, k, v, group, scale, docs, window)


# ---- training -------------------------------------------------------------------------------

def apply_context_parallel(model: Transformer, group: dist.ProcessGroup, mode: str) -> None:
    """Every layer of `model` attends across the cp ranks' shares of the sequence (in place,
    before activation checkpointing and data-parallel wrapping, which keep the attribute)."""
    for block in model.layers.values():
        attention = block.attention
        attention.context = partial(context_attention, group=group, mode=mode, scale=attention.scale,
                                    window=attention.window)
    model.sequence_sharded = True


def shard_rows(inputs: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor | None,
               group: dist.ProcessGroup) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(inputs, targets, positions, doc_ids) of this rank's share of every row [b, s]: its two
    chunks of the tokens and targets, their global positions (RoPE must not restart at a
    shard) and, for packed rows (`positions` restart at each document), the document of each
    token, numbered over the whole row before it is cut: a shard alone cannot tell."""
    cp, rank = group.size(), group.rank()
    doc_ids = None
    if positions is None:
        positions = shard_positions(inputs.shape[1], cp, rank, inputs.device).expand(inputs.shape[0], -1)
    else:
        doc_ids = shard_sequence(document_ids(positions), cp, rank)
        positions = shard_sequence(positions, cp, rank)
    return shard_sequence(inputs, cp, rank), shard_sequence(targets, cp, rank), positions, doc_ids
