"""Mixture-of-experts layers (models/moe.py): the grouped, dropless computation against a
per-expert reference, Mixtral and Qwen3-MoE folders against transformers, and MoE models
split into pipeline stages, fine-tuned data-parallel and exported back."""

import json
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from llmsplit.errors import ConfigError
from llmsplit.layout import Layout, check
from llmsplit.models.llama import LlamaConfig
from llmsplit.models.moe import MoE
from llmsplit.models.presets import preset_config


def _reference(moe: MoE, x: torch.Tensor, renorm: bool, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Each token through its top-k experts one at a time, as the papers write it."""
    logits = moe.router(x).float()
    scores = logits.softmax(-1) if moe.score == "softmax" else logits.sigmoid()
    idx = (scores if bias is None else scores + bias).topk(moe.k).indices
    w = scores.gather(1, idx)
    w = w / w.sum(-1, keepdim=True) if renorm else w
    out = moe.shared(x) if moe.shared is not None else torch.zeros_like(x)
    rows = []
    for t in range(x.shape[0]):
        y = out[t]
        for j in range(moe.k):
            e = idx[t, j]
            y = y + w[t, j] * (F.silu(x[t] @ moe.w1[e].T) * (x[t] @ moe.w3[e].T)) @ moe.w2[e].T
        rows.append(y)
    return torch.stack(rows)


@pytest.mark.parametrize("shared,renorm,score", [(0, True, "softmax"), (1, False, "softmax"), (1, True, "sigmoid")])
def test_grouped_experts_equal_one_token_at_a_time(shared, renorm, score):
    cfg = LlamaConfig(dim=32, n_heads=4, ffn_dim=48, n_experts=4, experts_per_token=2, n_shared_experts=shared,
                      router_renorm=renorm, router_score=score)
    torch.manual_seed(0)
    moe = MoE(cfg)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(2, 7, 32, requires_grad=True)
    got = moe(x)
    want = _reference(moe, x.reshape(-1, 32), renorm).view_as(got)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    grads = torch.autograd.grad(got.pow(2).sum(), [x, moe.w1, moe.w2])
    for g, h in zip(grads, torch.autograd.grad(want.pow(2).sum(), [x, moe.w1, moe.w2])):
        torch.testing.assert_close(g, h, atol=1e-4, rtol=1e-4)
    counts = moe.tokens_per_expert
    assert counts.sum() == 14 * 2 and counts.shape == (4,)  # dropless: every token reached its 2 experts
    # Loss-free balancing's bias chooses the experts (every token takes expert 3 here); the
    # weights stay the scores.
    biased = MoE(replace(cfg, router_bias=True))
    biased.load_state_dict({**moe.state_dict(), "expert_bias": torch.tensor([0.0, 0.0, 0.0, 9.0])})
    torch.testing.assert_close(biased(x), _reference(biased, x.reshape(-1, 32), renorm, biased.expert_bias).view_as(got),
                               atol=1e-5, rtol=1e-5)
    assert biased.tokens_per_expert[3] == 14
    logits = moe.router(x.reshape(-1, 32))
    scores = logits.softmax(-1) if score == "softmax" else logits.sigmoid()
    assert torch.isclose(moe.aux_loss, 4 * (counts / 28 * scores.mean(0)).sum())


def test_moe_configs_refused_in_one_sentence():
    with pytest.raises(ConfigError, match="model.experts_per_token is 5; each token goes to between 1 and "
                                          "model.n_experts 4 experts"):
        check(preset_config("tiny-moe", experts_per_token=5), Layout())
    with pytest.raises(ConfigError, match="model.router_score is 'top'; it must be one of 'softmax', 'sigmoid'"):
        check(preset_config("tiny-moe", router_score="top"), Layout())
    with pytest.raises(ConfigError, match="parallel.tp=2 does not split mixture-of-experts layers"):
        check(preset_config("tiny-moe"), Layout(tp=2))
    with pytest.raises(ConfigError, match="use parallel.ep > 1 beside parallel.tp"):
        check(preset_config("tiny-moe"), Layout(tp=2, dp=2))
    check(preset_config("tiny-moe"), Layout(tp=2, dp=2, ep=2))
    from llmsplit.layout import Workload

    infer = Workload(seq_len=1, global_batch=1, mode="infer")
    check(preset_config("tiny-moe"), Layout(tp=2), infer)  # inference splits each expert over tp
    with pytest.raises(ConfigError, match=r"--tp 2 splits each expert's model.moe_ffn_dim=40 into 20 rows, not a "
                                          r"multiple of 8 .*; use --tp in 1$"):
        check(preset_config("tiny-moe", moe_ffn_dim=40), Layout(tp=2), infer)
    for layout, fragment in ((Layout(dp=4, ep=3), "parallel.ep=3 does not divide the 4 data-parallel ranks"),
                             (Layout(dp=6, ep=3), "parallel.ep=3 does not divide model.n_experts=4; use parallel.ep "
                                                  "in 1, 2"),
                             (Layout(dp=2, ep=2, zero=1), "parallel.ep=2 does not combine with parallel.zero=1"),
                             (Layout(dp=4, dp_replicate=2, zero=2, ep=4), r"parallel.ep=4 does not divide the 2 "
                              r"data-parallel ranks \(parallel.dp / parallel.dp_replicate\); use parallel.ep in 1, 2")):
        with pytest.raises(ConfigError, match=fragment):
            check(preset_config("tiny-moe"), layout)
    with pytest.raises(ConfigError, match="this model has none"):
        check(preset_config("tiny"), Layout(dp=2, ep=2))
    cfg = preset_config("tiny-moe")
    assert cfg.num_params() == sum(p.numel() for p in __import__("llmsplit").models.Transformer(cfg).parameters())


def test_planner_counts_total_parameters_and_active_activations():
    from llmsplit.plan.memory import layer_activation_bytes

    moe = preset_config("tiny-moe")  # 4 experts of 128, 2 per token
    dense = preset_config("tiny-moe", n_experts=0, ffn_dim=2 * 128)  # what one token computes
    assert moe.layer_matmul_params() == dense.layer_matmul_params()  # FLOPs: the active experts
    assert moe.layer_params() - dense.layer_params() == 2 * 3 * 128 * 128 + 4 * 128  # + idle experts, router
    for name, total, active in (("mixtral-8x7b", 46.70e9, 12.88e9), ("qwen3-30b-a3b", 30.53e9, 3.34e9)):
        cfg = preset_config(name)  # the published sizes
        assert abs(cfg.num_params() - total) < 0.01e9 and abs(cfg.active_params() - active) < 0.01e9, name
    for pattern in ("fp32", "autocast"):  # activations: the k experts' intermediates of each token
        assert layer_activation_bytes(moe, 4, 64, Layout(), pattern) == layer_activation_bytes(dense, 4, 64, Layout(),
                                                                                              pattern)



def test_planner_splits_experts_over_ep_and_counts_the_all_to_all():
    from llmsplit.layout import Workload
    from llmsplit.plan.experts import all_to_all_bytes_per_step, dispatch_buffer_bytes
    from llmsplit.plan.memory import layer_params
    from llmsplit.plan.search import enumerate_layouts
    from llmsplit.plan.hardware import get_device

    cfg = preset_config("tiny-moe")  # 4 experts of 3 x 128 x 128, 2 per token, 2 layers
    routed = 4 * 3 * 128 * 128
    assert layer_params(cfg) - layer_params(cfg, ep=2) == routed // 2
    assert layer_params(cfg) - layer_params(cfg, ep=4) == 3 * routed // 4
    work = Workload(seq_len=32, global_batch=8, precision="fp32")
    lay = Layout(dp=4, ep=2, micro_batch=2)  # 1 micro-batch of 2 x 32 tokens per rank, 2 routed copies each
    rows = 2 * 32 * 2 * 128 * 4  # bytes of one exchange
    # 2 layers x (forward: rows out and back, backward: their gradients) x half of them leave the rank
    assert all_to_all_bytes_per_step(cfg, lay, work) == 2 * 4 * rows // 2
    assert all_to_all_bytes_per_step(cfg, Layout(dp=4, ep=2, micro_batch=2, activation_checkpoint="full"),
                                     work) == 2 * 6 * rows // 2
    assert dispatch_buffer_bytes(cfg, lay, work) == 4 * rows
    assert all_to_all_bytes_per_step(cfg, Layout(dp=4, micro_batch=2), work) == 0
    eps = {lay.ep for lay in enumerate_layouts(cfg, work, 4, get_device("H100-80GB"))}
    assert eps == {1, 2, 4}
    # tp x ep: the routed experts are split over ep only, whole on every tp rank (and the router).
    assert layer_params(cfg, tp=2) - layer_params(cfg, tp=2, ep=2) == routed // 2
    assert layer_params(cfg) - layer_params(cfg, tp=2) == (2 * 128 * 128 + cfg.kv_params()) // 2  # q, o, k, v
    assert (2, 2) in {(lay.tp, lay.ep) for lay in enumerate_layouts(cfg, work, 4, get_device("H100-80GB"))}

transformers = pytest.importorskip("transformers")

import llmsplit  # noqa: E402
from helpers import assert_close_losses, assert_same_gradients, dump_grads, grads_dir, losses, run_cli, train  # noqa: E402
from hf_models import MOE, greedy_tokens, hf_model, make_hf_folder, transformers_loss  # noqa: E402



@pytest.fixture(scope="module", params=sorted(MOE))
def family(request, tmp_path_factory):
    arch = request.param
    return arch, make_hf_folder(tmp_path_factory.mktemp(arch) / arch, arch=arch, num_hidden_layers=2, **MOE[arch])


def test_moe_folders_match_transformers(family):
    arch, folder = family
    ref, m = hf_model(folder), llmsplit.load(folder)
    assert (m.config.family, m.config.n_experts, m.config.experts_per_token, m.config.router_renorm) == (
        arch, 4, 2, arch == "mixtral")
    ids = torch.randint(2, m.config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(m.logits(ids), ref(ids).logits, atol=1e-4, rtol=0)
        want = ref.generate(ids[:1], max_new_tokens=8, do_sample=False, eos_token_id=None)[0, 13:]
    assert greedy_tokens(m, ids[0].tolist()) == want.tolist()


def test_experts_kept_on_the_cpu_give_the_same_tokens(family):
    """--n-cpu-moe 1: layer 0's experts loaded into CPU memory and run through the dispatch that
    moves rows there and back (a no-op move on a CPU-only machine), the logits unchanged."""
    arch, folder = family
    whole = llmsplit.load(folder)
    m = llmsplit.load(folder, n_cpu_moe=1)
    from llmsplit.infer.runner.cpu_experts import experts_on_cpu

    layers = m.runner.model.layers
    assert m.placement.cpu_experts == [0] and layers["0"].feed_forward.dispatch is experts_on_cpu
    assert layers["1"].feed_forward.dispatch is None and layers["0"].feed_forward.w1.device.type == "cpu"
    ids = torch.randint(2, m.config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(m.logits(ids), whole.logits(ids), atol=1e-6, rtol=0)
    with pytest.raises(ConfigError, match="--n-cpu-moe 1 keeps the experts .*; drop --tp/--pp$"):
        llmsplit.load(folder, n_cpu_moe=1, pp=2)


@pytest.mark.slow
def test_moe_folders_under_tensor_parallel_match_transformers(family):
    """--tp 2 splits each expert's hidden width like a dense MLP (infer/runner.py): logits and
    greedy tokens equal transformers'."""
    arch, folder = family
    ref, m = hf_model(folder), llmsplit.load(folder, tp=2)
    try:
        piece = m.engine.runner.runner.model.layers["0"].feed_forward
        assert piece.w1.shape == (4, m.config.moe_ffn_dim // 2, m.config.dim)  # rank 0's half of each expert
        ids = torch.randint(2, m.config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            torch.testing.assert_close(m.logits(ids), ref(ids).logits, atol=1e-4, rtol=0)
            want = ref.generate(ids[:1], max_new_tokens=8, do_sample=False, eos_token_id=None)[0, 13:]
        assert greedy_tokens(m, ids[0].tolist()) == want.tolist()
    finally:
        m.close()


@pytest.mark.slow
def test_moe_pipeline_data_parallel_and_export(family, tmp_path):
    arch, folder = family
    if arch != "mixtral":
        pytest.skip("one MoE family is enough for the layouts; both load and export alike")
    whole = llmsplit.load(folder, device_map="cpu")
    ids = torch.randint(2, whole.config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(0))
    split = llmsplit.load(folder, pp=2)
    try:
        torch.testing.assert_close(split.logits(ids), whole.logits(ids), atol=1e-5, rtol=0)
    finally:
        split.close()
    sets = [f"model.hf={folder}", "data.seq_len=32", "train.global_batch=8", "train.micro_batch=2", "train.steps=2",
            "train.warmup_steps=1", "train.lr=3e-3"]
    train(tmp_path / "one", *sets)
    train(tmp_path / "dp", *sets, "parallel.zero=1", nproc=2)
    one = losses(tmp_path / "one")
    assert abs(one[0] - transformers_loss(folder)) <= 1e-5 * one[0] and one[1] < one[0]
    assert_close_losses(losses(tmp_path / "dp"), one)
    out = tmp_path / "hf"
    run_cli("export", "--checkpoint", str(tmp_path / "dp"), "--to", "hf", str(out))
    assert json.loads((out / "config.json").read_text())["num_local_experts"] == 4
    with torch.no_grad():
        torch.testing.assert_close(hf_model(out)(ids).logits, llmsplit.load(tmp_path / "dp").logits(ids),
                                   atol=1e-5, rtol=0)


@pytest.mark.slow
def test_aux_loss_and_tokens_per_expert_are_the_same_whatever_the_layout(tmp_path):
    sets = ["model.preset=tiny-moe", "data.seq_len=32", "train.global_batch=8", "train.micro_batch=2", "train.steps=3",
            "train.moe_aux_loss=0.5"]
    train(tmp_path / "one", *sets)
    # dp 2 × tp 2 × ep 2: each token routed on both tp ranks of its replica, counted once.
    train(tmp_path / "dp", *sets, "parallel.tp=2", "parallel.ep=2", "memory.activation_checkpoint=full", nproc=4)
    rows = {name: [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
            for name in ("one", "dp")}
    assert_close_losses(losses(tmp_path / "dp"), losses(tmp_path / "one"))
    for a, b in zip(rows["one"], rows["dp"]):
        # Every token of the step reached 2 experts in each layer, once (recomputation not counted).
        assert a["tokens_per_expert"] == b["tokens_per_expert"] and all(sum(layer) == 8 * 32 * 2
                                                                        for layer in a["tokens_per_expert"])
        assert abs(a["moe_aux_loss"] - b["moe_aux_loss"]) <= 1e-5 * a["moe_aux_loss"]
    assert rows["one"][0]["moe_aux_loss"] > 2 * 0.99  # two layers, each at least 1 (1 = perfectly balanced)
    proc = run_cli("train", "--run-dir", str(tmp_path / "pp"), "--nproc", "2", *[a for s in sets for a in ("--set", s)],
                   "--set", "parallel.pp=2", check=False)
    assert proc.returncode == 2 and "train.moe_aux_loss with parallel.pp > 1" in proc.stderr


@pytest.mark.slow
def test_expert_parallel_equals_one_process_and_resumes_across_degrees(tmp_path):
    """ep 2 on 4 workers (each expert on 2 ranks: its gradient summed over them; hybrid sharding,
    2 replicas of ZeRO-3 over 2 ranks, for the rest of the model), tp 2 × ep 2
    × zero 3 (attention and the shared expert split over tp, experts over ep, sequence parallel; the
    aux-loss test runs tp 2 × ep 2 with zero 0), ep 4 ×
    zero 2 and ep 2 × pp 2 × zero 3: the losses of one process at every step; each ep rank holds
    1/ep of the experts, as the planner predicts; checkpoints continue under another ep degree
    and ZeRO level (ep 2 -> 4, ep 1 -> 2 × pp 2)."""
    sets = ["model.preset=tiny-moe", "data.seq_len=32", "train.global_batch=8", "train.micro_batch=2", "train.steps=4",
            "train.warmup_steps=1", "checkpoint.every=2", "train.moe_bias_rate=0.01",  # loss-free balancing on
            "model.n_shared_experts=1"]
    # Step 1's gradients dumped beside the runs (helpers.grads_dir) and compared parameter by parameter.
    train(tmp_path / "one", *sets, env=dump_grads(tmp_path / "one"))
    train(tmp_path / "ep2", *sets, "parallel.ep=2", "parallel.dp_replicate=2", "parallel.zero=3", nproc=4,
          env=dump_grads(tmp_path / "ep2"))
    train(tmp_path / "ep2_tp2", *sets, "parallel.ep=2", "parallel.tp=2", "parallel.zero=3", nproc=4,
          env=dump_grads(tmp_path / "ep2_tp2"))
    ck = {name: str(tmp_path / name / "checkpoints" / "step_2") for name in ("one", "ep2")}
    train(tmp_path / "ep4", *sets, "parallel.ep=4", "parallel.zero=2", nproc=4, extra=("--resume", ck["ep2"]))
    train(tmp_path / "ep2_pp2", *sets, "parallel.ep=2", "parallel.pp=2", "parallel.zero=3", nproc=4,
          extra=("--resume", ck["one"]))
    one = losses(tmp_path / "one")
    assert_close_losses(losses(tmp_path / "ep2"), one)
    assert_close_losses(losses(tmp_path / "ep2_tp2"), one)
    for name in ("ep2", "ep2_tp2"):  # the experts' gradients gathered over ep, the rest over FSDP (and tp)
        assert_same_gradients(grads_dir(tmp_path / name), grads_dir(tmp_path / "one"))
    for name in ("ep4", "ep2_pp2"):
        assert_close_losses(losses(tmp_path / name), one[2:])
    rows = {name: [json.loads(line)["tokens_per_expert"] for line in (tmp_path / name / "metrics.jsonl").open()]
            for name in ("one", "ep2", "ep2_tp2")}
    assert rows["one"] == rows["ep2"] == rows["ep2_tp2"]
    summaries = {name: json.loads((tmp_path / name / "summary.json").read_text())
                 for name in ("one", "ep2", "ep2_tp2", "ep4", "ep2_pp2")}
    for name, summary in summaries.items():
        assert summary["layout"]["ep"] == {"one": 1, "ep4": 4}.get(name, 2)
        assert abs(summary["plan_check"]["ratio_model_state"] - 1) < 0.01, (name, summary["plan_check"])
    experts = {name: [r["expert_param_bytes"] for r in summaries[name]["per_rank"]]
               for name in ("one", "ep2", "ep2_tp2", "ep4")}
    assert experts["one"][0] == 2 * 4 * 3 * 128 * 128 * 4  # 2 layers of 4 experts, fp32
    for name, ep in (("ep2", 2), ("ep2_tp2", 2), ("ep4", 4)):
        assert max(experts[name]) <= 1.05 * experts["one"][0] / ep, experts
    # The bias moved by 0.01 a step towards balance, by the step's global counts; checkpointed
    # (the resumed runs' losses depend on it) and loaded for inference.
    counts = torch.tensor(rows["one"], dtype=torch.float32)  # [steps, layers, experts]
    want = (0.01 * torch.sign(counts.mean(-1, keepdim=True) - counts)).sum(0)
    m = llmsplit.load(tmp_path / "ep2_pp2")
    got = torch.stack([m.runner.model.layers[str(i)].feed_forward.expert_bias for i in range(2)])
    assert want.abs().sum() > 0 and torch.allclose(got, want)
    split = llmsplit.load(tmp_path / "ep2_pp2", tp=2)  # the shared expert split over tp, the biased router whole
    try:
        ids = torch.randint(0, 264, (2, 13), generator=torch.Generator().manual_seed(0))
        torch.testing.assert_close(split.logits(ids), m.logits(ids), atol=1e-5, rtol=0)
    finally:
        split.close()


@pytest.mark.slow
def test_lora_adapts_attention_of_a_moe_model_under_expert_parallel(tmp_path):
    """LoRA on a MoE model adapts q, k, v, o (the experts are stacked weights, not nn.Linear:
    gate/up/down refused in one sentence); ep 2 on 2 workers logs one process's losses, and the
    planner counts the frozen experts without gradients or optimizer state."""
    sets = ["model.preset=tiny-moe", "data.seq_len=32", "train.global_batch=8", "train.micro_batch=2", "train.steps=3",
            "train.warmup_steps=1", "train.lr=1e-2", "lora.rank=4"]
    proc = run_cli("train", "--run-dir", str(tmp_path / "mlp"), *[a for s in sets for a in ("--set", s)], check=False)
    assert proc.returncode == 2 and "adapts gate, up, down, and this model's MLPs are mixtures of experts" in proc.stderr
    sets.append("lora.targets=q,k,v,o")
    train(tmp_path / "one", *sets)
    train(tmp_path / "ep2", *sets, "parallel.ep=2", nproc=2)
    assert_close_losses(losses(tmp_path / "ep2"), losses(tmp_path / "one"))
    check = json.loads((tmp_path / "ep2" / "summary.json").read_text())["plan_check"]
    assert abs(check["ratio_model_state"] - 1) < 0.01, check
