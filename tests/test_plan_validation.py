"""The planner against a real run: `llmsplit train` on 2 CPU workers with a ~25M-parameter
model, predicted model state within 3% and peak memory within 25% of summary.json."""

import json

import pytest

from helpers import MEDIUM_TOML, run_cli
from llmsplit.config import load_config, model_config, validate
from llmsplit.diagnose.probe import local_cpu
from llmsplit.plan.api import predict_for_config


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["zero = 0", "zero = 3", "tp = 2", "pp = 2"])
def test_prediction_matches_a_real_run(tmp_path, parallel):
    path = tmp_path / "run.toml"
    path.write_text(MEDIUM_TOML + f"[parallel]\n{parallel}\n")

    def measured(run: str) -> list[dict]:
        run_cli("train", "--config", str(path), "--nproc", "2", "--run-dir", str(tmp_path / run), timeout=240)
        return json.loads((tmp_path / run / "summary.json").read_text())["per_rank"]

    cfg = load_config(path)
    model_cfg = model_config(cfg, 258)
    validate(cfg, 2, model_cfg, 258)
    # By hand: 8 layers of wq, wo 512·512, wk, wv 256·512, w1 w2 w3 3·512·1376, two norms of 512
    # (2,900,992 each), embedding and head 2·264·512, the final norm 512.
    assert model_cfg.num_params() == 8 * 2_900_992 + 2 * 264 * 512 + 512 == 23_478_784
    pred = predict_for_config(cfg, model_cfg, 2, local_cpu(2))
    per_rank = measured("run")
    for rank in per_rank:
        measured_state = rank["param_bytes"] + rank["grad_bytes"] + rank["optim_bytes"]
        assert pred["model_state_bytes"] == pytest.approx(measured_state, rel=0.03)
    within = lambda ranks: all(pred["memory_per_device"]["total"] == pytest.approx(r["peak_mem_bytes"], rel=0.25)
                               for r in ranks)  # noqa: E731
    # Inside the full suite the zero-3 peaks came out 1.25-1.35x the ~700 MB they reach alone:
    # an earlier in-process launch had left MALLOC_MMAP_THRESHOLD_ in the environment, which
    # glibc reads only at start-up, so forked workers ran without it. Now applied with mallopt
    # wherever it is set (launch.workers._small_mmap_threshold); no retry.
    assert within(per_rank), (pred["memory_per_device"]["total"], per_rank)
