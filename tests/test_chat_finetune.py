"""Fine-tune an instruct model and keep it one (issue 22): the fine-tuning defaults, the
tokenizer compared by content, the run folder used from anywhere, and the chat template and
end-of-turn ids carried through the run, export and `generate --chat`.

One short fine-tune of a tiny chat folder, made as a newcomer would: the data prepared with
the tokenizer named by a relative path, the model named by a relative path (training reads
both as absolute ones), then used from another directory."""

import json
from pathlib import Path

import pytest

from helpers import run_cli, train
from hf_models import make_hf_folder, train_tokenizer

pytestmark = pytest.mark.slow

# A ChatML template like SmolLM2-Instruct's: a default system turn, <|im_end|> ends each turn.
TEMPLATE = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
            "{{ '<|im_start|>system\nYou are tiny.<|im_end|>\n' }}{% endif %}"
            "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
IM_END = 321  # the trained vocabulary has 320 tokens; the two chat markers come after it
DOC = "<|im_start|>user\nWhat is llmsplit?<|im_end|>\n<|im_start|>assistant\nA toolkit that splits models.<|im_end|>\n"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is llmsplit?"}]
SETS = ["data.seq_len=32", "train.global_batch=4", "train.micro_batch=2", "train.steps=2"]


def make_chat_folder(path: Path) -> Path:
    """A tiny Llama folder whose tokenizer files are a chat model's: <|im_end|> is eos in
    tokenizer_config.json and config.json, and generation_config.json lists it with </s>."""
    import transformers

    make_hf_folder(path, vocab_size=328, eos_token_id=IM_END)
    tok = train_tokenizer()
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    assert tok.token_to_id("<|im_end|>") == IM_END
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<|im_end|>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": [IM_END, 1]}))
    return path


def eos_ids(folder: Path, name: str) -> set[int]:
    eos = json.loads((folder / name).read_text())["eos_token_id"]
    return set(eos) if isinstance(eos, list) else {eos}


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    """(folder holding chat-hf/ and data/, the source model, the run) after a 2-step fine-tune."""
    base = tmp_path_factory.mktemp("chat")
    source = make_chat_folder(base / "chat-hf")
    (base / "data").mkdir()
    (base / "data" / "chat.txt").write_text(DOC * 20)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(base)
        run_cli("prepare", "data/chat.txt", "--out", "data/chat.tok", "--tokenizer", "chat-hf/tokenizer.json")
        proc = train(Path("run"), "model.hf=chat-hf", "data.source=data/chat.tok", *SETS)
    return base, source, base / "run", proc


def test_fine_tuning_defaults_when_weights_are_loaded(chat):
    """Not set by the user: the fine-tuning lr, warmup and weight decay, not the from-scratch ones."""
    from llmsplit.config import load_config

    cfg = load_config(chat[2] / "config.toml")
    assert (cfg.train.lr, cfg.train.warmup_steps, cfg.train.weight_decay) == (2e-5, 0, 0.0)
    assert "warning" not in chat[3].stderr


def test_a_from_scratch_lr_with_loaded_weights_is_kept_and_warned_about(chat, capsys):
    from llmsplit.config import Config
    from llmsplit.train.api import Workers, prepare_job

    folder = str(chat[1])
    job = prepare_job(None, [f"model.hf={folder}", "train.lr=3e-3"], None, "none", Workers(nproc=1))
    assert job.cfg.train.lr == 3e-3 and job.cfg.train.warmup_steps == 0  # the user's lr; the rest fine-tuning's
    assert "warning: train.lr=0.003 is a learning rate for training from random weights" in capsys.readouterr().err
    cfg = Config()  # the Python API: a value changed by attribute is the user's too
    cfg.model.hf, cfg.train.weight_decay = folder, 0.05
    job = prepare_job(cfg, [], None, "none", Workers(nproc=1))
    assert (job.cfg.train.lr, job.cfg.train.weight_decay) == (2e-5, 0.05)


def test_the_tokenizer_is_compared_by_content_and_another_is_refused_before_workers(chat, tmp_path, capsys):
    from llmsplit.io.token_file import read_token_file

    base, _, run, _ = chat
    header = read_token_file(base / "data" / "chat.tok")[1]
    assert header["tokenizer"] == "chat-hf/tokenizer.json"  # relative; training named it absolutely, and trained
    assert (run / "checkpoints").is_dir()
    other = tmp_path / "other.json"
    train_tokenizer(vocab_size=300).save(str(other))
    from llmsplit.cli import main

    capsys.readouterr()
    code = main(["train", "--nproc", "2", "--run-dir", str(tmp_path / "run"), "--set", f"data.tokenizer={other}",
                 "--set", f"data.source={base / 'data' / 'chat.tok'}"])
    err = capsys.readouterr().err
    assert code == 2 and "another tokenizer than data.tokenizer" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "run").exists()  # refused before any worker made the run folder


def test_the_run_works_from_another_directory(chat, tmp_path, monkeypatch):
    import llmsplit

    _, _, run, _ = chat
    monkeypatch.chdir(tmp_path)
    cfg = (run / "config.toml").read_text()
    assert f'source = "{chat[0] / "data" / "chat.tok"}"' in cfg  # paths as absolute ones
    assert (run / "tokenizer" / "tokenizer.json").is_file() and (run / "tokenizer" / "chat_template.jinja").is_file()
    m = llmsplit.load(str(run))
    assert m.tokenizer.name == str(run / "tokenizer" / "tokenizer.json")  # the run's own copy
    assert m.engine.eos_ids == {IM_END, 1}
    assert isinstance(m.generate("What is", max_new_tokens=3), str)
    m.close()


def test_export_keeps_the_chat_template_and_every_eos_id(chat, tmp_path):
    import transformers

    from llmsplit.cli import main
    from llmsplit.infer.chat import chat_prompt
    from llmsplit.io.tokenizer import load_tokenizer

    _, source, run, _ = chat
    out = tmp_path / "hf"
    assert main(["export", "--checkpoint", str(run), "--to", "hf", str(out)]) == 0
    assert (out / "chat_template.jinja").read_text() == (source / "chat_template.jinja").read_text()
    want = eos_ids(source, "config.json") | eos_ids(source, "generation_config.json")
    assert eos_ids(out, "config.json") == eos_ids(out, "generation_config.json") == want == {IM_END, 1}
    theirs = transformers.AutoTokenizer.from_pretrained(out).apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert theirs == transformers.AutoTokenizer.from_pretrained(source).apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert chat_prompt(MESSAGES, load_tokenizer(str(out)))[0] == list(theirs)


def test_generate_chat_renders_the_models_template(chat):
    import transformers

    _, source, _, _ = chat
    proc = run_cli("generate", "--model", str(source), "--chat", "--system", "Be brief.", "--show-prompt",
                   "--max-new-tokens", "3", "What is llmsplit?")
    want = transformers.AutoTokenizer.from_pretrained(source).apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=False)
    assert want.startswith("<|im_start|>system\nBe brief.<|im_end|>") and want in proc.stderr, proc.stderr
    bad = run_cli("generate", "--model", str(source), "--system", "Be brief.", "hi", check=False)
    assert bad.returncode == 2 and "--system needs --chat" in bad.stderr
