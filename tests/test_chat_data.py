"""Chat data (issue 17): the assistant mask from the model's own chat template, with and
without generation markers, templates for which no correct mask exists refused; chat token
files (tokens + mask + document offsets); packing whose loss equals that of the documents
one by one."""

import json

import numpy as np
import pytest
import torch
from helpers import run_cli

from llmsplit.config import ConfigError, load_config, validate
from llmsplit.data.chat import Documents, encode_conversation
from llmsplit.data.loader import IGNORE
from llmsplit.data.packing import PackedSampler
from llmsplit.io.tokenizer import ByteTokenizer

CHATML = ("{% for message in messages %}"
          "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# The same format, with transformers' markers around what an assistant turn trains on: the
# reply and its <|im_end|>, not the newline after it.
MARKED = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
          "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}"
          "{% endgeneration %}{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"},
            {"role": "assistant", "content": "Yo."}, {"role": "user", "content": "Sum 2+2"},
            {"role": "tool", "content": "4"}, {"role": "assistant", "content": "It is 4."}]


def byte_chat(template):
    tok = ByteTokenizer()
    tok.chat_template = template
    return tok


def marked_text(ids, mask) -> str:
    """The rendered bytes with every token that carries no loss shown as '_'."""
    return "".join(chr(i) if m else "_" for i, m in zip(ids, mask))


def expected(pieces) -> str:
    """Hand-written: (text, carries loss) pieces of the rendered conversation."""
    return "".join(text if loss else "_" * len(text.encode()) for text, loss in pieces)


def test_mask_without_generation_markers_is_each_reply_and_its_end_of_turn():
    ids, mask = encode_conversation(MESSAGES, byte_chat(CHATML), "assistant")
    want = expected([("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi?<|im_end|>\n"
                      "<|im_start|>assistant\n", False), ("Yo.<|im_end|>\n", True),
                     ("<|im_start|>user\nSum 2+2<|im_end|>\n<|im_start|>tool\n4<|im_end|>\n<|im_start|>assistant\n",
                      False), ("It is 4.<|im_end|>\n", True)])
    assert marked_text(ids, mask) == want


def test_generation_markers_say_what_trains():
    ids, mask = encode_conversation(MESSAGES, byte_chat(MARKED), "assistant")
    want = expected([("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi?<|im_end|>\n"
                      "<|im_start|>assistant\n", False), ("Yo.<|im_end|>", True),
                     ("\n<|im_start|>user\nSum 2+2<|im_end|>\n<|im_start|>tool\n4<|im_end|>\n<|im_start|>assistant\n",
                      False), ("It is 4.<|im_end|>", True), ("\n", False)])
    assert marked_text(ids, mask) == want
    assert encode_conversation(MESSAGES, byte_chat(MARKED), "all")[1].all()


def test_the_default_transcript_and_a_bpe_tokenizer():
    # No template (a byte model): the plain "Role: text" transcript that generate --chat uses.
    ids, mask = encode_conversation(MESSAGES[1:3], ByteTokenizer(), "assistant")
    assert marked_text(ids, mask) == expected([("User: Hi?\n\nAssistant:", False), (" Yo.\n\n", True)])
    # A BPE vocabulary with the chat markers as special tokens: the mask is whole tokens.
    from hf_models import train_tokenizer

    from llmsplit.io.tokenizer import HFTokenizer

    raw = train_tokenizer()
    raw.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok = HFTokenizer.from_tokenizer(raw, "bpe")
    tok.chat_template = CHATML
    ids, mask = encode_conversation(MESSAGES, tok, "assistant")
    end, nl = raw.token_to_id("<|im_end|>"), tok.encode("\n")
    want = tok.encode("Yo.") + [end] + nl + tok.encode("It is 4.") + [end] + nl
    assert [i for i, m in zip(ids, mask) if m] == want
    # transformers' own mask (return_assistant_tokens_mask, which needs markers): for MARKED as
    # it is, and for CHATML with markers around what the incremental renders found.
    import transformers

    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=raw)
    for template, theirs in ((MARKED, MARKED), (CHATML, MARKED.replace("{% endgeneration %}{% else %}",
                                                                        "{{ '\n' }}{% endgeneration %}{% else %}")
                                                .replace("{% endif %}{{ '\n' }}", "{{ '\n' }}{% endif %}"))):
        tok.chat_template = template
        ids, mask = encode_conversation(MESSAGES, tok, "assistant")
        ref = fast.apply_chat_template(MESSAGES, chat_template=theirs, tokenize=True, return_dict=True,
                                       return_assistant_tokens_mask=True)
        assert ref["input_ids"] == ids and ref["assistant_masks"] == mask.tolist()


@pytest.mark.parametrize("template, fragment", [
    # Earlier turns written differently once later ones follow (as templates that drop past reasoning do).
    ("{% for m in messages %}{% if not loop.last %}[{{ m['content'] }}]{% else %}{{ m['content'] }}{% endif %}"
     "{% endfor %}{% if add_generation_prompt %}>{% endif %}", "differently once later messages follow"),
    # Generation markers that mark none of the assistant's text: it would train on nothing.
    ("{% for m in messages %}{{ m['content'] }}{% generation %}{% endgeneration %}{% endfor %}", "mark none"),
    ("{% for m in messages %}{{ m['content'] }}{% endfor %}{{ raise_exception('roles must alternate') }}",
     "roles must alternate"),
])
def test_templates_without_a_correct_mask_are_refused(template, fragment):
    with pytest.raises(ConfigError, match=fragment):
        encode_conversation(MESSAGES, byte_chat(template), "assistant")


def _tokenizer_folder(path, template):
    from hf_models import train_tokenizer

    path.mkdir()
    raw = train_tokenizer()
    raw.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    raw.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "chat_template": template}))
    return path / "tokenizer.json"


def test_prepare_writes_tokens_mask_and_documents(tmp_path):
    from llmsplit.io.token_file import read_token_documents

    rows = [{"messages": MESSAGES}, {"prompt": "Capital of France?", "completion": "Paris."}]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = _tokenizer_folder(tmp_path / "tok", CHATML)
    out = tmp_path / "chat.tok"
    proc = run_cli("prepare", str(tmp_path / "chat.jsonl"), "--out", str(out), "--format", "chat",
                   "--tokenizer", str(tok))
    assert "2 documents" in proc.stdout and "of them carry loss" in proc.stdout
    tokens, mask, offsets, header = read_token_documents(out)
    assert isinstance(tokens, np.memmap) and isinstance(mask, np.memmap) and header["format"] == "chat"
    from llmsplit.io.tokenizer import load_tokenizer

    t = load_tokenizer(str(tok))
    ids0, mask0 = encode_conversation(MESSAGES, t, "assistant")
    ids1, mask1 = encode_conversation([{"role": "user", "content": "Capital of France?"},
                                       {"role": "assistant", "content": "Paris."}], t, "assistant")
    assert tokens.tolist() == ids0 + ids1 and mask.tolist() == mask0.tolist() + mask1.tolist()
    assert offsets.tolist() == [0, len(ids0), len(ids0) + len(ids1)]
    # A template that does not compile: exit 2 and one sentence, no traceback.
    bad = _tokenizer_folder(tmp_path / "bad", "{% for m in messages %}{{ m['content'] }")
    proc = run_cli("prepare", str(tmp_path / "chat.jsonl"), "--out", str(tmp_path / "x.tok"), "--format", "chat",
                   "--tokenizer", str(bad), check=False)
    assert proc.returncode == 2 and "chat template does not compile" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_packed_rows_compute_what_the_documents_compute_alone():
    from llmsplit.models.llama import LlamaConfig, Transformer
    from llmsplit.train.objectives import token_loss

    g = torch.Generator().manual_seed(0)
    lengths = [9, 30, 4, 17, 40, 12, 25, 3]
    tokens = torch.randint(0, 60, (sum(lengths),), generator=g).numpy()
    mask = (torch.rand(len(tokens), generator=g) < 0.6).numpy().astype(np.uint8)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    sampler = PackedSampler(Documents(tokens, mask, offsets), seq_len=47, global_batch=2, seed=0)
    assert sampler.truncated == 0 and sampler.n_windows == 3  # 40+4+3 | 30+17 | 25+12+9 (best fit, longest first)
    batch = sampler.rows(list(range(sampler.n_windows)))
    assert batch.positions[0, :40].tolist() == list(range(40)) and batch.positions[0, 40] == 0
    assert batch.targets[0, 39] == IGNORE  # the last token of a document does not predict the next one
    assert batch.loss_tokens() == sum(int(mask[a + 1:b].sum()) for a, b in zip(offsets[:-1], offsets[1:]))
    assert sampler.loss_tokens(0) == sum(sampler.row_loss[sampler.window_ids(0)])

    cfg = LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, ffn_dim=128, max_seq_len=64)
    model = Transformer(cfg)
    model.init_weights(0)
    packed = token_loss(model(batch.inputs, positions=batch.positions), batch.targets, 1.0)
    alone = torch.zeros(())
    for a, b in zip(offsets[:-1], offsets[1:]):
        doc = torch.from_numpy(tokens[a:b]).long()[None]
        targets = torch.where(torch.from_numpy(mask[a + 1:b]).bool(), doc[0, 1:], IGNORE)[None]
        alone += token_loss(model(doc[:, :-1]), targets, 1.0)
    assert abs(packed.item() - alone.item()) <= 1e-5 * abs(alone.item())


@pytest.mark.parametrize("sets, fragment", [
    (["data.format=csv"], "data.format='csv' is not one of"),
    (["data.loss_on=assistant"], "needs data.format=\"chat\""),
    (["train.eval_every=5"], "needs held-out data"),
    (["data.eval_fraction=1.5"], "must be at least 0 and below 1"),
    (["train.eval_every=2", "data.eval_fraction=0.1", "parallel.pp=2", "parallel.pp_schedule=zbv",
      "model.n_layers=4"], "cannot run that schedule forward-only"),
])
def test_data_keys_are_checked(sets, fragment):
    with pytest.raises(ConfigError, match=fragment):
        validate(load_config(None, sets), 1)
