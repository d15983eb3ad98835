"""Starting worker processes, for training and inference alike: torch's elastic launcher
(what `torchrun` runs) for local and multi-node jobs, the environment `torchrun` already set
up, and, for inference, the follower ranks of a job whose rank 0 is the calling process.
A process utility under both `train/` and `infer/`: it imports neither."""

from .followers import Followers, Nodes
from .restarts import restart_note
from .workers import (PEER_GONE, LaunchError, check_master_addr, claim_process_for_launching, default_nproc,
                      fork_workers_server, free_port, join_job, launch, start_method, under_torchrun, worker_entry)

__all__ = ["PEER_GONE", "Followers", "LaunchError", "Nodes", "check_master_addr", "claim_process_for_launching",
           "default_nproc", "fork_workers_server", "free_port", "join_job", "launch", "restart_note", "start_method",
           "under_torchrun", "worker_entry"]
