"""Load a trained model in one process and generate text (greedy or sampled), with a KV cache.

This is the first inference path; the split-inference engine grows from here.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from ..config import model_config
from ..io.run_dir import read_run_config, resolve_checkpoint
from ..io.tokenizer import load_tokenizer
from ..models.llama import Transformer


class KVCache:
    """A contiguous cache, [batch, kv_heads, max_len, head_dim] per layer."""

    def __init__(self, cfg, batch: int, max_len: int, device, dtype):
        shape = (batch, cfg.n_kv_heads, max_len, cfg.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layers)]

    def update(self, layer_id: int, start: int, k: torch.Tensor, v: torch.Tensor):
        end = start + k.shape[2]
        self.k[layer_id][:, :, start:end] = k
        self.v[layer_id][:, :, start:end] = v
        return self.k[layer_id][:, :, :end], self.v[layer_id][:, :, :end]


class LoadedModel:
    """What `llmsplit.load` returns: `generate`, `logits`, `tokenizer`, `device_map`."""

    def __init__(self, model: Transformer, tokenizer, device: torch.device):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.device = device
        self.device_map = {"": str(device)}

    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids.to(self.device)).float()

    @torch.no_grad()
    def generate(self, prompt, max_new_tokens: int = 32, temperature: float = 0.0, top_k: int | None = None,
                 top_p: float | None = None, seed: int | None = None, stop=None, ignore_eos: bool = False,
                 on_text=None) -> str:
        ids = self._prompt_ids(prompt)
        cfg = self.model.cfg
        cache = KVCache(cfg, 1, len(ids) + max_new_tokens, self.device, next(self.model.parameters()).dtype)
        gen = torch.Generator(device="cpu")
        if seed is not None:
            gen.manual_seed(seed)
        else:
            gen.seed()
        tokens = torch.tensor([ids], device=self.device)
        logits = self.model(tokens, kv_cache=cache, start_pos=0)[:, -1]
        out: list[int] = []
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        text = ""
        for i in range(max_new_tokens):
            nxt = sample(logits[0].float().cpu(), temperature, top_k, top_p, gen)
            if nxt == self.tokenizer.eos_id and not ignore_eos:
                break
            out.append(nxt)
            new_text = self.tokenizer.decode(out)
            if on_text is not None and len(new_text) > len(text) and not new_text.endswith("\ufffd"):
                on_text(new_text[len(text):])
                text = new_text
            if any(s in new_text for s in stops):
                cut = min(new_text.index(s) for s in stops if s in new_text)
                return new_text[:cut]
            if i + 1 < max_new_tokens:
                pos = len(ids) + len(out) - 1
                logits = self.model(torch.tensor([[nxt]], device=self.device), kv_cache=cache, start_pos=pos)[:, -1]
        final = self.tokenizer.decode(out)
        if on_text is not None and len(final) > len(text):
            on_text(final[len(text):])
        return final

    def _prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
            if self.tokenizer.bos_id is not None and not ids:
                ids = [self.tokenizer.bos_id]
            return ids
        if isinstance(prompt, torch.Tensor):
            return prompt.reshape(-1).tolist()
        return list(prompt)


def sample(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None,
           gen: torch.Generator) -> int:
    """One token id from a [vocab] row: greedy at temperature 0, else top-k / nucleus sampling."""
    if temperature <= 0:
        return int(torch.argmax(logits))
    logits = logits / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p is not None and top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, dim=-1) - sorted_p < top_p  # always keeps the top token
        sorted_p = sorted_p * keep
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    return int(torch.multinomial(probs / probs.sum(), 1, generator=gen))


def load_run(path: str | Path, device: str | torch.device | None = None) -> LoadedModel:
    """A model from a training run folder or one of its checkpoints, in one process."""
    import torch.distributed.checkpoint as dcp

    run_dir, ck = resolve_checkpoint(path)
    cfg = read_run_config(run_dir)
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    with torch.device("meta"):
        model = Transformer(model_config(cfg, tokenizer.vocab_size))
    model.to_empty(device=device)
    model.init_weights(0, buffer_device=device)  # rope tables; weights are overwritten below
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(ck))
    model.load_state_dict(state["model"])
    return LoadedModel(model, tokenizer, device)
