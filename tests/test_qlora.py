"""QLoRA (issue 17): `lora.base = "nf4" | "int8"` keeps the frozen base's linear weights quantized
(torchao's tensors) and computes with them dequantized; a run on them logs the losses of a run
on the dequantized weights in float, in one process and under DDP and ZeRO-3."""

import json
import re
import shutil

import pytest
import torch
from helpers import assert_close_losses, losses, train

from llmsplit.adapters.lora import apply_lora, init_lora, parameter_counts
from llmsplit.adapters.qlora import dequantize, is_quantized, quantize_base, quantize_weight
from llmsplit.config import ConfigError, load_config, model_config, validate
from llmsplit.models.llama import LlamaConfig, Transformer
from llmsplit.train.metrics import tensor_bytes

CFG = LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, ffn_dim=128, max_seq_len=32)


def _lora_model() -> Transformer:
    model = Transformer(CFG)
    model.init_weights(0)
    apply_lora(model, rank=4, alpha=8, dropout=0.0, targets=["q", "v", "down"])
    init_lora(model, 0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # B = 0 at the start: give the update something to carry
        for name, p in model.named_parameters():
            if name.endswith("lora_b"):
                p.normal_(0, 0.1, generator=g)
    return model


@pytest.mark.parametrize("base", ["nf4", "int8"])
def test_a_quantized_base_computes_with_its_dequantized_weights(base):
    """Logits and adapter gradients of the quantized model equal those of the same model holding
    the dequantized weights in float32; only the adapters get gradients."""
    quantized, reference = _lora_model(), _lora_model()
    float_wq = reference.layers["0"].attention.wq.weight.clone()
    quantize_base(quantized, base)
    with torch.no_grad():
        for (name, q), r in zip(quantized.named_parameters(), reference.parameters()):
            if is_quantized(q):
                r.copy_(dequantize(q))
    wq = quantized.layers["0"].attention.wq.weight
    assert is_quantized(wq) and not wq.requires_grad
    assert not torch.equal(dequantize(wq), float_wq)  # quantized: not the float weight
    torch.testing.assert_close(dequantize(wq), float_wq, rtol=0, atol=0.2 * float_wq.abs().max().item())
    tokens = torch.randint(0, 64, (2, 16))
    logits = quantized(tokens)
    torch.testing.assert_close(logits, reference(tokens), rtol=1e-6, atol=1e-6)
    logits.square().mean().backward()
    reference(tokens).square().mean().backward()
    grads = {n: p.grad for n, p in quantized.named_parameters() if p.grad is not None}
    assert sorted(grads) == sorted(n for n, p in reference.named_parameters() if p.requires_grad)
    for name, p in reference.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-7)
    stored = sum(t.numel() * t.element_size() for t in (wq.quantized_data, wq.quantized_scalers)) if base == "nf4" \
        else wq.int_data.numel()
    assert stored <= wq.numel() * (0.52 if base == "nf4" else 1)
    # summary.json's frozen_base_bytes, counted from the shapes, is what the quantized model holds (issue 51)
    frozen = [p for p in quantized.parameters() if not p.requires_grad]
    assert parameter_counts(CFG, 4, "q,v,down", base)["frozen_base_bytes"] == tensor_bytes(frozen)


def test_nf4_weights_decode_into_one_workspace_as_torchao_decodes_them():
    """`dequantize_nf4` gives torchao's `get_original_weight` value for value (a weight over the
    int32 chunk of codes included), into one buffer every weight reuses; NF4 layers compute
    through it and its backward gives the input torchao's gradient."""
    from llmsplit.adapters import qlora

    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(shape, generator=g) for shape in [(2048, 1088), (64, 128), (192, 576)]]
    quantized = [quantize_weight(w, "nf4") for w in weights]
    buffers = set()
    for q in quantized:
        got = qlora.dequantize_nf4(q)
        assert torch.equal(got, q.get_original_weight())
        buffers.add(got.untyped_storage().data_ptr())
    assert len(buffers) == 1 and quantized[0].numel() // 2 > qlora._CODES_CHUNK
    x = torch.randn(3, 5, 128, generator=g, requires_grad=True)
    out = qlora.nf4_linear(x, quantized[1])
    out.square().sum().backward()
    x2 = x.detach().clone().requires_grad_(True)
    want = torch.nn.functional.linear(x2, quantized[1])  # torchao's linear_nf4
    want.square().sum().backward()
    assert torch.equal(out, want) and torch.allclose(x.grad, x2.grad, rtol=1e-6, atol=1e-6)
    model = _lora_model()
    quantize_base(model, "nf4")
    assert type(model.layers["0"].attention.wq) is qlora.NF4LoRALinear
    assert type(model.layers["0"].attention.wk) is qlora.NF4Linear


@pytest.mark.parametrize("sets, fragment", [
    (["lora.rank=4", "lora.base=nf4", "parallel.tp=2"], "does not split the quantized base by tensor parallel"),
    (["lora.base=nf4"], "quantizes the frozen base of LoRA; set lora.rank"),
    (["lora.rank=4", "lora.base=fp4"], "is not one of: 'none', 'nf4', 'int8'"),
])
def test_quantized_base_keys_are_checked(sets, fragment):
    with pytest.raises(ConfigError, match=fragment):
        validate(load_config(None, sets), 2)


def test_a_base_whose_shapes_break_nf4_blocks_is_refused_before_training():
    """NF4 stores whole blocks of 64 values; with dim 36 the q weight holds 36x36 = 1,296. The
    config check refuses it, naming lora.base and the fix, where torchao would have stopped
    every worker with an assertion; int8 (a scale per row) stores it."""
    sizes = ["lora.rank=4", "model.dim=36", "model.n_heads=2", "model.n_kv_heads=2", "model.ffn_dim=96"]
    cfg = load_config(None, [*sizes, "lora.base=nf4"])
    with pytest.raises(ConfigError, match=re.escape("lora.base='nf4' cannot store this model: the attention.wq weight "
                                                    "(36x36) is not a whole number of NF4 blocks of 64 values; use "
                                                    "lora.base=\"int8\" or lora.base=\"none\"")):
        validate(cfg, 1, model_config(cfg))
    cfg = load_config(None, [*sizes, "lora.base=int8"])
    validate(cfg, 1, model_config(cfg))


def test_the_planner_counts_the_base_at_its_stored_width():
    from llmsplit.layout import Layout, Workload
    from llmsplit.models.presets import PRESETS
    from llmsplit.plan.hardware import get_device
    from llmsplit.plan.memory import memory_per_device

    cfg, gpu = LlamaConfig(**PRESETS["llama-3-8b"]), get_device("H100-80GB")
    work = dict(seq_len=2048, global_batch=1, lora_rank=16)
    lora = memory_per_device(cfg, Layout(dp=1), Workload(**work), gpu)
    nf4 = memory_per_device(cfg, Layout(dp=1), Workload(**work, lora_base="nf4"), gpu)
    linear = cfg.n_layers * cfg.layer_matmul_params()
    assert lora.params - nf4.params == pytest.approx(linear * (4 - 0.5 - 1 / 64), rel=1e-6)
    assert (nf4.grads, nf4.optimizer) == (lora.grads, lora.optimizer)


def _dequantized_copy(folder, out, base):
    """`folder` (a Hugging Face model) with each decoder linear weight replaced by its quantized
    form dequantized: the float model a QLoRA run on `folder` computes with."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, out)
    weights = load_file(folder / "model.safetensors")
    for name, w in weights.items():
        if ".layers." in name and name.endswith("proj.weight"):
            weights[name] = dequantize(quantize_weight(w, base)).contiguous()
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


def _assert_events_hold_the_metrics(run):
    """train.tensorboard: the event files carry each numeric key of metrics.jsonl at its step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    keys = {k for r in records for k, v in r.items() if k != "step" and isinstance(v, (int, float))}
    assert {"loss", "lr", "grad_norm", "tokens_per_s"} <= keys == set(events.Tags()["scalars"])
    for key in keys:
        got = {e.step: e.value for e in events.Scalars(key)}
        assert got == pytest.approx({r["step"]: r[key] for r in records if key in r}, rel=1e-6)


QL = ["lora.rank=4", "lora.alpha=8", "train.lr=3e-2", "data.seq_len=32", "train.global_batch=4",
      "train.micro_batch=2", "train.steps=3", "train.warmup_steps=0"]


@pytest.mark.slow
def test_qlora_logs_the_losses_of_its_dequantized_base_under_ddp_and_zero3(tmp_path):
    """ZeRO-3 on 2 workers (FSDP2 shards and gathers the NF4 bytes) logs the fp32 losses of one
    process on the dequantized weights; DDP with bf16 autocast (mixed-precision LoRA) logs them
    to bf16's precision, with the adapters' master weights and gradients in fp32."""
    from hf_models import make_hf_folder

    base = make_hf_folder(tmp_path / "base")
    reference = _dequantized_copy(base, tmp_path / "dequantized", "nf4")
    train(tmp_path / "ref", f"model.hf={reference}", *QL, "train.tensorboard=true", nproc=1)
    want = losses(tmp_path / "ref")
    _assert_events_hold_the_metrics(tmp_path / "ref")
    assert want[-1] < want[0] - 0.05  # it learns: a tolerance below could not pass a run that does not
    train(tmp_path / "z3", f"model.hf={base}", "lora.base=nf4", "parallel.zero=3", *QL, nproc=2)
    z3 = losses(tmp_path / "z3")
    # Losses to 1e-5 and step 1's gradient norm; from step 2 the adapters' gradient norm over the NF4
    # base is 0.7-0.9% off the dequantized copy's (z3 0.5458 vs 0.5422, --auto 0.5729 vs 0.5780, measured
    # 2026-12-06) under every layout. Likely what test_families measured for gemma3 under tp (rounding
    # amplified by AdamW's near-sign first updates at a large lr: here 3e-2); not yet checked at a small lr.
    assert_close_losses(list(z3), list(want))
    assert_close_losses(z3[:1], want[:1])
    summary = json.loads((tmp_path / "z3" / "summary.json").read_text())
    assert summary["plan_check"]["ratio_model_state"] == pytest.approx(1.0, abs=0.02)
    # --auto over the nf4 base: the planner's layout for 2 workers (never tensor parallel, which the
    # quantized base refuses) trains with the same losses.
    proc = train(tmp_path / "auto", f"model.hf={base}", "lora.base=nf4", *QL, nproc=2, extra=("--auto",))
    chosen = re.search(r"--auto chose (.*?) for 2 ", proc.stderr).group(1)
    assert "tp=1" in chosen and json.loads((tmp_path / "auto" / "summary.json").read_text())["layout"]["tp"] == 1
    auto = losses(tmp_path / "auto")
    assert_close_losses(list(auto), list(want))
    assert_close_losses(auto[:1], want[:1])
    # Pipeline parallel: each stage holds its layers' NF4 bytes.
    train(tmp_path / "pp", f"model.hf={base}", "lora.base=nf4", "parallel.pp=2", *QL, nproc=2)
    pp = losses(tmp_path / "pp")
    assert_close_losses(list(pp), list(want))
    assert_close_losses(pp[:1], want[:1])
    train(tmp_path / "ddp", f"model.hf={base}", "lora.base=nf4", "parallel.zero=0", "train.precision=bf16", *QL,
          nproc=2)
    got = losses(tmp_path / "ddp")
    assert_close_losses(list(got), list(want), rtol=5e-3)
    assert_close_losses(got[:1], want[:1], rtol=5e-3)
    assert got != want  # bf16 did compute
    ddp = json.loads((tmp_path / "ddp" / "summary.json").read_text())
    (rank0, _), (ref0,) = ddp["per_rank"], json.loads((tmp_path / "ref" / "summary.json").read_text())["per_rank"]
    assert (rank0["grad_bytes"], rank0["optim_bytes"]) == (ref0["grad_bytes"], ref0["optim_bytes"])  # fp32 adapters
    # A DDP rank holds the whole model: the stored base the summary counts, and the fp32 adapters.
    assert rank0["param_bytes"] == ddp["frozen_base_bytes"] + 4 * ddp["trainable_params"]
    assert ddp["trainable_params"] * 4 == rank0["grad_bytes"] and ddp["params"] == summary["params"]


@pytest.mark.slow
def test_an_int8_base_under_zero3_and_cp_logs_the_losses_of_its_dequantized_copy(tmp_path):
    """The int8 base (a scale per row) sharded by FSDP2 on 2 workers, and an NF4 base under
    context parallel (each sequence split over 2 ranks): the losses of one process on the
    dequantized weights, and step 1's gradient norm (as for NF4 above)."""
    from hf_models import make_hf_folder

    base = make_hf_folder(tmp_path / "base")
    train(tmp_path / "ref", f"model.hf={_dequantized_copy(base, tmp_path / 'dequantized', 'int8')}", *QL, nproc=1)
    want = losses(tmp_path / "ref")
    train(tmp_path / "z3", f"model.hf={base}", "lora.base=int8", "parallel.zero=3", *QL, nproc=2)
    got = losses(tmp_path / "z3")
    assert_close_losses(list(got), list(want))
    assert_close_losses(got[:1], want[:1])
    train(tmp_path / "nf4", f"model.hf={_dequantized_copy(base, tmp_path / 'nf4-dequantized', 'nf4')}", *QL, nproc=1)
    train(tmp_path / "cp2", f"model.hf={base}", "lora.base=nf4", "parallel.cp=2", *QL, nproc=2)
    got, want = losses(tmp_path / "cp2"), losses(tmp_path / "nf4")
    assert_close_losses(list(got), list(want))
    assert_close_losses(got[:1], want[:1])
