import json
import socket
from pathlib import Path

import pytest
from helpers import run_cli


def test_doctor_is_healthy_here_and_reports_torch_and_gloo():
    proc = run_cli("doctor", timeout=120)
    assert proc.returncode == 0
    assert "torch" in proc.stdout and "gloo" in proc.stdout
    assert "FAIL" not in proc.stdout
    checks = json.loads(run_cli("doctor", "--json", timeout=120).stdout)
    assert {c["status"] for c in checks} <= {"OK", "WARN"}


def test_an_unresolvable_master_address_fails_with_the_fix():
    proc = run_cli("doctor", check=False, timeout=120,
                   env={"MASTER_ADDR": "no-such-host.invalid", "MASTER_PORT": "29500"})
    assert proc.returncode == 1
    line = next(line for line in proc.stdout.splitlines() if "master address" in line)
    assert line.startswith("FAIL") and "does not resolve" in line
    assert "fix: use node 0's IP address" in proc.stdout


def test_a_busy_local_master_port_is_reported():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = run_cli("doctor", "--master-addr", "127.0.0.1", "--master-port", str(port), timeout=120)
    assert f"{port} is in use" in proc.stdout


def test_a_missing_socket_interface_fails():
    proc = run_cli("doctor", check=False, timeout=120, env={"GLOO_SOCKET_IFNAME": "nosuchif0"})
    assert proc.returncode == 1 and "no interface nosuchif0" in proc.stdout


def test_plot_writes_non_empty_pngs(tmp_path):
    import pytest

    pytest.importorskip("matplotlib")
    from helpers import TINY, train

    train(tmp_path / "run", *TINY, nproc=1)
    out = run_cli("plot", str(tmp_path / "run"), timeout=120).stdout.split()
    assert len(out) == 4
    for path in out:
        data = open(path, "rb").read()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    bad = run_cli("plot", str(tmp_path), check=False, timeout=60)
    assert bad.returncode == 2 and "has no metrics.jsonl" in bad.stderr


def test_the_thread_tuner_keeps_the_faster_count_and_backs_off(monkeypatch):
    """Decode picks its thread count as it runs (issue 23: with libgomp's spinning barriers,
    2 threads collapsed when another process wanted the cores, and no fixed wait policy kept
    the quiet machine's speed): a few steps at the other count, kept when clearly faster; a
    trial that loses doubles the wait before the next. Steps timed here are synthetic: the
    speeds of 2 threads and 1 under contention, then on a quiet machine."""
    import torch

    from llmsplit import threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    chosen = []
    monkeypatch.setattr(torch, "set_num_threads", chosen.append)
    tuner = threads.ThreadTuner(threads=2)
    assert tuner.enabled and tuner.current == 2
    speed = {2: 0.25, 1: 0.04}  # seconds a step: 2 spinning threads beside another job, 1 thread

    def run(steps):
        for _ in range(steps):
            tuner.record(speed[chosen[-1] if chosen else 2], shape=1)

    run(20)
    assert tuner.current == 1 and tuner.switches == 1  # contention: one thread is faster
    speed = {2: 0.03, 1: 0.04}  # the other job ended
    run(200)
    assert tuner.current == 2 and tuner.switches == 2
    period = tuner._period
    run(2000)  # quiet: trials of one thread lose, and come ever more rarely
    assert tuner.current == 2 and tuner.switches == 2 and tuner._period > period
    assert tuner._period == threads.MAX_PERIOD_S
    tuner.record(0.5, shape=4)  # another batch size: not compared with the steps before
    assert tuner.current == 2
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the user's choice: left alone
    assert not threads.ThreadTuner(threads=2).enabled
    assert not threads.ThreadTuner(threads=1).enabled
    monkeypatch.setenv(threads.CHOSEN_BY_LLMSPLIT, "1")  # set by llmsplit's launcher for its workers: theirs
    assert threads.ThreadTuner(threads=2).enabled
    assert threads.oversubscription(cores=2, load=1.5) is None
    assert "load average 5.0 on 2 cores" in threads.oversubscription(cores=2, load=5.0)


def test_the_training_thread_tuner_tries_one_thread_only_when_steps_slow_down(monkeypatch):
    """Training steps do the same work each time, so its tuner never tries another count on a
    steady machine; when the steps slow down (another process wants the cores and 2 spinning
    threads collapse: measured 5.8x), it drops to one thread, and goes back once the machine
    is quiet again. Step times are synthetic, in the proportions `benchmarks/train_threads.py`
    measured (quiet: 0.63 s at 2 threads, 1.08 s at 1; loaded: 3.6 s and 1.0 s)."""
    import torch

    from llmsplit import threads
    from llmsplit.launch.workers import prepare_workers

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    chosen = []
    monkeypatch.setattr(torch, "set_num_threads", chosen.append)
    tuner = threads.ThreadTuner(threads=2, uniform=True)
    speed = {2: 0.63, 1: 1.08}

    def run(steps):
        for _ in range(steps):
            tuner.record(speed[chosen[-1] if chosen else 2])

    run(500)
    assert chosen == [1, 2] and tuner.current == 2  # quiet: one early trial, then none
    speed = {2: 3.6, 1: 1.0}
    run(12)
    assert tuner.current == 1 and chosen[-1] == 1
    run(300)  # still loaded: trials of 2 threads lose after two steps, ever more rarely
    assert tuner.current == 1 and tuner._period == threads.MAX_PERIOD_STEPS
    losing_trials = len(chosen)
    speed = {2: 0.63, 1: 1.08}
    run(threads.MAX_PERIOD_STEPS + 2 * threads.TRIAL_STEPS)
    assert tuner.current == 2 and tuner.switches == 2 and len(chosen) == losing_trials + 2
    chosen.clear()
    tuner, speed = threads.ThreadTuner(threads=2, uniform=True), {2: 3.6, 1: 1.0}
    run(20)
    assert tuner.current == 1  # loaded from the start: the early trial finds it
    # The launcher's own count is marked as its own, recomputed by a later launch, and
    # tunable in the workers; one the user exported is kept and left alone.
    _, env = prepare_workers(2, [])
    assert env[threads.CHOSEN_BY_LLMSPLIT] == "1"
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    monkeypatch.setenv(threads.CHOSEN_BY_LLMSPLIT, "1")
    _, env = prepare_workers(4, [])
    assert env["OMP_NUM_THREADS"] != "7" and env[threads.CHOSEN_BY_LLMSPLIT] == "1"
    monkeypatch.delenv(threads.CHOSEN_BY_LLMSPLIT)
    _, env = prepare_workers(4, [])
    assert env["OMP_NUM_THREADS"] == "7" and env[threads.CHOSEN_BY_LLMSPLIT] == "0"
    assert not threads.ThreadTuner(threads=2, uniform=True).enabled


def test_workers_start_at_one_thread_where_other_processes_want_the_cores(monkeypatch, capsys):
    """`llmsplit train` reads, as it starts, how many threads of other processes want the
    cores (the kernel's runnable count, not the 1-minute load average): a worker of 2
    threads beside a busy core starts at 1 and tries 2 later; one-thread workers are told
    what sharing costs. A trial of 2 threads that is far slower ends after one step."""
    import torch

    from llmsplit import threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert threads.contention(1, 2, busy=0, cores=2) == (2, None)  # quiet
    assert threads.contention(2, 1, busy=1, cores=4) == (1, None)  # room for everyone
    start, note = threads.contention(1, 2, busy=1, cores=2)
    assert start == 1 and note.startswith("1 thread of other processes wants this machine's 2 cores: each worker "
                                          "starts at 1 thread instead of 2") and "tries 2 again" in note
    start, note = threads.contention(2, 1, busy=1, cores=2)
    assert start == 1 and note.endswith("the 2 workers share them, so each step takes about 1.5x as long as on a "
                                        "quiet machine")
    assert threads.runnable_elsewhere(samples=3) >= 0
    env = threads.workers_threads(1, busy=3)
    assert env[threads.START_THREADS] == "1" and "threads of other processes want" in capsys.readouterr().err
    assert threads.workers_threads(1, busy=0)[threads.START_THREADS] == env["OMP_NUM_THREADS"]

    chosen = []
    monkeypatch.setattr(torch, "set_num_threads", chosen.append)
    monkeypatch.setenv(threads.START_THREADS, "1")
    tuner = threads.ThreadTuner(threads=2, uniform=True)
    assert tuner.current == 1 and chosen == [1]
    speed = {2: 14.0, 1: 1.0}  # SmolLM2 LoRA beside a busy core (issue 51): 60 s and 4.4 s a step
    for _ in range(threads.FIRST_PERIOD_STEPS + threads.TRIAL_STEPS + 1):
        tuner.record(speed[chosen[-1]])
    assert chosen == [1, 2, 1] and tuner.trials == 1  # the trial of 2 threads lost in one step
    monkeypatch.setenv(threads.START_THREADS, "2")  # nothing else ran: the full count from the start
    assert threads.ThreadTuner(threads=2, uniform=True).current == 2


def _torch_check(monkeypatch, cuda, gpus, version="2.5.1+cu124", file=None):
    """doctor's torch line on a machine whose torch says what the arguments say."""
    import torch

    from llmsplit.diagnose import doctor

    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(torch, "__version__", version)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(doctor, "_device_checks", lambda torch: [])  # they would query the GPUs
    if file:
        monkeypatch.setattr(torch, "__file__", str(file))
    return next(c for c in doctor.run_checks() if c.name == "torch")


def test_a_cuda_build_without_a_gpu_names_its_size_and_the_cpu_build(monkeypatch, tmp_path):
    import subprocess

    import torch

    package = Path(torch.__file__).parent
    check = _torch_check(monkeypatch, "12.4", 0)
    assert check.status == "WARN" and "2.5.1+cu124 (CUDA 12.4) on a machine with no GPU" in check.detail
    # The size on disk of the installed package, as du measures it.
    du_gib = int(subprocess.run(["du", "-sk", str(package)], capture_output=True, text=True).stdout.split()[0]) / 2**20
    shown = float(check.detail.split("installed: torch ")[1].split(" GiB")[0])
    assert shown == pytest.approx(du_gib, abs=0.1) and f"in {package}" in check.detail
    # The version without its local suffix, from PyTorch's CPU index.
    assert check.fix.endswith("pip install torch==2.5.1 --index-url https://download.pytorch.org/whl/cpu")
    # The CUDA libraries pip installs beside it (nvidia-*-cu12 wheels) are counted too.
    (tmp_path / "torch").mkdir()
    (tmp_path / "nvidia" / "cublas").mkdir(parents=True)
    (tmp_path / "nvidia" / "cublas" / "libcublas.so").write_bytes(b"\0" * (1 << 20))
    check = _torch_check(monkeypatch, "12.4", 0, file=tmp_path / "torch" / "__init__.py")
    assert f"its CUDA libraries 0.0 GiB in {tmp_path / 'nvidia'}" in check.detail


def test_no_torch_build_warning_for_the_cpu_build_or_with_a_gpu(monkeypatch):
    cpu = _torch_check(monkeypatch, None, 0, version="2.5.1+cpu")
    assert (cpu.status, cpu.detail, cpu.fix) == ("OK", "2.5.1+cpu (CPU build)", "")
    gpu = _torch_check(monkeypatch, "12.4", 2)
    assert (gpu.status, gpu.detail, gpu.fix) == ("OK", "2.5.1+cu124 (CUDA 12.4)", "")
