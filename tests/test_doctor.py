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
