"""The planner against every run (summary.json's plan_check, a warning beyond 25%), and
`llmsplit train --auto`, which runs the layout the planner picks for the local devices."""

import collections
import gc
import json

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from helpers import TINY, train
from llmsplit.config import load_config, model_config
from llmsplit.layout import Layout, Workload
from llmsplit.models.llama import LlamaConfig, TransformerBlock
from llmsplit.models.rope import rope_tables
from llmsplit.diagnose.plan_check import compare
from llmsplit.plan.api import auto_config
from llmsplit.diagnose.probe import local_cpu, local_device
from llmsplit.plan.hardware import CATALOGUE, cpu_device
from llmsplit.plan.memory import cpu_retained_heap_bytes, layer_saved_tensors, training_memory


# A 2-core machine's measured numbers as diagnose.probe.measure_cpu records them.
MEASURED = {"cores": 2, "mem_total_bytes": 24 << 30, "matmul_flops_per_core": {"fp32": 1.9e11, "bf16": 1.4e12},
            "copy_bytes_per_s": 1.6e10, "loopback_bytes_per_s": 2.6e9, "baseline_process_bytes": 300 << 20}


def _summary(state, peak):
    return {"per_rank": [{"rank": 0, "param_bytes": state // 4, "grad_bytes": state // 4, "optim_bytes": state // 2,
                          "peak_mem_bytes": peak},
                         {"rank": 1, "param_bytes": 1, "grad_bytes": 1, "optim_bytes": 1, "peak_mem_bytes": 1}]}


def _prediction(state, total):
    return {"gpu": "cpu", "model_state_bytes": state, "host_bytes_per_device": 0,
            "memory_per_device": {"total": total}}


def test_compare_takes_the_fullest_rank_and_warns_beyond_25_percent():
    cpu = cpu_device(MEASURED, 2)
    close = compare(_summary(400, 1100), _prediction(400, 1000), cpu, "none")
    assert close["measured_model_state_bytes"] == 400 and close["measured_peak_bytes"] == 1100
    assert close["ratio_peak"] == pytest.approx(1.1) and close["warnings"] == []
    off = compare(_summary(400, 1300), _prediction(400, 1000), cpu, "none")
    assert len(off["warnings"]) == 1 and "peak memory" in off["warnings"][0]


def test_a_compiled_run_counts_what_compiling_adds_to_a_cpu_worker():
    """train.compile's workers hold Dynamo's and Inductor's modules and the compiled code (~100
    MiB a worker here, measured by the probe at the first compiled run): counted only where the
    workload compiles, and not at all where it was never measured (an older cache)."""
    cfg = LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=32)
    layout, work = Layout(dp=2), Workload(seq_len=32, global_batch=8, precision="fp32")
    measured = cpu_device({**MEASURED, "compile_extra_bytes": 100 << 20}, 2)
    eager = training_memory(cfg, layout, work, measured).total
    compiled = Workload(seq_len=32, global_batch=8, precision="fp32", compile=True)
    assert training_memory(cfg, layout, compiled, measured).total == eager + (100 << 20)
    unmeasured = cpu_device(MEASURED, 2)
    assert training_memory(cfg, layout, compiled, unmeasured).total == training_memory(cfg, layout, work, unmeasured).total


def test_compare_on_a_gpu_leaves_out_what_the_allocator_does_not_see():
    gpu = CATALOGUE["H100-80GB"]
    check = compare(_summary(400, 5000), _prediction(400, 5000 + gpu.runtime_bytes), gpu, "none")
    assert check["predicted_peak_bytes"] == 5000 and check["warnings"] == []


def test_local_device_names_the_catalogue_gpu(monkeypatch):
    class Props:
        name, total_memory = "NVIDIA H100 80GB HBM3", 85_000_000_000

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: Props)
    assert local_device(8).name == "H100-80GB"
    Props.name, Props.total_memory = "NVIDIA Future GPU", 100 * 2**30
    unknown = local_device(8)
    assert unknown.name == "NVIDIA Future GPU" and unknown.memory_bytes == 100 * 2**30


@pytest.mark.slow
def test_auto_runs_the_planners_layout_and_confirms_the_micro_batch_by_trial(tmp_path):
    """With memory.limit_bytes (as on a GPU) the workers try micro-batches from the
    planner's upward; under a generous limit the largest, the whole per-rank batch, fits."""
    limit = ("--set", f"memory.limit_bytes={4 << 30}")
    proc = train(tmp_path / "run", *TINY, nproc=2, extra=("--auto", *limit), timeout=240)
    cfg = load_config(None, [*TINY, f"memory.limit_bytes={4 << 30}"])
    want, best = auto_config(cfg, model_config(cfg, 258), 2, local_cpu(2))
    assert f"--auto chose {' '.join(best.layout.settings())} for 2 × cpu" in proc.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    for key in ("dp", "zero", "tp", "pp"):
        assert summary["layout"][key] == getattr(best.layout, key), key
    per_rank = cfg.train.global_batch // best.layout.dp
    trials = [line for line in proc.stderr.splitlines() if "--auto trial" in line]
    assert f"micro_batch={best.layout.micro_batch}:" in trials[0] and trials[-1].endswith("fits"), trials
    written = load_config(tmp_path / "run" / "config.toml")
    assert written.train.micro_batch == per_rank  # the trial's choice is what ran (and what a resume reads)
    assert written.memory.activation_checkpoint == best.layout.activation_checkpoint
    check = summary["plan_check"]
    for key in ("predicted_model_state_bytes", "measured_model_state_bytes", "predicted_peak_bytes",
                "measured_peak_bytes", "ratio_model_state", "ratio_peak"):
        assert check[key] > 0, key
    assert check["ratio_model_state"] == pytest.approx(1.0, rel=0.03)


def test_micro_batch_search_goes_up_from_the_prediction_and_down_when_it_does_not_fit():
    from llmsplit.train.batch_trial import candidates, search

    options = candidates(12)
    assert options == [1, 2, 3, 4, 6, 12]
    tried = []

    def fits_up_to(n):
        def fits(mb):
            tried.append(mb)
            return mb <= n
        return fits

    assert search(2, options, fits_up_to(6)) == 6 and tried == [2, 3, 4, 6, 12]
    tried.clear()
    assert search(6, options, fits_up_to(3)) == 3 and tried == [6, 4, 3]
    tried.clear()
    assert search(12, options, fits_up_to(12)) == 12 and tried == [12]
    assert search(4, options, fits_up_to(0)) is None


class _Storages(TorchDispatchMode):
    """Every storage an op creates, held weakly, with its size."""

    def __init__(self):
        super().__init__()
        self.made = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                self.made[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes())
        return out


def test_saved_tensors_and_the_heap_they_leave_are_what_a_block_allocates():
    """Each tensor a block's forward leaves for backward, by size: the planner's list of
    them, and the part of them below glibc's 4 MiB mmap threshold (what the heap keeps).
    At 4096 tokens of dim 128 the ffn-wide tensors (5.5 MiB) get their own mappings."""
    cfg = LlamaConfig(n_layers=1, vocab_size=64, max_seq_len=4096, dim=128, n_heads=8, n_kv_heads=2, ffn_dim=352)
    b, s = 1, 4096
    torch.manual_seed(0)
    block = TransformerBlock(cfg, 0)
    cos, sin = rope_tables(cfg.head_dim, s, 1e4)
    leaf = torch.randn(b, s, cfg.dim, requires_grad=True)
    mode = _Storages()
    with mode:
        x = leaf * 1.0  # the block input as an op output: alive later only if something keeps it
        y = block(x, cos, sin)
    del x
    gc.collect()
    skip = {t.untyped_storage().data_ptr() for t in (*block.parameters(), cos, sin, y)}
    alive = [n for ptr, (ref, n) in mode.made.items() if not ref.expired() and ptr not in skip]
    planned = [int(row * b * s) for count, row in layer_saved_tensors(cfg, s, Layout(), "fp32") for _ in range(count)]
    assert collections.Counter(planned) == collections.Counter(alive)
    assert cpu_retained_heap_bytes(cfg, b, s, Layout(), "fp32", 1) == sum(n for n in alive if n < 4 << 20)


def test_zero_3_with_accumulation_peaks_before_the_sharded_gradients_exist():
    """FSDP2 accumulates micro-batches in unsharded gradients and makes the sharded ones in
    the last backward only: at the peak (the start of that backward) they do not exist yet.
    DDP makes them in the first backward: with 2 micro-batches they exist at the peak."""
    cfg = LlamaConfig(dim=512, n_layers=8, n_heads=8, n_kv_heads=8, vocab_size=264, ffn_dim=1376, max_seq_len=256)
    work = Workload(seq_len=256, global_batch=8, precision="fp32")
    cpu = cpu_device(MEASURED, 2)
    zero3 = training_memory(cfg, Layout(dp=2, zero=3, micro_batch=2), work, cpu)
    ddp = training_memory(cfg, Layout(dp=2, zero=0, micro_batch=2), work, cpu)
    assert zero3.detail["microbatches"] == 2
    assert zero3.detail["grads_absent_at_peak"] == zero3.grads > 0
    assert ddp.detail["grads_absent_at_peak"] == 0


# Issue 16's model: 512 wide, 8 layers, seq 256, micro-batch 2 on 2 workers (2 micro-batches).
ISSUE_MODEL = ["model.dim=512", "model.n_layers=8", "model.n_heads=8", "model.n_kv_heads=8", "model.ffn_dim=1376",
               "data.seq_len=256", "train.micro_batch=2", "train.global_batch=8", "train.steps=3",
               "train.warmup_steps=1", "checkpoint.every=0"]


@pytest.mark.slow
def test_cpu_peak_prediction_is_within_25_percent_for_zero_3(tmp_path):
    """The worst of issue 16's three cases: measured 1.23-1.25x the prediction on this
    2-core VM, 1.41x where the issue was filed, before the planner counted the heap glibc
    keeps and the sharded gradients zero 3 does not hold at the peak (now ~1.08x). Three
    steps: the peak settles only once the optimizer state exists (step 2) and the heap has
    grown around the second micro-batch."""
    train(tmp_path / "run", *ISSUE_MODEL, "parallel.zero=3", nproc=2, timeout=240)
    check = json.loads((tmp_path / "run" / "summary.json").read_text())["plan_check"]
    assert abs(check["ratio_peak"] - 1) <= 0.25, check
    assert check["warnings"] == []
