"""Drain a run: ``python launch/stop.py run.name=NAME [at_step=N]`` (or ``python launch/stop.py RUN_DIR``).

Takes the same overrides as ``launch/pretrain.py`` (they only locate the run directory) or the
run directory itself. Writes the stop request file ``<run_dir>/stop.json``
(:mod:`recovery.stop`); rank 0 of the running attempt polls it at every step boundary, the
ranks agree, save a checkpoint and exit 0 without a requeue: the Slurm job ends COMPLETED
(``cluster=local``: the launcher ends), with a ``stop`` event ``user_stop``. ``at_step=N``
stops once N steps are done instead of at the next boundary. A requeued attempt that has not
started yet honours the request when it starts. Submitting the same ``run.name`` again with
``launch/pretrain.py`` clears the request and continues the run from that checkpoint.

A run that is complete (its last attempt ended ``completed`` and nothing was submitted since)
has nothing to stop: one line says so, exit 3, and no ``stop.json`` is written (it would
only make the next launch clear it).

Exit codes: 0 request written, 2 bad input (no such run, a bad ``at_step``, a run name the run-directory
rule of ``launch/paths.py`` refuses), 3 the run is already complete (nothing written), 4 the stop request
cannot be written (``stop.json`` is a directory or the run directory is read-only). No torch.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional, Sequence, TextIO

import yaml

from launch.cli import override_error_line
from launch.compose import compose_job
from launch.kinds import EventKind
from launch.paths import RunPaths, given_run_dir, run_dir_for
from recovery import stop as stopping
from recovery.events import read_events

if __package__ in (None, ""):  # run as a script: make the repository importable, not launch/ itself
    _ROOT = str(Path(__file__).resolve().parent.parent)
    sys.path[:] = [_ROOT] + [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

EXIT_BAD_INPUT = 2
EXIT_COMPLETE = 3
EXIT_CANNOT_WRITE = 4  # the run exists but its stop request cannot be written (stop.json a directory, read-only)
USAGE = """usage: python launch/stop.py run.name=NAME [other overrides as for pretrain.py] [at_step=N]
       python launch/stop.py RUN_DIR [at_step=N]

Drain a run: the running attempt saves a checkpoint at the next step boundary (or once step N is done)
and ends without a requeue; a requeued attempt that has not started yet honours the request when it
starts. Submitting the same run again with launch/pretrain.py clears the request and continues it.

exit codes: 0 request written (<run_dir>/stop.json), 2 bad input (no such run, a bad at_step),
            3 the run is already complete (nothing written), 4 stop.json cannot be written

documentation: docs/stopping.md in the slurmtron repository"""


def parse_args(argv: Sequence[str]) -> tuple[Optional[Path], list[str], Optional[int]]:
    """(run dir given as a path, Hydra overrides, at_step); raises ValueError with one clear line."""
    run_dir, overrides, at_step = None, [], None
    for a in argv:
        if a.startswith("at_step="):
            raw = a.split("=", 1)[1]
            if not raw.isdigit() or int(raw) < 1:
                raise ValueError(f"at_step: {raw!r} is not a step number >= 1; fix: at_step=N with N the step to "
                                 f"stop after")
            at_step = int(raw)
        elif "=" in a:
            overrides.append(a)
        elif a.startswith("-"):
            raise ValueError(f"unknown option {a}; usage: python launch/stop.py run.name=NAME [at_step=N] "
                             f"(or a run directory; --help for more)")
        elif run_dir is None:
            run_dir = Path(a)
        else:
            raise ValueError(f"{a!r}: one run directory at most (or run.name=NAME); usage: "
                             f"python launch/stop.py run.name=NAME [at_step=N]")
    if run_dir is None and not overrides:
        raise ValueError("which run? usage: python launch/stop.py run.name=NAME [at_step=N] (or a run directory)")
    return run_dir, overrides, at_step


def completed_at(last: Optional[dict], submissions: list[dict]) -> Optional[object]:
    """The step at which the run completed, or None when it may still run: its last ``job_start``/``exit``
    event is an exit ``completed`` and no submission (``submissions.jsonl``) came after it."""
    if last is None or last.get("event") != EventKind.EXIT or last.get("reason") != "completed":
        return None
    ended = last.get("time")
    later = [r for r in submissions if not isinstance(ended, (int, float))
             or not isinstance(r.get("time"), (int, float)) or r["time"] > ended]
    return None if later else last.get("step", "?")


def resolve_run_dir(run_dir: Optional[Path], overrides: list[str]) -> Path:
    """The run directory, resolved; raises ValueError (one line) for a name or path the run-directory rule refuses."""
    if run_dir is not None:
        return given_run_dir(str(run_dir))

    job = compose_job(overrides)
    return run_dir_for(job.cluster.run_root, job.run.name, job.run.dir)


CONFIG_MAX_BYTES = 4 << 20  # a run's config.yaml is a few KiB


def _unreadable_config(config: Path) -> Optional[str]:
    """Why a run's ``config.yaml`` cannot be read back as a job (one phrase), or None: a stop request is only
    written into a directory that is a run."""
    try:
        if not config.is_file():
            return "not a regular file"
        if config.stat().st_size > CONFIG_MAX_BYTES:
            return f"{config.stat().st_size} bytes, more than {CONFIG_MAX_BYTES}"
        doc = yaml.safe_load(config.read_bytes().decode("utf-8"))
        if not isinstance(doc, dict):
            return f"a YAML {type(doc).__name__}, not a mapping"
    except OSError as e:
        return e.strerror or type(e).__name__
    except (UnicodeDecodeError, yaml.YAMLError) as e:  # a damaged file
        text = str(e).strip().splitlines()
        return f"{type(e).__name__}: {text[0][:160]}" if text else type(e).__name__
    return None


def main(argv: Optional[Sequence[str]] = None, out: Optional[TextIO] = None, err: Optional[TextIO] = None) -> int:
    out, err = out or sys.stdout, err or sys.stderr
    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        print(USAGE, file=out)
        return 0
    try:
        run_dir, overrides, at_step = parse_args(args)
        run_dir = resolve_run_dir(run_dir, overrides)
    except Exception as e:  # a bad override fails in Hydra's composition: one line, no traceback

        print(override_error_line(e, args), file=err)
        return EXIT_BAD_INPUT
    paths = RunPaths.of(run_dir)
    if not paths.config.exists():
        print(f"refused: run directory {run_dir} has no config.yaml: no such run (check run.name / cluster.run_root)",
              file=err)
        return EXIT_BAD_INPUT
    unreadable = _unreadable_config(paths.config)
    if unreadable:
        print(f"refused: {paths.config} cannot be read as a run's config ({unreadable}); nothing was written (is "
              f"{run_dir} a run directory?)", file=err)
        return EXIT_BAD_INPUT
    request = paths.stop_request
    if request.is_symlink() or (request.exists() and not request.is_file()):
        kind = "a symlink" if request.is_symlink() else "a directory" if request.is_dir() else "not a regular file"
        print(f"refused: {request} is {kind}, not a stop request; nothing was written (remove it, then run "
              f"launch/stop.py again)", file=err)
        return EXIT_CANNOT_WRITE
    try:
        events = [e for e in read_events(paths.events) if e.get("event") in (EventKind.JOB_START, EventKind.EXIT)]
    except OSError:  # the event log only adds a note: its absence or a directory there is no reason to refuse
        events = []
    last = events[-1] if events else None
    try:
        submissions = read_events(paths.submissions)
    except OSError:
        submissions = []
    done = completed_at(last, submissions)
    if done is not None:
        print(f"nothing to stop: run {run_dir} is complete (its last attempt ended 'completed' at step {done}); "
              f"no {paths.stop_request.name} written", file=out)
        return EXIT_COMPLETE
    try:
        doc = stopping.request_stop(request, at_step=at_step)
    except OSError as exc:
        print(f"refused: cannot write {request}: {exc.strerror or exc}; nothing was written (check the run "
              f"directory's permissions)", file=err)
        return EXIT_CANNOT_WRITE
    when = f"once step {at_step} is done" if at_step else "at the next step boundary"
    print(f"stop requested for {run_dir} ({paths.stop_request.name}, by {doc['by']}): the running attempt saves a "
          f"checkpoint {when} and ends without a requeue", file=out)
    if last is not None and last.get("event") == EventKind.EXIT:
        why = last.get("reason")
        note = ("its requeued attempt honours it when it starts" if why == "requeue"
                else "no attempt is running now (last: exit " + str(why) + "); a job still queued honours it")
        print(f"note: {note}", file=out)
    print(f"continue later with: python launch/pretrain.py <the same overrides> (it clears {paths.stop_request.name})",
          file=out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
