"""``python launch/status.py [overrides | RUN_DIR | SWEEP_ID] [--json] [--watch [SECONDS]] [--lines N]``.

Where is my run: its state in Slurm (pending with the reason, running, requeued, completed,
failed, cancelled) or on this machine (``cluster=local``), job id and attempts, step / target
and the ETA at the measured step time (and the Slurm slices that needs), the newest verified
checkpoint and its age, interruptions by cause, goodput so far, MFU now against the planner's
estimate, and the last log lines. The run is named like ``pretrain.py`` names it (the same
overrides, e.g. ``run.name=NAME`` or ``model=30b cluster=lustre``), or by its directory; a sweep
id (``<run_root>/sweeps/<id>.jsonl``, or that file) shows every member in one table.

Exit codes: 0 shown, 2 no such run or sweep, or a run name the run-directory rule refuses
(``launch/paths.py``), 3 the run's ``config.yaml`` or the sweep registry cannot be read (one line each). Login-node safe: no torch.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, TextIO

if __package__ in (None, ""):  # python launch/status.py: make the repository importable
    sys.path[:] = [str(Path(__file__).resolve().parent.parent)] + [
        p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

from analysis import throughput  # noqa: E402
from analysis.spend import fmt  # noqa: E402
from launch.cost import cost_text, unit  # noqa: E402
from launch.paths import (  # noqa: E402
    RunDirError, RunPaths, given_run_dir, resolved, run_dir_for, run_name_issue, run_root_problem)
from recovery.slurm import default_runner  # noqa: E402

# Hydra (the overrides) and launch.run_state (pandas, matplotlib: the log analysis) are imported where a run is
# named by overrides or found: "no such run" answers without them.

EXIT_NO_RUN = 2
EXIT_UNREADABLE = 3  # the run's own files (config.yaml, the sweep registry) cannot be read
USAGE = ("usage: python launch/status.py [k=v overrides as for pretrain.py | RUN_DIR | SWEEP_ID] "
         "[--json] [--watch [SECONDS]] [--lines N]")

HELP = USAGE + """

Where is my run: its state in Slurm (or on this machine for cluster=local), job id and attempts, step /
target and the ETA, the newest verified checkpoint, interruptions by cause, goodput, MFU against the
planner's estimate, and the last log lines. Name the run like pretrain.py does (run.name=NAME, or the
same overrides), give its directory, or a sweep id (<run_root>/sweeps/<id>.jsonl) for every member.

examples:
  python launch/status.py run.name=tiny
  python launch/status.py runs/tiny --watch 10
  python launch/status.py cluster.run_root=runs 20261202-003216-7291     # a sweep
options: --json (machine-readable), --watch [SECONDS] (refresh until the run ends), --lines N (log lines)
exit codes: 0 shown, 2 no such run or sweep (or a name the run-directory rule refuses), 3 the run's
            config.yaml or the sweep registry cannot be read

documentation: docs/monitoring.md in the slurmtron repository"""


def _dur(seconds: Optional[float]) -> str:
    if seconds is None:
        return "?"
    s = int(round(seconds))
    if s < 120:
        return f"{s} s"
    if s < 7200:
        return f"{s // 60} min"
    if s < 3 * 86400:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} days"


def _pct(v: Optional[float]) -> str:
    return "?" if v is None else f"{100 * v:.1f}%"


def format_state(st: "RunState") -> str:
    """The human view of one run."""
    lines = [f"run        {st.run}  ({st.run_dir})",
             f"layout     {st.layout or '?'} on {st.world_size} {'processes' if st.gpu == 'cpu' else st.gpu}"
             f" ({st.launcher})"]
    what = st.state + (f" ({st.reason})" if st.reason else "")
    if st.job_id:
        what += f"; job {st.job_id}" + (f" (of {', '.join(st.job_ids)})" if len(st.job_ids) > 1 else "")
    lines.append(f"state      {what}; attempts {st.attempts}")
    if st.step is not None or st.target:
        prog = f"step {st.step if st.step is not None else 0:,} / {st.target:,}" if st.target else f"step {st.step}"
        if st.target and st.step is not None:
            prog += f" ({100 * st.step / st.target:.1f}%)"
        if st.eta_s is not None and not st.finished:
            prog += f"; ETA {_dur(st.eta_s)} of training"
            if st.step_time_s:
                prog += f" at {throughput.step_time_text(st.step_time_s)}/step (the last 10 logged steps)"
            if st.slices_left:
                prog += f" ({st.slices_left} more slice{'s' if st.slices_left > 1 else ''})"
        if st.loss is not None:
            prog += f"; lm loss {st.loss:.4g}"
        lines.append(f"progress   {prog}")
    if st.val_loss is not None:
        val = f"lm loss {st.val_loss:.4g}" + (f", PPL {st.val_ppl:.4g}" if st.val_ppl is not None else "")
        val += f" at step {st.val_step:,}"
        if st.val_first:
            val += f" (was {st.val_first[1]:.4g} at step {st.val_first[0]:,})"
        lines.append(f"validation {val}")
    if st.checkpoint_step is not None:
        lines.append(f"checkpoint step {st.checkpoint_step:,} verified, {_dur(st.checkpoint_age_s)} ago"
                     f" ({Path(st.checkpoint_path or '').name})")
    else:
        lines.append("checkpoint none verified yet")
    intr = ", ".join(f"{k} {v}" for k, v in sorted(st.interruptions.items())) or "none"
    lines.append(f"interrupts {intr}")
    if st.in_job:
        j = st.in_job
        lines.append(f"in-job     {j['used']} of {j['budget']} in-job restarts used in this allocation "
                     f"({j['total']} in the run); spares left {j['spares_left']} of {j['spares']}")
    lines.append(f"goodput    {_pct(st.goodput)}" + (" so far" if st.goodput is not None else ""))
    if st.gpu_hours is not None:
        src = "Slurm accounting" if st.gpu_hours_source == "sacct" else "event log, worker time"
        priced = cost_text(st.gpu_hours, st.gpu_hour_price, gpu=st.gpu, what=f"so far, from the {src}")
        lines.append(f"cost       {priced}" if priced else
                     f"used       {st.gpu_hours:,.3g} {unit(st.gpu)} so far (from the {src}; "
                     "set cluster.gpu_hour_price for a cost)")
    if st.budget_gpu_hours or st.projected_gpu_hours is not None:
        u = unit(st.gpu)
        b = f"{fmt(st.gpu_hours or 0.0)} of {fmt(st.budget_gpu_hours)} {u} ({100 * (st.gpu_hours or 0.0) / st.budget_gpu_hours:.1f}%)" \
            if st.budget_gpu_hours else "no run.budget_gpu_hours"
        if st.projected_gpu_hours is not None:
            b += f"; projected {fmt(st.projected_gpu_hours)} {u} at the target"
        lines.append(f"budget     {b}")
    fig = throughput.RunFigures(**st.throughput) if st.throughput else None
    if fig is not None and fig.step_time_s is not None:
        lines.append(f"throughput {throughput.line(fig)} ({throughput.LABEL}; {fig.steps} step(s))")
    if st.mfu_now is not None or st.mfu_estimate is not None:
        run_mfu = throughput.pct_text(fig.mfu if fig is not None else None)
        lines.append(f"MFU        {run_mfu} (the run) vs {_pct(st.mfu_estimate)} estimated; "
                     f"{_pct(st.mfu_now)} over the last 10 logged steps")
    elif st.mfu_note:
        lines.append(f"MFU        {st.mfu_note}")
    if st.log_file:
        lines.append(f"log        {st.log_file}")
        lines.extend(f"  | {ln}" for ln in st.log_tail)
    lines.extend(f"note: {n}" for n in getattr(st, "notes", []))
    lines.extend(f"WARNING: {w}" for w in st.warnings)
    return "\n".join(lines)


def format_sweep(rows: list[dict]) -> str:
    """One line per sweep member: name, layout, state, job, step/target, MFU or the refusal."""
    head = ("member", "layout", "state", "job", "step", "MFU", "note")
    table = [head]
    for r in rows:
        st = r.get("status")
        if st is None:
            table.append((r["run_name"], r.get("layout", ""), r.get("registry_status", ""), r.get("job_id") or "-",
                          "-", "-", "; ".join(r.get("reasons") or [])[:80].replace("\n", " ")))
            continue
        step = f"{st['step'] or 0}/{st['target']}" if st.get("target") else str(st.get("step") or "-")
        table.append((r["run_name"], st.get("layout", ""), st["state"], st.get("job_id") or "-", step,
                      throughput.pct_text((st.get("throughput") or {}).get("mfu"))  # the run's figure
                      if (st.get("throughput") or {}).get("mfu") is not None else "-",
                      (st.get("reason") or "")[:60]))
    widths = [max(len(str(row[i])) for row in table) for i in range(len(head))]
    return "\n".join("  ".join(str(v).ljust(w) for v, w in zip(row, widths)).rstrip() for row in table)


def sweep_rows(registry: Path, *, gather_run: Callable[[Path], "RunState"]) -> list[dict]:
    """One row per member of the sweep registry; raises :class:`UnreadableRun` for a registry that is not text."""
    from launch.run_state import UnreadableRun

    try:
        text = registry.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UnreadableRun(f"sweep registry {registry} is not text (byte {exc.start} is not UTF-8): not a registry "
                            "launch/pretrain.py -m wrote; give the sweep id of another sweep") from None
    except OSError as exc:
        raise UnreadableRun(f"sweep registry {registry} cannot be read: {exc.strerror or exc}") from None
    rows, odd = [], 0
    for line in text.splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            entry = None
        if not isinstance(entry, dict) or not isinstance(entry.get("run_name", ""), str) \
                or not isinstance(entry.get("run_dir", ""), str):
            odd += bool(line.strip())
            continue
        row = {"run_name": entry.get("run_name") or "?", "layout": str(entry.get("layout") or ""),
               "job_id": entry.get("job_id"), "registry_status": str(entry.get("status") or ""),
               "reasons": [str(r) for r in entry.get("reasons") or []] if isinstance(entry.get("reasons"), list)
               else []}
        run_dir = Path(entry.get("run_dir") or "")
        if entry.get("status") == "submitted" and entry.get("run_dir") and RunPaths.of(run_dir).config.exists():
            row["status"] = gather_run(run_dir).to_dict()
        rows.append(row)
    if odd and not rows:
        raise UnreadableRun(f"sweep registry {registry} holds no member record ({odd} line(s) that are not one): "
                            "not a registry launch/pretrain.py -m wrote")
    return rows


def resolve(args: list[str]) -> tuple[str, Path]:
    """('run', dir) or ('sweep', registry) named by the command line; raises ValueError with one line."""
    overrides = [a for a in args if "=" in a]
    names = [a for a in args if "=" not in a]
    if len(names) > 1:
        raise ValueError(f"give one run directory or sweep id, not {names}")
    if names:
        target = given_run_dir(names[0], "run directory or sweep id")
        if RunPaths.of(target).config.exists():
            return "run", target
        if target.suffix == ".jsonl" and target.is_file():
            return "sweep", target
        if "/" in names[0]:  # a path, not a sweep id (a sweep id names a file under <run_root>/sweeps/)
            raise RunDirError(f"no run at {target} (no config.yaml) and not a sweep registry (.jsonl): give a run "
                              "directory, a sweep id, or run.name=NAME")
        issue = run_name_issue(names[0])
        if issue:  # the same rule as a run name: a sweep id names one file under <run_root>/sweeps/
            raise RunDirError(f"sweep id: {issue[0].replace('run.name', 'the name', 1)}; fix: give the id "
                              "launch/pretrain.py -m printed, or a run directory")

    from launch.cli import override_error_line
    from launch.compose import compose_job

    try:
        job = compose_job(overrides)
    except Exception as exc:  # Hydra/OmegaConf: a bad override (one line, a "did you mean" for a typo)

        raise ValueError(override_error_line(exc, overrides).removeprefix("refused: ")) from None
    if names:
        if run_root_problem(job.cluster.run_root):
            raise RunDirError(run_root_problem(job.cluster.run_root))
        registry = resolved(Path(job.cluster.run_root) / "sweeps" / f"{names[0]}.jsonl")
        if registry.is_file():
            return "sweep", registry
        raise ValueError(f"{names[0]} is neither a run directory (no config.yaml) nor a sweep id ({registry} "
                         "does not exist)")
    run_dir = run_dir_for(job.cluster.run_root, job.run.name, job.run.dir)
    if not job.paths_at(run_dir).config.exists():
        raise ValueError(f"no run {job.run.name!r} at {run_dir} (no config.yaml): start it with "
                         f"python launch/pretrain.py {' '.join(overrides)}".rstrip())
    return "run", run_dir


def _number(text: str) -> Optional[float]:
    try:
        return float(text)
    except ValueError:
        return None


def _seconds(flag: str, text: str) -> float:
    """``--watch``'s refresh period: a finite number of seconds > 0, else one line (ValueError)."""
    value = _number(text)
    if value is None or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{flag} {text!r} is not a refresh period in seconds (a number > 0, e.g. --watch 30)")
    return value


def _parse_flags(argv: list[str]) -> tuple[list[str], dict]:
    opts: dict[str, Any] = {"json": False, "watch": None, "lines": 5}
    rest, i = [], 0
    while i < len(argv):
        a = argv[i]
        if a == "--json":
            opts["json"] = True
        elif a == "--watch":
            opts["watch"] = 30.0
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            if nxt is not None and (_number(nxt) is not None or (rest and "=" not in nxt)):
                opts["watch"] = _seconds("--watch", nxt)  # a number, or a word where the run is already named
                i += 1
        elif a.startswith("--watch="):
            opts["watch"] = _seconds("--watch", a.split("=", 1)[1])
        elif a == "--lines" or a.startswith("--lines="):
            value = a.split("=", 1)[1] if "=" in a else argv[i + 1] if i + 1 < len(argv) else ""
            i += 0 if "=" in a else 1
            if not value.isdigit():
                raise ValueError(f"--lines {value!r} is not a count of log lines (0 or more)")
            opts["lines"] = int(value)
        elif a.startswith("--"):
            raise ValueError(f"unknown option {a}; {USAGE}")
        else:
            rest.append(a)
        i += 1
    return rest, opts


def main(argv: Optional[list[str]] = None, *, runner: Callable[..., Any] = default_runner, out: TextIO = sys.stdout,
         err: TextIO = sys.stderr, clock: Callable[[], float] = time.time,
         sleep: Callable[[float], None] = time.sleep, max_refreshes: Optional[int] = None) -> int:
    """Print the status once, or every ``--watch`` seconds until the run ends (or Ctrl-C)."""
    if any(a in ("-h", "--help") for a in (sys.argv[1:] if argv is None else argv)):
        print(HELP, file=out)
        return 0
    try:
        args, opts = _parse_flags(list(sys.argv[1:] if argv is None else argv))
        kind, path = resolve(args)
    except ValueError as exc:
        print(f"status: {exc}", file=err)
        return EXIT_NO_RUN
    from launch.run_state import RunState, UnreadableRun, gather  # something to read: the analysis loads now

    def one(run_dir: Path) -> RunState:
        return gather(run_dir, runner=runner, clock=clock, log_lines=opts["lines"])

    refreshes = 0
    try:
        while True:
            if kind == "run":
                st = one(path)
                text = json.dumps(st.to_dict(), indent=1, default=str) if opts["json"] else format_state(st)
                done = st.finished
            else:
                rows = sweep_rows(path, gather_run=one)
                text = json.dumps(rows, indent=1, default=str) if opts["json"] else (
                    f"sweep {path.stem} ({path})\n" + format_sweep(rows))
                done = all(r.get("status") is None or r["status"]["state"] in ("completed", "failed", "cancelled",
                                                                              "timeout", "stopped") for r in rows)
            if opts["watch"] and not opts["json"]:
                out.write("\x1b[H\x1b[2J")  # clear the terminal: a refreshing view, like watch(1)
                text += f"\n(refreshed {time.strftime('%H:%M:%S', time.localtime(clock()))}; every " \
                        f"{opts['watch']:g} s; Ctrl-C to stop)"
            print(text, file=out, flush=True)
            refreshes += 1
            if not opts["watch"] or done or (max_refreshes is not None and refreshes >= max_refreshes):
                return 0
            sleep(opts["watch"])
    except KeyboardInterrupt:
        return 0
    except UnreadableRun as exc:  # nothing shown yet for this refresh: one line, its own exit code
        print(f"status: {exc}", file=err)
        return EXIT_UNREADABLE


if __name__ == "__main__":
    try:
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:  # `status.py RUN | head`: the reader left early, which says nothing about the run
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at interpreter exit
        code = 0
    sys.exit(code)
