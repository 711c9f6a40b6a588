"""``python analysis/report.py PATH... --out DIR``: interruption, goodput and MFU report.

PATHs are run directories (``runs/<name>/``), a sweep root holding run directories, log
files and ``sacct --parsable2`` dumps (all loose files together form one "run"). Writes
``iterations.csv``, ``interruptions.csv``, ``summary.json``, ``report.md``, a
self-contained ``report.html`` (plots embedded as base64 PNG) and the PNG files.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Optional

if __name__ == "__main__":  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pandas as pd  # noqa: E402

from analysis import figures, recovery_time, spend  # noqa: E402
from analysis.interruptions import build_attempts, goodput, interruptions, job_key
from analysis.load import RunInputs, load_paths
from analysis.mfu import (
    RunShape, attempt_summary, layout_summary, regression_flags, run_figures, shape_from_config, step_metrics,
    straggler_flags, with_event_times,
)
from analysis import throughput
from analysis.document import counts, csv_safe, num, to_html, to_markdown
from analysis.plots import MEMORY_SERIES, plot_goodput, plot_loss_by_step, plot_memory, plot_mfu_by_layout, plot_timeline
from analysis.slice_end import report_line
from launch.kinds import Cause, EventKind
from launch.paths import RunDirError, given_run_dir, unwritable_ancestor

__all__ = ["main", "analyze_run", "ITERATIONS_CSV_COLUMNS"]

ITERATIONS_CSV_COLUMNS = [
    "run", "source", "job_id", "attempt", "rank", "timestamp", "iteration", "lm_loss", "elapsed_ms",
    "tflops_per_gpu", "mfu_pct", "tflops", "mfu", "hfu", "tokens_per_s", "lr", "global_batch_size",
    "loss_scale", "grad_norm", "skipped_iters", "nan_iters", "layout", "regressed",
]


def _shape(run: RunInputs, args: argparse.Namespace) -> RunShape:
    shape = shape_from_config(run.config)
    if args.gpu:
        shape.device = args.gpu
    if args.dtype:
        shape.dtype = args.dtype
    if args.num_gpus:
        shape.world_size = args.num_gpus
    return shape


def analyze_run(run: RunInputs, shape: RunShape, *, window: int = 20, threshold: float = 0.10) -> dict:
    """All tables of one run: attempts, interruptions, per-step metrics, summaries, goodput."""
    gpus = shape.world_size
    att, it = build_attempts(run.iterations, run.signatures, run.checkpoints, run.events, run.sacct, gpus=gpus)
    intr = recovery_time.add_recovery(interruptions(att), att, run.events)
    ev = run.events
    m = step_metrics(with_event_times(it, _records(ev)), shape)  # rank 0's step times: the figures' (throughput.py)
    if ev is not None and not ev.empty and "layout" in ev:
        # the layout each attempt really ran with (a resumed run may reshard)
        starts = ev[ev["event"] == EventKind.JOB_START]
        for r in starts.itertuples():
            label = figures.layout_of({"layout": getattr(r, "layout", None),
                                       "layout_label": getattr(r, "layout_label", None)})
            if label:
                job = str(r.job_id) if isinstance(r.job_id, str) else "local"
                sel = (m["job"] == job) & (m["attempt"] == int(r.restart_count if pd.notna(r.restart_count) else 0))
                m.loc[sel, "layout"] = label
    flagged = regression_flags(m, window=window, threshold=threshold)
    m["regressed"] = False
    if not flagged.empty:
        m.loc[flagged.index, "regressed"] = flagged["regressed"].astype(bool)
    steps = event_steps(_records(ev), shape)  # the per-attempt and per-layout tables: the run figure's steps
    table = steps if steps is not None else m
    return {
        "attempts": att, "interruptions": intr, "metrics": m, "by_attempt": attempt_summary(table),
        "by_layout": layout_summary(table), "stragglers": straggler_flags(m), "goodput": goodput(att),
        "computed": bool(shape.model and shape.world_size),
        # step time, tokens/s, TFLOP/s, MFU, HFU of the run: one definition (analysis/throughput.py)
        "throughput": run_figures(m, _records(ev)),
        "live": live_alerts(ev),
    }


def event_steps(records: list, shape: RunShape) -> Optional[pd.DataFrame]:
    """Rank 0's timed steps from the event log, one row each, keyed by attempt like the log's rows (``job``,
    ``attempt``, ``layout``): the steps the run's figures are over (:mod:`analysis.throughput`), so the per-attempt
    and per-layout tables hold the same steps (a step the last rank's log lost is still there). None without a timed
    ``iteration`` event or without the shape the rates need (the log lines then)."""
    if not (shape.model and shape.world_size and shape.global_batch_size and shape.seq_length):
        return None
    rows, ordinal, start = [], -1, None
    for e in records:
        kind, rank = e.get("event"), _num(e.get("rank"))
        if rank not in (None, 0.0):
            continue
        if kind == EventKind.JOB_START or ordinal < 0:
            ordinal, start = ordinal + 1, (e if kind == EventKind.JOB_START else {})
        if kind != EventKind.ITERATION:
            continue
        step, sec = _num(e.get("step")), _num(e.get("seconds"))
        if step is None or sec is None or sec <= 0:
            continue
        job_id = e.get("job_id") if isinstance(e.get("job_id"), str) else None
        label = _num(e.get("attempt"))
        label = label if label is not None else _num(e.get("restart_count"))
        rows.append({"ordinal": ordinal, "job": job_key(job_id)[0] if job_id else "local",
                     "attempt": int(label) if label is not None else 0, "iteration": int(step),
                     "elapsed_ms": sec * 1000.0, "layout": figures.layout_of(start) or shape.layout})
    if not rows:
        return None
    df = pd.DataFrame(rows)
    keys = df.groupby("ordinal")[["job", "attempt"]].first()
    if keys.duplicated().any():  # launches that all start at restart count 0 (old local runs): number them
        df["attempt"] = df["ordinal"]
    df = df.assign(global_batch_size=float(shape.global_batch_size), tflops_per_gpu=math.nan, mfu_pct=math.nan)
    layouts = df["layout"]
    return step_metrics(df, shape).assign(layout=layouts)


LIVE_EVENTS = (EventKind.HANG, EventKind.NAN, EventKind.NAN_ROLLBACK, EventKind.BATCHES_SKIPPED,
               EventKind.STRAGGLER, EventKind.REGRESSION, EventKind.REPLAY_MISMATCH, EventKind.SAVE_FAILED,
               EventKind.CHECKPOINT_ABANDONED, EventKind.EXCLUDE)


def hardware_exclusions(ev: Optional[pd.DataFrame]) -> pd.DataFrame:
    """The ranks' ``exclude`` events that name a hardware fault of their node (launch/hardware_faults.py: ECC,
    Xid, NVLink, IB, ...): the node was recorded and the job requeued without it. An ``exclude`` without a
    ``reason`` carries recorded nodes over to the next attempt, and is no new fault."""
    if ev is None or ev.empty or "reason" not in ev:
        return pd.DataFrame(columns=list(ev.columns) if ev is not None else [])
    return ev[(ev["event"] == EventKind.EXCLUDE) & ev["reason"].map(lambda x: isinstance(x, str) and bool(x))]


def live_alerts(ev: Optional[pd.DataFrame]) -> pd.DataFrame:
    """What the job's live checks recorded while it ran (hangs, NaNs, stragglers, regressions, hardware faults
    that excluded a node), one row each."""
    cols = ["ts", "job_id", "restart_count", "event", "step", "what"]
    if ev is None or ev.empty:
        return pd.DataFrame(columns=cols)
    rows = []
    hw = hardware_exclusions(ev)
    live = ev[ev["event"].isin(LIVE_EVENTS) & ((ev["event"] != EventKind.EXCLUDE) | ev.index.isin(hw.index))]
    for r in live.to_dict("records"):
        k = r["event"]
        if k == EventKind.EXCLUDE:
            hosts = r.get("hosts")
            hosts = ",".join(str(h) for h in hosts) if isinstance(hosts, list) else str(hosts)
            what = (f"{r.get('reason')} on {hosts}: node recorded, job requeued without it"
                    + ("" if r.get("ok") in (True,) else f" (the requeue failed: {r.get('detail')})"))
        elif k == EventKind.HANG:
            what = (f"{r.get('deadline')} deadline ({r.get('arithmetic')}); suspects "
                    + ", ".join(f"rank {_rank(s.get('rank'))} on {s.get('host')}" for s in (r.get("suspects") or []))
                    + f"; stacks {r.get('stacks')}")
        elif k == EventKind.STRAGGLER:
            what = (f"rank {_rank(r.get('rank_slow'))} on {r.get('host_slow')}: {_f(r.get('ratio'))}x the median compute "
                    f"time over {r.get('steps')} steps")
        elif k == EventKind.REGRESSION:
            what = (f"median step {_f(r.get('step_s'))} s vs baseline {_f(r.get('baseline_s'))} s "
                    f"for {r.get('intervals')} intervals")
        elif k == EventKind.NAN:
            what = f"loss {r.get('loss')}, grad norm {r.get('grad_norm')}; policy {r.get('policy')}"
        elif k in (EventKind.REPLAY_MISMATCH, EventKind.CHECKPOINT_ABANDONED):
            what = str(r.get("detail") or "")[:300]
        elif k == EventKind.SAVE_FAILED:
            what = (f"{r.get('cause')} ({r.get('save')} save); policy {r.get('policy')}: "
                    f"{'went on' if r.get('go_on') else 'stopped'}")
        elif k == EventKind.NAN_ROLLBACK:
            what = f"rolled back to step {r.get('to_step')}; skip {r.get('skip_batches')} batch(es)"
        else:
            what = f"skipped {r.get('batches')} batch(es) from sample {r.get('first_sample')}"
        rows.append({"ts": r.get("ts"), "job_id": r.get("job_id"), "restart_count": r.get("restart_count"),
                     "event": k, "step": r.get("step"), "what": what})
    return pd.DataFrame(rows, columns=cols)


def _hardware_counts(ev: Optional[pd.DataFrame]) -> dict:
    hw = hardware_exclusions(ev)
    return {str(k): int(v) for k, v in hw["reason"].value_counts(sort=False).items()} if len(hw) else {}


def _rank(v) -> str:
    """A rank (or attempt) as an integer: pandas carries them as floats next to a missing value ("rank 2.0")."""
    x = _num(v)
    return "?" if x is None else (str(int(x)) if float(x).is_integer() else str(v))


def _f(v) -> str:
    x = _num(v)
    return "?" if x is None else f"{x:.3g}"


def _num(v):
    if v is None:
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(f) or math.isinf(f) else f


def _records(events: Any) -> list:
    return [] if events is None or events.empty else events.to_dict("records")


def _summary(run: RunInputs, res: dict) -> dict:
    m, intr = res["metrics"], res["interruptions"]
    counts = {c.value: int((intr["cause"] == c).sum()) for c in Cause if (intr["cause"] == c).any()}
    steady = res["by_attempt"]
    return {
        "iterations": int(len(m)),
        # job_start events (separate local launches do not merge), or more when Slurm knows attempts killed before
        # their first event (status.py counts the same union)
        "attempts": max(figures.attempt_count(_records(run.events)), int(len(res["attempts"]))),
        "layout": figures.run_layout(_records(run.events)),
        "interruptions": int(len(intr)),
        "counts_by_cause": counts,
        "recovery": recovery_time.summary(intr),
        "goodput": {k: _num(v) for k, v in res["goodput"].items()},
        # the run's figures, as status.py, TensorBoard and the rank's end-of-attempt line show them
        "throughput": res["throughput"].to_dict(),
        "step_time_s": res["throughput"].step_time_s,
        "mfu": res["throughput"].mfu,
        "hfu": res["throughput"].hfu,
        "tflops_per_gpu": res["throughput"].tflops_per_gpu,
        "tokens_per_s": res["throughput"].tokens_per_s,
        "mfu_by_attempt": [{k: (v if k in ("job", "layout") else int(v) if k in ("attempt", "steps", "first_step",
                                                                                  "last_step") and pd.notna(v)
                                else _num(v)) for k, v in r.items()} for r in steady.to_dict("records")],
        "skipped_lines": dict(run.skipped),
        "skipped_iterations_logged": _num(m["skipped_iters"].max()) if len(m) else None,
        "nan_iterations_logged": _num(m["nan_iters"].max()) if len(m) else None,
        "regressed_steps": int(m["regressed"].sum()) if len(m) else 0,
        # the job's own TFLOP/s over ours (same formula): far from 1 means the config does not match the log
        "logged_vs_computed_tflops": _num((m["tflops_per_gpu"] / m["tflops"])[m["tflops_per_gpu"] >= 1.0].median())
        if len(m) and res["computed"] else None,
        "stragglers": res["stragglers"][res["stragglers"]["straggler"]].to_dict("records"),
        "saves": figures.save_figures(_records(run.events)),
        "live_alerts": {k.value: int((res["live"]["event"] == k).sum()) for k in LIVE_EVENTS
                        if (res["live"]["event"] == k).any()},
        # hardware faults the ranks named (ECC, Xid, NVLink, IB, ...), each excluding its node: count by reason
        "hardware_faults": _hardware_counts(run.events),
        # the last attempt ended TIMEOUT with no stop checkpoint and nothing requeued it (analysis/slice_end.py)
        "ended_unanswered_timeout": report_line(run.sacct, run.events, run.config, run.name),
        "spend": spend.of_run(run.config, _records(run.events), _allocations(run.sacct)),
    }


def _median_of(xs: list) -> Optional[float]:
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def _allocations(sacct: Optional[pd.DataFrame]) -> list:
    """Slurm's (GPUs, elapsed seconds) of each allocation (every attempt), for the spend ledger."""
    if sacct is None or sacct.empty or not {"is_alloc", "elapsed_s"} <= set(sacct):
        return []
    alloc = sacct[sacct["is_alloc"].astype(bool) & sacct["elapsed_s"].notna()]
    gpus = alloc["gpus"] if "gpus" in alloc else [None] * len(alloc)
    return [(None if g is None or g != g else float(g), float(e)) for g, e in zip(gpus, alloc["elapsed_s"])]


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status (0, or 2 for a missing input path)."""
    ap = argparse.ArgumentParser(
        prog="python analysis/report.py", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="The interruption, goodput and MFU report of one or more runs: iterations.csv, "
                    "interruptions.csv,\nsummary.json, report.md, a self-contained report.html and the plots, "
                    "written to --out.",
        epilog="examples:\n"
               "  python analysis/report.py runs/tiny --out report/\n"
               "  python analysis/report.py runs/ --out report/ --gpu h100_sxm   # every run of a sweep root\n"
               "exit codes: 0 written, 2 bad input (a missing path, an unusable --out, --window < 1, ...)\n\n"
               "documentation: docs/reports.md in the slurmtron repository")
    ap.add_argument("paths", nargs="+", help="run directories, sweep roots, log files, sacct dumps")
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--gpu", default=None, help="device for MFU when config.yaml lacks it (e.g. h100_sxm)")
    ap.add_argument("--dtype", default=None, help="dtype for the peak (bf16, fp16, fp8, tf32)")
    ap.add_argument("--num-gpus", type=int, default=None, help="world size when config.yaml lacks it")
    ap.add_argument("--window", type=int, default=20, help="rolling window (logged steps) for regressions")
    ap.add_argument("--threshold", type=float, default=0.10, help="slow-down that counts as a regression")
    args = ap.parse_args(argv)
    problem = _option_problem(args)
    if problem:
        print(f"report: {problem}", file=sys.stderr)
        return 2
    try:  # the run-directory rule of every entry point (launch/paths.py): resolved, so the report names them
        args.paths = [str(given_run_dir(p, "input path")) for p in args.paths]
    except RunDirError as exc:
        print(f"report: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    problem = _out_problem(out)
    if problem:
        print(f"report: --out {out}: {problem}", file=sys.stderr)
        return 2

    started = time.monotonic()

    def say(text: str) -> None:  # one progress line per phase: a large input takes seconds per phase
        print(f"report: [{time.monotonic() - started:5.1f} s] {text}", file=sys.stderr, flush=True)

    ignored: list = []
    say(f"reading {len(args.paths)} input(s)")
    try:
        runs = load_paths(args.paths, ignored=ignored)
    except FileNotFoundError as e:
        print(f"report: {e}", file=sys.stderr)
        return 2
    for path, why in ignored:
        print(f"report: skipped {path}: {why}", file=sys.stderr)
    empty = [r for r in runs if r.iterations is None or r.iterations.empty]
    for r in empty:
        print(f"report: no Megatron iteration lines in {r.name}: found {_found(r)}", file=sys.stderr)
    runs = [r for r in runs if r not in empty]
    if not runs:
        print("report: nothing to report: no input holds an iteration line"
              + (f" ({len(ignored)} input(s) skipped)" if ignored else ""), file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    its, intrs, layouts, summary, body = [], [], [], {"runs": {}}, []
    mfu_reasons = []
    for run in runs:
        n_events = len(run.events) if run.events is not None else 0
        say(f"analysing and plotting {run.name}: {len(run.iterations):,} iteration line(s), {n_events:,} event(s)")
        res = analyze_run(run, _shape(run, args), window=args.window, threshold=args.threshold)
        m = res["metrics"].assign(run=run.name)
        its.append(m)
        intrs.append(res["interruptions"].assign(run=run.name))
        layouts.append(res["by_layout"].assign(run=run.name))
        s = summary["runs"][run.name] = _summary(run, res)
        reason = mfu_missing_reason(run, m, args.gpu)
        if reason:
            mfu_reasons.append(reason)
        safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in run.name)
        tl = plot_timeline(m, res["interruptions"], out / f"timeline_{safe}.png", title=f"{run.name}: loss and throughput")
        val = validation_table(run)
        ls = plot_loss_by_step(m, res["interruptions"], out / f"loss_by_step_{safe}.png",
                               title=f"{run.name}: lm loss by step", validation=val)
        if len(val):
            s["validation"] = [{"iteration": int(r.iteration), "val_loss": _num(r.val_loss), "val_ppl": _num(r.val_ppl)}
                               for r in val.itertuples()]
        gp = plot_goodput(res["goodput"], out / f"goodput_{safe}.png")
        mem = memory_table(run)
        plan = run.memory_plan
        memory_fig = [(plot_memory(mem, out / f"memory_{safe}.png", plan["total_gib"] if plan else None,
                                   title=f"{run.name}: memory by step (rank 0)"),
                       "rank 0's memory at each logged step" + (
                           f"; dashed: the planner's estimate for {plan.get('layout')} ({plan.get('breakdown')})"
                           if plan and "mem_allocated" in mem else ""))] if len(mem) else []
        body += run_blocks(run.name, s, res, args, reason, [
            (ls, "lm loss against the step: each attempt in its own colour; a resumed attempt redoes the steps "
                 "after its checkpoint" + ("; black squares: validation loss" if len(val) else "")),
            (tl, "lm loss and throughput against wall-clock time; dashed lines are interruptions (colour = cause)"),
            (gp, "where the allocated time went (hours)")] + memory_fig)

    say(f"writing iterations.csv, interruptions.csv, summary.json, report.md and report.html to {out}")
    all_it = pd.concat(its, ignore_index=True) if its else pd.DataFrame()
    all_it = all_it.rename(columns={"job": "_job"})
    all_it["job_id"] = all_it["job_id"].fillna(all_it["_job"]) if "_job" in all_it else all_it.get("job_id")
    csv_safe(all_it.reindex(columns=ITERATIONS_CSV_COLUMNS)).to_csv(out / "iterations.csv", index=False)
    all_intr = pd.concat(intrs, ignore_index=True) if intrs else pd.DataFrame()
    cols = ["run"] + [c for c in all_intr.columns if c != "run"]
    csv_safe(all_intr.reindex(columns=cols)).to_csv(out / "interruptions.csv", index=False)
    lay = pd.concat(layouts, ignore_index=True) if layouts else pd.DataFrame()
    lay_median = lay.groupby("layout", as_index=False).median(numeric_only=True) if not lay.empty else lay
    mfu_reason = "; ".join(sorted(set(mfu_reasons))) if len(mfu_reasons) == len(runs) else ""
    mfu_png = plot_mfu_by_layout(lay_median, out / "mfu_by_layout.png", reason=mfu_reason)

    causes = all_intr["cause"].value_counts().to_dict() if not all_intr.empty else {}
    runs_s = summary["runs"].values()
    summary.update({
        "goodput": _num(sum(r["goodput"]["productive_s"] or 0 for r in runs_s)
                        / sum(r["goodput"]["allocated_s"] or 0 for r in runs_s))
        if sum(r["goodput"]["allocated_s"] or 0 for r in runs_s) > 0 else None,
        # one run: its figure; several: the median of the runs' figures
        "mfu": _median_of([r["mfu"] for r in runs_s]),
        "hfu": _median_of([r["hfu"] for r in runs_s]),
        "mfu_missing_reason": mfu_reason or None,
        "counts_by_cause": {str(k): int(v) for k, v in causes.items()},
        "skipped_lines": {k: sum(r["skipped_lines"].get(k, 0) for r in runs_s)
                          for k in ("iteration_lines", "sacct_lines", "event_lines")},
        "iterations": int(len(all_it)),
        "interruptions": int(len(all_intr)),
    })
    summary["skipped_inputs"] = [{"path": p, "reason": why} for p, why in ignored]
    summary["runs_without_iterations"] = {r.name: _found(r) for r in empty}
    summary["skipped_sacct_columns"] = sum(r["skipped_lines"].get("sacct_columns", 0) for r in runs_s)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")

    title = "Training run report: " + ", ".join(r.name for r in runs)
    mfu_card = throughput.pct_text(summary["mfu"])
    one = len(runs) == 1
    head = [("h", 1, title),
            ("cards", [("goodput", throughput.pct_text(summary["goodput"]), "productive / allocated"),
                       ("MFU", mfu_card, mfu_reason or ("dense peak of the configured GPU; " + (
                           throughput.LABEL if one else "the median of the runs' figures"))),
                       ("HFU", throughput.pct_text(summary["hfu"]), ""),
                       ("interruptions", str(summary["interruptions"]), counts(summary["counts_by_cause"])),
                       ("iterations logged", f"{summary['iterations']:,}",
                        f"unreadable lines skipped: {counts(summary['skipped_lines'])}")]),
            ("h", 2, "MFU per layout"),
            ("table", lay, f"per layout: the median step time over the steady steps of its attempts (the first "
                           f"{throughput.WARMUP_STEPS} logged steps of each are warm-up) and the rates at it"),
            ("img", mfu_png, "MFU and HFU per layout" if not mfu_reason else f"throughput per layout ({mfu_reason})")]
    found = ([f"input skipped: {d['path']}: {d['reason']}" for d in summary["skipped_inputs"]]
             + [f"no iteration lines in {k}: found {v}" for k, v in summary["runs_without_iterations"].items()]
             + [f"sacct columns not used by the report: {summary['skipped_sacct_columns']}"])
    blocks = head + [("ul", found)] + body
    (out / "report.md").write_text(to_markdown(blocks))
    (out / "report.html").write_text(to_html(blocks, title))
    print(f"wrote {out}/report.md, report.html, summary.json, iterations.csv, interruptions.csv")
    return 0


def validation_table(run: RunInputs) -> pd.DataFrame:
    """Validation loss per iteration (the last evaluation of an iteration a resumed run repeated)."""
    v = run.validation
    if v is None or v.empty:
        return pd.DataFrame(columns=["iteration", "val_loss", "val_ppl"])
    return v.drop_duplicates("iteration", keep="last").sort_values("iteration")[["iteration", "val_loss", "val_ppl"]]


def mfu_missing_reason(run: RunInputs, m: pd.DataFrame, gpu_flag: str | None) -> str:
    """Why MFU is empty for ``run`` ('' when it is not): the reader should not have to guess."""
    if len(m) and m["mfu"].notna().any():
        return ""
    gpu = ((run.config or {}).get("cluster") or {}).get("gpu") if run.config else None
    if gpu_flag:
        return f"no dense peak for --gpu {gpu_flag}"
    if run.config is None:
        return "no config.yaml beside the logs: pass --gpu, --dtype and --num-gpus"
    if gpu in (None, "", "cpu"):
        return f"cluster.gpu is {gpu or 'unset'}: no accelerator peak FLOP/s to compare against"
    return f"no dense peak for cluster.gpu {gpu!r}"


def memory_table(run: RunInputs) -> pd.DataFrame:
    """Rank 0's memory at each logged step, from the ``iteration`` events' ``mem_*`` fields (empty without them)."""
    ev = run.events
    cols = [c for c, _ in MEMORY_SERIES]
    if ev is None or ev.empty or "event" not in ev or not any(c in ev for c in cols):
        return pd.DataFrame(columns=["step", *cols])
    its = ev[ev["event"] == EventKind.ITERATION]
    out = its.reindex(columns=["step", *cols]).apply(pd.to_numeric, errors="coerce")
    return out.dropna(subset=["step"]).drop_duplicates("step", keep="last").sort_values("step")


def s_validation(s: dict) -> pd.DataFrame:
    return pd.DataFrame(s["validation"])


def run_blocks(name: str, s: dict, res: dict, args: argparse.Namespace, mfu_reason: str,
               figures: list) -> list[tuple]:
    """The section of one run: key numbers, interruptions, throughput per attempt, figures."""
    strag = [f"job {r['job']} attempt {_rank(r['attempt'])} rank {_rank(r['rank'])} ({num(r['ratio'])}x)"
             for r in s["stragglers"]]
    fig = throughput.RunFigures(**s["throughput"])
    mfu = (f"MFU {throughput.pct_text(s['mfu'])}, HFU {throughput.pct_text(s['hfu'])}" if s["mfu"] is not None
           else f"MFU n/a ({mfu_reason})")
    return [
        ("h", 2, f"Run {name}"),
        ("ul", ([f"ended: {s['ended_unanswered_timeout']}"] if s.get("ended_unanswered_timeout") else []) + [
                f"iterations parsed: {s['iterations']:,} (unreadable lines skipped: {counts(s['skipped_lines'])})",
                (f"layout: {s['layout']}; " if s.get("layout") else "") + f"attempts: {s['attempts']}; interruptions: {s['interruptions']} ({counts(s['counts_by_cause'])})",
                *([f"recovery: {recovery_time.summary_line(s['recovery'])} (phases per interruption below)"]
                  if s.get("recovery") else []),
                *([f"node hardware faults the ranks named, each node excluded: {counts(s['hardware_faults'])}"]
                  if s.get("hardware_faults") else []),
                f"goodput {throughput.pct_text(s['goodput']['goodput'])}",
                f"throughput: step time {throughput.step_time_text(fig.step_time_s)}, "
                f"{throughput.tokens_text(fig.tokens_per_s)}, {throughput.tflops_text(fig.tflops_per_gpu)}, {mfu} "
                f"({throughput.LABEL}; {fig.steps} step(s), from the {fig.source or 'log lines'})",
                f"spend: {s['spend']['line']}",
                f"steps with a throughput regression (rolling {args.window} steps vs the baseline, "
                f"+{args.threshold:.0%} slower): {s['regressed_steps']}",
                "straggler ranks (median step time > 1.1x the ranks' median): " + (", ".join(strag) or "none")]
         + _save_lines(s.get("saves") or {})),
        ("h", 3, "Interruptions"),
        ("table", res["interruptions"], "one row per attempt that ended before the run finished"),
        ("h", 3, "Live alerts"),
        ("table", res["live"], "hangs, NaNs, stragglers, throughput regressions and node hardware faults (an "
                               "exclude event) the job's live checks recorded"),
    ] + ([("h", 3, "Validation loss"), ("table", s_validation(s), "lm loss on the validation split")]
         if s.get("validation") else []) + [
        ("h", 3, "Throughput per attempt"),
        ("table", res["by_attempt"], "per attempt: the median step time over its steady steps and the rates at it"),
    ] + [("img", path, caption) for path, caption in figures]


def _save_lines(f: dict) -> list:
    """The checkpoint bullet (the three numbers of a save, failed and abandoned saves, replay checks), when the run
    recorded any (event logs from before these figures have none)."""
    if not (f.get("saves") or f.get("failed") or f.get("abandoned") or f.get("replay_matches")
            or f.get("replay_mismatches")):
        return []
    dip = "n/a" if f.get("step_time_dip") is None else f"{f['step_time_dip'] * 100:+.1f}%"
    return [f"checkpoints: {f['saves']} committed (median training blocked {num(f['blocked_s'])} s, durable "
            f"{num(f['durable_s'])} s, step-time dip while writing {dip}); failed saves: {f['failed']}"
            + (f" ({counts(f['failed_by_cause'])})" if f["failed"] else "")
            + f"; abandoned writes: {f['abandoned']}; replay checks: {f['replay_matches']} matched, "
            f"{f['replay_mismatches']} mismatched"]


def _option_problem(args: argparse.Namespace) -> str | None:
    """The first option out of its range, as one line (field, value, fix), or None."""
    if args.window < 1:
        return (f"--window {args.window}: the rolling window is a number of logged steps, at least 1; "
                "fix: --window 20 (the default)")
    if not math.isfinite(args.threshold) or args.threshold <= 0:
        return (f"--threshold {args.threshold}: the slow-down that counts as a regression must be a finite "
                "fraction > 0; fix: --threshold 0.10 (10%, the default)")
    if args.num_gpus is not None and args.num_gpus < 1:
        return f"--num-gpus {args.num_gpus}: the world size is at least 1; fix: --num-gpus N with N the GPUs of the run"
    return None


def _out_problem(out: Path) -> str | None:
    """Why the report cannot be written to ``out`` (one line), or None."""
    if out.exists() and not out.is_dir():
        return "is a file, not a directory; give a directory (it is created if missing)"
    return unwritable_ancestor(out)


def _found(run) -> str:
    """What a run's inputs held, in words (for a run without iteration lines)."""
    ev = 0 if run.events is None else len(run.events)
    sa = 0 if run.sacct is None else len(run.sacct)
    sk = run.skipped or {}
    return (f"{sk.get('iteration_lines', 0)} unreadable log line(s), {ev} event(s), {sa} sacct row(s), "
            f"{0 if run.checkpoints is None else len(run.checkpoints)} checkpoint line(s)")




if __name__ == "__main__":
    raise SystemExit(main())
