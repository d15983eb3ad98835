"""The argparse set-up of `llmsplit <command>`: one function per subcommand, each adding
that command's flags; `cli.py` binds every command to its handler."""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
from collections.abc import Callable

from .cli_shared_args import COUNT, add_placement_args, number
from .infer.choices import POOLING, TOOL_CALL_PARSERS

EPILOG = "Config keys and files: see README.md. Exit status: 0 ok, 1 runtime failure, 2 bad usage or config."
# Three real commands each, after EPILOG in `train/generate/serve --help` (README's examples;
# tests/test_cli_flags.py parses them). The GGUF file is README's SmolLM2-135M-Instruct.
EXAMPLES = {
    "train": [("llmsplit train --run-dir runs/quickstart", "README's Quickstart: the tiny model on the built-in corpus"),
              ("llmsplit train --nproc 4 --set parallel.zero=3 --set parallel.tp=2", "FSDP x tensor parallel"),
              ("llmsplit train --nproc 1 --set model.hf=path/to/hf_folder --set lora.rank=16",
               "LoRA on a Hugging Face model")],
    "generate": [("llmsplit generate --model runs/quickstart \"The def statement\"", "a run's newest checkpoint"),
                 ("llmsplit generate --model SmolLM2-135M-Instruct.Q4_1.gguf --chat \"What is the capital of France?\"",
                  "one chat turn"),
                 ("llmsplit generate --model path/to/hf_folder --quantize int8 \"Hello\"", "int8 weights, quantized "
                  "as they load")],
    "serve": [("llmsplit serve --model SmolLM2-135M-Instruct.Q4_1.gguf --port 8000", "OpenAI-compatible on 127.0.0.1"),
              ("llmsplit serve --model path/to/hf_folder --lora mascot=runs/mascot", "a LoRA run's adapters as model "
               "\"mascot\" beside the base"),
              ("llmsplit serve --model SmolLM2-135M-Instruct.Q4_1.gguf --host 0.0.0.0 --api-key KEY",
               "other machines may connect, with the key")],
}


def _epilog(command: str) -> str:
    lines = [f"  # {what}\n  {line}" for line, what in EXAMPLES[command]]
    return EPILOG + "\n\nexamples:\n" + "\n".join(lines) + "\n"


class Parser(argparse.ArgumentParser):
    """An error is one line naming the flag (argparse would print the whole usage first);
    subcommand parsers are of this class too."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kwargs)

    def parse_args(self, args=None, namespace=None):
        self.argv = list(sys.argv[1:] if args is None else args)  # the command an unknown flag belongs to
        return super().parse_args(args, namespace)

    def error(self, message: str):
        # "argument --top-p: 2 must be at most 1" -> "--top-p 2 must be at most 1", as ConfigErrors name flags
        message = re.sub(r"^argument (--[\w-]+): (\S+ must be )", r"\1 \2", message)
        parser = self._command_parser()
        if message.startswith("unrecognized arguments: "):
            message += _closest_flag(message.removeprefix("unrecognized arguments: ").split(), parser)
        self.exit(2, f"{self.prog}: error: {message} ({parser.prog} --help lists the flags)\n")

    def _command_parser(self) -> argparse.ArgumentParser:
        """The subcommand's parser when the command line names one (the top-level parser reports
        the flags a subcommand did not know), else this one."""
        commands = next((a.choices for a in self._actions if isinstance(a, argparse._SubParsersAction)), {})
        return next((commands[w] for w in getattr(self, "argv", []) if w in commands), self)


def _closest_flag(unknown: list[str], parser: argparse.ArgumentParser) -> str:
    """The end of the sentence that refuses `unknown`: the flag of `parser` that its first typo
    likeliest meant (difflib), as "; did you mean --nproc?", or nothing."""
    flags = [s for action in parser._actions for s in action.option_strings if s.startswith("--")]
    for word in unknown:
        close = difflib.get_close_matches(word.split("=")[0], flags, n=1, cutoff=0.6) if word.startswith("-") else []
        if close:
            return f"; did you mean {close[0]}?"
    return ""


class _Formatter(argparse.HelpFormatter):
    """argparse's, except that a text with lines of its own (an epilog of examples) keeps them."""

    def _fill_text(self, text, width, indent):
        if "\n" in text:
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


def build_parser(handlers: dict[str, Callable]) -> argparse.ArgumentParser:
    """The `llmsplit` parser; `handlers[name]` becomes `args.func` of subcommand `name`."""
    from . import __version__

    p = Parser(prog="llmsplit", description="Split large language models across devices.", epilog=EPILOG)
    p.add_argument("--version", action="version", version=f"llmsplit {__version__}")
    sub = p.add_subparsers(title="commands", metavar="COMMAND")
    for name, add in SUBCOMMANDS:
        add(sub).set_defaults(func=handlers[name])
    return p


def _add_train(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("train", help="train or fine-tune a model on 1..N workers",
                       description="Train on local workers started by llmsplit, or inside torchrun.",
                       epilog=_epilog("train"))
    p.add_argument("--config", metavar="FILE.toml", help="TOML config (default: the tiny model on the built-in "
                   "corpus; --help-config lists every key)")
    p.add_argument("--help-config", action=_ConfigKeysAction,
                   help="list the config keys with what each means, its allowed values and its default, and exit")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set train.steps=10 (repeatable; default none)")
    p.add_argument("--nproc", type=COUNT, metavar="N", help="local worker processes (default: one per GPU, 2 on a CPU)")
    p.add_argument("--run-dir", metavar="DIR", help="where to write the run (default runs/<timestamp>-<preset>)")
    _add_node_args(p, elastic=True)
    p.add_argument("--max-restarts", type=number(int, at_least=0), default=0, metavar="K",
                   help="restart the workers up to K times after a failure, resuming from the newest checkpoint "
                        "(default %(default)s)")
    p.add_argument("--resume", default="none", metavar="auto|none|PATH",
                   help="auto: newest checkpoint in --run-dir; PATH: a run folder or checkpoint (default %(default)s)")
    p.add_argument("--resume-changed", action="store_true",
                   help="resume although data.seq_len, train.global_batch, train.seed, the tokenizer or the data "
                        "differ from the checkpoint's (refused by default); summary.json records what changed")
    p.add_argument("--overwrite", action="store_true",
                   help="with --resume none: start a --run-dir that holds a run over from step 0 (refused by "
                        "default); the old run is moved into RUN_DIR/previous/<UTC time>/, not truncated")
    p.add_argument("--auto", action="store_true",
                   help="let the planner choose the [parallel]/[memory] keys and train.micro_batch for these devices")
    p.add_argument("--profile", type=COUNT, metavar="STEPS", help="trace STEPS steps with torch.profiler into "
                   "RUN_DIR/profile/ and print each rank's compute / communication / idle time (default: no trace)")
    return p


def _add_generate(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("generate", help="load a model split across devices and generate text",
                       description="Print the continuation of PROMPT (the prompt is not repeated). Environment: "
                                   "LLMSPLIT_GPU_COUNT and LLMSPLIT_GPU_MEMORY_LIMIT (bytes or e.g. 20GiB per GPU) "
                                   "limit the GPUs used.", epilog=_epilog("generate"))
    p.add_argument("--model", required=True, metavar="RUN_DIR|CHECKPOINT|HF_FOLDER|FILE.gguf|PEFT_DIR",
                   help="a run folder or checkpoint, a Hugging Face Llama-family folder, a GGUF file, or a PEFT LoRA "
                        "adapter folder (merged over the base its adapter_config.json names)")
    p.add_argument("prompt", nargs="*", help="prompt text (default: standard input when it is not a terminal)")
    p.add_argument("--max-new-tokens", type=COUNT, default=64, metavar="N",
                   help="tokens to generate at most (default %(default)s)")
    p.add_argument("--temperature", type=number(float, at_least=0), default=0.0, metavar="T",
                   help="sampling temperature; 0 is greedy (default %(default)s)")
    p.add_argument("--top-k", type=COUNT, metavar="K", help="sample from the K likeliest tokens (default: all)")
    p.add_argument("--top-p", type=number(float, above=0, at_most=1), metavar="P",
                   help="sample from the likeliest tokens whose probabilities add up to P, in (0, 1] (default: all)")
    p.add_argument("--seed", type=int, metavar="S", help="seed of the sampler (default: a fresh random seed)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop before TEXT (repeatable; default none)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    p.add_argument("--stream", action="store_true", help="print text as it is generated")
    p.add_argument("--chat", action="store_true", help="PROMPT is one user message, written in the model's own chat "
                   "template (its tokenizer files' or GGUF's; a plain 'User:' transcript without one); the answer "
                   "ends at the template's end of turn")
    p.add_argument("--system", metavar="TEXT", help="with --chat: a system message before the question (default: "
                   "the template's own, if it has one)")
    p.add_argument("--show-prompt", action="store_true", help="print the prompt as the model reads it, after the "
                   "chat template (stderr)")
    _add_template_args(p)
    add_placement_args(p, context_default="prompt + --max-new-tokens, at most the model's")
    p.add_argument("--show-device-map", action="store_true", help="print where each module lives, with bytes (stderr)")
    p.add_argument("--verbose", action="store_true", help="print prompt and decode tokens/s, and with --speculative "
                   "how many proposals the model took (stderr)")
    return p


def _add_serve(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server over the same engine (extra [serve])",
                       description="Serve GET /v1/models, POST /v1/completions, POST /v1/chat/completions (with "
                                   "\"stream\": true), GET /health and GET /metrics, batching all live requests "
                                   "together. SIGTERM or Ctrl-C drains in-flight requests, then stops. Environment: "
                                   "LLMSPLIT_API_KEY (default of --api-key), LLMSPLIT_GPU_COUNT and "
                                   "LLMSPLIT_GPU_MEMORY_LIMIT as for generate.", epilog=_epilog("serve"))
    p.add_argument("--model", required=True, metavar="RUN_DIR|CHECKPOINT|HF_FOLDER|FILE.gguf|PEFT_DIR",
                   help="a run folder or checkpoint, a Hugging Face Llama-family folder, a GGUF file, or a PEFT LoRA "
                        "adapter folder (merged over the base its adapter_config.json names)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=number(int, at_least=0, at_most=65535), default=8000, help="port to bind (default 8000; 0 picks a free one)")
    p.add_argument("--api-key", default=os.environ.get("LLMSPLIT_API_KEY"), metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default $LLMSPLIT_API_KEY, else none)")
    p.add_argument("--metrics-auth", action="store_true",
                   help="require the --api-key on /metrics too (default: /metrics is open for scrapers without a "
                        "key; /health is always open)")
    p.add_argument("--served-model-name", metavar="NAME", help="the model id clients send (default the folder or "
                   "file name)")
    p.add_argument("--max-batch", type=COUNT, default=8, metavar="N", help="sequences decoded together (default 8)")
    p.add_argument("--kv-tokens", type=COUNT, default=None, metavar="N",
                   help="tokens the KV cache holds, shared by all sequences (default max-batch full contexts); "
                        "blocks are taken as tokens arrive and the newest sequence is preempted when it runs out")
    p.add_argument("--max-num-batched-tokens", type=COUNT, default=None, metavar="N",
                   help="tokens one step computes at most, the batch's decodes first and then chunks of the "
                        "prompts being filled, so that a long prompt never stalls the streams already running "
                        "(default 512, or --max-batch if larger: the chunk size that computed prompts fastest)")
    p.add_argument("--lora", action="append", default=[], metavar="NAME=RUN|PEFT_DIR",
                   help="serve a LoRA run's adapters, or a PEFT adapter folder's, over --model as the model NAME "
                        "(repeatable; under --tp/--pp too): a request's \"model\" picks an adapter or the base, and "
                        "requests for all of them are batched together (default none: the base alone)")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="compute every prompt in full (default: prompts that start alike share the KV blocks of "
                        "their common start)")
    p.add_argument("--max-queue", type=number(int, at_least=0), default=64, metavar="N",
                   help="sequences that may wait for a batch slot; beyond that requests get 429 (default 64)")
    p.add_argument("--max-request-size", default="1MiB", metavar="SIZE", help="largest request body (default 1MiB)")
    p.add_argument("--drain-timeout", type=number(float, at_least=0), default=30.0, metavar="SECONDS",
                   help="on SIGTERM, how long in-flight requests may finish before they are aborted "
                        "(default %(default)s)")
    p.add_argument("--request-timeout", type=number(float, above=0), default=10.0, metavar="SECONDS",
                   help="how long a request's headers and body may take to arrive, and its chat template and "
                        "tokenizing to run, before it is refused (default %(default)s)")
    p.add_argument("--max-request-items", type=COUNT, default=10_000, metavar="N",
                   help="messages, content parts and tools one request may hold, each counted before the body is "
                        "parsed (default %(default)s)")
    p.add_argument("--pooling", choices=POOLING, default="last", help="what /v1/embeddings and Ollama's "
                   "/api/embed return: the final hidden state of the last token, or the mean over the text, "
                   "normalized (default %(default)s)")
    p.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default="auto",
                   help="how tool calls (tool_choice \"auto\") are read from the model's replies: hermes "
                        "(<tool_call> JSON: Qwen2.5/3, Hermes), llama3_json (Llama 3.1+ JSON), mistral "
                        "([TOOL_CALLS]), or none (left as text); auto picks by the chat template (default %(default)s)")
    _add_template_args(p)
    add_placement_args(p, context_default="the model's, at most 4096")
    _add_node_args(p, node0="; node 0 serves HTTP, the others run their share of the --tp/--pp workers")
    return p


def _add_template_args(p) -> None:
    p.add_argument("--template-timeout", type=number(float, above=0), default=10.0, metavar="SECONDS",
                   help="how long the model's chat template may run for one conversation before it is stopped "
                        "(default %(default)s)")
    p.add_argument("--template-max-bytes", default="1GiB", metavar="SIZE",
                   help="memory the chat template may use for one conversation, in the process it runs in, before "
                        "it is stopped (default %(default)s)")


def _add_prepare(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("prepare", help="tokenize text/JSONL files into a token file for training",
                       description="A .jsonl file gives one document per line (its \"text\" field); "
                                   "any other file is one document.", epilog=EPILOG)
    p.add_argument("inputs", nargs="+", metavar="FILE|GLOB", help="text or .jsonl files, or quoted glob patterns")
    p.add_argument("--out", required=True, metavar="FILE", help="token file to write")
    p.add_argument("--tokenizer", default="byte", metavar="byte|tokenizer.json",
                   help="byte, or a Hugging Face tokenizer.json file (default %(default)s)")
    p.add_argument("--format", default="text", choices=("text", "chat"),
                   help="chat: .jsonl rows with \"messages\" or \"prompt\"/\"completion\", in the chat template of "
                        "--tokenizer's folder, with the mask of the tokens that carry loss (default %(default)s)")
    p.add_argument("--loss-on", default="assistant", choices=("assistant", "all"),
                   help="with --format chat: which tokens carry loss (default %(default)s)")
    return p


def _add_export(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("export", help="convert a training checkpoint to a Hugging Face safetensors folder",
                       description="Write a folder that transformers' AutoModelForCausalLM.from_pretrained loads: "
                                   "config.json, safetensors (sharded above --max-shard-size), tokenizer files.",
                       epilog=EPILOG)
    p.add_argument("--checkpoint", required=True, metavar="RUN_DIR|CHECKPOINT",
                   help="a run folder (its newest checkpoint) or one checkpoint folder")
    p.add_argument("--to", required=True, choices=("hf", "peft"),
                   help="output format (hf: a Hugging Face model folder, LoRA adapters merged; peft: a LoRA run's "
                        "adapters as a PEFT adapter folder for its model.hf)")
    p.add_argument("out", metavar="OUT", help="folder to create (must not exist or be empty)")
    p.add_argument("--max-shard-size", default="5GiB", metavar="SIZE", help="largest safetensors file (default 5GiB)")
    return p


def _add_eval(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("eval", help="score a model with lm-evaluation-harness tasks (extra [eval])", epilog=EPILOG,
                       description="Run lm-eval's tasks on the model in this process, split as generate splits it.")
    p.add_argument("--model", required=True, metavar="RUN_DIR|CHECKPOINT|HF_FOLDER|FILE.gguf|PEFT_DIR",
                   help="what generate takes")
    p.add_argument("--tasks", required=True, metavar="T[,T]", help="lm-eval task or group names")
    p.add_argument("--limit", type=number(float, above=0), metavar="K", help="the first K examples (default all)")
    p.add_argument("--include-path", metavar="DIR", help="a folder of your own task YAML files (default none)")
    p.add_argument("--output", metavar="DIR", help="write results.json there (default: print the table only)")
    p.add_argument("--max-batch", type=COUNT, default=16, metavar="N", help="sequences scored together (default 16)")
    add_placement_args(p, context_default="the model's, at most 4096")
    return p


def _add_doctor(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("doctor", help="check torch, devices, backends, launcher variables and network",
                       description="One line per check: OK, WARN or FAIL, each with the fix. Exit 1 if any FAIL.",
                       epilog=EPILOG)
    p.add_argument("--master-addr", metavar="HOST", help="check this master address (default: $MASTER_ADDR)")
    p.add_argument("--master-port", type=int, metavar="PORT", help="check this port (default: $MASTER_PORT)")
    p.add_argument("--json", action="store_true", help="print the checks as JSON")
    return p


def _add_plot(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("plot", help="draw a run's loss, tokens/s and memory as PNG files (extra [plot])",
                       epilog=EPILOG)
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run folder (its metrics.jsonl)")
    p.add_argument("--out", metavar="DIR", help="where to write the PNGs (default RUN_DIR/plots)")
    return p


def _add_plan(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("plan", help="predict memory per device and step time for layouts; write a config",
                       description="Predict, for each layout, memory per device term by term and the step "
                                   "time; rank those that fit and say why the others do not.", epilog=EPILOG)
    p.add_argument("--model", required=True, metavar="PRESET|HF_FOLDER|CONFIG.toml",
                   help="a preset (e.g. llama-3-8b), a Hugging Face folder or an llmsplit training config")
    p.add_argument("--gpus", type=COUNT, required=True, metavar="N", help="number of devices (CPU workers for --gpu cpu)")
    p.add_argument("--gpu", default="H100-80GB", metavar="NAME", help="device kind, or cpu (default %(default)s)")
    p.add_argument("--nodes", type=COUNT, metavar="K", help="machines the devices are spread over (default: as few "
                   "as hold --gpus devices of this kind)")
    p.add_argument("--seq-len", type=COUNT, metavar="S", help="tokens per sequence (default: the config's, else the "
                   "model's context up to 2048 for train, 8192 for infer)")
    p.add_argument("--global-batch", type=COUNT, metavar="B", help="train: sequences per step (default: the config's, "
                   "else 4 per device); infer: concurrent sequences (default 1)")
    p.add_argument("--mode", default="train", choices=("train", "infer"), help="plan training or inference "
                   "(default %(default)s)")
    p.add_argument("--precision", metavar="fp32|bf16|fp16", help="default: bf16 on GPUs, fp32 on cpu, or the config's")
    p.add_argument("--quantize", default="none", metavar="int8|int4|none", help="infer: count the weights packed "
                   "as generate --quantize holds them, group scales included (default %(default)s)")
    p.add_argument("--layout", metavar="KEY=VAL,...", help="evaluate only this layout, e.g. zero=3,tp=2,pp=1 "
                   "(default: every layout)")
    p.add_argument("--top", type=COUNT, default=5, metavar="K", help="layouts to show (default %(default)s)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="sets",
                   help="a training key the plan counts, e.g. lora.rank=16, lora.base=nf4 (repeatable; "
                   "default: the config's, else no LoRA)")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.add_argument("--emit-config", metavar="OUT.toml", help="write the best layout llmsplit train runs as a config "
                   "(default: write nothing)")
    return p


def _node_count(text: str) -> int | str:
    """train's --nnodes: N machines, or MIN:MAX for an elastic job (kept as that text)."""
    from .errors import ConfigError
    from .launch.elastic import node_range

    try:
        low, high = node_range(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix(f"--nnodes {text}: ").removeprefix("--nnodes ")) from None
    return high if low == high else f"{low}:{high}"


def _add_node_args(p: argparse.ArgumentParser, node0: str = "", elastic: bool = False) -> None:
    """The machines a job runs on: the same flags for `train` and `serve`, None when not passed
    (a cluster launcher's values, else launch.Nodes' defaults, fill them in: cli._node_settings).
    `elastic`: --nnodes also takes MIN:MAX (train)."""
    if elastic:
        p.add_argument("--nnodes", type=_node_count, metavar="N|MIN:MAX", help="number of machines (default 1, or "
                       "what Slurm, Kubeflow or SkyPilot says), or MIN:MAX for a job that goes on when machines leave "
                       "and takes in those that join: docs/multinode.md")
    else:
        p.add_argument("--nnodes", type=COUNT, metavar="N", help="number of machines (default 1, or what Slurm, "
                       "Kubeflow or SkyPilot says: docs/multinode.md)")
    p.add_argument("--node-rank", type=number(int, at_least=0), metavar="R",
                   help=f"this machine's rank, 0..nnodes-1{node0} (default 0, or the cluster launcher's)")
    p.add_argument("--master-addr", metavar="HOST", help="address of node 0 (default 127.0.0.1, or the cluster "
                   "launcher's)")
    p.add_argument("--master-port", type=number(int, at_least=0, at_most=65535), metavar="PORT",
                   help="port on node 0 (required with --nnodes > 1; default: a free port, or the cluster launcher's)")


class _ConfigKeysAction(argparse.Action):
    """`llmsplit train --help-config`: print `config_keys_text()` and exit, as --help does."""

    def __init__(self, option_strings, dest, help=None):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        from .config import config_keys_text

        print(config_keys_text(), end="")
        parser.exit(0)


# In the order `llmsplit --help` lists them.
SUBCOMMANDS = (("train", _add_train), ("generate", _add_generate), ("serve", _add_serve), ("prepare", _add_prepare),
               ("export", _add_export), ("eval", _add_eval), ("doctor", _add_doctor), ("plot", _add_plot),
               ("plan", _add_plan))
