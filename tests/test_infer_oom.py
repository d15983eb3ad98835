"""The generate/serve out-of-memory explainer's --tp/--pp suggestions (the single-process
changes and the CLI path are in tests/test_oom.py)."""

import pytest

from llmsplit.diagnose.oom import explain_infer_oom
from llmsplit.plan.placement import Sizes
from llmsplit.models.llama import LlamaConfig
from llmsplit.diagnose import probe
from llmsplit.plan import hardware

GiB = 1 << 30


def _split_suggestions(n_kv_heads: int, gpus: int) -> list[list[str]]:
    # An 8B-like decoder: 7.2e9 bf16 parameters are 13.5 GiB of weights, over a 14 GiB GPU
    # once the KV cache and the runtime come on top; half of it fits easily.
    cfg = LlamaConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=n_kv_heads, vocab_size=32000, ffn_dim=14336,
                      max_seq_len=4096)
    sizes = Sizes(batch=4, context=4096, dtype_bytes=2, kv_dtype_bytes=2)
    report = explain_infer_oom(cfg, sizes, {"cuda:0": 14 * GiB}, "auto", None, offload_dir=None,
                               max_batch_flag=False, gpus=gpus)
    return [s for s in report["suggestions"] if s[0] in ("--tp", "--pp")]


@pytest.fixture(autouse=True)
def h100(monkeypatch):
    monkeypatch.setattr(probe, "local_device", lambda n: hardware.get_device("H100-80GB"))


def test_two_gpus_offer_tp_and_pp_one_gpu_neither():
    assert _split_suggestions(n_kv_heads=8, gpus=1) == []
    assert _split_suggestions(n_kv_heads=8, gpus=2) == [["--tp", "2"], ["--pp", "2"]]


def test_tp_is_offered_only_where_it_shards_the_kv_heads():
    # One kv head cannot be split over 2 workers (inference does not replicate kv heads).
    assert _split_suggestions(n_kv_heads=1, gpus=2) == [["--pp", "2"]]
