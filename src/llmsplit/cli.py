"""`llmsplit <command>`: each subcommand is a thin function over the library.

Exit status: 0 success, 2 bad usage or invalid config (one sentence, no traceback),
1 a runtime failure (message plus a hint).
"""

from __future__ import annotations

import sys

from .allocator import keep_freed_memory
from .cli_args import build_parser
from .errors import ConfigError
from .launch import LaunchError


def main(argv: list[str] | None = None) -> int:
    parser = build_parser(COMMANDS)
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version, or a flag refused while parsing (exit 2, one line)
        return e.code
    args.program = argv is None  # the `llmsplit` program itself, not a call from Python
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args) or 0
    except ConfigError as e:
        print(f"llmsplit: error: {e}", file=sys.stderr)
        return 2
    except LaunchError as e:  # a worker of generate/serve --tp/--pp died: its rank and error, no traceback
        print(f"llmsplit: {args.func.__name__.removeprefix('cmd_')} failed: {e}", file=sys.stderr)
        if e.hint:
            print(f"hint: {e.hint}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("llmsplit: interrupted", file=sys.stderr)
        return 130


# ---------------------------------------------------------------- train

def cmd_train(args) -> int:
    from .launch import claim_process_for_launching, under_torchrun
    from .api import TrainingFailed, train
    from .train.api import WORKER_MODULES

    if args.program and not under_torchrun():
        claim_process_for_launching(WORKER_MODULES)  # before anything here computes
    overrides = list(args.set)
    if args.profile is not None:  # at least 1: cli_args refuses less while parsing
        overrides.append(f"train.profile_steps={args.profile}")
    try:
        result = train(args.config, args.nproc, args.run_dir, args.resume, overrides=overrides, auto=args.auto,
                       **_node_settings(args), max_restarts=args.max_restarts,
                       resume_changed=args.resume_changed, overwrite=args.overwrite)
    except TrainingFailed as e:
        print(f"llmsplit: training failed: {e}" + (f"\nhint: {e.hint}" if e.hint else ""), file=sys.stderr)
        return 1
    for warning in (result.plan_check or {}).get("warnings", []):
        print(f"llmsplit: warning: {warning} (the plan is off for this layout; plan_check in summary.json)",
              file=sys.stderr)
    return 0


def _node_settings(args) -> dict:
    """train's and serve's --nnodes/--node-rank/--master-addr/--master-port: those passed, the
    others from a cluster launcher (launch/cluster_env.py); under torchrun its variables decide."""
    import os

    from .launch import under_torchrun
    from .launch.cluster_env import FLAGS, node_settings
    from .launch.elastic import node_range

    given = {k: getattr(args, k) for k in FLAGS}
    elastic = given["nnodes"] if isinstance(given["nnodes"], str) else None  # MIN:MAX: the rendezvous numbers nodes
    if elastic:  # train.api refuses a --node-rank other than 0 with it
        given.update(nnodes=node_range(elastic)[1], node_rank=given["node_rank"] or 0)
    settings, found = node_settings({} if under_torchrun() else os.environ, **given)
    if found is not None:  # which node this is and where node 0 is: the line to read when nodes do not meet
        print(f"llmsplit: {found.describe()}", file=sys.stderr, flush=True)
    return {**settings, "nnodes": elastic} if elastic else settings


def _fork_followers_server(args) -> None:
    """generate/serve/eval over --tp/--pp worker processes: the server of their follower ranks
    forked from this program now, before it computes anything (launch/forkserver.py)."""
    from .launch import fork_workers_server, under_torchrun

    if args.program and args.tp * args.pp > 1 and not under_torchrun():
        fork_workers_server(("llmsplit.infer.runner.split",))


# ---------------------------------------------------------------- generate

def cmd_generate(args) -> int:
    import llmsplit

    from .diagnose.oom import infer_failure, infer_oom_errors
    from .infer.api import generation_context
    from .infer.config import InferConfig
    from .io.weights import open_weights

    _fork_followers_server(args)
    keep_freed_memory()  # this process is llmsplit's own: its steps reuse their memory (allocator.py)
    prompt = " ".join(args.prompt)
    if not prompt and not sys.stdin.isatty():
        prompt = sys.stdin.read()
    if not prompt:
        raise ConfigError("the prompt is empty; pass PROMPT words or text on standard input")
    if args.system is not None and not args.chat:  # before the model loads
        raise ConfigError("--system needs --chat: it is the system message of a chat; add --chat")
    source = open_weights(args.model)
    prompt = _prompt_ids(args, prompt, source.tokenizer)
    prompt_tokens = len(prompt)
    if args.max_context is None:  # a cache for this one answer, not the model's whole context
        args.max_context = generation_context(prompt_tokens, args.max_new_tokens)
    if InferConfig(compile=args.compile).compile == "auto":
        # One answer rarely pays for a compile, even from the cache: SmolLM2-135M's warm compile
        # takes ~16 s, which at 117 against 55 tokens/s eager pays off after ~2,000 tokens.
        args.compile = "off"
    config = _infer_config(args, max_batch=1)
    try:
        m = llmsplit.load(args.model, config, source=source)
    except infer_oom_errors() as e:
        failure = infer_failure(e, "loading the model")
    else:
        del source  # a run's checkpoint is held in memory until the runner has its weights
        failure = _print_generation(m, prompt, args)
        del m  # closed; what it held must be free before a failure is explained
    if failure is not None:  # outside `except`: the traceback no longer holds the half-loaded model
        return _explain_infer_failure(args, failure, config, min_context=prompt_tokens + 1)
    return 0


def _template_limits(args):
    from .io.template_process import TemplateLimits
    from .plan.placement import parse_size

    return TemplateLimits(args.template_timeout, parse_size(args.template_max_bytes, "--template-max-bytes"))


def _prompt_ids(args, prompt: str, tokenizer) -> list[int]:
    """The prompt's token ids. With --chat, `prompt` is one user message (after --system's)
    in the model's own chat template, and the template's stop strings join --stop."""
    from .infer.chat import TemplateError, chat_prompt, render_chat

    if not args.chat:
        if args.show_prompt:
            print(prompt, file=sys.stderr)
        return tokenizer.encode(prompt)
    messages = [{"role": "system", "content": args.system}] if args.system is not None else []
    messages.append({"role": "user", "content": prompt})
    try:
        limits = _template_limits(args)
        ids, stops = chat_prompt(messages, tokenizer, limits=limits)
        if args.show_prompt:
            print(render_chat(messages, tokenizer, limits=limits), file=sys.stderr)
    except TemplateError as e:
        raise ConfigError(f"--chat: {e}") from None
    args.stop = [*args.stop, *stops]
    return ids


def _print_generation(m, prompt: list[int], args):
    """Print the continuation of `prompt` (and, asked, the device map); close `m`. Returns
    None, or the `InferFailure` of a generation that ran out of memory."""
    import torch

    from .diagnose.oom import infer_failure
    from .infer.timing import GenerationTiming

    def emit(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    try:
        if args.show_device_map:
            print(m.placement.describe() if m.placement else
                  "device map:\n" + "\n".join(f"  {u}: {d}" for u, d in m.device_map.items()), file=sys.stderr)
        timing = GenerationTiming(m.engine, len(prompt))
        text = m.generate(prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                          top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop=args.stop,
                          ignore_eos=args.ignore_eos, on_text=emit if args.stream else None)
    except torch.OutOfMemoryError as e:
        return infer_failure(e, "generating")
    finally:
        m.close()
    if not args.stream:
        sys.stdout.write(text)
    sys.stdout.write("\n")
    if args.verbose:
        print(timing.summary(), file=sys.stderr)
    return None


def _infer_config(args, **fields):
    """The placement flags of generate and serve (`cli_shared_args.add_placement_args`), with `fields`
    (the command's own), as the `InferConfig` they load with."""
    from .infer.config import InferConfig

    return InferConfig(device_map=args.device_map, max_memory=args.max_memory, offload_dir=args.offload_dir,
                       dtype=args.dtype, tp=args.tp, pp=args.pp, max_context=args.max_context, compile=args.compile,
                       quantize=args.quantize, kv_dtype=args.kv_dtype, tune_threads=True,
                       n_cpu_moe=args.n_cpu_moe or 0, speculative=args.speculative,
                       speculative_tokens=args.speculative_tokens, **fields)


def _explain_infer_failure(args, failure, config, min_context: int = 16) -> int:
    """generate/serve out of memory: the placement's breakdown against the budgets and the
    changes of flags that fit (no context under `min_context`, which the prompt needs); exit 1."""
    from .diagnose.oom import explain_infer_failure

    command = {cmd_serve: "serve", cmd_eval: "eval"}.get(args.func, "generate")
    report = explain_infer_failure(failure, args.model, config, max_batch_flag=command != "generate",
                                   min_context=min_context)
    hint = "\nhint: add the flags of one line above to the same command" if report["suggestions"] else ""
    print(f"llmsplit: {command} failed: {report['text']}{hint}", file=sys.stderr)
    return 1


# ---------------------------------------------------------------- serve

def _is_loopback(host: str) -> bool:
    import ipaddress

    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


def _lora_runs(pairs: list[str]) -> dict[str, str]:
    """serve --lora NAME=RUN (repeatable) as {name: run}."""
    runs = {}
    for pair in pairs:
        name, _, run = pair.partition("=")
        if not (name.strip() and run) or name in runs:
            raise ConfigError(f"--lora {pair!r}: write NAME=RUN (a name clients send as \"model\", then a LoRA run, "
                              f"checkpoint or PEFT adapter folder), each NAME once")
        runs[name.strip()] = run
    return runs


def cmd_serve(args) -> int:
    from .diagnose.oom import infer_failure, infer_oom_errors
    from .plan.placement import parse_size
    from .launch import Nodes

    _fork_followers_server(args)
    keep_freed_memory()  # this process is llmsplit's own: its steps reuse their memory (allocator.py)
    try:
        from .infer.serve.server import serve
    except ImportError as e:
        raise ConfigError(f"llmsplit serve needs the [serve] extra ({e.name} is missing): "
                          f"pip install 'llmsplit[serve]'") from None
    if not args.api_key and not _is_loopback(args.host):
        print(f"llmsplit: warning: --host {args.host} lets other machines connect and no --api-key is set, so "
              f"anyone who reaches this port can use the model; set --api-key or LLMSPLIT_API_KEY", file=sys.stderr)
    failure = None
    config = _infer_config(args, max_batch=args.max_batch, kv_tokens=args.kv_tokens,
                           prefix_caching=args.prefix_caching, max_num_batched_tokens=args.max_num_batched_tokens,
                           pooling=args.pooling, tool_call_parser=args.tool_call_parser,
                           lora=_lora_runs(args.lora),
                           nodes=Nodes(**_node_settings(args)))
    try:
        serve(args.model, config, host=args.host, port=args.port, name=args.served_model_name, api_key=args.api_key,
              max_queue=args.max_queue, max_body=parse_size(args.max_request_size, "--max-request-size"),
              drain_timeout=args.drain_timeout, request_timeout=args.request_timeout, metrics_auth=args.metrics_auth,
              max_items=args.max_request_items, template_limits=_template_limits(args))
    except infer_oom_errors() as e:  # raised while loading, before serving starts
        failure = infer_failure(e, "loading the model")
    if failure is not None:
        return _explain_infer_failure(args, failure, config)
    return 0


# ---------------------------------------------------------------- prepare

def cmd_prepare(args) -> int:
    from .data.prepare import prepare
    from .io.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.tokenizer, key="--tokenizer")
    info = prepare(args.inputs, args.out, tokenizer, args.format, args.loss_on)
    carried = f", {info['loss_fraction']:.1%} of them carry loss" if "loss_fraction" in info else ""
    print(f"wrote {info['n_tokens']} tokens ({info['documents']} documents from {info['files']} files, "
          f"{info['dtype']}, tokenizer {info['tokenizer']}{carried}) to {args.out}")
    return 0


# ---------------------------------------------------------------- plan

def cmd_plan(args) -> int:
    import json

    from . import plan
    from .plan.report import format_report

    report = plan(model=args.model, gpus=args.gpus, gpu=args.gpu, nodes=args.nodes, seq_len=args.seq_len,
                  global_batch=args.global_batch, mode=args.mode, layout=args.layout, top=args.top,
                  precision=args.precision, quantize=args.quantize, emit_config=args.emit_config, sets=tuple(args.sets))
    # With --emit-config the report's next step names the file written and the train command.
    print(json.dumps(report, indent=1) if args.json else format_report(report))
    return 0 if report["fitting"] else 1  # a script can ask `plan` whether anything fits


# ---------------------------------------------------------------- doctor

def cmd_doctor(args) -> int:
    import dataclasses
    import json

    from .diagnose.doctor import format_checks, run_checks

    checks = run_checks(args.master_addr, args.master_port)
    print(json.dumps([dataclasses.asdict(c) for c in checks], indent=1) if args.json else format_checks(checks))
    return 1 if any(c.status == "FAIL" for c in checks) else 0


# ---------------------------------------------------------------- plot

def cmd_plot(args) -> int:
    from .diagnose.plot import plot_run

    for path in plot_run(args.run_dir, args.out):
        print(path)
    return 0


# ---------------------------------------------------------------- export

def cmd_export(args) -> int:
    from .plan.placement import parse_size
    from .io.hf_export import export_hf
    from .io.peft_adapter import export_peft

    if args.to == "peft":
        info = export_peft(args.checkpoint, args.out)
    else:
        info = export_hf(args.checkpoint, args.out, max_shard_bytes=parse_size(args.max_shard_size, "--max-shard-size"))
    print(f"wrote {info['out']}: {info['tensors']} tensors in {info['files']} safetensors file(s), "
          f"{info['params'] / 1e6:.2f}M parameters")
    return 0


def cmd_eval(args) -> int:
    import json
    from pathlib import Path

    import llmsplit

    _fork_followers_server(args)

    try:
        from lm_eval import simple_evaluate
        from lm_eval.tasks import TaskManager
        from lm_eval.utils import make_table

        from .infer.lm_eval_model import LlmsplitLM
    except ImportError as e:
        raise ConfigError(f"llmsplit eval needs the [eval] extra ({e.name} is missing): "
                          f"pip install 'llmsplit[eval]'") from None
    tasks = [t for t in args.tasks.split(",") if t]
    # lm-eval's own tasks (thousands of YAML files, ~12 s to index here) only when needed.
    manager = TaskManager(include_path=args.include_path, include_defaults=False) if args.include_path else None
    if manager is None or not all(manager.match_tasks([t]) for t in tasks):
        manager = TaskManager(include_path=args.include_path)
    unknown = [t for t in tasks if not manager.match_tasks([t])]
    if unknown:
        raise ConfigError(f"--tasks: lm-eval knows no task {unknown[0]!r}; name one of its tasks, or pass "
                          f"--include-path DIR with that task's YAML")
    from .diagnose.oom import infer_failure, infer_oom_errors

    config = _infer_config(args, max_batch=args.max_batch)
    try:
        m = llmsplit.load(args.model, config)
    except infer_oom_errors() as e:  # explained in the command line's flags, as generate and serve do
        failure = infer_failure(e, "loading the model")
        return _explain_infer_failure(args, failure, config)
    try:
        results = simple_evaluate(model=LlmsplitLM(m), tasks=tasks, limit=args.limit, task_manager=manager,
                                  log_samples=args.output is not None)
    finally:
        m.close()
    print(make_table(results))
    if args.output:
        out = Path(args.output)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
        print(f"wrote {out / 'results.json'}", file=sys.stderr)
    return 0


COMMANDS = {"train": cmd_train, "generate": cmd_generate, "serve": cmd_serve, "prepare": cmd_prepare,
            "export": cmd_export, "eval": cmd_eval, "doctor": cmd_doctor, "plot": cmd_plot, "plan": cmd_plan}
