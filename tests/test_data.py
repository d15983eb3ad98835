import json

import numpy as np
import pytest
import torch

from llmsplit.errors import ConfigError
from llmsplit.data.corpus import builtin_documents, load_tokens
from llmsplit.data.loader import BatchSampler
from llmsplit.io.token_file import read_token_file
from llmsplit.io.tokenizer import ByteTokenizer, load_tokenizer

from helpers import run_cli


def test_builtin_corpus_is_real_english_text():
    text = "".join(builtin_documents())
    assert len(text) > 300_000 and "the" in text


def test_every_data_parallel_size_sees_the_same_global_batch():
    tokens = np.arange(10_000, dtype=np.int64)
    s = BatchSampler(tokens, seq_len=16, global_batch=8, seed=1)
    for step in range(3):
        whole = s.rank_batch(step, 0, 1)
        for dp in (2, 4):
            parts = torch.cat([s.rank_batch(step, r, dp) for r in range(dp)])
            assert torch.equal(parts, whole)
        assert whole.shape == (8, 17)
        assert torch.equal(whole[:, 1:-1], whole[:, :-2] + 1)  # contiguous windows


def test_sampling_is_deterministic_resumable_and_covers_epochs():
    tokens = np.arange(1_000, dtype=np.int64)
    a = BatchSampler(tokens, seq_len=9, global_batch=4, seed=7)
    b = BatchSampler(tokens, seq_len=9, global_batch=4, seed=7)  # a "resumed" sampler
    assert [a.window_ids(s) for s in range(60)] == [b.window_ids(s) for s in range(60)]
    first_epoch = [w for s in range(a.n_windows // 4) for w in a.window_ids(s)]
    assert len(set(first_epoch)) == len(first_epoch)  # no window twice within an epoch
    assert BatchSampler(tokens, 9, 4, seed=8).window_ids(0) != a.window_ids(0)


def test_too_little_data_is_a_config_error():
    with pytest.raises(ConfigError, match="fewer than data.seq_len"):
        BatchSampler(np.arange(10), seq_len=16, global_batch=2, seed=0)


def test_prepare_writes_a_memory_mapped_token_file(tmp_path):
    (tmp_path / "a.txt").write_text("hello world")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "héllo"}) + "\n" + json.dumps({"text": "x"}) + "\n")
    out = tmp_path / "tokens.bin"
    proc = run_cli("prepare", str(tmp_path / "*.txt"), str(tmp_path / "b.jsonl"), "--out", str(out), timeout=60)
    assert "3 documents" in proc.stdout
    tokens, header = read_token_file(out)
    tok = ByteTokenizer()
    want = tok.encode("hello world") + [257] + tok.encode("héllo") + [257] + tok.encode("x") + [257]
    assert tokens.tolist() == want and header["dtype"] == "uint16"
    assert isinstance(tokens, np.memmap)
    assert load_tokens(str(out), tok).tolist() == want


def test_prepare_refuses_bad_input(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{\"text\": 1}\n")
    for args, fragment in ([[str(tmp_path / "none*.txt")], "matches no files"],
                           [[str(bad)], "has no string \"text\" field"]):
        proc = run_cli("prepare", *args, "--out", str(tmp_path / "t.bin"), check=False, timeout=60)
        assert proc.returncode == 2 and fragment in proc.stderr and "Traceback" not in proc.stderr


def test_text_glob_source_and_tokenizer_json(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    (tmp_path / "doc.txt").write_text("the cat sat on the mat. " * 50)
    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.train([str(tmp_path / "doc.txt")], trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>", "</s>"]))
    tk.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(str(tmp_path / "tokenizer.json"))
    assert tok.eos_id == 1 and tok.decode(tok.encode("the cat")) == "the cat"
    ids = load_tokens(f"text:{tmp_path}/*.txt", tok)
    assert ids[-1] == 1 and len(ids) > 50
