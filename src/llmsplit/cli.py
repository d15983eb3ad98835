"""`llmsplit <command>`: each subcommand is a thin function over the library.

Exit status: 0 success, 2 bad usage or invalid config (one sentence, no traceback),
1 a runtime failure (message plus a hint).
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

from .cli_args import build_parser
from .config import ConfigError


def main(argv: list[str] | None = None) -> int:
    parser = build_parser(COMMANDS)
    args = parser.parse_args(argv)
    args.program = argv is None  # the `llmsplit` program itself, not a call from Python
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args) or 0
    except ConfigError as e:
        print(f"llmsplit: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("llmsplit: interrupted", file=sys.stderr)
        return 130


# ---------------------------------------------------------------- train

def cmd_train(args) -> int:
    from .config import load_config, model_config, record_model_sizes, to_toml, validate
    from .data.corpus import check_source
    from .io.run_dir import CONFIG_FILE, METRICS_FILE, checkpoint_dir, newest_checkpoint, resolve_checkpoint
    from .io.tokenizer import load_tokenizer
    from .launch import (LaunchError, check_master_addr, claim_process_for_launching, default_nproc, launch,
                         start_method, under_torchrun)
    from .train.limits import MemoryLimitExceeded
    from .train.entry import default_run_dir, run_worker

    torchrun = under_torchrun()
    if args.program and not torchrun:
        claim_process_for_launching()  # before anything here computes
    if args.nproc is not None and args.nproc < 1:
        raise ConfigError(f"--nproc {args.nproc} must be at least 1")
    if args.nnodes < 1 or not 0 <= args.node_rank < args.nnodes:
        raise ConfigError(f"--node-rank {args.node_rank} must be between 0 and --nnodes - 1 = {args.nnodes - 1}")
    if args.nnodes > 1 and args.master_port is None:
        raise ConfigError("--nnodes > 1 needs --master-port (the same on every node)")
    if args.nnodes > 1 and not torchrun:
        check_master_addr(args.master_addr, args.master_port)
    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts {args.max_restarts} must be 0 or more")
    run_dir = Path(args.run_dir) if args.run_dir else None
    if run_dir is not None and run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"--run-dir {str(run_dir)!r} is a file; pass a folder")
    if args.resume == "auto" and run_dir is None:
        raise ConfigError("--resume auto needs --run-dir (the run to continue)")
    # A damaged or missing checkpoint is refused here, before any worker starts.
    resume_from = resolve_checkpoint(args.resume)[1] if args.resume not in ("auto", "none") else None
    config_path, sets = args.config, list(args.set)
    if config_path is None and args.resume != "none" and run_dir is not None and (run_dir / CONFIG_FILE).is_file():
        # Continue a run with its own config; the data-parallel degree follows the new
        # world size (checkpoints load under any layout) unless --set says otherwise.
        config_path, sets = run_dir / CONFIG_FILE, ["parallel.dp=-1", *sets]
    if run_dir is not None and args.resume == "none" and any((run_dir / f).exists() for f in (CONFIG_FILE, METRICS_FILE)):
        raise ConfigError(f"--run-dir {str(run_dir)!r} already holds a run; pass --resume auto to continue it "
                          f"or choose another --run-dir")

    if args.profile is not None:
        if args.profile < 1:
            raise ConfigError(f"--profile {args.profile} must be at least 1 (steps to trace)")
        sets.append(f"train.profile_steps={args.profile}")
    cfg = load_config(config_path, sets)
    if cfg.model.hf:
        _use_pretrained_sizes(cfg)
    world = int(os.environ["WORLD_SIZE"]) if torchrun else (args.nproc or default_nproc()) * args.nnodes
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    check_source(cfg.data.source)
    model_cfg = model_config(cfg, tokenizer.vocab_size)
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world)) if torchrun else args.nproc or default_nproc()
    if args.auto:
        cfg = _apply_auto(cfg, model_cfg, world, per_node)
    validate(cfg, world, model_cfg, tokenizer.vocab_size)
    record_model_sizes(cfg, model_cfg)
    if args.resume == "auto":
        resume_from = newest_checkpoint(checkpoint_dir(cfg, run_dir))[0]  # the workers warn about skipped ones
    if resume_from is not None:
        from .train.checkpoint import check_fits

        check_fits(resume_from, model_cfg)
    config_text = to_toml(cfg)

    if torchrun:
        # Every rank proposes a run folder and rank 0's is taken, so rank 0 knows where it is.
        run_dir = run_dir or default_run_dir(cfg.model.preset)
        try:
            summary = run_worker(config_text, str(run_dir), args.resume)
        except MemoryLimitExceeded as e:
            if int(os.environ["RANK"]) == 0:
                _explain_oom(str(e), cfg, model_cfg, world, per_node)
            return 1
        if summary is not None:  # rank 0
            _plan_check(run_dir, cfg, model_cfg, world, per_node)
        return 0
    if run_dir is None and args.nnodes == 1:
        run_dir = default_run_dir(cfg.model.preset)
    nproc = args.nproc or default_nproc()
    if nproc > 1 and start_method() == "fork":
        # Forked workers inherit what is imported here: import the trainer (DTensor, DCP:
        # ~2 s) once, not once per worker on the same cores.
        importlib.import_module("llmsplit.train.trainer")
    print(f"llmsplit: training on {world} worker(s) ({nproc} on this machine); run dir "
          f"{run_dir or '(chosen by node 0)'}", file=sys.stderr, flush=True)
    try:
        launch(run_worker, (config_text, str(run_dir) if run_dir else None, args.resume), nproc=nproc,
               nnodes=args.nnodes, node_rank=args.node_rank, master_addr=args.master_addr,
               master_port=args.master_port, max_restarts=args.max_restarts, timeout_s=cfg.train.timeout_s)
    except LaunchError as e:
        if _explain_oom(str(e), cfg, model_cfg, world, per_node):
            return 1
        hint = e.hint or (f"the worker's traceback is printed above; `--resume auto --run-dir {run_dir}` "
                          f"continues from the newest checkpoint")
        print(f"llmsplit: training failed: {e}\nhint: {hint}", file=sys.stderr)
        return 1
    if run_dir is not None and args.node_rank == 0:  # node 0 holds rank 0, which wrote the summary
        _plan_check(run_dir, cfg, model_cfg, world, per_node)
    return 0


def _apply_auto(cfg, model_cfg, world: int, per_node: int):
    """`--auto`: the planner's fastest runnable layout for these devices replaces the config's."""
    from .plan.api import auto_config
    from .plan.hardware import local_device

    device = local_device(per_node)
    cfg, best = auto_config(cfg, model_cfg, world, device)
    # On a GPU (or under memory.limit_bytes) the workers confirm the micro-batch by trial.
    cfg.train.confirm_micro_batch = device.kind != "cpu" or cfg.memory.limit_bytes is not None
    lay = best["layout"]
    keys = ["dp", "zero", "tp", "pp", "micro_batch", "activation_checkpoint", "offload"]
    if lay["pp"] > 1:
        keys.insert(4, "pp_schedule")
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"llmsplit: --auto chose {' '.join(f'{k}={lay[k]}' for k in keys)} for {world} × {device.name} "
              f"(predicted {best['memory_per_device']['total'] / 2**20:.0f} MiB per device, "
              f"{best['tokens_per_s']:.0f} tokens/s)", file=sys.stderr, flush=True)
    return cfg


def _explain_oom(message: str, cfg, model_cfg, world: int, per_node: int) -> bool:
    """A failure that is an out-of-memory stop: print the planner's explanation (True)."""
    from .train.limits import parse_oom

    failure = parse_oom(message)
    if failure is None:
        return False
    from .diagnose.oom import explain_oom
    from .plan.hardware import local_device

    report = explain_oom(cfg, model_cfg, world, local_device(per_node), failure)
    print(f"llmsplit: training failed: {report['text']}\nhint: apply one of the changes above with --set "
          f"(or raise memory.limit_bytes)", file=sys.stderr)
    return True


def _plan_check(run_dir, cfg, model_cfg, world: int, per_node: int) -> None:
    """Record the planner's prediction next to what the run measured; warn when they differ."""
    from .config import load_config
    from .diagnose.plan_check import check_run
    from .io.run_dir import CONFIG_FILE
    from .plan.hardware import local_device

    if cfg.train.confirm_micro_batch:  # --auto's trial may have changed it; the run's config says
        cfg.train.micro_batch = load_config(Path(run_dir) / CONFIG_FILE).train.micro_batch
    check = check_run(run_dir, cfg, model_cfg, world, local_device(per_node))
    for warning in (check or {}).get("warnings", []):
        print(f"llmsplit: warning: {warning} (the plan is off for this layout; plan_check in summary.json)",
              file=sys.stderr)


def _use_pretrained_sizes(cfg) -> None:
    """`model.hf`: the model's sizes come from the folder's config.json (explicit size keys
    would contradict the weights) and, unless one is named, its tokenizer is the folder's."""
    from dataclasses import fields

    from .config import record_model_sizes
    from .io.hf import HFWeights

    hf = HFWeights(cfg.model.hf)  # reads only config.json and the safetensors headers
    for f in fields(cfg.model):
        if f.name not in ("preset", "hf", "gguf") and getattr(cfg.model, f.name) is not None \
                and getattr(cfg.model, f.name) != getattr(hf.config, f.name):
            raise ConfigError(f"model.{f.name} cannot be set together with model.hf (the folder's config.json "
                              f"says {getattr(hf.config, f.name)}); remove model.{f.name}")
    record_model_sizes(cfg, hf.config)
    if cfg.data.tokenizer == "byte":
        cfg.data.tokenizer = str(cfg.model.hf)


# ---------------------------------------------------------------- generate

def cmd_generate(args) -> int:
    import llmsplit

    from .diagnose.oom import infer_failure, infer_oom_errors

    prompt = " ".join(args.prompt)
    if not prompt and not sys.stdin.isatty():
        prompt = sys.stdin.read()
    if not prompt:
        raise ConfigError("the prompt is empty; pass PROMPT words or text on standard input")
    try:
        m = llmsplit.load(args.model, **_placement_kwargs(args), max_batch=1)
    except infer_oom_errors() as e:
        failure = infer_failure(e, "loading the model")
    else:
        failure = _print_generation(m, prompt, args)
        del m  # closed; what it held must be free before a failure is explained
    if failure is not None:  # outside `except`: the traceback no longer holds the half-loaded model
        return _explain_infer_failure(args, failure, max_batch=1)
    return 0


def _print_generation(m, prompt: str, args):
    """Print the continuation of `prompt` (and, asked, the device map); close `m`. Returns
    None, or the `InferFailure` of a generation that ran out of memory."""
    import torch

    from .diagnose.oom import infer_failure

    def emit(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    try:
        if args.show_device_map:
            print(m.placement.describe() if m.placement else
                  "device map:\n" + "\n".join(f"  {u}: {d}" for u, d in m.device_map.items()), file=sys.stderr)
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
    return None


def _placement_kwargs(args) -> dict:
    """The placement flags of generate and serve (`cli_args._add_placement_args`) as `llmsplit.load` arguments."""
    return dict(device_map=args.device_map, max_memory=args.max_memory, offload_dir=args.offload_dir,
                dtype=args.dtype, tp=args.tp, pp=args.pp, max_context=args.max_context, compile=args.compile)


def _explain_infer_failure(args, failure, max_batch: int) -> int:
    """generate/serve out of memory: the placement's breakdown against the budgets and the
    one-flag changes that fit; exit 1."""
    from .diagnose.oom import explain_infer_failure

    serving = args.func is cmd_serve
    text = explain_infer_failure(failure, args.model, device_map=args.device_map, max_memory=args.max_memory,
                                 offload_dir=args.offload_dir, dtype=args.dtype, max_batch=max_batch,
                                 max_context=args.max_context, max_batch_flag=serving)
    print(f"llmsplit: {'serve' if serving else 'generate'} failed: {text}\n"
          f"hint: add one of the flags above to the same command", file=sys.stderr)
    return 1


# ---------------------------------------------------------------- serve

def cmd_serve(args) -> int:
    from .diagnose.oom import infer_failure, infer_oom_errors
    from .infer.placement import parse_size

    try:
        from .infer.server import serve
    except ImportError as e:
        raise ConfigError(f"llmsplit serve needs the [serve] extra ({e.name} is missing): "
                          f"pip install 'llmsplit[serve]'") from None
    failure = None
    try:
        serve(args.model, host=args.host, port=args.port, name=args.served_model_name, api_key=args.api_key,
              max_queue=args.max_queue, max_body=parse_size(args.max_request_size, "--max-request-size"),
              drain_timeout=args.drain_timeout, max_batch=args.max_batch, **_placement_kwargs(args))
    except infer_oom_errors() as e:  # raised while loading, before serving starts
        failure = infer_failure(e, "loading the model")
    if failure is not None:
        return _explain_infer_failure(args, failure, args.max_batch)
    return 0


# ---------------------------------------------------------------- prepare

def cmd_prepare(args) -> int:
    from .data.prepare import prepare
    from .io.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.tokenizer, key="--tokenizer")
    info = prepare(args.inputs, args.out, tokenizer)
    print(f"wrote {info['n_tokens']} tokens ({info['documents']} documents from {info['files']} files, "
          f"{info['dtype']}, tokenizer {info['tokenizer']}) to {args.out}")
    return 0


# ---------------------------------------------------------------- plan

def cmd_plan(args) -> int:
    import json

    from . import plan
    from .plan.report import format_report

    report = plan(model=args.model, gpus=args.gpus, gpu=args.gpu, nodes=args.nodes, seq_len=args.seq_len,
                  global_batch=args.global_batch, mode=args.mode, layout=args.layout, top=args.top,
                  precision=args.precision, emit_config=args.emit_config)
    print(json.dumps(report, indent=1) if args.json else format_report(report))
    if args.emit_config:
        print(f"llmsplit: wrote {args.emit_config} (run it with: llmsplit train --config {args.emit_config} "
              f"--nproc {args.gpus})", file=sys.stderr)
    return 0


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
    from .infer.placement import parse_size
    from .io.hf_export import export_hf

    info = export_hf(args.checkpoint, args.out, max_shard_bytes=parse_size(args.max_shard_size, "--max-shard-size"))
    print(f"wrote {info['out']}: {info['tensors']} tensors in {info['files']} safetensors file(s), "
          f"{info['params'] / 1e6:.2f}M parameters")
    return 0


COMMANDS = {"train": cmd_train, "generate": cmd_generate, "serve": cmd_serve, "prepare": cmd_prepare,
            "export": cmd_export, "doctor": cmd_doctor, "plot": cmd_plot, "plan": cmd_plan}
