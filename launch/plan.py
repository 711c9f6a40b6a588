"""``python launch/plan.py <the same overrides as pretrain.py>``: does it fit, how fast, what it costs.

Prints the planner's estimate for the composed layout as a table, or one JSON object with
``plan.format=json``, followed by whatever the job check (``launch.check.check``, which includes
the planner's memory, budget and lead-time guards) has against the job. With
``parallelism=auto`` it ranks every valid layout first and reports the winner. Runs on a login node: no torch, no megatron, well under a second.

``main(cfg)`` is thin so tests call it with a composed config; ``@hydra.main`` wraps it only
when run as a script.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable, Union

if __package__ in (None, ""):  # python launch/plan.py: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from omegaconf import DictConfig  # noqa: E402

from launch.check import check, run_dir_problems  # noqa: E402
from launch.config import Job  # noqa: E402
from launch.planner import estimate, memory_warnings  # noqa: E402
from launch.planner.estimate import Estimate  # noqa: E402
from launch.planner.advice import fit_advice, layout_advice  # noqa: E402
from launch.planner.layouts import NoLayoutFits, choose_layout  # noqa: E402
from launch.cli import EXIT_REFUSED, job_or_refusal, usage  # noqa: E402


_VERDICT = {"fits": "fits", "inside the error band": "MAY NOT FIT (inside the planner's error band)",
            "does not fit": "DOES NOT FIT"}


def format_estimate(job: Job, est: Estimate) -> str:
    """The estimate as a short human table: memory by term, step time by cause, run cost."""
    c = job.cluster
    mem = est.breakdown["memory"]
    lines = [
        f"layout {est.layout} on {est.world_size} GPUs ({c.nodes} x {c.gpus_per_node} {c.gpu}), dp {job.dp}, "
        f"gbs {job.training.global_batch_size}, mbs {job.training.micro_batch_size}",
        f"memory per GPU, worst stage {mem['stage']} ({mem['layers']:g} layers), GiB: weights {mem['weights']:.1f}"
        f" + grads {mem['grads']:.1f} + optimizer {mem['optimizer']:.1f} + activations {mem['activations']:.1f}"
        f" ({mem['activations_per_microbatch']:.2f}/microbatch x {mem['inflight_microbatches']:g} in flight)"
        f" + embedding/logits {mem['embedding_logits']:.1f} + workspace {mem['workspace']:.1f}"
        f" = {est.memory_gb_per_gpu:.1f} of {c.gpu_memory_gb:g}: {_VERDICT[est.memory_verdict]}",
    ]
    terms = mem.get("workspace_terms") or {}
    if terms:
        lines.append("workspace, GiB: " + ", ".join(f"{k} {v:.2f}" for k, v in terms.items()))
    st = est.breakdown.get("step_time")
    if st:
        lines.append(
            f"step time {est.step_time_s:.3f} s ({st['microbatches']} microbatches): compute {st['compute_s']:.3f}"
            f" + tp {st['tp_comm_s']:.3f} + bubble {st['pp_bubble_s']:.3f} + pp sends {st['pp_p2p_s']:.3f}"
            f" + cp {st['cp_comm_s']:.3f} + ep {st['ep_comm_s']:.3f} + dp exposed {st['dp_comm_s']:.3f}"
            f" + stragglers {st['straggler_s']:.3f} + optimizer {st['optimizer_s']:.3f}"
            f" + host overhead {st['overhead_s']:.3f}")
        lines.append(f"throughput {est.tflops_per_gpu:.0f} TFLOP/s per GPU, MFU {100 * est.mfu:.1f}%"
                     f" (HFU {100 * est.hfu:.1f}%)")
    if est.gpu_hours_total is not None:
        lines.append(
            f"run: {est.train_iters:,} iterations -> {est.wall_time_h_total:,.1f} h wall "
            f"({est.wall_time_h_total / 24:,.1f} days), {est.gpu_hours_total:,.0f} GPU-hours")
    interval = f", every {est.checkpoint_interval} steps" if est.checkpoint_interval else ""
    lines.append(f"checkpoint {est.checkpoint_gb:,.1f} GB, save {est.save_time_s:.3g} s at "
                 f"{c.fs_write_bandwidth_gbs:g} GB/s{interval}")
    why = (est.breakdown or {}).get("checkpoint_interval") or ""
    if est.checkpoint_interval and why.startswith("auto"):
        lines.append(f"checkpoint interval {why}")
    if est.note:
        lines.append(f"note: {est.note}")
    return "\n".join(lines)


def plan(job: Job) -> tuple[str, int]:
    """(text to print, exit status) for ``job``.

    Status 0: the job check has nothing against it (a layout over the GPU's memory but inside the
    planner's error band is a warning, not a refusal); 1: an estimate was made but the check
    refuses the job (memory, budget, lead time, mesh ...) or no layout fits; 2:
    the job is too broken to estimate (the problems are printed instead).
    """
    as_json = job.plan.format == "json"
    table = ""
    if job.parallelism.name == "auto":
        try:
            job, table = choose_layout(job)
        except NoLayoutFits as exc:
            advice = fit_advice(job)
            if as_json:
                return json.dumps({"fits": False, "error": "no valid layout fits", "table": str(exc),
                                   "advice": advice}), 1
            return f"{exc}\n{advice}", 1
    problems = check(job)
    try:
        est = estimate(job)
    except (ArithmeticError, ValueError, KeyError) as exc:
        if not problems:
            raise
        lines = [str(p) for p in problems]
        if as_json:
            return json.dumps({"fits": False, "error": f"cannot estimate: {exc}", "problems": lines}), 2
        return "\n".join([f"cannot estimate ({exc}); the job check says:"] + lines), 2
    status = 0 if (est.memory_verdict != "does not fit" and not problems) else 1
    warnings = memory_warnings(job)
    if as_json:
        out = est.to_dict()
        out["problems"] = [str(p) for p in problems]
        out["warnings"] = warnings
        if table:
            out["ranked_table"] = table
        return json.dumps(out, sort_keys=True, default=float), status
    text = ([table, "", f"chosen: parallelism.name={job.parallelism.name}", ""] if table else [])
    if problems:  # lead with the refusal; the numbers only explain it, they are not a plan
        text.append(f"refused: pretrain.py would refuse this job ({len(problems)} problem(s)); this is not a plan")
        text.extend(f"problem: {p}" for p in problems)
        if any(p.field == "parallelism" and "memory" in p.message for p in problems):
            text.append(layout_advice(job))  # which of the rule's fixes helps, from the planner's own arithmetic
        text.extend(["", "what the refused layout would give (for reference only, not a plan):"])
        text.extend(f"  {line}" for line in format_estimate(job, est).splitlines())
    else:
        text.append(format_estimate(job, est))
        text.extend(f"warning: {w.removeprefix('WARNING: ')}" for w in warnings)
    return "\n".join(text), status


USAGE = usage(
    "Estimate a job without submitting it: memory per GPU by term, step time by cause, MFU, checkpoint size and\n"
    "save time, the run's GPU-hours; then whatever pretrain.py would refuse. parallelism=auto ranks every valid\n"
    "layout and names the winner (and, when none fits, the node count on which one would).",
    "python launch/plan.py [key=value ...]   (the same overrides as launch/pretrain.py)",
    "planning.md",
    "examples:\n"
    "  python launch/plan.py cluster=lustre model=70b\n"
    "  python launch/plan.py cluster=lustre model=405b parallelism=auto cluster.nodes=128 plan.top=5\n"
    "options: plan.format=table|json, plan.top=N (rows of the parallelism=auto table, N >= 1)\n"
    "exit codes: 0 fits and would be accepted, 1 does not fit or would be refused, 2 bad input")


def run_dir_refusal(job: Job) -> str:
    """The run-directory rule of every entry point (launch/paths.py) as one line, '' when the names pass."""
    where = run_dir_problems(job)
    return f"refused: {where[0].arithmetic}; fix: {where[0].fix}" if where else ""


def option_problem(job: Job) -> str:
    """One line for a bad option of plan.py itself (``plan.top``), '' when there is none."""
    if job.plan.top < 1:
        return (f"refused: plan.top={job.plan.top}: the ranked table needs at least one row; "
                f"fix: plan.top=10 (or any N >= 1)")
    return ""


def main(cfg: Union[DictConfig, Job], out: Callable[[str], None] = print,
         err: Callable[[str], None] = lambda line: print(line, file=sys.stderr)) -> int:
    """Entry point: compose -> plan -> print. Returns the exit status (see :func:`plan`)."""
    if isinstance(cfg, Job):
        job, refusal = cfg, ""
    else:
        job, refusal = job_or_refusal(cfg, done="nothing was planned")
    refusal = refusal or option_problem(job) or run_dir_refusal(job)
    if refusal:
        err(refusal)
        return EXIT_REFUSED
    text, status = plan(job)
    out(text)
    return status


if __name__ == "__main__":
    from launch.entry import hydra_entry

    sys.exit(hydra_entry(lambda cfg, _sweep_id: main(cfg), usage=USAGE))
