"""launch/cluster_env.py: the node flags that Slurm, Kubeflow (PET_*) and SkyPilot give a
command started on every node, flags passed by hand winning. Unit tests on dictionaries set as
those launchers set them: no processes, no training."""

import os

import pytest

from llmsplit import cli
from llmsplit.diagnose import doctor
from llmsplit.errors import ConfigError
from llmsplit.launch import workers
from llmsplit.launch.cluster_env import detect, drop_launcher_variables, expand_nodelist, node_settings

NO_FLAGS = {"nnodes": None, "node_rank": None, "master_addr": None, "master_port": None}

# What `sbatch --nodes=2 --ntasks-per-node=1` then `srun llmsplit train ...` leaves in the
# environment of the task on the job's second node (the step's variables next to the job's).
SLURM = {"SLURM_JOB_ID": "4242117", "SLURM_JOBID": "4242117", "SLURM_JOB_NUM_NODES": "2", "SLURM_NNODES": "2",
         "SLURM_JOB_NODELIST": "gpu-[09-10]", "SLURM_NODELIST": "gpu-[09-10]", "SLURM_NODEID": "1",
         "SLURM_PROCID": "1", "SLURM_LOCALID": "0", "SLURM_NTASKS": "2", "SLURM_TASKS_PER_NODE": "1(x2)",
         "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": "2",
         "SLURM_STEP_NODELIST": "gpu-[09-10]", "SLURMD_NODENAME": "gpu-10"}
# Kubeflow Trainer's torch runtime (TrainJob "exp1", numNodes 2), pod of node 1.
TRAINJOB = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "8", "PET_NODE_RANK": "1",
            "PET_MASTER_ADDR": "exp1-node-0-0.exp1", "PET_MASTER_PORT": "29400"}
# The training operator's PyTorchJob (Master + 1 Worker): PET_* and torchrun's plain names.
PYTORCHJOB = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "8", "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "exp1-master-0",
              "PET_MASTER_PORT": "23456", "MASTER_ADDR": "exp1-master-0", "MASTER_PORT": "23456", "RANK": "1",
              "WORLD_SIZE": "16", "PYTHONUNBUFFERED": "1"}
SKYPILOT = {"SKYPILOT_NUM_NODES": "2", "SKYPILOT_NODE_RANK": "1", "SKYPILOT_NODE_IPS": "10.1.0.4\n10.1.0.5\n",
            "SKYPILOT_NUM_GPUS_PER_NODE": "8", "SKYPILOT_TASK_ID": "sky-2025-01-01-00-00-00-000000_exp1_1"}


def test_slurm_host_lists_expand_as_scontrol_show_hostnames():
    assert expand_nodelist("gpu-[01-03,07],login1") == ["gpu-01", "gpu-02", "gpu-03", "gpu-07", "login1"]
    assert expand_nodelist("n[098-101]") == ["n098", "n099", "n100", "n101"]  # the first number's padding
    assert expand_nodelist("rack[1-2]-n[8,10]") == ["rack1-n8", "rack1-n10", "rack2-n8", "rack2-n10"]
    assert expand_nodelist("node7") == ["node7"]
    for bad in ("gpu-[01-03", "gpu-[a-b]", "gpu-[03-01]", "a,,b", "", "gpu]1"):
        with pytest.raises(ValueError):
            expand_nodelist(bad)


def test_slurm_gives_every_node_the_same_master_and_port():
    found = detect(SLURM)
    assert (found.launcher, found.nnodes, found.node_rank, found.master_addr) == ("Slurm", 2, 1, "gpu-09")
    assert found.master_port == 12000 + 4242117 % 20000 and found.master_port < 32768
    assert detect({**SLURM, "SLURM_NODEID": "0", "SLURMD_NODENAME": "gpu-09"}) == found.__class__(
        "Slurm", 2, 0, "gpu-09", found.master_port)
    exported = detect({**SLURM, "MASTER_PORT": "29500", "MASTER_ADDR": "gpu-09-ib"})
    assert (exported.master_addr, exported.master_port) == ("gpu-09-ib", 29500)  # what the user exported wins
    padded = detect({**SLURM, "SLURM_STEP_NODELIST": "gpu-[08-10,12],login1", "SLURM_STEP_NUM_NODES": "5",
                     "SLURM_STEP_NUM_TASKS": "5", "SLURM_NODEID": "4"})
    assert (padded.nnodes, padded.node_rank, padded.master_addr) == (5, 4, "gpu-08")


def test_one_machine_under_slurm_runs_as_without_it():
    assert detect({**SLURM, "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NUM_TASKS": "1",
                   "SLURM_STEP_NODELIST": "gpu-09", "SLURM_NODEID": "0"}) is None  # srun -N1 in a 2-node job
    salloc = {k: v for k, v in SLURM.items() if not k.startswith(("SLURM_STEP", "SLURM_NODEID", "SLURM_PROCID"))}
    assert detect(salloc) is None  # an salloc shell or the batch script: one machine, not the job's nodes
    assert node_settings(salloc, **NO_FLAGS) == ({}, None)  # the defaults, as before


def test_bad_slurm_values_are_refused_naming_the_variable(monkeypatch, capsys):
    with pytest.raises(ConfigError, match=r"SLURM_NODEID='x' is not a whole number"):
        detect({**SLURM, "SLURM_NODEID": "x"})
    with pytest.raises(ConfigError, match=r"SLURM_NODEID=2 is not below SLURM_STEP_NUM_NODES=2"):
        detect({**SLURM, "SLURM_NODEID": "2"})
    with pytest.raises(ConfigError, match=r"SLURM_STEP_NUM_TASKS=16 on 2 nodes.*--ntasks-per-node=1"):
        detect({**SLURM, "SLURM_STEP_NUM_TASKS": "16"})
    with pytest.raises(ConfigError, match=r"SLURM_STEP_NODELIST='gpu-\[09-' is not a Slurm host list"):
        detect({**SLURM, "SLURM_STEP_NODELIST": "gpu-[09-"})
    # From the command line: exit 2, one sentence, before anything starts.
    for name, value in SLURM.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("SLURM_NODEID", "x")
    assert cli.main(["train", "--nproc", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "SLURM_NODEID='x'" in err[0] and "Traceback" not in err[0], err


def test_kubeflow_trainjob_and_pytorchjob():
    for env, addr, port in ((TRAINJOB, "exp1-node-0-0.exp1", 29400), (PYTORCHJOB, "exp1-master-0", 23456)):
        found = detect(env)
        assert (found.launcher, found.nnodes, found.node_rank, found.master_addr, found.master_port) == (
            "Kubeflow (PET_*)", 2, 1, addr, port)
    plain = {k: v for k, v in PYTORCHJOB.items() if k not in ("PET_MASTER_ADDR", "PET_MASTER_PORT")}
    assert (detect(plain).master_addr, detect(plain).master_port) == ("exp1-master-0", 23456)
    assert detect({**TRAINJOB, "PET_NNODES": "2:2"}).nnodes == 2
    with pytest.raises(ConfigError, match=r"PET_NNODES='1:3' asks for an elastic job"):
        detect({**TRAINJOB, "PET_NNODES": "1:3"})
    assert detect({**TRAINJOB, "PET_NNODES": "1", "PET_NODE_RANK": "0"}) is None  # numNodes 1


def test_skypilot_names_the_head_node_and_a_port_every_node_derives_alike():
    found = detect(SKYPILOT)
    assert (found.launcher, found.nnodes, found.node_rank, found.master_addr) == ("SkyPilot", 2, 1, "10.1.0.4")
    assert found.master_port == detect({**SKYPILOT, "SKYPILOT_NODE_RANK": "0"}).master_port
    assert 12000 <= found.master_port < 32000


def test_flags_win_and_fill_what_the_launcher_leaves_out():
    settings, found = node_settings(SLURM, **{**NO_FLAGS, "master_port": 29500})
    assert settings == {"nnodes": 2, "node_rank": 1, "master_addr": "gpu-09", "master_port": 29500}
    assert found.sources["master_port"] == "--master-port" and found.describe() == "Slurm: node 1 of 2, master gpu-09:29500"
    assert node_settings(SLURM, **{**NO_FLAGS, "nnodes": 1}) == ({"nnodes": 1}, None)  # this machine alone
    everything = {"nnodes": 3, "node_rank": 2, "master_addr": "a", "master_port": 1}
    assert node_settings({**SLURM, "SLURM_NODEID": "x"}, **everything) == (everything, None)  # env not even read
    five = {**SLURM, "SLURM_STEP_NUM_NODES": "5", "SLURM_STEP_NUM_TASKS": "5", "SLURM_NODEID": "4"}
    with pytest.raises(ConfigError, match=r"node rank 4 \(SLURM_NODEID\) is not below the 2 machines of --nnodes; "
                                          r"pass both --nnodes and --node-rank, or neither"):
        node_settings(five, **{**NO_FLAGS, "nnodes": 2})
    with pytest.raises(ConfigError, match=r"PET_MASTER_PORT is not set; pass --master-port"):
        node_settings({k: v for k, v in TRAINJOB.items() if k != "PET_MASTER_PORT"}, **NO_FLAGS)
    settings, _ = node_settings({k: v for k, v in TRAINJOB.items() if k != "PET_MASTER_PORT"},
                                **{**NO_FLAGS, "master_port": 7000})
    assert settings["master_port"] == 7000
    assert node_settings({}, **NO_FLAGS) == ({}, None)


def test_the_command_line_leaves_unpassed_node_flags_to_the_launcher():
    parser = cli.build_parser(cli.COMMANDS)
    for command in (["train"], ["serve", "--model", "m"]):
        args = parser.parse_args(command)
        assert (args.nnodes, args.node_rank, args.master_addr, args.master_port) == (None, None, None, None)


def test_workers_never_see_the_launchers_pet_variables_nor_its_rank(monkeypatch):
    monkeypatch.setattr(workers, "_small_mmap_threshold", lambda: None)
    for name, value in {**PYTORCHJOB, "RANK": "5", "LLMSPLIT_TEST_PASSED_ON": "0"}.items():
        monkeypatch.setenv(name, value)  # RANK=5: as torch's agent set it for this worker
    parent = {**PYTORCHJOB, "LLMSPLIT_TEST_PASSED_ON": "1"}
    handed_on = {k: v for k, v in parent.items() if k not in workers.AGENT_VARIABLES}  # as `launch` builds it
    here = os.getcwd()
    try:  # the launcher's directory, whatever the forkserver's (an earlier launch may have started it)
        assert workers._in_environment(handed_on, "/", os.getcwd) == "/"
    finally:
        os.chdir(here)
    seen = workers._in_environment(handed_on, here, lambda: dict(os.environ))
    assert not [k for k in seen if k.startswith("PET_")]
    assert seen["RANK"] == "5" and seen["LLMSPLIT_TEST_PASSED_ON"] == "1"
    env = dict(TRAINJOB, PATH="/bin")
    drop_launcher_variables(env)  # a follower of `serve --tp/--pp` (followers._run_follower)
    assert env == {"PATH": "/bin"}


def test_doctor_says_which_launcher_and_what_it_resolved():
    check, found = doctor._cluster_check(SLURM)
    line = doctor.format_checks([check])
    assert line.startswith("OK") and "cluster launcher" in line
    assert f"Slurm: node 1 of 2, master gpu-09:{found.master_port} (from SLURM_STEP_NUM_NODES, SLURM_NODEID, " \
           f"SLURM_STEP_NODELIST, SLURM_JOB_ID)" in line
    assert "Kubeflow (PET_*): node 1 of 2, master exp1-node-0-0.exp1:29400" in doctor._cluster_check(TRAINJOB)[0].detail
    assert doctor._cluster_check({})[0].detail.startswith("none:")
    assert "not inside a multi-node srun" in doctor._cluster_check({"SLURM_JOB_ID": "1"})[0].detail
    bad = doctor._cluster_check({**SLURM, "SLURM_NODEID": "x"})[0]
    assert bad.status == "FAIL" and "SLURM_NODEID='x'" in bad.detail
    unset = doctor._cluster_check({k: v for k, v in TRAINJOB.items() if k != "PET_NODE_RANK"})[0]
    assert unset.status == "WARN" and "node ? of 2" in unset.detail and "--node-rank" in unset.fix
