"""Training scalars for TensorBoard and (optionally) Weights & Biases, from one rank.

Which rank: the first data-parallel, first tensor-parallel rank of the last pipeline stage
(the loss lives on the last stage; every dp rank there holds the same reduced values).

Names are Megatron-LM's where it has one (``training.py::training_log`` and
``evaluate_and_print_results``): ``lm loss``, ``learning-rate``, ``grad-norm``, ``loss-scale``,
``batch-size``, ``iteration-time``, ``throughput`` (TFLOP/s/GPU), ``mem-allocated-bytes`` /
``mem-reserved-bytes`` / ``mem-max-allocated-bytes`` (CUDA), ``lm loss validation`` / ``lm loss validation ppl``.
Ours where it has none: ``mfu``, ``tokens-per-sec``, ``mem-gap-bytes`` (reserved - allocated), ``mem-alloc-retries``,
``mem-planner-estimate-bytes`` (the planner's estimate of the layout, CUDA), ``mem-rss-bytes`` (CPU runs: the
process's resident set); the samples come from :mod:`train.memory`.

Across requeues: TensorBoard's ``purge_step`` is the first step this attempt will train (the
resumed checkpoint's step + 1), so the steps a failed attempt ran past its last checkpoint are
hidden when the same steps are logged again: one point per step, in order. W&B: the run id is
kept in ``<run_dir>/wandb_id`` so every attempt resumes the same W&B run (offline by default:
clusters often have no internet; ``wandb sync <run_dir>/wandb/offline-run-*`` uploads it later).
W&B's step is the iteration. An online attempt that resumes from a checkpoint rewinds the W&B run
to that step (``wandb.init(resume_from="<id>?_step=<k>")``), so the redone steps replace the lost
ones; if W&B refuses the rewind (a preview feature: not enabled for every account) the attempt
resumes the run plainly, with a WARNING line and a ``tracking_fallback`` event. An offline attempt
cannot rewind reliably (the rewind is applied by the server at ``wandb sync`` time, after the earlier
attempts' uploads, and only where the preview is enabled), so it resumes plainly and says once,
with a WARNING line and the event, that redone steps may appear twice in W&B: TensorBoard is the
de-duplicated view.

Neither package is needed for training: a missing one is one WARNING line and a
``tracking_unavailable`` event, and training goes on (``pip install 'slurmtron[tracking]'``).
"""
from __future__ import annotations

import os
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Protocol

from launch.config import Job
from launch.kinds import EventKind
from launch.paths import RunPaths

NAMES = {  # our key -> the TensorBoard tag
    "loss": "lm loss", "lr": "learning-rate", "grad_norm": "grad-norm", "loss_scale": "loss-scale",
    "batch_size": "batch-size", "iteration_time": "iteration-time", "throughput": "throughput", "mfu": "mfu",
    "tokens_per_s": "tokens-per-sec", "mem_allocated": "mem-allocated-bytes", "mem_reserved": "mem-reserved-bytes",
    "mem_max_allocated": "mem-max-allocated-bytes", "mem_rss": "mem-rss-bytes", "mem_gap": "mem-gap-bytes",
    "mem_alloc_retries": "mem-alloc-retries", "mem_planner_estimate": "mem-planner-estimate-bytes",
    "val_loss": "lm loss validation", "val_ppl": "lm loss validation ppl",
    "ckpt_blocked_s": "checkpoint/training-blocked-s", "ckpt_durable_s": "checkpoint/durable-s",
    "ckpt_step_dip": "checkpoint/step-time-dip",
    # the run's figures at the end of each attempt (analysis/throughput.py: the median step time over every
    # attempt's steady logged steps, the rates at it), the same as status.py and the report: "run/", not per step
    "run_step_time": "run/step-time-s", "run_tokens_per_s": "run/tokens-per-sec", "run_throughput": "run/throughput",
    "run_mfu": "run/mfu",
}


TEXT_EVENTS = {  # event kind -> the fields shown in its text line
    "job_start": ("world_size", "layout"), "resume": ("step", "checkpoint", "from_layout"),
    "resume_fallback": ("skipped", "reason"), "signal": ("signal", "step"),
    "checkpoint_saved": ("step", "reason", "seconds"), "requeue": ("method", "step", "ok"),
    "stop": ("reason", "detail"), "exit": ("reason", "code", "step"), "lead_time_warning": ("detail",),
    "failed_node": ("host",), "budget_warning": ("threshold", "spent", "budget", "projected"),
    "memory_fragmentation": ("rank", "symptom", "detail"),
}


class Writer(Protocol):
    def scalars(self, step: int, values: Mapping[str, float]) -> None: ...
    def text(self, step: int, text: str) -> None: ...
    def close(self) -> None: ...


class TensorBoardWriter:
    """``torch.utils.tensorboard.SummaryWriter`` (the writer Megatron-LM uses) into ``<run_dir>/tensorboard``."""

    def __init__(self, log_dir: Path, *, first_step: int, flush_secs: int = 30) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: events at >= first_step from earlier attempts are hidden (they were redone)
        self.w = SummaryWriter(log_dir=str(log_dir), purge_step=first_step if first_step > 1 else None,
                               flush_secs=flush_secs)

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        for key, value in values.items():
            self.w.add_scalar(NAMES.get(key, key), value, step)

    def text(self, step: int, text: str) -> None:
        self.w.add_text("events", text, step)
        self.w.flush()  # events are rare and worth having on disk

    def close(self) -> None:
        self.w.flush()
        self.w.close()


def wandb_run_id(path: Path, new_id: Callable[[], str] = lambda: uuid.uuid4().hex[:12]) -> str:
    """The run's W&B id: read from ``path``, or made once and written atomically."""
    try:
        text = path.read_text().strip()
        if text:
            return text
    except FileNotFoundError:
        pass
    run_id = new_id()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(run_id + "\n")
    try:
        os.link(tmp, path)  # fails if another writer made it first: then theirs wins
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)
    return path.read_text().strip()


def wandb_resume(run_id: str, mode: str, resumed_step: int) -> tuple[dict, str]:
    """How an attempt opens the run's W&B run: ``wandb.init`` keyword arguments, and why steps may repeat
    ('' when they cannot).

    Fresh run: resume the id if it exists. Online resume from step k: rewind the run to k, dropping
    the points a failed attempt logged past its checkpoint. Offline resume: plain resume (see the module
    docstring for why offline cannot rewind).
    """
    if resumed_step <= 0:
        return {"id": run_id, "resume": "allow"}, ""
    if mode == "online":
        return {"id": run_id, "resume_from": f"{run_id}?_step={resumed_step}"}, ""
    return {"id": run_id, "resume": "allow"}, (
        f"W&B {mode} mode cannot rewind run {run_id} to the resumed step {resumed_step}: steps after it that an "
        "earlier attempt logged may appear twice in W&B once synced; TensorBoard (runs/NAME/tensorboard) is the "
        "de-duplicated view")


class WandbWriter:
    """One W&B run per slurmtron run, resumed (online: rewound) by every attempt (id in ``<run_dir>/wandb_id``).

    W&B's step is the iteration (monotonic within an attempt, which a rewind needs); an event text logged
    for an earlier step than the last one goes to the last one (W&B drops a step that goes back).
    """

    def __init__(self, job: Job, paths: RunPaths, *, mode: str, project: str, entity: str = "",
                 resumed_step: int = 0, warn: Callable[[str], None] = print,
                 emit: Callable[..., Any] = lambda *a, **k: None) -> None:
        import wandb

        self.wandb = wandb
        self.run_id = wandb_run_id(paths.wandb_id)
        self._step = resumed_step + 1  # the first step this attempt logs
        common = dict(mode=mode, project=project, entity=entity or None, name=job.run.name,
                      dir=str(paths.run_dir), config=asdict(job), settings=wandb.Settings(silent=True, console="off"))
        how, repeats = wandb_resume(self.run_id, mode, resumed_step)
        try:
            self.run = wandb.init(**how, **common)
        except Exception as exc:  # the rewind refused (preview not enabled, run not on the server): resume plainly
            if "resume_from" not in how:
                raise
            repeats = (f"W&B refused to rewind run {self.run_id} to step {resumed_step} ({type(exc).__name__}: "
                       f"{str(exc).splitlines()[0] if str(exc) else ''}); resumed it without a rewind: steps after "
                       "it that an earlier attempt logged appear twice in W&B; TensorBoard is the de-duplicated view")
            self.run = wandb.init(id=self.run_id, resume="allow", **common)
        if repeats:
            warn(f"WARNING: tracking.wandb: {repeats}")
            emit(EventKind.TRACKING_FALLBACK, writer="wandb", mode=mode, step=resumed_step, detail=repeats)

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        self._step = max(self._step, step)
        self.run.log({NAMES.get(k, k): v for k, v in values.items()}, step=step)

    def text(self, step: int, text: str) -> None:
        self._step = max(self._step, step)
        self.run.log({"events": text}, step=self._step)

    def close(self) -> None:
        """Finish the run and shut W&B's service down: the attempt's files are complete when this returns.

        ``finish()`` only hands the close of the run's stream to W&B's service process and returns (a reader right
        after it can find the offline transaction log still empty); ``wandb.teardown()`` waits until the service has
        closed every stream and exited, which otherwise happens only in the interpreter's exit handlers, and a rank
        can be SIGKILLed before those run (``srun --kill-on-bad-exit``, Slurm's KillWait after a requeue). One
        service per attempt also means no state carries over to a later W&B run in the same process."""
        self.run.finish()
        try:
            self.wandb.teardown()
        except SystemExit as exc:  # teardown passes a failed service's exit code to sys.exit: a failure, not an exit
            raise RuntimeError(f"W&B's service process exited with code {exc.code}") from None


class Tracker:
    """Fans scalars and event texts out to the writers; a writer that fails is dropped with a warning."""

    def __init__(self, writers: list, warn: Callable[[str], None] = print) -> None:
        self.writers = list(writers)
        self.warn = warn
        self._last_step = 0

    def _each(self, call: Callable[[Any], None], what: str) -> None:
        for w in list(self.writers):
            try:
                call(w)
            except Exception as exc:  # tracking must never stop training; say so, once
                self.warn(f"WARNING: {type(w).__name__} failed on {what} ({type(exc).__name__}: {exc}); "
                          "it writes nothing more in this attempt")
                self.writers.remove(w)

    def scalars(self, step: int, values: Mapping[str, Optional[float]]) -> None:
        clean = {k: float(v) for k, v in values.items() if v is not None}
        self._last_step = step
        self._each(lambda w: w.scalars(step, clean), f"step {step}")

    def text(self, step: int, text: str) -> None:
        self._each(lambda w: w.text(step, text), "an event")

    def close(self) -> None:
        self._each(lambda w: w.close(), "close")
        self.writers = []

    def event(self, record: Mapping[str, Any]) -> None:
        """An event-log record worth seeing beside the curves (start, resume, signal, checkpoint, stop)."""
        kind = record.get("event")
        if kind not in TEXT_EVENTS:
            return
        step = record.get("step")
        step = int(step) if isinstance(step, int) else self.last_step
        detail = ", ".join(f"{k}={record[k]}" for k in TEXT_EVENTS[kind] if record.get(k) not in (None, ""))
        self.text(step, f"{kind} (job {record.get('job_id') or 'local'}, attempt {record.get('restart_count')})"
                        + (f": {detail}" if detail else ""))

    @property
    def last_step(self) -> int:
        return self._last_step


def open_tracker(job: Job, paths: RunPaths, *, resumed_step: int, warn: Callable[[str], None] = print,
                 emit: Callable[..., Any] = lambda *a, **k: None) -> Tracker:
    """The writers ``job.tracking`` asks for; a missing package is a WARNING line and an event, not an error."""
    t = job.tracking
    writers: list = []
    if t.tensorboard:
        try:
            writers.append(TensorBoardWriter(paths.tensorboard, first_step=resumed_step + 1))
        except ImportError as exc:
            warn(f"WARNING: tracking.tensorboard: {exc.name or 'tensorboard'} is not installed "
                 "(pip install 'slurmtron[tracking]'); no TensorBoard scalars (tracking.tensorboard=false silences this)")
            emit(EventKind.TRACKING_UNAVAILABLE, writer="tensorboard", detail=str(exc))
    if t.wandb:
        try:
            w = WandbWriter(job, paths, mode=t.wandb_mode, project=t.wandb_project, entity=t.wandb_entity,
                            resumed_step=resumed_step, warn=warn, emit=emit)
            writers.append(w)
            if t.wandb_mode == "offline":
                warn(f"W&B offline run {w.run_id}: upload with  wandb sync {paths.run_dir}/wandb/offline-run-*")
        except ImportError as exc:
            warn(f"WARNING: tracking.wandb: wandb is not installed (pip install 'slurmtron[tracking]'); no W&B run")
            emit(EventKind.TRACKING_UNAVAILABLE, writer="wandb", detail=str(exc))
        except Exception as exc:  # wandb.init failing (no login for online mode, ...): train anyway, say so
            warn(f"WARNING: tracking.wandb: wandb.init failed ({type(exc).__name__}: {exc}); no W&B run")
            emit(EventKind.TRACKING_UNAVAILABLE, writer="wandb", detail=str(exc))
    return Tracker(writers, warn)


def tensorboard_missing(job: Job) -> Optional[str]:
    """The WARNING line :func:`open_tracker` writes when TensorBoard is asked for and cannot be imported, for the
    rank whose output reaches the terminal when it is not the tracking rank (the same environment on every rank)."""
    if not job.tracking.tensorboard:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError as exc:
        return (f"WARNING: tracking.tensorboard: {exc.name or 'tensorboard'} is not installed "
                "(pip install 'slurmtron[tracking]'); no TensorBoard scalars (tracking.tensorboard=false silences this)")
    return None


def is_tracking_rank() -> bool:
    """First data-parallel and tensor-parallel rank of the last pipeline stage (call after init)."""
    from megatron.core import parallel_state as ps

    return (ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_data_parallel_rank() == 0
            and ps.get_tensor_model_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0)
