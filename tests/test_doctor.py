import json
import socket

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


def test_openmp_wait_policy_defaults_apply_only_where_the_user_chose_none(monkeypatch):
    """llmsplit's processes and workers get a short libgomp spin (issue 23: the default spin
    made 2-thread decode collapse when the cores were shared); a user's own choice is kept."""
    import os
    import subprocess
    import sys

    from llmsplit import threads
    from llmsplit.launch.workers import prepare_workers

    assert threads.wait_policy_defaults({}) == threads.DEFAULTS
    assert threads.wait_policy_defaults({"OMP_WAIT_POLICY": "PASSIVE"}) == {}
    assert threads.wait_policy_defaults({"GOMP_SPINCOUNT": "5"}) == {}
    for key in threads.USER_KEYS:
        monkeypatch.delenv(key, raising=False)
    assert prepare_workers(2)[1].items() >= threads.DEFAULTS.items()
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert "GOMP_SPINCOUNT" not in prepare_workers(2)[1]
    # The command line sets them before torch is first imported (libgomp reads them once, then).
    spy = ("import os, sys\n"
           "class Spy:\n"
           "    def find_spec(self, name, path=None, target=None):\n"
           "        if name == 'torch' and 'seen' not in globals():\n"
           "            globals()['seen'] = os.environ.get('GOMP_SPINCOUNT')\n"
           "sys.meta_path.insert(0, Spy())\n"
           "import llmsplit.cli\n"
           "print(seen)\n")
    env = {k: v for k, v in os.environ.items() if k not in threads.USER_KEYS}
    out = subprocess.run([sys.executable, "-c", spy], env=env, capture_output=True, text=True)
    assert out.stdout.split() == [threads.DEFAULTS["GOMP_SPINCOUNT"]], out.stderr
    out = subprocess.run([sys.executable, "-c", spy], env={**env, "GOMP_SPINCOUNT": "7"}, capture_output=True, text=True)
    assert out.stdout.split() == ["7"], out.stderr
    assert threads.oversubscription(cores=2, load=1.5) is None
    assert "load average 5.0 on 2 cores" in threads.oversubscription(cores=2, load=5.0)
