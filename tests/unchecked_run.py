"""Train a layout for one step on 2 gloo workers WITHOUT `layout.check`, to learn whether it
really runs: the ground truth for test_layout's property test. Prints one line, `ran` or
`failed: <what the launcher reported>`; exits 0 either way.

    python tests/unchecked_run.py RUN_DIR [--nproc N] KEY=VALUE ...
"""

import sys


def main(run_dir: str, sets: list[str], nproc: int = 2) -> None:
    from llmsplit.config import load_config, model_config, record_model_sizes, resolve_world, to_toml
    from llmsplit.launch import LaunchError, claim_process_for_launching, launch
    from llmsplit.train.api import WORKER_MODULES
    from llmsplit.train.entry import run_worker

    claim_process_for_launching(WORKER_MODULES)  # a program that only launches, as `llmsplit train` is
    cfg = load_config(None, ["train.steps=1", "train.warmup_steps=0", "train.timeout_s=60", *sets])
    resolve_world(cfg, nproc)  # dp from the world size, as validate would; no splitting rule is checked
    record_model_sizes(cfg, model_config(cfg, 258))
    try:
        launch(run_worker, (to_toml(cfg), run_dir, "none"), nproc=nproc, timeout_s=60)
    except LaunchError as e:
        print(f"failed: {e}")
        return
    print("ran")


if __name__ == "__main__":
    args, nproc = sys.argv[2:], 2
    if args[:1] == ["--nproc"]:
        nproc, args = int(args[1]), args[2:]
    main(sys.argv[1], args, nproc)
