"""LoRA (issue 17): adapters applied from outside the plain model, the base frozen; every layout
logs the single-process loss; gradients, optimizer state and checkpoints hold the adapters only,
and an adapters-only checkpoint resumes under another layout."""

import json

import pytest
import torch
from helpers import assert_close_losses, assert_same_gradients, dump_grads, grads_dir, losses, run_cli, train

from llmsplit.adapters.lora import LoRALinear, apply_lora, init_lora
from llmsplit.config import ConfigError, load_config, validate
from llmsplit.models.llama import LlamaConfig, Transformer

CFG = LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, ffn_dim=128, max_seq_len=32)


def test_adapters_start_as_the_base_and_only_they_train():
    base = Transformer(CFG)
    base.init_weights(0)
    model = Transformer(CFG)
    model.load_state_dict(base.state_dict())
    apply_lora(model, rank=4, alpha=8, dropout=0.0, targets=["q", "v", "down"])
    init_lora(model, 0)
    tokens = torch.randint(0, 64, (2, 16))
    assert torch.equal(model(tokens), base(tokens))  # B = 0: the update starts at nothing
    trained = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert trained == sorted(f"layers.{i}.{m}.lora_{x}" for i in range(2) for m in
                             ("attention.wq", "attention.wv", "feed_forward.w2") for x in "ab")
    assert isinstance(model.layers["0"].attention.wq, LoRALinear)
    assert type(model.layers["0"].attention.wk) is torch.nn.Linear
    a = model.layers["1"].feed_forward.w2.lora_a
    assert a.shape == (4, 128) and a.abs().max() <= 1 / 128 ** 0.5  # PEFT's kaiming-uniform bound
    with torch.no_grad():
        model.layers["0"].attention.wq.lora_b.fill_(0.1)
    model(tokens).sum().backward()
    assert all(p.grad is None for n, p in model.named_parameters() if not p.requires_grad)
    assert model.layers["0"].attention.wq.lora_a.grad.abs().sum() > 0


@pytest.mark.parametrize("bias", [False, True])
def test_the_cpu_lora_matmul_gives_the_float64_products_and_gradients(bias):
    """A float32 CPU LoRA layer computes through _LoRAMatmul (oneDNN, backward by hand): its output
    and the gradients of its input, bias and adapters are float64 autograd's; the frozen weight
    gets none; with dropout, the adapter's input is F.dropout's."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch is built without oneDNN: LoRA layers take the composed path")
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 48, bias=bias)
    layer.requires_grad_(False)
    layer.register_parameter("lora_a", torch.nn.Parameter(torch.randn(8, 64) * 0.1))
    layer.register_parameter("lora_b", torch.nn.Parameter(torch.randn(48, 8) * 0.1))
    layer.__class__, layer.lora_scale = LoRALinear, 2.0
    if bias:
        layer.bias.requires_grad_(True)
    x = torch.randn(3, 5, 64, requires_grad=True)
    out = layer(x)
    assert type(out.grad_fn).__name__ == "_LoRAMatmulBackward"
    grad = torch.randn_like(out)
    out.backward(grad)
    wide = {n: t.detach().double().requires_grad_() for n, t in
            (("x", x), ("a", layer.lora_a), ("b", layer.lora_b)) + ((("bias", layer.bias),) if bias else ())}
    want = torch.nn.functional.linear(wide["x"], layer.weight.double(), wide.get("bias")) + \
        (wide["x"] @ wide["a"].T @ wide["b"].T) * 2.0
    want.backward(grad.double())
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-6)
    for name, got in (("x", x.grad), ("a", layer.lora_a.grad), ("b", layer.lora_b.grad)) + \
            ((("bias", layer.bias.grad),) if bias else ()):
        torch.testing.assert_close(got.double(), wide[name].grad, rtol=1e-5, atol=1e-6)
    assert layer.weight.grad is None
    # With dropout the adapter sees F.dropout(x) (the same mask from the same seed) and the base x.
    layer.lora_dropout, x.grad, layer.lora_a.grad = 0.5, None, None
    torch.manual_seed(1)
    out = layer(x)
    out.backward(grad)
    torch.manual_seed(1)
    keep = torch.nn.functional.dropout(torch.ones_like(x), 0.5).double()  # the same draws: F.dropout's mask
    xd, a = x.detach().double().requires_grad_(), layer.lora_a.detach().double().requires_grad_()
    want = torch.nn.functional.linear(xd, layer.weight.double(), layer.bias.double() if bias else None) + \
        ((xd * keep) @ a.T @ layer.lora_b.double().T) * 2.0
    want.backward(grad.double())
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad.double(), xd.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(layer.lora_a.grad.double(), a.grad, rtol=1e-5, atol=1e-5)


def test_a_checkpoint_of_a_tied_model_holds_the_adapters_only():
    """A tied head is the frozen embedding under a second name, which torch's ignore_frozen_params
    kept: SmolLM2's LoRA runs saved it as trained, and their generate/serve/export refused them."""
    from dataclasses import replace

    from llmsplit.train.checkpoint import _model_state

    model = Transformer(replace(CFG, tie_embeddings=True))
    apply_lora(model, rank=4, alpha=8, dropout=0.0, targets=["q", "v"])
    assert model.output.weight is model.tok_embeddings.weight
    assert sorted(_model_state(model)) == sorted(f"layers.{i}.attention.w{m}.lora_{x}" for i in range(2)
                                                 for m in "qv" for x in "ab")


@pytest.mark.parametrize("sets, fragment", [
    (["lora.rank=-1"], "lora.rank=-1 must be at least 0"),
    (["lora.rank=8", "lora.targets=q,x"], "comma-separated list of: q, k, v, o, gate, up, down"),
    (["lora.rank=8", "lora.dropout=1.0"], "below 1"),
])
def test_lora_keys_are_checked(sets, fragment):
    with pytest.raises(ConfigError, match=fragment):
        validate(load_config(None, sets), 1)


MP = ["model.dim=64", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=128",
      "data.seq_len=32", "train.global_batch=8", "train.micro_batch=2", "train.steps=4", "train.warmup_steps=1",
      "train.lr=1e-2", "lora.rank=4", "checkpoint.every=2"]
# 4 layers x adapters of rank 4 on q, k, v, o, gate, up, down (dims 64, 32 for k/v, 128 for the MLP).
ADAPTER_PARAMS = 4 * 4 * ((64 + 64) + 2 * (64 + 32) + (64 + 64) + 3 * (64 + 128))


REFERENCE_STDERR = []  # what the reference run printed


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run = tmp_path_factory.mktemp("lora") / "run"
    REFERENCE_STDERR.append(train(run, *MP, "train.micro_batch=8", nproc=1, env=dump_grads(run, step=2)).stderr)
    return run


def test_parameter_counts_are_the_whole_models_each_parameter_once():
    """summary.json's params (the model's, as num_params computes them) and trainable_params
    (LoRA: the adapters), counted on the whole model however a rank's share is split."""
    from llmsplit.adapters.lora import parameter_counts

    cfg = LlamaConfig(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=264)
    assert parameter_counts(cfg, 4, "q,k,v,o,gate,up,down") == {"params": cfg.num_params(),
                                                                 "trainable_params": ADAPTER_PARAMS}
    tied = LlamaConfig(dim=64, n_layers=2, n_heads=4, vocab_size=264, ffn_dim=128, tie_embeddings=True)
    assert parameter_counts(tied) == {"params": tied.num_params(), "trainable_params": tied.num_params()}


@pytest.mark.slow
def test_one_process_holds_gradients_and_state_of_the_adapters_only(reference):
    from llmsplit.config import model_config
    from llmsplit.io import dcp_files

    summary = json.loads((reference / "summary.json").read_text())
    (rank0,) = summary["per_rank"]
    assert rank0["grad_bytes"] == 4 * ADAPTER_PARAMS and rank0["optim_bytes"] == 8 * ADAPTER_PARAMS
    params = model_config(load_config(reference / "config.toml"), 258).num_params()
    assert (summary["params"], summary["trainable_params"]) == (params, ADAPTER_PARAMS)
    assert rank0["param_bytes"] == 4 * (params + ADAPTER_PARAMS)  # the one rank holds each parameter once
    assert "frozen_base_bytes" not in summary  # an fp32 base: params says it
    assert (f"llmsplit: model {params / 1e6:.2f}M parameters, frozen; trainable {ADAPTER_PARAMS / 1e6:.2f}M in LoRA "
            f"adapters ({ADAPTER_PARAMS / params:.2%} of the model's)\n") in REFERENCE_STDERR[0]
    assert summary["plan_check"]["ratio_model_state"] == pytest.approx(1.0, abs=1e-3)  # the planner counts them
    saved = dcp_files.saved_model_shapes(dcp_files.read_metadata(reference / "checkpoints" / "step_4"))
    assert len(saved) == 4 * 7 * 2 and all(name.endswith(("lora_a", "lora_b")) for name in saved)


@pytest.mark.slow
@pytest.mark.parametrize("nproc, sets", [(2, ["parallel.zero=0"]), (4, ["parallel.pp=2", "parallel.zero=1"]),
                                         (4, ["parallel.zero=2", "parallel.dp_replicate=2",
                                              "memory.activation_checkpoint=full"])],
                         ids=["ddp", "pp2-zero1", "hybrid-checkpointed"])
def test_layouts_log_the_single_process_loss(reference, tmp_path, nproc, sets):
    train(tmp_path / "run", *MP, *sets, nproc=nproc, env=dump_grads(tmp_path / "run", step=2))
    assert_close_losses(losses(tmp_path / "run"), losses(reference))
    # The adapters' gradients (the base has none), at step 2: at step 1 every lora_a's is zero.
    assert_same_gradients(grads_dir(tmp_path / "run"), grads_dir(reference))


@pytest.mark.slow
def test_adapters_resume_under_fsdp_and_tensor_parallel(reference, tmp_path):
    """The step-2 checkpoint of one process (adapters and their optimizer state) continues under
    ZeRO-3 x tp 2 with the single-process losses of steps 3 and 4."""
    run = tmp_path / "run"
    train(run, *MP, "parallel.zero=3", "parallel.tp=2", nproc=4,
          extra=("--resume", str(reference / "checkpoints" / "step_2")))
    assert_close_losses(losses(run), losses(reference)[2:])
    assert json.loads((run / "summary.json").read_text())["plan_check"]["ratio_model_state"] == pytest.approx(1.0, abs=1e-3)
    proc = train(tmp_path / "other", *MP, "lora.rank=8", nproc=1, check=False,
                 extra=("--resume", str(reference / "checkpoints" / "step_2")))
    assert proc.returncode == 2 and "holds LoRA adapters of rank 4" in proc.stderr


@pytest.mark.slow
def test_generate_and_export_merge_the_adapters(reference, tmp_path):
    """`llmsplit.load(RUN)` of a LoRA run (and `export --to hf`) is the base with each adapter
    merged: the logits of the adapted model that trained, rebuilt here from the checkpoint."""
    import llmsplit
    from llmsplit.config import model_config
    from llmsplit.io import dcp_files

    cfg = load_config(reference / "config.toml")
    model = Transformer(model_config(cfg, 258))
    model.init_weights(cfg.train.seed)
    apply_lora(model, 4, cfg.lora.alpha, 0.0, list("qkvo") + ["gate", "up", "down"])
    ck = reference / "checkpoints" / "step_4"
    state = {"model": {n: torch.empty(s) for n, s in dcp_files.saved_model_shapes(dcp_files.read_metadata(ck)).items()}}
    dcp_files.load(state, ck)
    model.load_state_dict(state["model"], strict=False)
    tokens = torch.randint(0, 258, (1, 12))
    want = model(tokens)
    assert (model.layers["0"].attention.wq.lora_b != 0).any()  # the adapters did train
    torch.testing.assert_close(llmsplit.load(str(reference), device_map="cpu").logits(tokens), want,
                               rtol=1e-5, atol=1e-5)
    run_cli("export", "--checkpoint", str(reference), "--to", "hf", str(tmp_path / "hf"))
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    torch.testing.assert_close(hf(tokens).logits, want, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_a_lora_run_on_a_hugging_face_base_exports_a_peft_adapter(tmp_path):
    """`export --to peft`: PEFT's names, shapes and scale. Applied to the transformers model of
    model.hf the way PEFT merges it (W + lora_alpha / r * B @ A), the adapter gives the logits of
    `llmsplit.load(RUN)`, and so does peft's own PeftModel.from_pretrained over that model."""
    import transformers
    from hf_models import make_hf_folder, merge_peft_adapter
    from peft import PeftModel
    from safetensors.torch import load_file

    import llmsplit

    base = make_hf_folder(tmp_path / "base")
    train(tmp_path / "run", f"model.hf={base}", "lora.rank=4", "lora.alpha=8", "lora.targets=q,v,down",
          "train.lr=1e-2", "data.seq_len=32", "train.global_batch=4", "train.micro_batch=4", "train.steps=2", nproc=1)
    run_cli("export", "--checkpoint", str(tmp_path / "run"), "--to", "peft", str(tmp_path / "adapter"))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (4, 8, ["down_proj", "q_proj", "v_proj"])
    adapter = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert adapter["base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"].shape == (4, 128)
    model = merge_peft_adapter(transformers.AutoModelForCausalLM.from_pretrained(base), tmp_path / "adapter", scale=8 / 4)
    tokens = torch.randint(0, 300, (1, 12))
    want = llmsplit.load(str(tmp_path / "run"), device_map="cpu").logits(tokens)
    torch.testing.assert_close(model(tokens).logits, want, rtol=1e-4, atol=1e-4)
    peft_model = PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base), tmp_path / "adapter")
    with torch.no_grad():
        torch.testing.assert_close(peft_model(tokens).logits, want, rtol=1e-4, atol=1e-4)
    assert (tmp_path / "adapter" / "tokenizer.json").is_file()


@pytest.mark.slow
def test_lora_init_continues_from_a_peft_adapter_or_a_run(tmp_path):
    """On data of exactly one global batch every step sees the same rows, so a run whose adapters
    start from another's step-2 adapters (its PEFT export, or its checkpoint) logs at step 1 the
    loss the other logged at step 3, under another layout too."""
    from hf_models import make_hf_folder

    base = make_hf_folder(tmp_path / "base")
    (tmp_path / "one.txt").write_text("x" * 120)
    sets = [f"model.hf={base}", "lora.rank=4", "lora.alpha=8", "train.lr=1e-2", "data.seq_len=24",
            f"data.source=text:{tmp_path / 'one.txt'}", "train.global_batch=4", "train.micro_batch=4"]
    train(tmp_path / "a", *sets, "train.steps=3", "checkpoint.every=2", nproc=1)
    run_cli("export", "--checkpoint", str(tmp_path / "a" / "checkpoints" / "step_2"), "--to", "peft",
            str(tmp_path / "adapter"))
    step3 = losses(tmp_path / "a")[2:]
    train(tmp_path / "b", *sets, "train.steps=1", f"lora.init={tmp_path / 'adapter'}", "parallel.tp=2", nproc=2)
    assert_close_losses(losses(tmp_path / "b"), step3)
    train(tmp_path / "c", *sets, "train.steps=1", f"lora.init={tmp_path / 'a' / 'checkpoints' / 'step_2'}", nproc=1)
    assert_close_losses(losses(tmp_path / "c"), step3)
    proc = train(tmp_path / "d", *sets, "lora.rank=8", f"lora.init={tmp_path / 'adapter'}", nproc=1, check=False)
    assert proc.returncode == 2 and "is an adapter of r=4, lora_alpha=8; set lora.rank" in proc.stderr


def test_lora_on_trained_weights_takes_the_lora_lr_and_says_which_default_applied(tmp_path, capsys):
    """Issue 51: with [lora] on model.hf an unset train.lr is LoRA's 2e-4 (full fine-tuning's 2e-5
    barely moved SmolLM2's loss in 20 steps), the start says which defaults applied and why, and
    an lr set far outside LoRA's usual range gets one warning line."""
    from hf_models import make_hf_folder

    from llmsplit.train.api import Workers, prepare_job

    base = make_hf_folder(tmp_path / "base")
    capsys.readouterr()  # transformers' progress bar of writing it

    def prepared(*sets):
        job = prepare_job(None, [f"model.hf={base}", *sets], None, "none", Workers(nproc=1))
        return job.cfg.train, capsys.readouterr().err

    t, err = prepared("lora.rank=4")
    assert (t.lr, t.warmup_steps, t.weight_decay) == (2e-4, 0, 0.0)
    assert err == ("llmsplit: model.hf holds trained weights, so the keys not set take fine-tuning values: "
                   "train.lr=0.0002 (LoRA's: PEFT, TRL and torchtune recipes use 1e-4 to 3e-4), train.warmup_steps=0, "
                   "train.weight_decay=0\n")
    t, err = prepared()  # full fine-tuning keeps its own
    assert t.lr == 2e-5 and "train.lr=2e-05 (full fine-tuning's: TRL's default, torchtune's recipes)" in err
    for lr, said in (("1e-2", "far above LoRA's usual 1e-4 to 3e-4 (PEFT, TRL and torchtune recipes): the adapters "
                               "can diverge (leave train.lr unset for the LoRA default 0.0002)"),
                     ("2e-6", "far below LoRA's usual 1e-4 to 3e-4 (PEFT, TRL and torchtune recipes): the adapters "
                              "barely learn")):
        t, err = prepared("lora.rank=4", f"train.lr={lr}", "train.warmup_steps=5", "train.weight_decay=0.01")
        assert t.lr == float(lr) and err.startswith(f"llmsplit: warning: train.lr={float(lr):g} is {said}"), err
        assert err.count("\n") == 1, err  # every other key set: the warning alone
    t, err = prepared("lora.rank=4", "train.lr=5e-4")  # within LoRA's range (issue 51's working recipe)
    assert t.lr == 5e-4 and "warning" not in err


def test_the_planner_counts_gradients_and_optimizer_state_of_the_adapters_only():
    from llmsplit.layout import Layout, Workload
    from llmsplit.models.presets import PRESETS
    from llmsplit.plan.hardware import get_device
    from llmsplit.plan.memory import memory_per_device

    cfg, gpu = LlamaConfig(**PRESETS["llama-3-8b"]), get_device("H100-80GB")
    full = memory_per_device(cfg, Layout(dp=1), Workload(seq_len=2048, global_batch=1), gpu)
    lora = memory_per_device(cfg, Layout(dp=1), Workload(seq_len=2048, global_batch=1, lora_rank=16), gpu)
    adapters = 41_943_040  # PEFT's trainable count for r=16 on every linear of Llama-3-8B's 32 layers
    assert (lora.grads, lora.optimizer) == (4 * adapters, 8 * adapters)
    assert lora.params == full.params + 4 * adapters
    tp2 = memory_per_device(cfg, Layout(dp=1, tp=2), Workload(seq_len=2048, global_batch=1, lora_rank=16), gpu)
    assert adapters // 2 < tp2.grads // 4 < adapters  # B split under column parallel, A under row parallel


def test_an_unset_alpha_is_twice_the_rank_and_a_set_one_is_kept():
    """A scale of 2 whatever the rank (guide §12: SmolLM2's 40 default steps reach 0.31, not 1.07)."""
    from llmsplit.config import check_lora, load_config

    for sets, alpha in ((["lora.rank=16"], 32.0), (["lora.rank=4"], 8.0), (["lora.rank=16", "lora.alpha=16"], 16.0)):
        cfg = load_config(None, sets)
        check_lora(cfg.lora)
        assert cfg.lora.alpha == alpha, sets
