"""Flags more than one command takes, and the argparse types of numbers: the placement and
engine flags of `generate`, `serve` and `eval` (cli.py's `_infer_config` maps them onto
`InferConfig`)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from .infer.choices import COMPILE, KV_DTYPES, MAX_SPECULATIVE_TOKENS


def number(kind: type, at_least=None, above=None, at_most=None) -> Callable:
    """An argparse `type`: `kind` (int or float) within the bounds. A value out of range is
    refused while the command line is parsed, naming the flag, before any model loads."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        # Negated comparisons, so that a float NaN is out of every range.
        if at_least is not None and not value >= at_least:
            raise argparse.ArgumentTypeError(f"{text} must be at least {at_least}")
        if above is not None and not value > above:
            raise argparse.ArgumentTypeError(f"{text} must be more than {above}")
        if at_most is not None and not value <= at_most:
            raise argparse.ArgumentTypeError(f"{text} must be at most {at_most}")
        return value

    parse.__name__ = kind.__name__  # what argparse calls the type in its own messages
    return parse


COUNT = number(int, at_least=1)  # workers, devices, tokens, sequences


def add_placement_args(p: argparse.ArgumentParser, context_default: str) -> None:
    """Where a model for generation lives: the same flags for `generate` and `serve`
    (`context_default` says what each does without --max-context)."""
    p.add_argument("--device-map", default="auto", metavar="auto|balanced|sequential|cpu|DEVICE",
                   help="how to place the model (default auto: fill devices in order, then CPU, then disk)")
    p.add_argument("--max-memory", metavar="DEV=SIZE,...", help="budgets, e.g. cuda:0=20GiB,cuda:1=20GiB,cpu=64GiB "
                   "(default: the free memory of each device)")
    p.add_argument("--offload-dir", metavar="DIR", help="folder for layers that fit in no memory budget; the files "
                   "written there are removed at the end, and the folder if llmsplit made it (default: no disk offload)")
    p.add_argument("--tp", type=COUNT, default=1, metavar="N",
                   help="tensor parallel over N worker processes (default %(default)s)")
    p.add_argument("--pp", type=COUNT, default=1, metavar="N",
                   help="pipeline stages over N worker processes (default %(default)s)")
    p.add_argument("--dtype", metavar="fp32|bf16|fp16", help="compute dtype (default fp32 on CPU, the model's on GPU)")
    p.add_argument("--max-context", type=number(int, at_least=2), metavar="N", help="tokens per sequence the KV "
                   f"cache holds (default: {context_default})")
    p.add_argument("--quantize", choices=("int8", "int4", "none"), help="keep the weights packed: int8 (one scale "
                   "per row) or int4 (groups of 32) quantized at load; none widens a GGUF's own int4/int8 to --dtype "
                   "(default: a GGUF keeps its own, other models stay float)")
    p.add_argument("--kv-dtype", choices=KV_DTYPES, help="store the KV cache as int8 with a scale "
                   "per token and head (about 1/4 of the float32 cache's bytes, 1/2 of bfloat16's), or as bfloat16 "
                   "under a float32 compute dtype (1/2, and faster decoding of many long sequences on CPU) (default: "
                   "the compute dtype)")
    p.add_argument("--compile", nargs="?", const="now", choices=COMPILE,
                   help="torch.compile the decode step: auto (the default, or $LLMSPLIT_COMPILE) runs eager while a "
                   "background process compiles it once for this model shape and machine, then compiles from "
                   "that cache at every later start (seconds) and swaps it into a running server; now (the flag "
                   "alone) compiles at load (minutes on a small CPU the first time); off never. Not with "
                   "--tp/--pp or offload (auto stays eager there)")
    p.add_argument("--n-cpu-moe", type=number(int, at_least=1), metavar="N",
                   help="keep the routed experts of the first N mixture-of-experts layers in CPU memory, attention "
                   "on the accelerator, as llama.cpp's --n-cpu-moe (default: experts stay with their layer)")
    # Checked by InferConfig (a path or a proposer; the range of K), its errors named as these flags.
    p.add_argument("--speculative", metavar="ngram|PATH", help="speculative decoding: ngram proposes the tokens "
                   "that followed the text's last words where they appeared before in the prompt or answer (prompt "
                   "lookup); PATH, a smaller draft model with the same tokenizer, proposes its own greedy "
                   "continuation; the model checks them in one step, and the output is what it would be without "
                   "(default: off)")
    p.add_argument("--speculative-tokens", type=int, default=4, metavar="K",
                   help=f"tokens proposed a step with --speculative, 1..{MAX_SPECULATIVE_TOKENS} (default %(default)s)")
