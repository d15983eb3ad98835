"""Memory savers in one process (no workers): NVMe-offloaded AdamW, activation
checkpointing policies, and the config checks that guard them."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from llmsplit.config import ConfigError, config_from_dict, validate
from llmsplit.models.llama import LlamaConfig, Transformer
from llmsplit.parallel.memory import NvmeAdamW, apply_activation_checkpointing

TINY = LlamaConfig(dim=64, n_layers=2, n_heads=4, vocab_size=64, ffn_dim=128, max_seq_len=16)
# On a read fault Linux also maps neighbouring pages that sit in its page cache
# ("fault-around", 64 KiB by default), so a released group can show up again as resident.
FAULT_AROUND = 64 << 10


def _model(seed: int = 0) -> Transformer:
    model = Transformer(TINY)
    model.init_weights(seed)
    return model


def _groups(model):
    return [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]


def _train(model, optimizer, steps: int = 3, lrs=(1e-2, 5e-3, 2e-3)):
    tokens = torch.randint(0, TINY.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = lrs[step % len(lrs)]
        model(tokens[:, :-1]).float().logsumexp(-1).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _resident_kib(path) -> int:
    """Resident size of this process's mapping of `path` (from /proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if len(head) >= 5 and "-" in head[0] and ":" in head[3]:  # a mapping's header line
                inside = line.rstrip().endswith(str(path))
            elif inside and line.startswith("Rss:"):
                total += int(head[1])
    return total


def test_nvme_adamw_matches_adamw_and_keeps_state_off_memory(tmp_path):
    ref, off = _model(), _model()
    ref_opt = torch.optim.AdamW(_groups(ref), lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    # A small group size forces the step to stream through several groups.
    group_bytes = 16 << 10
    nvme = NvmeAdamW(_groups(off), tmp_path, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, group_bytes=group_bytes)
    assert len(nvme._groups) > 3
    _train(ref, ref_opt)
    _train(off, nvme)
    state_bytes = sum(t.numel() * t.element_size() for t in nvme.offloaded_tensors())
    assert state_bytes == sum(2 * 4 * p.numel() for p in off.parameters())
    # Checked before anything below reads the moments back in.
    resident = _resident_kib(nvme.path) * 1024
    assert resident <= 2 * group_bytes + FAULT_AROUND < state_bytes / 4, (resident, state_bytes)
    for (name, a), b in zip(ref.named_parameters(), off.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    for a, b in zip(ref.parameters(), off.parameters()):
        torch.testing.assert_close(ref_opt.state[a]["exp_avg_sq"], nvme.state[b]["exp_avg_sq"], rtol=0, atol=0)
    assert nvme.path.stat().st_size >= state_bytes
    assert _resident_kib(nvme.path) * 1024 >= state_bytes / 2  # reading them back pages them in
    nvme.close()
    assert not nvme.path.exists()


def test_nvme_state_round_trips_through_plain_adamw(tmp_path):
    ref = _model()
    ref_opt = torch.optim.AdamW(_groups(ref), lr=1e-2, betas=(0.9, 0.95))
    _train(ref, ref_opt, steps=2)
    off = copy.deepcopy(ref)
    nvme = NvmeAdamW(_groups(off), tmp_path, lr=1e-2, betas=(0.9, 0.95))
    # load_state_dict maps by position: map ref's state onto the copy's parameters.
    nvme.load_state_dict(ref_opt.state_dict())
    assert _resident_kib(nvme.path) * 1024 <= FAULT_AROUND
    _train(ref, ref_opt, steps=2)
    _train(off, nvme, steps=2)
    for a, b in zip(ref.parameters(), off.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    back = torch.optim.AdamW(_groups(copy.deepcopy(off)), lr=1e-2)
    back.load_state_dict(nvme.state_dict())  # same group keys as AdamW
    assert back.param_groups[0]["betas"] == (0.9, 0.95)
    nvme.close()


def test_nvme_file_is_not_shared_by_two_live_optimizers(tmp_path):
    model = _model()
    first = NvmeAdamW(_groups(model), tmp_path, lr=1e-3)
    _train(model, first, steps=1)
    before = [t.clone() for t in first.offloaded_tensors()]
    with pytest.raises(RuntimeError, match="in use by another run"):
        NvmeAdamW(_groups(_model()), tmp_path, lr=1e-3)
    for a, b in zip(before, first.offloaded_tensors()):  # the refused one touched nothing
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    _train(model, first, steps=1)
    first.close()
    (tmp_path / first.path.name).write_bytes(b"left by a crashed run")
    second = NvmeAdamW(_groups(_model()), tmp_path, lr=1e-3)  # reused, from zeros
    assert all(float(t.abs().sum()) == 0 for t in second.offloaded_tensors())
    second.close()


class _CountMatmuls(TorchDispatchMode):
    """Counts matmuls and forward attention kernels run inside the context."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self.attention = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            self.count += 1
        name = func.name()
        if "scaled_dot_product" in name and "backward" not in name:
            self.attention += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mode", ["none", "full", "selective"])
def test_checkpointing_modes_recompute_what_they_promise(mode):
    """Same gradients in every mode; `full` recomputes every block's matmuls in backward,
    `selective` keeps their outputs and recomputes none of them."""
    ref, model = _model(), _model()
    apply_activation_checkpointing(model, mode)
    tokens = torch.randint(0, TINY.vocab_size, (2, 12), generator=torch.Generator().manual_seed(2))
    ref_loss = ref(tokens).float().logsumexp(-1).mean()
    with _CountMatmuls() as fwd:
        loss = model(tokens).float().logsumexp(-1).mean()
    with _CountMatmuls() as ref_bwd:
        ref_loss.backward()
    with _CountMatmuls() as bwd:
        loss.backward()
    block_fwd_matmuls = TINY.n_layers * 7  # q, k, v, o, gate, up, down
    # Full recomputation stops once backward has what it needs: the down projection's
    # output is never needed, so 6 of a block's 7 matmuls run again.
    extra = {"none": 0, "selective": 0, "full": TINY.n_layers * 6}[mode]
    assert bwd.count == ref_bwd.count + extra
    # Both checkpointing modes recompute attention; without checkpointing nothing is.
    assert ref_bwd.attention == 0
    assert bwd.attention == (0 if mode == "none" else TINY.n_layers)
    assert fwd.count == block_fwd_matmuls + 1  # + the output layer
    names = {n.replace("_checkpoint_wrapped_module.", "") for n, _ in model.named_parameters()}
    assert names == {n for n, _ in ref.named_parameters()}
    for (name, a), b in zip(ref.named_parameters(), model.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7, msg=name)


def _cfg(**keys):
    raw: dict = {}
    for dotted, value in keys.items():
        section, key = dotted.split("__")
        raw.setdefault(section, {})[key] = value
    return config_from_dict(raw)


def test_precision_the_device_lacks_is_refused(monkeypatch):
    import llmsplit.config.checks as config

    monkeypatch.setattr(config, "_autocast_supports", lambda device_type, dtype: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"train.precision='fp16' is not supported on this device"):
        validate(_cfg(train__precision="fp16"), 2)
    validate(_cfg(train__precision="fp32"), 2)


def test_offload_dir_must_exist_and_be_writable(tmp_path, monkeypatch):
    import llmsplit.config.checks as config

    cfg = _cfg(memory__offload="nvme", memory__offload_dir=str(tmp_path / "missing"), parallel__zero=3)
    with pytest.raises(ConfigError, match="is not an existing folder"):
        validate(cfg, 2)
    cfg = _cfg(memory__offload="nvme", memory__offload_dir=str(tmp_path), parallel__zero=3)
    validate(cfg, 2)
    monkeypatch.setattr(config.os, "access", lambda path, mode: False)  # as if read-only
    with pytest.raises(ConfigError, match="is not writable"):
        validate(cfg, 2)
