"""What one rank knows about itself: :class:`RankContext`, and the worker's test hooks.

The context is built once by :mod:`train.worker` and handed to the checkpointer and the
training loop instead of loose arguments: the job, its files (:class:`launch.paths.RunPaths`),
this rank's place (:class:`launch.dist_env.DistEnv`), the attempt number, the stop flag, the
event log, the clocks and the storage. Everything with a side effect is a field, so a test
can build a context with its own clock or storage.

No torch at import time (the collective helper imports it when called).
"""
from __future__ import annotations

import datetime
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

from launch.dist_env import DistEnv
from launch.paths import RunPaths
from recovery.events import EventLog
from recovery.signals import StopFlag
from recovery.storage import LocalStorage

# The test hooks, read only from the environment (never set them in production).
STEP_SLEEP_ENV = "SLURMTRON_TEST_STEP_SLEEP_S"
SAVE_SLEEP_ENV = "SLURMTRON_TEST_SAVE_SLEEP_S"
PARAM_DIGEST_ENV = "SLURMTRON_TEST_PARAM_DIGEST"
FAIL_AT_ITER_ENV = "SLURMTRON_TEST_FAIL_AT_ITER"


@dataclass(frozen=True)
class Hooks:
    """The worker's test hooks (environment switches, see :mod:`train.worker`)."""

    step_sleep_s: float = 0.0
    save_sleep_s: float = 0.0
    param_digest: bool = False
    fail_at_iter: Optional[int] = None

    @staticmethod
    def from_env(env: Mapping[str, str]) -> "Hooks":
        fail = (env.get(FAIL_AT_ITER_ENV) or "").strip()
        return Hooks(
            step_sleep_s=float(env.get(STEP_SLEEP_ENV) or 0.0),
            save_sleep_s=float(env.get(SAVE_SLEEP_ENV) or 0.0),
            param_digest=bool(env.get(PARAM_DIGEST_ENV)),
            fail_at_iter=int(fail) if fail else None,
        )


def layout_of(job: Any) -> dict:
    """The parallel layout, as written into events and checkpoint manifests."""
    p = job.parallelism
    return {"tp": p.tp, "pp": p.pp, "vpp": p.vpp, "dp": job.dp, "cp": p.cp, "ep": p.ep}


def model_shape(job: Any) -> dict:
    """The model's shape, as written into checkpoint manifests."""
    m = job.model
    return {
        "name": m.name, "num_layers": m.num_layers, "hidden_size": m.hidden_size,
        "ffn_hidden_size": m.ffn_hidden_size, "num_attention_heads": m.num_attention_heads,
        "num_query_groups": m.num_query_groups, "seq_length": m.seq_length, "vocab_size": m.vocab_size,
        "num_experts": m.num_experts,
    }


def broadcast(obj: Any, src: int = 0) -> Any:
    """``obj`` as rank ``src`` has it, on every rank (a picklable object)."""
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


@dataclass
class RankContext:
    """One rank of one attempt of a run."""

    job: Any  # launch.config.Job
    paths: RunPaths
    dist: DistEnv
    env: Mapping[str, str]
    restart: int  # attempt number (SLURM_RESTART_COUNT / SLURMTRON_RESTART_COUNT)
    flag: StopFlag
    events: EventLog  # writes on rank 0 only
    hooks: Hooks = field(default_factory=Hooks)
    storage: LocalStorage = field(default_factory=LocalStorage)
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep
    now: Callable[[], datetime.datetime] = datetime.datetime.now  # the log lines' time stamps
    run_lock: Any = None  # recovery.lock.Acquired: rank 0 holds the run for the whole attempt
    cuda: bool = False  # set by init_distributed
    device: Any = None  # torch.device, set by init_distributed
    tracker: Any = None  # train.tracking.Tracker on the tracking rank (TensorBoard/W&B), else None

    @property
    def rank(self) -> int:
        return self.dist.rank

    @property
    def world(self) -> int:
        return self.dist.world_size

    @property
    def is_first(self) -> bool:
        """Rank 0: decides, commits, writes the event log, talks to Slurm."""
        return self.dist.rank == 0

    @property
    def is_last(self) -> bool:
        """The last rank: holds the last pipeline stage, prints Megatron's log lines."""
        return self.dist.rank == self.dist.world_size - 1

    @property
    def job_id(self) -> Optional[str]:
        return self.env.get("SLURM_JOB_ID")

    @property
    def layout(self) -> dict:
        return layout_of(self.job)

    def log(self, msg: str) -> None:
        """A line of the job log (printed by the last rank only)."""
        if self.is_last:
            print(msg, flush=True)

    def emit(self, event: str, **fields: Any) -> dict:
        record = self.events.emit(event, **fields)
        if self.tracker is not None:  # interruptions and checkpoints also appear in TensorBoard, as text
            self.tracker.event(record)
        return record
