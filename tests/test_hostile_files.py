"""Model files made to break the loader (issue 21, items 1 and 6): metadata that claims 10⁹
layers, zero heads, a size written as text, tensors that disagree with the config, a
safetensors index that points outside its folder. Each is refused with exit status 2 and one
sentence that names the key, within bounded time and memory, by every entry point that reads
it (`generate`, `llmsplit.load`, `plan --model`, `train --set model.hf=`).

The files are tiny and written here: safetensors with the `safetensors` package, GGUF with
the `gguf` package's writer, a run folder's checkpoint with torch.distributed.checkpoint."""

from __future__ import annotations

import json
import re
import resource
import time
import tracemalloc
import warnings

import pytest
import torch

import llmsplit
from llmsplit.cli import main
from llmsplit.errors import ConfigError
from llmsplit.io.hf import to_hf_name
from llmsplit.models.llama import LlamaConfig, Transformer

TIME_LIMIT_S = 30.0  # generous: the refusals take well under a second on an idle machine
MEMORY_LIMIT = 256 * 2**20  # Python allocations during one refusal (a list of 9e9 names needs far more)

SIZES = LlamaConfig(dim=16, n_layers=2, n_heads=2, n_kv_heads=1, vocab_size=8, ffn_dim=32, max_seq_len=64)
HF_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 16,
             "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
             "vocab_size": 8, "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "eos_token_id": 1}
WORDS = ["<s>", "</s>", "[UNK]", "the", "def", "statement", "hi", "a"]


def bounded(call):
    """`call()`, failing the test if it takes more than TIME_LIMIT_S, allocates more than
    MEMORY_LIMIT through Python, or (on Linux) maps more than 1 GiB of new address space: the
    address-space cap turns a runaway allocation into a MemoryError here, not an OOM kill."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    try:
        with open("/proc/self/status") as f:
            vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
        cap = vm + 2**30
        if hard == resource.RLIM_INFINITY or cap < hard:
            resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    except OSError:
        pass  # no /proc: the tracemalloc bound below still holds
    tracemalloc.start()
    start = time.perf_counter()
    try:
        result = call()
    finally:
        elapsed = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    assert elapsed < TIME_LIMIT_S, f"took {elapsed:.1f} s"
    assert peak < MEMORY_LIMIT, f"allocated {peak / 2**20:.0f} MiB"
    return result


def refused(capsys, *argv) -> str:
    """The one line `llmsplit ARGV` prints to standard error, after checking it exits 2."""
    capsys.readouterr()
    code = bounded(lambda: main(list(argv)))
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def weights_of(cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    with torch.device("meta"):
        shapes = {name: t.shape for name, t in Transformer(cfg).state_dict().items()}
    return {name: 0.1 * torch.randn(shape) for name, shape in shapes.items()}


def write_tokenizer(path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))


def hf_folder(path, config=None, tensors=None):
    """A Llama folder of SIZES (config.json, one model.safetensors, tokenizer.json); `config`
    overrides config.json keys, `tensors` replaces or adds tensors (under our names)."""
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({**HF_CONFIG, **(config or {})}))
    weights = {**weights_of(SIZES), **(tensors or {})}
    save_file({to_hf_name(name): t.contiguous() for name, t in weights.items()}, str(path / "model.safetensors"))
    write_tokenizer(path / "tokenizer.json")
    return path


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return hf_folder(tmp_path_factory.mktemp("hostile") / "good")


def test_a_well_formed_folder_loads(good):
    # The control: the files these tests write are a model llmsplit runs.
    m = llmsplit.load(good)
    assert m.generate("the def", max_new_tokens=2, ignore_eos=True) is not None


@pytest.mark.parametrize("config,words", [
    ({"num_hidden_layers": 10**9}, ["num_hidden_layers is 1000000000", "more layers than llmsplit builds"]),
    ({"num_hidden_layers": 3}, ["num_hidden_layers is 3 but the file holds the tensors of 2 layers"]),
    ({"num_attention_heads": 0}, ["num_attention_heads is 0", "positive int"]),
    ({"hidden_size": "16"}, ["hidden_size is '16'", "positive int"]),
    ({"num_key_value_heads": 3, "num_attention_heads": 4}, ["num_attention_heads 4 is not a multiple of "
                                                            "num_key_value_heads 3"]),
])
def test_hostile_config_json_is_refused_by_every_entry_point(tmp_path, capsys, config, words):
    folder = hf_folder(tmp_path / "m", config=config)
    for argv in (["generate", "--model", str(folder), "hi"], ["plan", "--model", str(folder), "--gpus", "2"],
                 ["train", "--run-dir", str(tmp_path / "run"), "--set", f"model.hf={folder}"]):
        err = refused(capsys, *argv)
        assert all(w in err for w in words), (argv[0], err)
    with pytest.raises(ConfigError, match=re.escape(words[0])):
        bounded(lambda: llmsplit.load(folder))
    assert not (tmp_path / "run").exists()  # refused before the run folder was made


def test_a_tensor_that_disagrees_with_config_json_is_named(tmp_path, capsys):
    folder = hf_folder(tmp_path / "m", tensors={"layers.1.feed_forward.w3.weight": torch.zeros(24, 16)})
    err = refused(capsys, "generate", "--model", str(folder), "hi")
    assert "tensor model.layers.1.mlp.up_proj.weight is [24, 16] in the file" in err and "[32, 16]" in err, err
    assert "does not match the safetensors weights" in refused(capsys, "plan", "--model", str(folder), "--gpus", "1")
    lacking = hf_folder(tmp_path / "lacks", config={"tie_word_embeddings": False})
    from safetensors.torch import save_file

    save_file({to_hf_name(n): t for n, t in weights_of(SIZES).items() if n != "layers.0.ffn_norm.weight"},
              str(lacking / "model.safetensors"))
    assert "lacks the tensor model.layers.0.post_attention_layernorm.weight [16]" in \
        refused(capsys, "generate", "--model", str(lacking), "hi")


@pytest.mark.parametrize("outside", ["../outside.safetensors", "/etc/passwd", "shards/../../outside.safetensors"])
def test_an_index_never_leads_out_of_the_folder(tmp_path, good, capsys, outside):
    import shutil

    # A complete model lies next to the folder: following the index would load it.
    shutil.copy(good / "model.safetensors", tmp_path / "outside.safetensors")
    folder = tmp_path / "m"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(good / name, folder / name)
    weight_map = {to_hf_name(n): outside for n in weights_of(SIZES)}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    for argv in (["generate", "--model", str(folder), "hi"], ["plan", "--model", str(folder), "--gpus", "1"]):
        err = refused(capsys, *argv)
        assert f"names the weight file {outside!r}, which is not inside the model folder" in err, err
    # Inside the folder, a subfolder is fine: only the way out is closed.
    (folder / "shards").mkdir()
    shutil.copy(good / "model.safetensors", folder / "shards" / "w.safetensors")
    weight_map = {name: "shards/./w.safetensors" for name in weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert llmsplit.load(folder).config.n_layers == 2


def test_an_index_whose_files_are_not_downloaded_plans_from_config_json(tmp_path, good, capsys):
    # config.json and the index alone, as one fetches them to plan before downloading the weights.
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text((good / "config.json").read_text())
    weight_map = {to_hf_name(n): "model-00001-of-00002.safetensors" for n in weights_of(SIZES)}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    capsys.readouterr()
    assert main(["plan", "--model", str(folder), "--gpus", "1", "--json"]) == 0, capsys.readouterr().err
    err = refused(capsys, "generate", "--model", str(folder), "hi")
    assert "model-00001-of-00002.safetensors' is not a readable safetensors file" in err, err


def write_gguf(path, metadata=None, tensors=None):
    """A GGUF file of SIZES with a byte-free word tokenizer; `metadata` (key -> value, added as
    the gguf writer's add_* calls would) replaces the llama.* keys, `tensors` replaces tensors."""
    gguf = pytest.importorskip("gguf")
    from llmsplit.io.gguf import to_gguf_name

    keys = {"block_count": SIZES.n_layers, "context_length": SIZES.max_seq_len, "embedding_length": SIZES.dim,
            "feed_forward_length": SIZES.ffn_dim, "attention.head_count": SIZES.n_heads,
            "attention.head_count_kv": SIZES.n_kv_heads, **(metadata or {})}
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in keys.items():
        (w.add_string if isinstance(value, str) else w.add_uint32)(f"llama.{key}", value)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(WORDS)
    w.add_token_merges([])
    w.add_eos_token_id(1)
    weights = {**weights_of(SIZES), **(tensors or {})}
    weights.pop("output.weight")  # tied, as many GGUFs are
    for name, t in weights.items():
        w.add_tensor(to_gguf_name(name), t.numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_well_formed_gguf_loads(tmp_path):
    m = llmsplit.load(write_gguf(tmp_path / "m.gguf"))
    assert m.config.n_layers == 2 and m.config.tie_embeddings
    assert m.logits(torch.tensor([[3, 4, 5]])).shape == (1, 3, SIZES.vocab_size)


@pytest.mark.parametrize("metadata,tensors,words", [
    ({"block_count": 10**9}, None, ["llama.block_count is 1000000000", "more layers than llmsplit builds"]),
    ({"block_count": 3}, None, ["llama.block_count is 3 but the file holds the tensors of 2 layers"]),
    ({"attention.head_count": 0}, None, ["llama.attention.head_count is 0", "positive integer"]),
    ({"embedding_length": "16"}, None, ["llama.embedding_length is '16'", "positive integer"]),
    ({"attention.head_count_kv": 3, "attention.head_count": 4}, None,
     ["llama.attention.head_count 4 is not a multiple of llama.attention.head_count_kv 3"]),
    (None, {"layers.0.attention.wk.weight": torch.zeros(4, 16)},
     ["tensor blk.0.attn_k.weight is [4, 16] in the file but the config's sizes make it [8, 16]"]),
])
def test_hostile_gguf_is_refused(tmp_path, capsys, metadata, tensors, words):
    path = write_gguf(tmp_path / "m.gguf", metadata, tensors)
    assert path.stat().st_size < 64 * 1024
    err = refused(capsys, "generate", "--model", str(path), "hi")
    assert all(w in err for w in words), err
    with pytest.raises(ConfigError, match=re.escape(words[0])):
        bounded(lambda: llmsplit.load(path))


def run_folder(path, **model):
    """A training run's folder as `llmsplit train` leaves it: config.toml and one complete
    checkpoint (DCP files and train_state.json) of a 2-layer model; `model` overrides the
    [model] keys config.toml names (TOML text)."""
    import torch.distributed.checkpoint as dcp

    cfg = LlamaConfig(dim=16, n_layers=2, n_heads=2, n_kv_heads=1, vocab_size=264, ffn_dim=32, max_seq_len=64)
    ck = path / "checkpoints" / "step_1"
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": weights_of(cfg)}, checkpoint_id=str(ck))
    (ck / "train_state.json").write_text(json.dumps({"step": 1}))
    keys = {"dim": "16", "n_layers": "2", "n_heads": "2", "n_kv_heads": "1", "ffn_dim": "32", "max_seq_len": "64",
            **model}
    (path / "config.toml").write_text("[model]\n" + "".join(f"{k} = {v}\n" for k, v in keys.items())
                                      + '[data]\ntokenizer = "byte"\n')
    return path


def test_a_well_formed_run_folder_loads(tmp_path):
    assert llmsplit.load(run_folder(tmp_path / "good")).config.n_layers == 2


@pytest.mark.parametrize("model,words", [
    ({"n_layers": "1000000000"}, ["model.n_layers is 1000000000 but the file holds the tensors of 2 layers",
                                  "config.toml", "step_1"]),
    ({"n_kv_heads": "2"}, ["tensor layers.0.attention.wk.weight is [8, 16] in the file but the config's sizes "
                           "make it [16, 16]"]),
    ({"n_heads": "0"}, ["model.n_heads=0 must be at least 1"]),
    ({"dim": '"16"'}, ["model.dim must be an integer, got '16'"]),
])
def test_a_run_folder_whose_config_disagrees_with_its_checkpoint_is_refused(tmp_path, capsys, model, words):
    err = refused(capsys, "generate", "--model", str(run_folder(tmp_path / "bad", **model)), "hi")
    assert all(w in err for w in words), err


def test_checkpoint_metadata_pickled_with_enums_by_name_loads_and_other_getattrs_do_not(tmp_path):
    """Some Pythons (Debian's 3.11.2) pickle an enum member as getattr(EnumClass, name), so a
    checkpoint's .metadata calls builtins.getattr for the tensors' memory format: README line
    1 failed there ("refers to builtins.getattr"). The metadata reader accepts that for DCP's
    own enums only; getattr on anything else is still refused."""
    import enum
    import io
    import pickle

    import torch
    import torch.distributed.checkpoint.metadata as m

    from llmsplit.io.dcp_files import UnsafeCheckpoint, read_metadata

    class ByName(pickle.Pickler):
        def reducer_override(self, obj):
            if isinstance(obj, enum.Enum):
                return getattr, (type(obj), obj.name)
            return NotImplemented

    def write(obj):
        buf = io.BytesIO()
        ByName(buf, protocol=4).dump(obj)
        (tmp_path / ".metadata").write_bytes(buf.getvalue())
        return buf.getvalue()

    tensor = m.TensorStorageMetadata(m.TensorProperties(dtype=torch.float32), torch.Size([2]), [])
    assert b"getattr" in write(m.Metadata(state_dict_metadata={"w": tensor}))
    assert read_metadata(tmp_path).state_dict_metadata["w"].size == torch.Size([2])

    class Sneaky:
        def __reduce__(self):
            return getattr, (m.Metadata, "__init__")

    write(m.Metadata(state_dict_metadata={"w": tensor}, planner_data=Sneaky()))
    with pytest.raises(UnsafeCheckpoint, match="calls getattr on"):
        read_metadata(tmp_path)


# Chat templates that never end, or that double a string 40 times (1 TiB), sprung by the message.
HOSTILE_TEMPLATE = (
    "{% if messages[-1]['content'] == 'spin' %}{% for i in range(100000) %}{% for j in range(100000) %}"
    "{% endfor %}{% endfor %}{% endif %}"
    "{% if messages[-1]['content'] == 'double' %}{% set ns = namespace(s='x') %}{% for i in range(40) %}"
    "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")


def test_a_hostile_chat_template_is_stopped_at_its_limits(tmp_path, good, capsys):
    import shutil

    folder = tmp_path / "hostile-template"
    shutil.copytree(good, folder)
    (folder / "chat_template.jinja").write_text(HOSTILE_TEMPLATE)
    base = ["generate", "--model", str(folder), "--chat", "--max-new-tokens", "1"]
    start = time.monotonic()
    err = refused(capsys, *base, "--template-timeout", "1", "spin")
    assert "ran for more than 1 s and was stopped (--template-timeout raises the limit)" in err, err
    assert time.monotonic() - start < 15
    # The string grows in the template's process, capped at 256 MiB; this process (held to 1 GiB
    # of new address space by `refused`) never holds it.
    err = refused(capsys, *base, "--template-max-bytes", "256MiB", "double")
    assert "needed more than 256 MiB of memory and was stopped (--template-max-bytes raises the limit)" in err, err
    assert main([*base, "hi"]) == 0  # the same template on a message that springs no trap
