"""`llmsplit <command>`: each subcommand is a thin function over the library.

Exit status: 0 success, 2 bad usage or invalid config (one sentence, no traceback),
1 a runtime failure (message plus a hint).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

from .config import ConfigError

EPILOG = "Config keys and files: see README.md. Exit status: 0 ok, 1 runtime failure, 2 bad usage or config."


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
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


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="llmsplit", description="Split large language models across devices.",
                                epilog=EPILOG)
    p.add_argument("--version", action="version", version=f"llmsplit {__import__('llmsplit').__version__}")
    sub = p.add_subparsers(title="commands", metavar="COMMAND")

    t = sub.add_parser("train", help="train or fine-tune a model on 1..N workers",
                       description="Train on local workers started by llmsplit, or inside torchrun.", epilog=EPILOG)
    t.add_argument("--config", metavar="FILE.toml", help="TOML config (defaults: the tiny model on the built-in corpus)")
    t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set train.steps=10 (repeatable)")
    t.add_argument("--nproc", type=int, metavar="N", help="local worker processes (default: one per GPU, 2 on a CPU)")
    t.add_argument("--run-dir", metavar="DIR", help="where to write the run (default runs/<timestamp>-<preset>)")
    t.add_argument("--nnodes", type=int, default=1, metavar="N", help="number of machines (default 1)")
    t.add_argument("--node-rank", type=int, default=0, metavar="R", help="this machine's rank, 0..nnodes-1")
    t.add_argument("--master-addr", default="127.0.0.1", metavar="HOST", help="address of node 0")
    t.add_argument("--master-port", type=int, metavar="PORT", help="port on node 0 (required with --nnodes > 1)")
    t.add_argument("--max-restarts", type=int, default=0, metavar="K",
                   help="restart the workers up to K times after a failure, resuming from the newest checkpoint")
    t.add_argument("--resume", default="none", metavar="auto|none|PATH",
                   help="auto: newest checkpoint in --run-dir; PATH: a run folder or checkpoint")
    t.add_argument("--auto", action="store_true",
                   help="let the planner choose the [parallel]/[memory] keys and train.micro_batch for these devices")
    t.add_argument("--profile", type=int, metavar="STEPS", help="trace STEPS steps with torch.profiler into "
                   "RUN_DIR/profile/ and print each rank's compute / communication / idle time")
    t.set_defaults(func=cmd_train)

    g = sub.add_parser("generate", help="load a model split across devices and generate text",
                       description="Print the continuation of PROMPT (the prompt is not repeated). Environment: "
                                   "LLMSPLIT_GPU_COUNT and LLMSPLIT_GPU_MEMORY_LIMIT (bytes or e.g. 20GiB per GPU) "
                                   "limit the GPUs used.", epilog=EPILOG)
    g.add_argument("--model", required=True, metavar="RUN_DIR|CHECKPOINT|HF_FOLDER|FILE.gguf",
                   help="a run folder or checkpoint, a Hugging Face Llama-family folder, or a GGUF file")
    g.add_argument("prompt", nargs="*", help="prompt text (default: standard input when it is not a terminal)")
    g.add_argument("--max-new-tokens", type=int, default=64, metavar="N")
    g.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 is greedy (default)")
    g.add_argument("--top-k", type=int, metavar="K")
    g.add_argument("--top-p", type=float, metavar="P")
    g.add_argument("--seed", type=int, metavar="S")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop before TEXT (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    g.add_argument("--stream", action="store_true", help="print text as it is generated")
    _add_placement_args(g)
    g.add_argument("--show-device-map", action="store_true", help="print where each module lives, with bytes (stderr)")
    g.set_defaults(func=cmd_generate)

    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server over the same engine (extra [serve])",
                        description="Serve GET /v1/models, POST /v1/completions, POST /v1/chat/completions (with "
                                    "\"stream\": true), GET /health and GET /metrics, batching all live requests "
                                    "together. SIGTERM or Ctrl-C drains in-flight requests, then stops. Environment: "
                                    "LLMSPLIT_API_KEY (default of --api-key), LLMSPLIT_GPU_COUNT and "
                                    "LLMSPLIT_GPU_MEMORY_LIMIT as for generate.", epilog=EPILOG)
    sv.add_argument("--model", required=True, metavar="RUN_DIR|CHECKPOINT|HF_FOLDER|FILE.gguf")
    sv.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    sv.add_argument("--port", type=int, default=8000, help="port to bind (default 8000; 0 picks a free one)")
    sv.add_argument("--api-key", default=os.environ.get("LLMSPLIT_API_KEY"), metavar="KEY",
                    help="require 'Authorization: Bearer KEY' on /v1 routes (default $LLMSPLIT_API_KEY, else none)")
    sv.add_argument("--served-model-name", metavar="NAME", help="the model id clients send (default the folder or "
                    "file name)")
    sv.add_argument("--max-batch", type=int, default=8, metavar="N", help="sequences decoded together (default 8); "
                    "the KV cache holds N full contexts")
    sv.add_argument("--max-queue", type=int, default=64, metavar="N",
                    help="sequences that may wait for a batch slot; beyond that requests get 429 (default 64)")
    sv.add_argument("--max-request-size", default="1MiB", metavar="SIZE", help="largest request body (default 1MiB)")
    sv.add_argument("--drain-timeout", type=float, default=30.0, metavar="SECONDS",
                    help="on SIGTERM, how long in-flight requests may finish before they are aborted (default 30)")
    _add_placement_args(sv)
    sv.set_defaults(func=cmd_serve)

    pr = sub.add_parser("prepare", help="tokenize text/JSONL files into a token file for training",
                        description="A .jsonl file gives one document per line (its \"text\" field); "
                                    "any other file is one document.", epilog=EPILOG)
    pr.add_argument("inputs", nargs="+", metavar="FILE|GLOB")
    pr.add_argument("--out", required=True, metavar="FILE", help="token file to write")
    pr.add_argument("--tokenizer", default="byte", metavar="byte|tokenizer.json")
    pr.set_defaults(func=cmd_prepare)

    ex = sub.add_parser("export", help="convert a training checkpoint to a Hugging Face safetensors folder",
                        description="Write a folder that transformers' AutoModelForCausalLM.from_pretrained loads: "
                                    "config.json, safetensors (sharded above --max-shard-size), tokenizer files.",
                        epilog=EPILOG)
    ex.add_argument("--checkpoint", required=True, metavar="RUN_DIR|CHECKPOINT",
                    help="a run folder (its newest checkpoint) or one checkpoint folder")
    ex.add_argument("--to", required=True, choices=("hf",), help="output format (hf: Hugging Face)")
    ex.add_argument("out", metavar="OUT", help="folder to create (must not exist or be empty)")
    ex.add_argument("--max-shard-size", default="5GiB", metavar="SIZE", help="largest safetensors file (default 5GiB)")
    ex.set_defaults(func=cmd_export)

    d = sub.add_parser("doctor", help="check torch, devices, backends, launcher variables and network",
                       description="One line per check: OK, WARN or FAIL, each with the fix. Exit 1 if any FAIL.",
                       epilog=EPILOG)
    d.add_argument("--master-addr", metavar="HOST", help="check this master address (default: $MASTER_ADDR)")
    d.add_argument("--master-port", type=int, metavar="PORT", help="check this port (default: $MASTER_PORT)")
    d.add_argument("--json", action="store_true", help="print the checks as JSON")
    d.set_defaults(func=cmd_doctor)

    pt = sub.add_parser("plot", help="draw a run's loss, tokens/s and memory as PNG files (extra [plot])",
                        epilog=EPILOG)
    pt.add_argument("run_dir", metavar="RUN_DIR")
    pt.add_argument("--out", metavar="DIR", help="where to write the PNGs (default RUN_DIR/plots)")
    pt.set_defaults(func=cmd_plot)

    pl = sub.add_parser("plan", help="predict memory per device and step time for layouts; write a config",
                        description="Predict, for each layout, memory per device term by term and the step "
                                    "time; rank those that fit and say why the others do not.", epilog=EPILOG)
    pl.add_argument("--model", required=True, metavar="PRESET|HF_FOLDER|CONFIG.toml")
    pl.add_argument("--gpus", type=int, required=True, metavar="N", help="number of devices (CPU workers for --gpu cpu)")
    pl.add_argument("--gpu", default="H100-80GB", metavar="NAME", help="device kind, or cpu (default H100-80GB)")
    pl.add_argument("--nodes", type=int, metavar="K", help="machines the devices are spread over")
    pl.add_argument("--seq-len", type=int, metavar="S")
    pl.add_argument("--global-batch", type=int, metavar="B", help="train: sequences per step; infer: concurrent sequences")
    pl.add_argument("--mode", default="train", choices=("train", "infer"))
    pl.add_argument("--precision", metavar="fp32|bf16|fp16", help="default: bf16 on GPUs, fp32 on cpu, or the config's")
    pl.add_argument("--layout", metavar="KEY=VAL,...", help="evaluate only this layout, e.g. zero=3,tp=2,pp=1")
    pl.add_argument("--top", type=int, default=5, metavar="K", help="layouts to show (default 5)")
    pl.add_argument("--json", action="store_true", help="print one JSON document")
    pl.add_argument("--emit-config", metavar="OUT.toml", help="write the best layout llmsplit train runs as a config")
    pl.set_defaults(func=cmd_plan)
    return p


def _add_placement_args(p: argparse.ArgumentParser) -> None:
    """Where a model for generation lives: the same flags for `generate` and `serve`."""
    p.add_argument("--device-map", default="auto", metavar="auto|balanced|sequential|cpu|DEVICE",
                   help="how to place the model (default auto: fill devices in order, then CPU, then disk)")
    p.add_argument("--max-memory", metavar="DEV=SIZE,...", help="budgets, e.g. cuda:0=20GiB,cuda:1=20GiB,cpu=64GiB")
    p.add_argument("--offload-dir", metavar="DIR", help="folder for layers that fit in no memory budget")
    p.add_argument("--tp", type=int, default=1, metavar="N", help="tensor parallel over N worker processes")
    p.add_argument("--pp", type=int, default=1, metavar="N", help="pipeline stages over N worker processes")
    p.add_argument("--dtype", metavar="fp32|bf16|fp16", help="compute dtype (default fp32 on CPU, the model's on GPU)")
    p.add_argument("--max-context", type=int, metavar="N", help="tokens per sequence the KV cache holds (default "
                   "the model's, at most 4096)")
    p.add_argument("--compile", action="store_true", help="torch.compile the decode step: faster tokens after "
                   "a one-time compile (minutes on a small CPU, cached on disk); not with --tp/--pp or offload")


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

    prompt = " ".join(args.prompt)
    if not prompt and not sys.stdin.isatty():
        prompt = sys.stdin.read()
    if not prompt:
        raise ConfigError("the prompt is empty; pass PROMPT words or text on standard input")
    import torch

    from .infer.placement import PlacementError

    failure = None
    try:
        m = llmsplit.load(args.model, device_map=args.device_map, max_memory=args.max_memory,
                          offload_dir=args.offload_dir, dtype=args.dtype, tp=args.tp, pp=args.pp, max_batch=1,
                          max_context=args.max_context, compile=args.compile)
    except (PlacementError, torch.OutOfMemoryError) as e:
        failure = _infer_failure(e, "loading the model")
    if failure is not None:  # outside `except`: the traceback no longer holds the half-loaded model
        return _explain_infer_oom(args, 1, *failure)
    try:
        if args.show_device_map:
            print(m.placement.describe() if m.placement else
                  "device map:\n" + "\n".join(f"  {u}: {d}" for u, d in m.device_map.items()), file=sys.stderr)

        def emit(piece: str) -> None:
            sys.stdout.write(piece)
            sys.stdout.flush()

        text = m.generate(prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                          top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop=args.stop,
                          ignore_eos=args.ignore_eos, on_text=emit if args.stream else None)
    except torch.OutOfMemoryError as e:
        failure = _infer_failure(e, "generating")
    finally:
        m.close()
    if failure is not None:
        del m
        return _explain_infer_oom(args, 1, *failure)
    if not args.stream:
        sys.stdout.write(text)
    sys.stdout.write("\n")
    return 0


def _infer_failure(error: BaseException, where: str) -> tuple:
    """(refused by placement?, the measured CUDA stop or None) for `_explain_infer_oom`."""
    from .infer.placement import PlacementError

    if isinstance(error, PlacementError):
        return True, None
    from .diagnose.oom import infer_failure_from_cuda

    return False, infer_failure_from_cuda(error, where)


def _explain_infer_oom(args, max_batch: int, placement_refused: bool, failure: dict | None) -> int:
    """generate/serve out of memory (placement refused the budgets, or CUDA ran out): the
    placement's breakdown against the budgets and the one-flag changes that fit; exit 1."""
    import gc

    import torch

    from .diagnose.oom import explain_infer_oom
    from .infer.api import placement_mode, run_sizes
    from .infer.placement import detect_budgets
    from .io.weights import open_weights

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # so that the budgets read below are the device's, not the failed load's
    source = open_weights(args.model)
    _, sizes = run_sizes(source, args.dtype, max_batch, args.max_context)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    report = explain_infer_oom(source.config, sizes, detect_budgets(args.max_memory, args.offload_dir),
                               placement_mode(args.device_map), failure, offload_dir=args.offload_dir,
                               max_batch_flag=args.func is cmd_serve, gpus=gpus)
    print(f"llmsplit: {'generate' if args.func is cmd_generate else 'serve'} failed: {report['text']}\n"
          f"hint: add one of the flags above to the same command", file=sys.stderr)
    return 1


# ---------------------------------------------------------------- serve

def cmd_serve(args) -> int:
    import torch

    from .infer.placement import PlacementError, parse_size

    try:
        from .infer.server import serve
    except ImportError as e:
        raise ConfigError(f"llmsplit serve needs the [serve] extra ({e.name} is missing): "
                          f"pip install 'llmsplit[serve]'") from None
    failure = None
    try:
        serve(args.model, host=args.host, port=args.port, name=args.served_model_name, api_key=args.api_key,
              max_queue=args.max_queue, max_body=parse_size(args.max_request_size, "--max-request-size"),
              drain_timeout=args.drain_timeout, device_map=args.device_map, max_memory=args.max_memory,
              offload_dir=args.offload_dir, dtype=args.dtype, tp=args.tp, pp=args.pp, max_batch=args.max_batch,
              max_context=args.max_context, compile=args.compile)
    except (PlacementError, torch.OutOfMemoryError) as e:  # raised while loading, before serving starts
        failure = _infer_failure(e, "loading the model")
    if failure is not None:
        return _explain_infer_oom(args, args.max_batch, *failure)
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
