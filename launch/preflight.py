"""The preflight job: ``python launch/preflight.py <the same overrides as pretrain.py> [preflight.k=v ...]``.

A short job on the *target layout* that catches the bugs that do not crash: parameters that
get no gradient, a layout that computes different numbers from one process, a checkpoint that
does not restore (or reshard) bit-for-bit, a slow fabric, a starving data loader. The checks
and their thresholds are in :mod:`launch.preflight_checks`; the ranks' work is in
:mod:`train.preflight_worker`.

Where it runs:

* ``cluster=local``: the ranks are local processes (like ``launch/local.py``), and this command
  waits for them, prints the verdict table and exits 1 on any FAIL;
* a Slurm cluster: the job is rendered by the same renderer as ``pretrain.py`` (same
  ``#SBATCH`` header, modules, NCCL environment, container, ``--exclude`` of failed nodes), with
  ``train.preflight_worker`` as the srun step, no requeue, and submitted with ``sbatch``; rank 0
  writes the table to the job log and ``<run_dir>/preflight.json``. ``preflight.wait=true``
  waits for that file and exits like the local case.

Either way ``<run_dir>/preflight.json`` records the verdicts, and ``pretrain.py`` refuses the
real submission while it holds a FAIL (unless ``force=true``; see
:func:`launch.preflight_checks.preflight_problems`). The preflight's own files (config, logs,
the scratch checkpoint, removed after the round trip) live in ``<run_dir>/preflight/``, never
in the run's ``checkpoints/``, so a resume can never pick a preflight checkpoint up.

Preflight options are ordinary overrides of the schema's ``preflight`` group
(:class:`launch.config.PreflightConfig`: ``preflight.steps``, ``preflight.timeout_s``,
``preflight.wait``, ``preflight.keep_checkpoint``), typed by Hydra and validated by the job check.

Test-only: ``SLURMTRON_TEST_PREFLIGHT_BREAK=detach`` (a module gets no gradient) or ``=tp_split``
(a skipped TP all-reduce) shows that the preflight fails a broken model. Never set it for a real run.

Login-node code: no torch, no megatron (the ranks import them).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence, TextIO

if __package__ in (None, ""):  # run as a script: make the repository importable, not launch/ itself
    _ROOT = str(Path(__file__).resolve().parent.parent)
    sys.path[:] = [_ROOT] + [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

from launch.check import check, run_dir_problems  # noqa: E402
from launch.cli import compose_config, job_or_refusal, override_error_line, wants_help  # noqa: E402
from launch.compose import job_to_yaml  # noqa: E402
from launch.config import Job, PreflightConfig  # noqa: E402
from launch.local import Ranks  # noqa: E402
from launch.paths import RunPaths  # noqa: E402
from launch.preflight_checks import (  # noqa: E402
    BREAKAGES, FAIL, Report, format_table, read_report, run_failed, write_report,
)
from launch.problems import format_problems  # noqa: E402
from launch.render import read_failed_nodes, render  # noqa: E402
from launch.submit import SubmitError, parse_job_id, sbatch  # noqa: E402
from recovery.slurm import Slurm  # noqa: E402
from recovery.slurm import default_runner  # noqa: E402
from recovery.storage import atomic_write_json  # noqa: E402

EXIT_PASS, EXIT_FAIL, EXIT_REFUSED = 0, 1, 2
USAGE = """usage: python launch/preflight.py [key=value ...]   (the same overrides as launch/pretrain.py)

A short job on the target layout that catches what does not crash: parameters with no gradient, a layout
that computes different numbers from one process, a checkpoint that does not restore (or reshard)
bit-for-bit, a slow fabric, a starving data loader. cluster=local runs the ranks here and waits; on Slurm
the job is submitted (preflight.wait=true waits for the verdict). The verdict is <run_dir>/preflight.json;
pretrain.py refuses the real submission while it holds a FAIL (unless force=true).

options: preflight.steps=N (>= 1), preflight.timeout_s=S, preflight.wait=true, preflight.keep_checkpoint=true
exit codes: 0 every check passed, 1 a check failed (or the job did not finish), 2 bad input (refused)

documentation: docs/planning.md in the slurmtron repository"""
WORKER_MODULE = "train.preflight_worker"
BREAK_ENV = "SLURMTRON_TEST_PREFLIGHT_BREAK"


def breakage(env: Mapping[str, str]) -> str:
    """The test-only breakage asked for by ``SLURMTRON_TEST_PREFLIGHT_BREAK`` ('' for none); ValueError if unknown."""
    brk = (env.get(BREAK_ENV) or "").strip()
    if brk and brk not in BREAKAGES:
        raise ValueError(f"{BREAK_ENV}={brk!r}: expected one of {', '.join(BREAKAGES)} (test-only)")
    return brk


def preflight_job(job: Job, opts: PreflightConfig) -> Job:
    """The job the preflight ranks run: ``steps`` iterations, no requeue, a short time limit."""
    training = replace(job.training, train_iters=opts.steps, train_tokens=None)
    cluster = replace(job.cluster, requeue_allowed=False)
    limit = max(5, min(job.run.time_limit_min, int(opts.timeout_s // 60) + 5))
    return replace(job, training=training, cluster=cluster, run=replace(job.run, time_limit_min=limit,
                                                                         dependency_chain=0))


def write_preflight_dir(job: Job, opts: PreflightConfig, run_dir: Path, brk: str = "") -> Path:
    """``<run_dir>/preflight/{config.yaml,options.json}``; removes a previous verdict."""
    pf_dir = RunPaths.of(run_dir).preflight_dir
    paths = RunPaths.of(pf_dir)
    paths.logs.mkdir(parents=True, exist_ok=True)
    paths.config.write_text(job_to_yaml(preflight_job(job, opts)))
    atomic_write_json(paths.preflight_options, {
        "steps": opts.steps, "timeout_s": opts.timeout_s, "break": brk, "run_dir": str(run_dir),
        "keep_checkpoint": opts.keep_checkpoint})
    old = RunPaths.of(run_dir).preflight_report
    if old.exists():
        old.unlink()
    return pf_dir


# ---- cluster=local ---------------------------------------------------------------------------

def run_local(job: Job, pf_dir: Path, timeout_s: float, *, popen: Callable[..., Any] = subprocess.Popen,
              env: Optional[Mapping[str, str]] = None, clock: Callable[[], float] = time.monotonic,
              sleep: Callable[[float], None] = time.sleep) -> list[Optional[int]]:
    """Start the ranks as local processes and wait; returns their codes (None = killed on timeout)."""
    logs = RunPaths.of(pf_dir).logs
    ranks = Ranks(argv=["-m", WORKER_MODULE, str(pf_dir)], world=job.world_size,
                  log_path=lambda r: logs / f"rank{r}.out", env=dict(os.environ if env is None else env),
                  popen=popen, clock=clock, sleep=sleep).start()
    # one rank failed: the others would wait in a collective; give them 10 s, then kill them
    done = ranks.wait(timeout_s=timeout_s + 60, grace_s=10.0, healthy=(0,))
    return [None if k else c for c, k in zip(done.codes, done.killed)]


def finish(run_dir: Path, pf_dir: Path, codes: Sequence[Optional[int]], out: TextIO) -> int:
    """Print the verdict table (writing a FAIL report if the ranks did not finish); the exit code."""
    report: Optional[Report]
    try:
        report = read_report(run_dir)
    except ValueError:
        report = None
    if report is None or any(c != 0 for c in codes):
        why = (f"ranks exited {list(codes)} (None = killed at the time limit); "
               f"see {RunPaths.of(pf_dir).logs}/rank*.out and reference.out")
        checks = (report.checks if report else []) + [run_failed(why)]
        report = Report(checks=checks, world_size=len(codes))
        write_report(run_dir, report, atomic_write_json)
    print(format_table(report), file=out)
    print(f"wrote {RunPaths.of(run_dir).preflight_report}", file=out)
    return EXIT_FAIL if report.verdict == FAIL else EXIT_PASS


# ---- Slurm ------------------------------------------------------------------------------------

def render_preflight(job: Job, run_dir: Path, pf_dir: Path, opts: PreflightConfig) -> str:
    """The preflight's sbatch script: pretrain's renderer, the preflight worker as the srun step."""
    pf_job = preflight_job(job, opts)
    pf_job = replace(pf_job, run=replace(pf_job.run, name=f"{job.run.name}-preflight"))
    script = render(pf_job, pf_dir, failed_nodes=read_failed_nodes(run_dir))
    needle = "-m train.worker "
    if script.count(needle) != 1:
        raise RuntimeError(f"the rendered script has {script.count(needle)} '{needle.strip()}' steps, expected 1; "
                           "sbatch_templates/srun.sh changed")
    return script.replace(needle, f"-m {WORKER_MODULE} ")


def submit_slurm(job: Job, run_dir: Path, pf_dir: Path, opts: PreflightConfig, *, runner: Callable[..., Any],
                 out: TextIO, err: TextIO, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> int:
    """Render, ``sbatch --parsable``, and (``preflight.wait``) wait for ``preflight.json``."""
    slurm = Slurm(runner)
    script = RunPaths.of(pf_dir).script
    script.write_text(render_preflight(job, run_dir, pf_dir, opts))
    try:
        job_id = parse_job_id(sbatch(slurm, script, "--parsable").out)
    except SubmitError as exc:
        print(f"preflight submission failed: {exc}", file=err)
        return EXIT_FAIL
    print(f"submitted preflight job {job_id}; verdict -> {RunPaths.of(run_dir).preflight_report} "
          f"(log {RunPaths.of(pf_dir).logs}/{job_id}_0.out)", file=out)
    if not opts.wait:
        return EXIT_PASS
    deadline = clock() + opts.timeout_s + 600  # queue wait included
    while clock() < deadline:
        if (RunPaths.of(run_dir).preflight_report).exists():
            return finish(run_dir, pf_dir, [0], out)
        if not slurm.in_queue(job_id):
            sleep(2.0)  # the verdict is written before the ranks exit; allow for a slow shared filesystem
            ok = (RunPaths.of(run_dir).preflight_report).exists()
            return finish(run_dir, pf_dir, [0 if ok else 1], out)
        sleep(5.0)
    print(f"preflight job {job_id}: no verdict after {opts.timeout_s + 600:g} s; check squeue/sacct", file=err)
    return EXIT_FAIL


def main(argv: Sequence[str], *, runner: Callable[..., Any] = default_runner,
         popen: Callable[..., Any] = subprocess.Popen, out: TextIO = sys.stdout, err: TextIO = sys.stderr,
         env: Optional[Mapping[str, str]] = None, clock: Callable[[], float] = time.monotonic,
         sleep: Callable[[float], None] = time.sleep) -> int:
    """Compose and check the job like pretrain.py, then run the preflight on its layout."""
    if wants_help(argv):
        print(USAGE, file=out)
        return EXIT_PASS
    env = dict(os.environ if env is None else env)
    try:
        brk = breakage(env)
    except ValueError as exc:
        print(f"refused: {exc}", file=err)
        return EXIT_REFUSED
    try:
        cfg = compose_config(argv)
    except Exception as exc:  # a bad option or a Hydra composition error: the user's input, one line
        print(override_error_line(exc, argv), file=err)
        return EXIT_REFUSED
    job, refusal = job_or_refusal(cfg, done="no preflight was run")  # a +key pretrain.py refuses too
    if job is None:
        print(refusal, file=err)
        return EXIT_REFUSED
    where = run_dir_problems(job)  # the run-directory rule of every entry point (launch/paths.py), before any path
    if where:
        print(f"refused: {where[0].arithmetic}; nothing was written; fix: {where[0].fix}", file=err)
        return EXIT_REFUSED
    opts = job.preflight
    problems = check(job)
    if problems:
        print(format_problems(problems), file=err)
        return EXIT_REFUSED
    run_dir = Path(job.run_dir).absolute()
    pf_dir = write_preflight_dir(job, opts, run_dir, brk)
    if brk:
        print(f"WARNING: {BREAK_ENV}={brk} is a test-only breakage; this preflight is meant to FAIL", file=err)
    if job.cluster.launcher == "local":
        print(f"preflight: {job.world_size} local ranks, layout tp={job.parallelism.tp} pp={job.parallelism.pp} "
              f"dp={job.dp}, {opts.steps} step(s); logs in {RunPaths.of(pf_dir).logs}", file=out)
        codes = run_local(job, pf_dir, opts.timeout_s, popen=popen, env=env, clock=clock, sleep=sleep)
        return finish(run_dir, pf_dir, codes, out)
    return submit_slurm(job, run_dir, pf_dir, opts, runner=runner, out=out, err=err, clock=clock, sleep=sleep)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
