"""The front door: ``python launch/pretrain.py cluster=lustre model=30b [k=v ...]``.

``main(cfg)`` is thin on purpose (tests call it with a composed config and a fake runner):
compose → (planner for ``parallelism=auto``) → check → refuse with every reason, or write the
run directory and render + submit (``dry_run=true``: print, write and submit nothing; the
``local`` launcher runs the ranks on this machine instead). With ``-m`` (Hydra multirun) each
sweep member is checked on its own: an invalid one is recorded as refused and skipped, a valid
one is submitted and left running (submit-and-detach), and all of them are appended to the
sweep registry ``<cluster.run_root>/sweeps/<sweep id>.jsonl``.

This path runs on login nodes: it must never import torch or megatron (tested in
``tests/test_pretrain_cli.py``).
"""
from __future__ import annotations

import subprocess
import sys
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field, is_dataclass, replace
from pathlib import Path
from typing import Any, Callable, Optional, TextIO

if __package__ in (None, ""):  # run as a script: make the repository importable, not launch/ itself
    _ROOT = str(Path(__file__).resolve().parent.parent)
    sys.path[:] = [_ROOT] + [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

from omegaconf import DictConfig, OmegaConf  # noqa: E402

from launch import check_local_ckpt, ledger, local, planner  # noqa: E402
from launch.check import check, notes, run_dir_problems, submission_problems  # noqa: E402
from launch.cli import interpolation_refusal, job_or_refusal, usage  # noqa: E402,F401 (one refusal path)
from launch.compose import job_to_yaml, literal_dollars, load_job  # noqa: E402
from launch.config import Job  # noqa: E402
from launch.planner.advice import fit_advice
from launch.planner.memory import memory_plan  # noqa: E402
from launch.preflight_checks import preflight_problems
from launch.problems import Problem, format_problems  # noqa: E402
from launch.render import render
from launch.submit import RunDirSnapshot, SubmitError, submit  # noqa: E402
from launch.submit import SubmitLock
from launch.summary import summary
from recovery import lock  # noqa: E402
from recovery.events import read_events  # noqa: E402
from recovery.identity import ensure_run_id, read_run_id  # noqa: E402
from recovery.resume import Resume  # noqa: E402
from recovery.slurm import Runner, default_runner  # noqa: E402
from recovery.start_check import Verdict, judge  # noqa: E402
from recovery.stop import request_problem  # noqa: E402
from recovery.storage import atomic_write_json  # noqa: E402

EXIT_REFUSED = 2
EXIT_SUBMIT_FAILED = 1

USAGE = usage(
    "Check a training job and submit it to Slurm (or run it here with cluster=local). Every problem is listed\n"
    "at once and the job is refused (exit 2, nothing written); dry_run=true prints the batch script instead.\n"
    "With -m, each combination of a sweep is checked and submitted on its own (exit 2 if none is accepted);\n"
    "a dry-run sweep prints one line per member, with the command that prints its script.",
    "python launch/pretrain.py [-m] [key=value ...]",
    "configuration.md",
    "examples:\n"
    "  python launch/pretrain.py                                   # the tiny model on this machine\n"
    "  python launch/pretrain.py cluster=lustre model=30b dry_run=true\n"
    "  python launch/pretrain.py -m cluster=lustre model=7b parallelism.tp=2,4,8 parallelism.pp=1,2 dry_run=true\n"
    "options: dry_run=true (print, submit nothing), force=true (submit despite a failed preflight)\n"
    "exit codes: 0 submitted, 1 the submission failed, 2 refused (bad input, nothing written);\n"
    "            cluster=local ends with the run's own code (0 complete; the others are in docs/recovery.md)")


@dataclass
class SweepMember:
    """Where one Hydra multirun member sits in its sweep."""

    sweep_id: str  # one id for the whole `-m` invocation
    job_num: int  # Hydra's hydra.job.num
    overrides: list[str] = field(default_factory=list)  # this member's task overrides
    name_swept: bool = False  # the sweep gives each member its own run.name (run.name=a,b,...)
    label: str = ""  # the swept values of this member, e.g. tp4-pp2 (names the member's run)
    outcomes: Optional[list] = None  # each member appends one row here: the sweep's summary table


def member_label(overrides: list[str], swept: list[str]) -> str:
    """``tp4-pp2`` for the member with ``parallelism.tp=4 parallelism.pp=2`` of a sweep over tp and pp."""
    parts = []
    for o in overrides:
        key, _, value = o.lstrip("+~").partition("=")
        if key in swept and key != "run.name":
            clean = "".join(ch if ch.isalnum() or ch in ".-" else "_" for ch in value)
            parts.append(f"{key.rsplit('.', 1)[-1]}{clean}")
    return "-".join(parts)


def member_job(job: Job, member: SweepMember) -> Job:
    """Give a sweep member its own run name (``<name>_<swept values>``, e.g. ``7b_tp4-pp2``) unless
    the sweep names each member itself; a single run.name shared by all members is a prefix."""
    if member.name_swept:
        return job
    name = f"{job.run.name}_{member.label or member.job_num}"
    return replace(job, run=replace(job.run, name=name))


def _layout(job: Job) -> str:
    return f"{job.layout_label}-dp{job.dp}"


def _mesh(job: Job) -> dict:
    p = job.parallelism
    return {"tp": p.tp, "pp": p.pp, "vpp": p.vpp, "cp": p.cp, "ep": p.ep, "dp": job.dp, "nodes": job.cluster.nodes,
            "gpus_per_node": job.cluster.gpus_per_node, "world": job.world_size,
            "sequence_parallel": p.sequence_parallel, "recompute": p.recompute}


def _outcome(job: Job, member: Optional[SweepMember], status: str, detail: str = "", job_id: str = "") -> None:
    if member is not None and member.outcomes is not None:
        est = _estimate(job) if status not in ("refused", "failed") else {}
        member.outcomes.append({"member": job.run.name, "layout": _layout(job), "status": status,
                                "detail": detail, "job_id": job_id,
                                "gpu_hours": est.get("gpu_hours_total") if isinstance(est, dict) else None})


def _refused_member(cfg: DictConfig, member: SweepMember, refusal: str) -> None:
    """The sweep table's row for a member refused before it became a typed Job (a ``+key`` typo)."""
    if member.outcomes is None:
        return
    try:
        name = str(cfg.run.name)
    except Exception:  # an unresolvable name: the member's number still identifies it
        name = f"member {member.job_num}"
    lines = refusal.splitlines()
    member.outcomes.append({"member": name, "layout": member.label or "?", "status": "refused",
                            "detail": (lines[1] if len(lines) > 1 else lines[0]).lstrip("- "), "job_id": ""})


def fit_status(job: Job, status: str) -> str:
    """``status``, marked ``may not fit`` when the estimated memory per GPU is over the GPU's memory
    (inside the planner's error band: the check lets it through, the table must not call it ok)."""
    est = _estimate(job)
    if isinstance(est, dict) and est.get("memory_verdict") not in (None, "fits"):
        return status.replace("ok", "may not fit", 1) if status.startswith("ok") else f"{status}, may not fit"
    return status


def sweep_exit(rows: list[dict], rc: int) -> int:
    """A multirun's exit status: 2 when no member was accepted (every one refused or failed to submit)."""
    if rows and rc == 0 and all(r["status"] in ("refused", "failed") for r in rows):
        return EXIT_REFUSED
    return rc


def _estimate_note(job: Job) -> str:
    est = _estimate(job)
    if not isinstance(est, dict) or "error" in est:
        return ""
    parts = [f"{est['memory_gb_per_gpu']:.1f} GiB/GPU"]
    if est.get("step_time_s"):
        parts.append(f"{est['step_time_s']:.3g} s/step")
    if est.get("mfu") is not None and job.cluster.gpu != "cpu":
        parts.append(f"MFU {100 * est['mfu']:.1f}%")
    if est.get("gpu_hours_total") is not None and job.cluster.gpu != "cpu":
        parts.append(f"{est['gpu_hours_total']:,.0f} GPU-h")
    return ", ".join(parts)


def sweep_table(rows: list[dict]) -> str:
    """One line per member: name, layout, status, job id, the estimate or the first reason."""
    head = ("member", "layout", "status", "job", "estimate or reason")
    table = [head] + [(r["member"], r["layout"], r["status"], r["job_id"] or "-", r["detail"]) for r in rows]
    widths = [max(len(str(row[i])) for row in table) for i in range(len(head) - 1)]
    return "\n".join("  ".join([str(v).ljust(w) for v, w in zip(row[:-1], widths)] + [str(row[-1])]).rstrip()
                     for row in table)


def shape_problems(job: Job, run_dir: Path) -> list[Problem]:
    """Same run name = same run: continuing is allowed, a different model shape is not."""
    path = job.paths_at(run_dir).config
    if not path.exists():
        return []
    try:
        old = load_job(path)
    except Exception as exc:  # a foreign or corrupt file: do not overwrite it
        return [Problem("run.name", "the run directory has a config.yaml that cannot be read",
                        f"{path}: {exc}", "pick a new run.name or repair that file")]
    if old.model == job.model:
        return []
    changed = [k for k, v in asdict(job.model).items() if asdict(old.model).get(k) != v]
    return [Problem(
        "run.name", "this run already exists with a different model shape; its checkpoints cannot be resumed",
        ", ".join(f"model.{k}: {asdict(old.model).get(k)!r} -> {asdict(job.model)[k]!r}" for k in changed),
        "pick a new run.name for a new model, or drop the model overrides to continue the run")]


def checkpoint_verdict(job: Job, run_dir: Path) -> Any:
    """What the run's newest checkpoint means for this launch (:func:`recovery.start_check.judge`): a
    conflict this job cannot load (refused before any rank starts), or nothing left to train."""
    try:
        return judge(job, job.paths_at(run_dir).checkpoints, read_run_id(run_dir))
    except OSError:  # an unreadable or impossible run directory: the write below refuses it in one line
        return Verdict(Resume(None, None))


def conflict_problems(verdict: Any) -> list[Problem]:
    c = verdict.conflict
    return [Problem(c.field, c.message, c.arithmetic, c.fix)] if c is not None else []


def writer_problems(job: Job, run_dir: Path, runner: Callable[..., Any]) -> tuple[list[Problem], list[str]]:
    """One writer per run, asked on the login node before anything is written: (problems, warnings).

    Refused, for Slurm: a run whose lock (``run.lock``) is held by a live attempt, and a run
    whose earlier jobs (``submissions.jsonl``) ``squeue`` still lists as pending or running.
    ``cluster=local`` takes the lock itself before it writes anything (:func:`launch.local.take_run_lock`).
    The compute-node lock (:mod:`recovery.lock`) is the last line; this answers before a job
    is even queued.
    """
    problems, warnings = [], []
    paths = job.paths_at(run_dir)

    if (bad_stop := request_problem(paths.stop_request)) is not None:  # before the lock or any write
        problems.append(Problem("run.name", "the run's stop file is not a stop record", bad_stop,
                                f"look at it, then remove it (rm -r {paths.stop_request}) to continue the run"))
    held = None
    if job.cluster.launcher != "local":  # the local launcher takes the lock itself (launch/local.py): exit 9
        held = lock.active_holder(paths.lock, job_active=lambda j: lock.slurm_job_active(j, runner))
    if held:
        holder, why = held
        problems.append(Problem("run.name", "this run is being trained right now (one writer per run)",
                                f"{paths.lock}: held by {holder.describe()} ({why})",
                                "wait for it to end, stop it, or pick another run.name"))
    ids = [str(r["job_id"]) for r in read_events(paths.submissions) if r.get("job_id")]
    if ids and job.cluster.launcher == "slurm" and not held:
        try:
            states = lock.squeue_states(ids, runner)
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            warnings.append(f"WARNING: cannot ask squeue whether this run's jobs {', '.join(ids[-3:])} still run "
                            f"({exc}); the compute-node run lock still keeps a second writer out")
        else:
            active = {j: st for j, st in states.items() if st.split()[0].rstrip("+") in lock.ACTIVE_STATES}
            if active:
                problems.append(Problem(
                    "run.name", "this run already has a job queued or running (one writer per run)",
                    ", ".join(f"job {j} {st}" for j, st in sorted(active.items())) + " (squeue)",
                    f"wait for it, cancel it (scancel {' '.join(sorted(active))}), or pick another run.name"))
    return problems, warnings


def _commented(text: str) -> str:
    return "\n".join(f"# {line}".rstrip() for line in text.rstrip("\n").splitlines())


def _estimate(job: Job) -> Any:
    try:
        est = planner.estimate(job)
    except Exception as exc:  # an estimate is informative only; never block the registry on it
        return {"error": str(exc)}
    return asdict(est) if is_dataclass(est) else est


def record_member(job: Job, member: SweepMember, *, status: str, run_dir: Path, job_id: Optional[str] = None,
                  reasons: Optional[list[str]] = None, clock: Callable[[], float] = time.time) -> Path:
    """Append one line to ``<cluster.run_root>/sweeps/<sweep id>.jsonl``."""
    import json

    path = Path(job.cluster.run_root) / "sweeps" / f"{member.sweep_id}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    entry = {"sweep_id": member.sweep_id, "job_num": member.job_num, "time": clock(), "run_name": job.run.name,
             "run_dir": str(run_dir), "job_id": job_id, "layout": _layout(job), "mesh": _mesh(job),
             "recipe": job.parallelism.name,
             "overrides": list(member.overrides), "status": status, "reasons": reasons or []}
    if status == "submitted":
        est = _estimate(job)
        if est is not None:
            entry["estimate"] = est
    with open(path, "a") as fh:
        fh.write(json.dumps(entry, sort_keys=True, default=str) + "\n")
    return path


def _print_notes(job: Job, err: TextIO) -> None:
    for note in notes(job):
        print(note if note.startswith("WARNING:") else f"note: {note}", file=err)


def main(cfg: DictConfig, *, runner: Runner = default_runner, out: TextIO = sys.stdout,
         err: TextIO = sys.stderr, sweep: Optional[SweepMember] = None) -> int:
    """Check, then dry-run / run locally / submit one composed job; returns the exit code.

    A user mistake or a missing tool ends in one clear message and an exit code, never a
    traceback: 2 refused (nothing written), 1 the submission failed (nothing left behind).
    A Slurm submission holds the run's submit lock (:class:`launch.submit.SubmitLock`) from its
    squeue check to its sbatch record, released on every way out.
    """
    with ExitStack() as held:
        return _main(cfg, runner=runner, out=out, err=err, sweep=sweep, held=held)


def _main(cfg: DictConfig, *, runner: Runner, out: TextIO, err: TextIO, sweep: Optional[SweepMember],
          held: ExitStack) -> int:
    refused = 0 if sweep else EXIT_REFUSED
    job, refusal = job_or_refusal(cfg)
    if job is None:
        print(refusal, file=err)
        if sweep is not None:
            _refused_member(cfg, sweep, refusal)
        return refused
    composed = job
    if job.parallelism.name == "auto":
        try:
            job, table = planner.choose_layout(job)
        except ValueError as exc:  # NoLayoutFits: its message carries the ranked table

            print(f"refused: no layout fits; nothing was submitted\n{exc}\n{fit_advice(job)}", file=err)
            return 0 if sweep else EXIT_REFUSED
        print(table, file=err)
    if sweep is not None:
        job = member_job(job, sweep)
    where = run_dir_problems(job)  # first: no path operation may see a name the rule refuses (launch/paths.py)
    if where:
        first = where[0]
        print(f"refused: {first.arithmetic}; nothing was written or submitted; fix: {first.fix}", file=err)
        _outcome(job, sweep, "refused", f"{first.field}: {first.arithmetic}")
        return refused
    run_dir = Path(job.run_dir).absolute()
    problems = check(job)
    problems += shape_problems(job, run_dir)
    problems += submission_problems(job)
    verdict = checkpoint_verdict(job, run_dir)
    problems += conflict_problems(verdict)
    problems += ledger.quota_problems(job, run_dir)
    if sweep is not None:  # the estimates of the members accepted so far count against the sweep's budget
        problems += ledger.sweep_budget_problems(job, [r["gpu_hours"] for r in sweep.outcomes or []
                                                       if r.get("gpu_hours") and r["status"] not in ("refused", "failed")])
    if not job.force:  # a failed `launch/preflight.py` of this run blocks the real submission

        problems += preflight_problems(run_dir)
    if not job.dry_run and job.cluster.launcher != "local" and not problems:
        submit_lock, busy = SubmitLock.take(run_dir)  # before the squeue check: one submitter per run
        if submit_lock is not None:
            held.callback(submit_lock.release)
        else:
            problems.append(busy)
    if not job.dry_run:
        more, warnings = writer_problems(job, run_dir, runner)
        problems += more
        problems += ledger.budget_problems(job, run_dir, runner=runner)
        for line in warnings:
            print(line, file=err)
    if problems:
        if sweep is not None:
            print(f"sweep member {job.run.name} ({_layout(job)}):", file=err)
        print(format_problems(problems), file=err)
        if sweep is not None:
            first = problems[0]
            _outcome(job, sweep, "refused", f"{first.field}: {first.message}"
                     + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""))
            if not job.dry_run:
                record_member(job, sweep, status="refused", run_dir=run_dir, reasons=[str(p) for p in problems])
            return 0  # a sweep skips an invalid combination and goes on with the next
        return EXIT_REFUSED
    if verdict.complete:  # nothing left to train: end here, before a rank starts or a job is queued
        print(("note: " if job.dry_run else "") + verdict.complete, file=err)
        if not job.dry_run:
            _outcome(job, sweep, "complete", verdict.complete)
            return 0
    # the composed DictConfig prints 5x faster than re-structuring the Job; same text when unchanged
    text = literal_dollars(cfg, OmegaConf.to_yaml(cfg, resolve=True)) if job is composed else job_to_yaml(job)
    if job.dry_run:
        _outcome(job, sweep, fit_status(job, "ok (dry run)"), _estimate_note(job))
        if sweep is not None:  # one line per member (and its notes); the table follows: the scripts would bury it
            print(member_line(job, sweep), file=err)
            _print_notes(job, err)
            return 0
        _print_notes(job, err)
        return _dry_run(job, run_dir, text, out, err)

    before = RunDirSnapshot.take(run_dir)
    run_lock = None
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        if job.cluster.launcher == "local":  # the launcher holds the run before it writes a byte into it
            run_lock = local.take_run_lock(run_dir, job_active=lambda j: lock.slurm_job_active(j, runner), echo=err)
        job.paths_at(run_dir).config.write_text(text)
        write_memory_plan(job, run_dir)
        write_local_plan(job, run_dir)
    except lock.RunLocked as exc:  # another launch is training this run right now: leave all of it alone
        before.restore()
        print(local.locked_line(exc, run_dir), file=err)
        if sweep is not None:
            _outcome(job, sweep, "refused", "run.name: this run is being trained right now")
            return 0
        return local.EXIT_RUN_LOCKED
    except OSError as exc:
        if run_lock is not None:
            run_lock.release()
        before.restore()
        print(f"refused: cannot write the run directory {run_dir}: {exc.strerror or exc}; nothing was submitted\n"
              f"    fix: set cluster.run_root=<a writable directory> (or run.dir=...)", file=err)
        return refused
    _print_notes(job, err)  # after the lock: a launch refused by it prints its one line only
    clear_stop_request(job, run_dir, err)  # put back by before.restore() if the submission fails
    if run_lock is not None:  # cluster=local
        ensure_run_id(run_dir)  # the run's identity: every checkpoint's manifest names it
        return int(local.run(job, run_dir, run_lock=run_lock))
    try:
        subs = submit(job, run_dir, runner=runner)
        ensure_run_id(run_dir)  # (or rank 0 of the job made it first: the first creator wins)
    except SubmitError as exc:
        if exc.submitted:  # a dependency chain broke half-way: those jobs are queued, keep their record
            ids = ", ".join(s.job_id or "?" for s in exc.submitted)
            print(f"submission failed after job(s) {ids} were queued: {exc}", file=err)
        else:
            before.restore()
            print(f"submission failed: {exc}; nothing was submitted or written", file=err)
        if sweep is not None:
            _outcome(job, sweep, "failed", str(exc))
            record_member(job, sweep, status="failed", run_dir=run_dir, reasons=[str(exc)])
            return 0
        return EXIT_SUBMIT_FAILED
    ids = ", ".join(s.job_id or "?" for s in subs)
    print(f"submitted job {ids}  run {job.run.name}  dir {run_dir}", file=out)
    if sweep is None:
        print(summary(job, run_dir, job_ids=[s.job_id for s in subs if s.job_id]), file=out)
    if sweep is not None:
        _outcome(job, sweep, fit_status(job, "submitted"), _estimate_note(job), subs[0].job_id or "")
        record_member(job, sweep, status="submitted", run_dir=run_dir, job_id=subs[0].job_id)
    return 0


def write_memory_plan(job: Job, run_dir: Path) -> None:
    """``<run_dir>/memory_plan.json``: the planner's memory estimate of this layout, beside which the ranks log (and
    TensorBoard and the report plot) the measured memory, and which an out-of-memory stop quotes with its fixes."""
    try:
        plan = memory_plan(job)
    except (ArithmeticError, ValueError, KeyError):  # a shape the planner cannot size: the ranks say "no estimate"
        return
    atomic_write_json(job.paths_at(run_dir).memory_plan, plan)


def write_local_plan(job: Job, run_dir: Path) -> None:
    """``<run_dir>/local_plan.json`` when the local tier is on: what one node's local directory must hold, which the
    ranks compare with each node's free space at the start (a login node cannot see the compute nodes' disks)."""
    path = job.paths_at(run_dir).local_plan
    if not job.training.local_checkpoint.enabled:
        path.unlink(missing_ok=True)
        return
    atomic_write_json(path, check_local_ckpt.local_plan(job))


def clear_stop_request(job: Job, run_dir: Path, err: TextIO) -> None:
    """Submitting a run again is the user's decision to continue it: a drain request or the record
    of a cancel/drain (``stop.json``, launch/stop.py) would make the new attempt refuse to start."""
    path = job.paths_at(run_dir).stop_request
    try:
        old = path.read_bytes().decode("utf-8", errors="replace").strip()
    except OSError:
        return
    path.unlink(missing_ok=True)
    print(f"note: continuing a stopped run; cleared {path.name} ({stop_request_line(old)})", file=err)


def stop_request_line(text: str) -> str:
    """``stop.json`` (:mod:`recovery.stop`) in a few words: its state, who asked, when, at which step."""
    import json

    try:
        doc = json.loads(text)
    except ValueError:
        doc = None
    if not isinstance(doc, dict):
        flat = " ".join(text.split())
        return f"unreadable: {flat[:120]!r}"
    parts = [str(doc.get("state") or "?")]
    for key, word in (("by", "by"), ("reason", "reason"), ("at_step", "at step"), ("step", "stopped at step")):
        if doc.get(key) not in (None, ""):
            parts.append(f"{word} {' '.join(str(doc[key]).split())[:80]}")
    when = doc.get("stopped_at") or doc.get("requested_at")
    if isinstance(when, (int, float)) and not isinstance(when, bool):
        try:
            parts.append(time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(when)))
        except (OverflowError, OSError, ValueError):
            pass
    return ", ".join(parts)


def member_line(job: Job, member: SweepMember) -> str:
    """A dry-run sweep member in one line: name, layout, fit, estimate, and the command that prints its whole
    batch script (the member's own overrides without ``-m``)."""
    import shlex

    row = (member.outcomes or [{}])[-1]
    detail = f", {row['detail']}" if row.get("detail") else ""
    command = " ".join(["python launch/pretrain.py", *map(shlex.quote, member.overrides)])
    return f"sweep member {job.run.name} ({_layout(job)}): {row.get('status', 'ok (dry run)')}{detail}; script: {command}"


def _dry_run(job: Job, run_dir: Path, config_yaml: str, out: TextIO, err: Optional[TextIO] = None) -> int:
    """Print what would be submitted; stdout stays a valid shell script (config as comments)."""
    if job.cluster.launcher == "local":
        print(f"# local launcher: {job.world_size} processes on this machine, run dir {run_dir}", file=out)
    else:
        print(render(job, run_dir), end="", file=out)
    print(f"# ---- composed config ({job.paths_at(run_dir).config}); dry run: nothing written or submitted ----", file=out)
    print(_commented(config_yaml), file=out)
    if err is not None:  # the summary goes to stderr: stdout stays a script that `bash -n` accepts

        out.flush()
        print(f"dry run of {job.run.name}:\n{summary(job, run_dir)}", file=err)
    return 0


def swept_keys(argv: list[str]) -> list[str]:
    """The keys the command line sweeps over (``parallelism.tp=2,4`` or a sweep function), in order."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    overrides = OverridesParser.create().parse_overrides([a for a in argv if "=" in a and not a.startswith("-")])
    return [o.key_or_group for o in overrides if o.is_sweep_override()]


def run_name_swept(argv: list[str]) -> bool:
    """Does the command line sweep over run.name (``run.name=a,b`` or a sweep function)?"""
    return "run.name" in swept_keys(argv)


def sweep_member(sweep_id: str, argv: list[str], outcomes: Optional[list] = None) -> Optional[SweepMember]:
    """This Hydra job's place in a multirun, or None for a single run."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hc = HydraConfig.get()
    if hc.mode != RunMode.MULTIRUN:
        return None
    swept = swept_keys(argv)
    task = list(hc.overrides.task)
    return SweepMember(sweep_id=sweep_id, job_num=int(hc.job.num), overrides=task,
                       name_swept="run.name" in swept, label=member_label(task, swept), outcomes=outcomes)


if __name__ == "__main__":
    from launch.entry import hydra_entry, new_sweep_id

    _sweep_id = new_sweep_id()
    _outcomes: list = []
    _roots: list = []

    def _run(cfg: DictConfig, sweep_id: str) -> int:
        _roots.append((str(cfg.cluster.run_root), bool(cfg.dry_run)))
        return main(cfg, sweep=sweep_member(sweep_id, sys.argv[1:], _outcomes))

    _rc = hydra_entry(_run, _sweep_id, usage=USAGE)
    if _outcomes:
        sys.stdout.flush()
        print(f"\nsweep {_sweep_id}: {len(_outcomes)} member(s)\n{sweep_table(_outcomes)}", file=sys.stderr)
        if _roots and not _roots[-1][1]:
            print(f"registry: {Path(_roots[-1][0]).absolute() / 'sweeps' / (_sweep_id + '.jsonl')}\n"
                  f"status:   python launch/status.py cluster.run_root={_roots[-1][0]} {_sweep_id}", file=sys.stderr)
        if sweep_exit(_outcomes, _rc) != _rc:
            _rc = sweep_exit(_outcomes, _rc)
            print(f"sweep {_sweep_id}: no member was accepted ({len(_outcomes)} refused or failed); exit {_rc}",
                  file=sys.stderr)
    sys.exit(_rc)
