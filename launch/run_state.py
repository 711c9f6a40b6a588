"""Where a run stands, gathered from its run directory and from Slurm: what ``launch/status.py`` prints.

Sources, each read once: ``config.yaml`` (target, layout, GPU), ``submissions.jsonl`` (job ids),
``events.jsonl`` (attempts, stops, iterations), the rank logs (parsed by ``analysis/``: step times,
MFU, interruptions by cause, goodput), the checkpoint directory (newest verified checkpoint),
``squeue``/``sacct`` through an injected runner (the job's state), and ``run.lock`` on
``cluster=local``. Nothing here writes anything. Every source that cannot be read becomes a
``warnings`` line and leaves its fields empty; the rest is still reported.
"""
from __future__ import annotations

import math
import socket
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from analysis import figures, spend
from analysis.load import load_paths
from analysis.mfu import shape_from_config
from analysis.parse_slurm import parse_sacct_text
from analysis.report import analyze_run, validation_table
from analysis.slice_end import attempt_events, continue_hint, timeout_line, unanswered_timeout
from launch.compose import load_job
from launch.config import Job
from launch.cost import cost, gpu_hours
from launch.kinds import EventKind
from launch.paths import RunPaths
from launch.planner.estimate import estimate, layout_name, train_iterations
from launch.submit import read_submissions
from launch import attempts
from recovery.commit import STAGING_SUFFIX, parse_dir_name
from recovery.events import read_events_counted, torn_warning
from recovery.injob import standing
from recovery.lock import active_holder
from recovery.resume import find_latest_verified
from recovery.slurm import Runner, Slurm, default_runner
TERMINAL = ("completed", "failed", "cancelled", "timeout", "stopped")
_SLURM_STATE = {"PENDING": "pending", "CONFIGURING": "running", "RUNNING": "running", "COMPLETING": "running",
                "SUSPENDED": "pending", "REQUEUED": "requeued", "REQUEUE_HOLD": "requeued", "REQUEUE_FED": "requeued",
                "COMPLETED": "completed", "FAILED": "failed", "CANCELLED": "cancelled", "TIMEOUT": "timeout",
                "NODE_FAIL": "failed", "OUT_OF_MEMORY": "failed", "BOOT_FAIL": "failed", "DEADLINE": "timeout",
                "PREEMPTED": "requeued"}


class UnreadableRun(Exception):
    """A run directory whose own files (``config.yaml``) cannot be read; ``str()`` is one line."""


@dataclass
class RunState:
    """Everything ``status`` shows about one run (JSON-ready)."""

    run: str
    run_dir: str
    launcher: str = "slurm"
    layout: str = ""
    world_size: int = 0
    gpu: str = ""
    state: str = "unknown"  # not_submitted | pending | running | requeued | completed | failed | cancelled | ...
    reason: str = ""  # Slurm's pending reason, or why a local run stopped
    job_id: Optional[str] = None
    job_ids: list = field(default_factory=list)
    attempts: int = 0
    step: Optional[int] = None
    target: Optional[int] = None
    step_time_s: Optional[float] = None  # median of the last 10 logged steps: the ETA's step time
    throughput: Optional[dict] = None  # the run's figures (analysis/throughput.py): the report's and the ranks'

    eta_s: Optional[float] = None  # training time left at that step time
    slices_left: Optional[int] = None  # Slurm slices of run.time_limit_min that time needs
    checkpoint_step: Optional[int] = None
    checkpoint_path: Optional[str] = None
    checkpoint_age_s: Optional[float] = None
    interruptions: dict = field(default_factory=dict)  # cause -> count
    goodput: Optional[float] = None
    mfu_now: Optional[float] = None
    mfu_estimate: Optional[float] = None
    mfu_note: str = ""  # why MFU is empty
    tokens_per_s: Optional[float] = None
    loss: Optional[float] = None
    val_step: Optional[int] = None  # the newest validation (training.eval_interval)
    val_loss: Optional[float] = None
    val_ppl: Optional[float] = None
    val_first: Optional[list] = None  # [step, loss] of the first validation, to show the trend
    gpu_hours: Optional[float] = None  # used so far (process-hours on cluster.gpu=cpu)
    gpu_hours_source: str = ""  # sacct (allocations, as billed) | events (worker time, excluding start-up)
    gpu_hour_price: Optional[float] = None  # cluster.gpu_hour_price
    cost: Optional[float] = None  # gpu_hours x gpu_hour_price
    budget_gpu_hours: Optional[float] = None  # run.budget_gpu_hours
    projected_gpu_hours: Optional[float] = None  # gpu_hours + the steps left at the measured step time
    log_file: Optional[str] = None
    log_tail: list = field(default_factory=list)
    in_job: Optional[dict] = None  # with cluster.spare_nodes: in-job restarts used, spares left (recovery.injob)
    warnings: list = field(default_factory=list)
    notes: list = field(default_factory=list)  # facts that are no trouble (an asynchronous save in progress)

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def finished(self) -> bool:
        return self.state in TERMINAL


def _last_line(text: Optional[str]) -> str:
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    return lines[-1][:300] if lines else "(no output)"


def slurm_state(job_id: str, runner: Runner) -> tuple[str, str, Optional[str]]:
    """(state, reason, error) of one job: ``squeue`` while Slurm lists it, ``sacct`` after.

    ``error`` is one line when neither could be asked (the state is then ``unknown``).
    """
    slurm = Slurm(runner)
    r = slurm.squeue([job_id], "%i|%T|%r")
    if isinstance(r.error, FileNotFoundError):
        return "unknown", "", "squeue is not on PATH (not a Slurm login node?): the job's state is unknown"
    if r.ok:
        for line in r.out.splitlines():
            jid, _, rest = line.strip().partition("|")
            if jid.split("_")[0] == str(job_id):
                state, _, reason = rest.partition("|")
                reason = "" if reason.strip() in ("None", "(null)") else reason.strip()
                return _SLURM_STATE.get(state.strip(), state.strip().lower()), reason, None
    elif "Invalid job id" not in r.err:
        return "unknown", "", f"squeue exited {r.rc}: {_last_line(r.err)}"
    r = slurm.sacct([job_id], "-n", "-X", "-P", "--format=JobID,State,ExitCode")
    if isinstance(r.error, FileNotFoundError):
        return "unknown", "", "sacct is not on PATH: the state of an ended job is unknown"
    if not r.ok:
        return "unknown", "", f"sacct exited {r.rc}: {_last_line(r.err)}"
    rows = [line.split("|") for line in r.out.splitlines() if line.strip()]
    rows = [r for r in rows if r and r[0].split("_")[0] == str(job_id)]
    if not rows:
        return "unknown", "", f"neither squeue nor sacct knows job {job_id} (accounting off, or purged)"
    state = rows[-1][1].split()[0] if len(rows[-1]) > 1 else ""
    exit_code = rows[-1][2] if len(rows[-1]) > 2 else ""
    reason = " ".join(rows[-1][1].split()[1:]) or (f"exit {exit_code}" if exit_code and exit_code != "0:0" else "")
    return _SLURM_STATE.get(state, state.lower() or "unknown"), reason, None


def sacct_dump(job_ids: list, runner: Runner) -> Optional[str]:
    """``sacct -D`` of the run's jobs (every attempt), for the interruption causes; None if unavailable."""
    if not job_ids:
        return None
    r = Slurm(runner).sacct(job_ids, "-D", "--parsable2", "--format=ALL")
    return r.out if r.ok and r.out.strip() else None


def _local_state(paths: RunPaths, events: list[dict], *, alive: Optional[Callable] = None) -> tuple[str, str]:
    kwargs = {"alive": alive} if alive is not None else {}
    held = active_holder(paths.lock, host=socket.gethostname(), job_active=lambda _j: None, **kwargs)
    if held is not None:
        if held[0].unreadable is not None:  # a garbage run.lock: nobody known holds it
            return "unknown", f"{paths.lock} holds no readable lock record; if no attempt of this run is running, " \
                              f"remove it (rm {paths.lock})"
        return "running", held[0].describe()
    return _ended_state(events)


def _ended_state(events: list[dict]) -> tuple[str, str]:
    if not attempts.attempt_keys(events):  # no attempt (one that failed before its first step counts)
        return "not_started", ""
    for e in reversed(events):
        kind = e.get("event")
        if kind == "exit":
            reason = str(e.get("reason") or "")
            if reason == "completed":
                return "completed", ""
            if reason == "budget":
                return "stopped", _budget_reason(e)
            if reason in ("requeue", "signal", "stopped"):  # stopped: a drain/stop request (launch/stop.py)
                who = next((f" by {x.get('reason')}" for x in reversed(events) if x.get("event") == EventKind.STOP
                            and x.get("job_id") == e.get("job_id") and x.get("restart_count") == e.get("restart_count")),
                           "") if reason == "stopped" else ""
                return "stopped", (f"stopped{who} at step {e.get('step')} (checkpointed); the same command "
                                   "continues it")
            said = next((x.get("detail") for x in reversed(events) if x.get("event") == EventKind.STOP
                         and x.get("reason") == reason and x.get("detail")), "")  # a final stop's own line
            return "failed", f"exit {reason} code {e.get('code')}" + (f": {said}" if said else "")
        if kind == "stop":
            return "failed", f"{e.get('reason')}: {e.get('detail') or ''}".strip(": ")
        if kind == "job_start":
            return "stopped", "the last attempt ended without an exit event (killed?)"
    return "unknown", ""


def _budget_reason(exit_event: dict) -> str:
    return (f"budget: run.budget_gpu_hours spent at step {exit_event.get('step')} (checkpointed); raise "
            "run.budget_gpu_hours and run the same command to continue")


def _tail(path: Path, lines: int) -> list[str]:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, 2)
            size = fh.tell()
            fh.seek(max(0, size - 16384))
            text = fh.read().decode("utf-8", "replace")
    except OSError:
        return []
    return [ln.rstrip() for ln in text.splitlines()[-lines:]]


def _newest_log(paths: RunPaths) -> Optional[Path]:
    try:
        logs = [p for p in paths.logs.iterdir() if p.is_file() and p.suffix in (".out", ".err", ".log")]
    except OSError:
        return None
    ranked = [p for p in logs if "batch" not in p.name] or logs
    return max(ranked, key=lambda p: (p.stat().st_mtime, p.name)) if ranked else None


def _checkpoint(state: RunState, paths: RunPaths, now: float) -> None:
    if not paths.checkpoints.exists():
        return
    try:
        found = find_latest_verified(paths.checkpoints, deep=False)  # manifest and sizes: no full re-hash
    except Exception as exc:  # a storage error: say so, keep the rest of the status
        state.warnings.append(f"checkpoints in {paths.checkpoints} cannot be read: {exc}")
        return
    if found.path is not None:
        state.checkpoint_step, state.checkpoint_path = found.step, str(found.path)
        try:
            state.checkpoint_age_s = max(0.0, now - found.path.stat().st_mtime)
        except OSError:
            pass

    for path, reason in found.skipped:
        newer = found.step is None or (_dir_step(Path(path)) or 0) > found.step
        if state.state in ("running", "requeued") and Path(path).name.endswith(STAGING_SUFFIX) and newer:
            state.notes.append(f"checkpoint {Path(path).name}: a save in progress (not committed yet)")
            continue
        state.warnings.append(f"checkpoint {Path(path).name} skipped: {reason}")


def _dir_step(path: Path) -> Optional[int]:
    parsed = parse_dir_name(path.name)
    return parsed[0] if parsed else None


def _analysis(state: RunState, run_dir: Path, sacct_text: Optional[str], window: int = 10, *,
              live_expected: bool = False) -> Any:
    """Interruptions by cause, goodput, recent step time, MFU, tokens/s, validation loss and the GPU-hours
    Slurm accounted so far (``analysis/``). Returns the sacct table it used (None without one).

    Live ``sacct`` (``sacct_text``) first: a ``sacct.txt`` saved in the run directory (for the report) is a
    snapshot of the past, used only when live sacct is unavailable (``live_expected``), and then said so."""
    (run,) = load_paths([run_dir])
    if sacct_text:
        run.sacct = parse_sacct_text(sacct_text)[0]
    elif live_expected and run.sacct is not None and not run.sacct.empty:
        state.warnings.append("sacct is unavailable: interruptions and GPU-hours come from the saved sacct dump in "
                              f"{run_dir}, which may be older than the run")
    val = validation_table(run)
    if len(val):
        first, last = val.iloc[0], val.iloc[-1]
        state.val_step, state.val_loss = int(last["iteration"]), float(last["val_loss"])
        state.val_ppl = None if last["val_ppl"] != last["val_ppl"] else float(last["val_ppl"])
        if len(val) > 1:
            state.val_first = [int(first["iteration"]), float(first["val_loss"])]
    _sacct_gpu_hours(state, run.sacct)
    res = analyze_run(run, shape_from_config(run.config))
    intr = res["interruptions"]
    if len(intr):
        state.interruptions = dict(Counter(str(c) for c in intr["cause"]))
    gp = res["goodput"].get("goodput")
    state.goodput = None if gp is None or math.isnan(gp) else float(gp)
    m = res["metrics"]
    if len(m):
        m = m.sort_values("iteration").drop_duplicates("iteration", keep="last")
        recent = m.tail(window)
        state.step = max(state.step or 0, int(m["iteration"].max()))
        secs = (recent["elapsed_ms"] / 1000.0).median()
        state.step_time_s = float(secs) if secs == secs else state.step_time_s

        state.throughput = res["throughput"].to_dict()  # the report's figures: steady steps, whole run
        state.tokens_per_s = res["throughput"].tokens_per_s
        for attr, col in (("mfu_now", "mfu"), ("loss", "lm_loss")):
            value = recent[col].median() if col != "lm_loss" else recent[col].iloc[-1]
            if value == value:  # not NaN
                setattr(state, attr, float(value))
    return run.sacct


def _count_attempts(state: RunState, events: list[dict], sacct: Any, logs: tuple = ()) -> None:
    """Attempts from Slurm, the event log and the local rank logs together (:func:`launch.attempts.attempt_keys`,
    the one definition): every (job, attempt) that one of them knows (an attempt killed before its first event, or
    one sacct no longer lists, still counts)."""
    keys = attempts.attempt_keys(events, logs)
    if sacct is not None and not getattr(sacct, "empty", True) and {"is_alloc", "job", "attempt"} <= set(sacct):
        alloc = sacct[sacct["is_alloc"].astype(bool)]
        if "state" in alloc:  # a pending allocation (or one cancelled before it started) is no attempt
            alloc = alloc[~alloc["state"].astype(str).isin(("PENDING", "REQUEUED_HOLD", "REQUEUE_HOLD"))]
        if "start" in alloc:
            alloc = alloc[alloc["start"].notna()]
        for job, attempt in zip(alloc["job"].astype(str), alloc["attempt"]):
            if job in state.job_ids and attempt == attempt and attempt is not None:
                keys.add((job, int(attempt)))
    state.attempts = len(keys)


def _explain_end(state: RunState, events: list[dict], job: Job) -> None:
    """Slurm's end state, read with the worker's own last word: a drained run is ``stopped``, not ``completed``;
    a slice that ended TIMEOUT without its stop checkpoint says so; each with how to continue."""
    if state.state == "failed" and state.job_id:  # the ranks' budget stop exits 16: Slurm says FAILED
        mine = [e for e in events if str(e.get("job_id")) == state.job_id and e.get("event") == EventKind.EXIT]
        if mine and mine[-1].get("reason") == "budget":
            state.state, state.reason = "stopped", _budget_reason(mine[-1])
            return
    if state.state not in ("completed", "cancelled", "timeout") or not state.job_id:
        return

    mine = [e for e in events if str(e.get("job_id")) == state.job_id] or events  # (a job that wrote nothing)
    last_exit = next((e for e in reversed(mine) if e.get("event") == EventKind.EXIT), None)
    last_stop = next((e for e in reversed(mine) if e.get("event") == EventKind.STOP), None)
    if last_exit is not None and last_exit.get("reason") == "completed":
        return
    if last_exit is not None and last_exit.get("reason") == "stopped":
        who = (last_stop or {}).get("reason") or "user_stop"
        step = last_exit.get("step")
        state.state = "stopped"
        state.reason = f"{who} at step {step}; {continue_hint(job.run.name, step)}"
        return
    if state.state == "completed":
        state.reason = "Slurm says COMPLETED but the worker logged no completion"
    elif state.state == "timeout" and unanswered_timeout("TIMEOUT", attempt_events(events, state.job_id)):
        state.reason = timeout_line(job.run.time_limit_min, job.run.name, state.checkpoint_step)


def _slices_left(state: RunState, job: Job, events: list[dict], now: float) -> None:
    """More Slurm slices the steps left need: the running slice's own time left counts first."""
    if job.cluster.launcher != "slurm" or not state.eta_s:
        return
    usable = job.run.time_limit_min * 60 - job.training.signal_lead_time_s
    if usable <= 0:
        return
    need = state.eta_s
    if state.state == "running" and state.job_id:
        starts = [e.get("time") for e in events if e.get("event") == EventKind.JOB_START and
                  str(e.get("job_id")) == state.job_id and isinstance(e.get("time"), (int, float))]
        if starts:
            need -= max(0.0, usable - (now - float(starts[-1])))
    state.slices_left = max(0, math.ceil(need / usable)) if need > 0 else 0


def _sacct_gpu_hours(state: RunState, sacct) -> None:
    """GPU-hours of the run's allocations as Slurm accounts them (one row per attempt with ``sacct -D``;
    a running attempt's Elapsed grows). Without a GPU count in AllocTRES every rank counts as one."""
    if sacct is None or sacct.empty or "is_alloc" not in sacct or "elapsed_s" not in sacct:
        return
    alloc = sacct[sacct["is_alloc"].astype(bool)]
    if "job" in alloc and state.job_ids:
        alloc = alloc[alloc["job"].astype(str).isin([str(j) for j in state.job_ids])]
    alloc = alloc[alloc["elapsed_s"].notna()]
    if alloc.empty:
        return
    gpus = alloc["gpus"] if "gpus" in alloc else None
    spans = [(g if g == g and g is not None else state.world_size, e)
             for g, e in zip(gpus if gpus is not None else [None] * len(alloc), alloc["elapsed_s"])]
    state.gpu_hours, state.gpu_hours_source = gpu_hours(spans), "sacct"


def _event_gpu_hours(state: RunState, events: list[dict], now: float) -> None:
    """GPU-hours from the event log where Slurm has no record (``cluster=local``, sacct unavailable): each
    attempt from its ``job_start`` to its last event (to now while it runs) x its world size
    (:func:`analysis.spend.event_spans`)."""
    spans = spend.event_spans(events, now=now if state.state == "running" else None, world_size=state.world_size)
    if spans:
        state.gpu_hours, state.gpu_hours_source = spend.hours(spans), "events"


def _budget(state: RunState, job: Job) -> None:
    """The budget, the spend projected to the target, and a WARNING when the projection passes the budget."""
    state.budget_gpu_hours = job.run.budget_gpu_hours
    if state.gpu_hours is None or state.target is None or state.step is None or state.finished:
        return
    state.projected_gpu_hours = spend.project(state.gpu_hours, state.target - state.step, state.step_time_s,
                                              state.world_size)
    led = spend.Ledger(state.gpu_hours, state.gpu_hours_source, state.budget_gpu_hours, state.projected_gpu_hours)
    if led.budget and led.projected is not None and led.projected > led.budget and not led.over:
        state.warnings.append(f"the spend projected to the target ({spend.fmt(led.projected)}) passes "
                              f"run.budget_gpu_hours ({spend.fmt(led.budget)}): the run will stop itself at the "
                              "budget; raise it and resubmit to reach the target")


def _whole(value: object) -> Optional[int]:
    """An event's step as an int, or None for anything else (a string, ``1e400`` read as inf, nan, a bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, float) and (not math.isfinite(value) or not value.is_integer()):
        return None
    return int(value)


def _finite(value: object) -> Optional[float]:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _from_events(state: RunState, events: list[dict]) -> None:
    # one job_start (rank 0) per attempt; a fresh local launch starts again at restart_count 0 with no job id

    state.attempts = figures.attempt_count(events)
    state.layout = figures.run_layout(events, state.layout)
    raw = [e for e in events if e.get("event") == EventKind.ITERATION and e.get("step") is not None]
    its = [e for e in raw if _whole(e.get("step")) is not None]
    if len(its) < len(raw):
        bad = next(e.get("step") for e in raw if _whole(e.get("step")) is None)
        state.warnings.append(f"{len(raw) - len(its)} iteration event(s) in the event log skipped: a step that is "
                              f"not a whole number (e.g. {str(bad)[:40]!r})")
    if its:
        state.step = _whole(its[-1]["step"])
        secs = sorted(x for x in (_finite(e.get("seconds")) for e in its[-10:]) if x is not None)
        if secs:
            state.step_time_s = secs[len(secs) // 2]
        try:
            state.loss = float(its[-1].get("loss"))
        except (TypeError, ValueError):
            pass


def _estimate(state: RunState, job: Job) -> None:
    state.layout = f"{layout_name(job.parallelism)}-dp{job.dp}"
    state.target = train_iterations(job)
    if job.cluster.gpu == "cpu":
        state.mfu_note = "no MFU: cluster.gpu is cpu (no accelerator peak to compare against)"
        return
    try:
        state.mfu_estimate = estimate(job).mfu
    except Exception as exc:  # informative only
        state.warnings.append(f"no planner estimate: {exc}")


def gather(run_dir: str | Path, *, runner: Runner = default_runner, clock: Callable[[], float] = time.time,
           log_lines: int = 5, alive: Optional[Callable] = None) -> RunState:
    """The status of the run in ``run_dir`` (which must hold a ``config.yaml``)."""
    run_dir = Path(run_dir).absolute()
    config = RunPaths.of(run_dir).config
    try:
        job = load_job(config)
    except Exception as exc:  # binary, empty, malformed or foreign: a file of the run, not a bug of ours
        why = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise UnreadableRun(f"{config} cannot be read as a run's config.yaml ({type(exc).__name__}"
                            f"{': ' + why[:160] if why else ''}); repair it from the run's sbatch.sh or "
                            "submissions, or resubmit with python launch/pretrain.py") from None
    paths = job.paths_at(run_dir)
    c = job.cluster
    state = RunState(run=job.run.name, run_dir=str(run_dir), launcher=c.launcher, world_size=job.world_size,
                     gpu=c.gpu)
    _estimate(state, job)
    events, torn = read_events_counted(paths.events)
    if torn:
        state.warnings.append(torn_warning(paths.events, torn).removeprefix("WARNING: "))
    _from_events(state, events)
    state.in_job = standing(events, c.spare_nodes, c.in_job_restarts)
    sacct_text = None
    if c.launcher == "local":
        state.state, state.reason = _local_state(paths, events, alive=alive)
    else:
        subs = [s for s in read_submissions(run_dir) if s.get("job_id")]
        state.job_ids = [str(s["job_id"]) for s in subs]
        if not subs:
            state.state = "not_submitted"
        else:
            state.job_id = state.job_ids[-1]
            state.state, state.reason, error = slurm_state(state.job_id, runner)
            if error:
                state.warnings.append(error)
                state.state, state.reason = _ended_state(events)
                state.reason = f"from the event log; {state.reason}".rstrip("; ")
            elif state.state == "pending" and any(e.get("job_id") == state.job_id
                                                  and e.get("event") == EventKind.JOB_START for e in events):
                state.state = "requeued"  # pending again after an attempt of the same job id
            sacct_text = sacct_dump(state.job_ids, runner)
    sacct = None
    try:
        sacct = _analysis(state, run_dir, sacct_text, live_expected=bool(state.job_ids))
    except Exception as exc:  # a report problem must not hide the state
        state.warnings.append(f"log analysis failed: {type(exc).__name__}: {exc}")
    _count_attempts(state, events, sacct, tuple(attempts.log_names(run_dir)))
    if state.target and state.step is not None and state.step_time_s:
        left = max(0, state.target - state.step)
        state.eta_s = left * state.step_time_s
        _slices_left(state, job, events, clock())
    if state.gpu_hours is None:
        _event_gpu_hours(state, events, clock())

    state.gpu_hour_price = c.gpu_hour_price
    state.cost = cost(state.gpu_hours, c.gpu_hour_price)
    _budget(state, job)
    if state.mfu_now is None and not state.mfu_note and state.step is not None:
        state.mfu_note = f"no MFU: unknown peak for cluster.gpu {c.gpu!r}"
    _checkpoint(state, paths, clock())
    _explain_end(state, events, job)
    log = _newest_log(paths)
    if log is not None:
        state.log_file, state.log_tail = str(log), _tail(log, log_lines)
    return state
