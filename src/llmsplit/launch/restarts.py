"""What a restart under `--max-restarts` says: which worker failed and how, as the launcher
saw it, handed on to the restarted workers, whose rank 0 prints it with the checkpoint it
resumes from (train/run_files.py). Without it a restart showed only in torch's own lines.

torch's elastic agent restarts the workers without telling its caller, and offers no hook
to learn of a failure before the new workers start (its events and metrics name no rank).
The one place that sees the failure first is the agent's log record of it ("failed
(exitcode: ...) local_rank: ..."), logged with torch.multiprocessing's exception attached,
whose public fields (`error_index`, `signal_name`, `exit_code`) name the worker and how it
ended. Should torch ever stop logging so, the restarted workers still say that a worker
failed, only not which."""

from __future__ import annotations

import logging
import os

from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

CAUSE = "LLMSPLIT_RESTART_CAUSE"  # set in the restarted workers' environment
_AGENT_LOG = "torch.distributed.elastic.multiprocessing.api"


class FailureWatch(logging.Filter):
    """While a launch runs (a context manager): each failure the agent logs, written into
    `environment` as CAUSE. `environment` is the dict every worker of the launch receives;
    the agent hands it to each new attempt's workers afresh, so a restart's workers find
    the failure that caused it. `first_rank`: the global rank of this node's local rank 0;
    None where the rendezvous numbers the machines anew each attempt (elastic), and the
    worker is then named by its local rank on `machine`."""

    def __init__(self, environment: dict[str, str], first_rank: int | None, machine: str = "this machine"):
        super().__init__()
        self.environment, self.first_rank, self.machine = environment, first_rank, machine

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, (ProcessExitedException, ProcessRaisedException)):
            who = f"worker {error.error_index} of machine {self.machine}" if self.first_rank is None else \
                f"worker rank {self.first_rank + error.error_index}"
            self.environment[CAUSE] = f"{who} {_how(error)}"
        return True  # torch's own lines stay

    def __enter__(self) -> FailureWatch:
        logging.getLogger(_AGENT_LOG).addFilter(self)
        return self

    def __exit__(self, *exc) -> None:
        logging.getLogger(_AGENT_LOG).removeFilter(self)


def _how(error: ProcessExitedException | ProcessRaisedException) -> str:
    if isinstance(error, ProcessRaisedException):  # its message ends with the worker's traceback
        last = [line.strip() for line in str(error).splitlines() if line.strip()]
        return f"failed ({last[-1]})" if last else "failed"
    if error.signal_name:
        return f"died (signal {error.signal_name})"
    return f"exited with code {error.exit_code}"


def restart_note() -> str | None:
    """In a worker: "worker rank 1 died (signal SIGKILL); restart 1 of 2" when the elastic
    agent restarted it, None on the first attempt."""
    count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if count == 0:
        return None
    cause = os.environ.get(CAUSE, "a worker failed")  # not under plain torchrun, or torch logged otherwise
    return f"{cause}; restart {count} of {os.environ.get('TORCHELASTIC_MAX_RESTARTS', '?')}"
