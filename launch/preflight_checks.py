"""Preflight verdicts: thresholds, the table, ``<run_dir>/preflight.json`` and the submit gate.

The preflight job (:mod:`train.preflight_worker`, started by ``launch/preflight.py``) measures
numbers on the target layout; this module turns them into verdicts. It is pure and imports
neither torch nor megatron, because the login node reads the result back
(:func:`preflight_problems`) before a real submission.

Why these checks (each catches a bug that otherwise costs days of GPU time silently):

* ``grad_flow``: a parameter whose gradient is exactly zero after a step is not being
  trained (a detached module, a frozen layer, a wrong ``requires_grad``); the loss still
  falls, so nothing looks wrong for weeks.
* ``loss_parity`` / ``grad_norm_parity``: the target layout against a single-process
  reference (tp=pp=1, same seed, layout-independent init, the same global batches). A wrong
  TP split or a missing all-reduce changes the numbers, not the shapes, so it never crashes.
* ``checkpoint_roundtrip`` / ``checkpoint_reshard``: save under the target layout, load it
  back (same layout) and under a single-process layout; compare hashes of the full
  (gathered) parameters. A checkpoint that does not restore bit-for-bit is found now, not at
  the first failure three weeks in.
* ``allreduce_bandwidth``: the achieved bus bandwidth (nccl-tests' ``busbw``) against the
  cluster's rated per-GPU bandwidth; a mis-set NCCL_IB_HCA or a node on the wrong fabric runs,
  only slower. On CPU (gloo) the rated number is a GPU fabric's, so it is informational.
* ``data_wait_fraction``: time spent fetching batches over step time; a starving data
  pipeline lowers MFU without any error.

A verdict is ``PASS``, ``WARN`` (reported, does not block) or ``FAIL`` (blocks the real
submission unless ``force=true``).
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

from launch.paths import RunPaths
from launch.paths import PREFLIGHT_REPORT as PREFLIGHT_FILE
from launch.problems import Problem

PASS, WARN, FAIL = "PASS", "WARN", "FAIL"
SCHEMA_VERSION = 1

# Relative tolerance of the parity checks, by training.precision. fp32 on one device vs a TP
# split differs only by summation order (about 1e-7 relative); half precision rounds the
# partial sums of a TP all-reduce differently, so its tolerance is wider.
PARITY_RTOL = {"fp32": 1e-5, "bf16": 2e-2, "fp16": 1e-2, "fp8": 5e-2}
# Fraction of the rated bandwidth: at least BW_PASS passes, below BW_FAIL fails.
BW_PASS, BW_FAIL = 0.5, 0.25
# Data-loader wait over step time: at most WAIT_PASS passes, above WAIT_FAIL fails.
WAIT_PASS, WAIT_FAIL = 0.05, 0.20

BREAKAGES = ("detach", "tp_split")  # test-only switches (preflight.break=...), see launch/preflight.py


@dataclass
class Verdict:
    """One row of the verdict table."""

    check: str
    value: Any  # the measured number (or a count); None when it could not be measured
    threshold: str  # what the value is compared with, in words
    verdict: str  # PASS | WARN | FAIL
    detail: str = ""  # why, with names (the first few offending parameters, the ranks' codes ...)


@dataclass
class Report:
    """What ``<run_dir>/preflight.json`` holds."""

    checks: list[Verdict]
    layout: dict = field(default_factory=dict)
    world_size: int = 0
    backend: str = ""
    time: float = 0.0
    version: int = SCHEMA_VERSION

    @property
    def verdict(self) -> str:
        """The worst verdict of all rows (an empty report fails: nothing was shown to work)."""
        verdicts = {c.verdict for c in self.checks}
        if not self.checks or FAIL in verdicts:
            return FAIL
        return WARN if WARN in verdicts else PASS


# ---- the checks, each a pure function of measured numbers --------------------------------

def judge_grad_flow(zero_grad: Sequence[str], total: int) -> Verdict:
    """FAIL if any trainable parameter got an all-zero gradient (names the first few)."""
    n = len(zero_grad)
    detail = "every trainable parameter has a non-zero gradient" if n == 0 else (
        "no gradient reaches: " + ", ".join(list(zero_grad)[:6]) + (f" (+{n - 6} more)" if n > 6 else ""))
    if total == 0:
        return Verdict("grad_flow", 0, "0 params with zero grad", FAIL, "no trainable parameters found")
    return Verdict("grad_flow", f"{n}/{total} zero", "0 params with zero grad", PASS if n == 0 else FAIL, detail)


def rel_diff(a: float, b: float) -> float:
    """|a - b| / max(|b|, 1e-12); inf when either is not finite."""
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max(abs(b), 1e-12)


def judge_parity(name: str, target: Sequence[float], reference: Optional[Sequence[float]], precision: str,
                 reference_error: str = "") -> Verdict:
    """Largest relative difference over the preflight steps against the single-process reference."""
    rtol = PARITY_RTOL.get(precision, PARITY_RTOL["bf16"])
    threshold = f"rel diff <= {rtol:g} ({precision})"
    if reference is None:
        return Verdict(name, None, threshold, FAIL, f"no reference numbers: {reference_error or 'reference missing'}")
    if len(reference) != len(target) or not target:
        return Verdict(name, None, threshold, FAIL,
                       f"{len(target)} target steps vs {len(reference)} reference steps")
    diffs = [rel_diff(a, b) for a, b in zip(target, reference)]
    worst = max(range(len(diffs)), key=lambda i: diffs[i])
    detail = (f"worst at step {worst + 1}: target {target[worst]!r} vs reference {reference[worst]!r}; "
              f"per step {', '.join(f'{d:.2e}' for d in diffs)}")
    return Verdict(name, float(f"{diffs[worst]:.3e}"), threshold, PASS if diffs[worst] <= rtol else FAIL, detail)


def compare_hashes(name: str, expected: Mapping[str, str], got: Optional[Mapping[str, str]], what: str,
                   error: str = "") -> Verdict:
    """FAIL on any parameter whose full-tensor hash differs or that is missing on one side."""
    threshold = "0 mismatched params"
    if got is None:
        return Verdict(name, None, threshold, FAIL, f"no hashes from {what}: {error or 'missing'}")
    if not expected:
        return Verdict(name, None, threshold, FAIL, "no parameter hashes from the target layout")
    differ = sorted(k for k in expected if k in got and got[k] != expected[k])
    missing = sorted(set(expected) ^ set(got))
    bad = differ + missing
    if not bad:
        return Verdict(name, f"0/{len(expected)}", threshold, PASS,
                       f"{len(expected)} full parameters bit-identical after {what}")
    detail = ""
    if differ:
        detail += f"differ after {what}: " + ", ".join(differ[:5]) + (" ..." if len(differ) > 5 else "")
    if missing:
        detail += ("; " if detail else "") + "present on one side only: " + ", ".join(missing[:5])
    return Verdict(name, f"{len(bad)}/{len(expected)}", threshold, FAIL, detail)


def rated_bandwidth(nodes: int, nvlink_gbs: float, ib_gbs: float) -> tuple[float, str]:
    """The per-GPU bandwidth an all-reduce over this job is bounded by: IB across nodes, else NVLink."""
    if nodes > 1:
        return float(ib_gbs), "cluster.ib_bandwidth_gbs"
    return float(nvlink_gbs), "cluster.nvlink_bandwidth_gbs"


def judge_bandwidth(busbw_gbs: Optional[float], rated_gbs: float, rated_field: str, *, gpu: bool,
                    world_size: int, nbytes: int = 0) -> Verdict:
    """Achieved bus bandwidth vs the rated one; informational (WARN at most) without a GPU."""
    threshold = f">= {BW_PASS:g} x {rated_gbs:g} GB/s ({rated_field})"
    if world_size < 2 or busbw_gbs is None:
        return Verdict("allreduce_bandwidth", None, threshold, WARN, "one rank: no all-reduce to measure")
    frac = busbw_gbs / rated_gbs if rated_gbs > 0 else math.inf
    size = f"{nbytes / 2**20:.0f} MiB all-reduce over {world_size} ranks" if nbytes else f"{world_size} ranks"
    detail = f"busbw {busbw_gbs:.3g} GB/s = {frac:.1%} of rated; {size}"
    value = float(f"{busbw_gbs:.4g}")
    if not gpu:
        return Verdict("allreduce_bandwidth", value, threshold, WARN,
                       detail + "; informational on CPU (gloo): the rated number is a GPU fabric's")
    if frac >= BW_PASS:
        verdict = PASS
    elif frac >= BW_FAIL:
        verdict = WARN
    else:
        verdict = FAIL
    return Verdict("allreduce_bandwidth", value, threshold, verdict, detail)


def judge_data_wait(wait_s: float, step_s: float) -> Verdict:
    """Time waiting for batches over step time (the slowest rank's)."""
    threshold = f"<= {WAIT_PASS:g} (FAIL > {WAIT_FAIL:g})"
    if step_s <= 0:
        return Verdict("data_wait_fraction", None, threshold, FAIL, "no step time measured")
    frac = wait_s / step_s
    verdict = PASS if frac <= WAIT_PASS else (WARN if frac <= WAIT_FAIL else FAIL)
    return Verdict("data_wait_fraction", float(f"{frac:.3g}"), threshold, verdict,
                   f"{wait_s * 1000:.1f} ms waiting in {step_s * 1000:.1f} ms of steps")


def run_failed(detail: str) -> Verdict:
    """The row written when the preflight job itself did not finish (a crash, a timeout)."""
    return Verdict("preflight_job", None, "all ranks finish", FAIL, detail)


# ---- table and file ----------------------------------------------------------------------

def format_table(report: Report) -> str:
    """The verdict table printed by the preflight (check, value, threshold, verdict, detail)."""
    rows = [("check", "value", "threshold", "verdict")]
    rows += [(c.check, "-" if c.value is None else str(c.value), c.threshold, c.verdict) for c in report.checks]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append(f"preflight verdict: {report.verdict}")
    details = [f"  {c.check}: {c.detail}" for c in report.checks if c.detail]
    return "\n".join(lines + (["details:"] + details if details else []))


def write_report(run_dir: str | Path, report: Report, write_json: Callable[[Path, Any], None],
                 clock: Callable[[], float] = time.time) -> Path:
    """Write ``<run_dir>/preflight.json`` with ``write_json`` (:func:`recovery.storage.atomic_write_json`: a
    half-written file would read as no preflight). Returns its path."""
    path = RunPaths.of(run_dir).preflight_report
    doc = asdict(report)
    doc["time"] = report.time or clock()
    doc["verdict"] = report.verdict
    write_json(path, doc)
    return path


def read_report(run_dir: str | Path) -> Optional[Report]:
    """The report in ``<run_dir>/preflight.json``; None if there is none. Raises ValueError if unreadable."""
    path = RunPaths.of(run_dir).preflight_report
    if not path.exists():
        return None
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        checks = [Verdict(**c) for c in doc["checks"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path} cannot be read: {exc}") from exc
    return Report(checks=checks, layout=doc.get("layout") or {}, world_size=int(doc.get("world_size") or 0),
                  backend=str(doc.get("backend") or ""), time=float(doc.get("time") or 0.0),
                  version=int(doc.get("version") or SCHEMA_VERSION))


def preflight_problems(run_dir: str | Path) -> list[Problem]:
    """The submit gate: one Problem per failed check in ``<run_dir>/preflight.json``.

    No file means no preflight was run: nothing to refuse (the preflight is recommended, not
    required). An unreadable file refuses, since it may be a failed preflight. The caller
    skips this gate when ``force=true``.
    """
    try:
        report = read_report(run_dir)
    except ValueError as exc:
        return [Problem("preflight", "the preflight result cannot be read", str(exc),
                        "rerun python launch/preflight.py <the same overrides>, or submit with force=true")]
    if report is None or report.verdict != FAIL:
        return []
    failed = [c for c in report.checks if c.verdict == FAIL] or [run_failed("empty preflight report")]
    return [Problem(
        "preflight", f"preflight check {c.check} failed: {c.detail}"[:600],
        f"{c.check} = {c.value} vs {c.threshold}",
        "fix the cause and rerun python launch/preflight.py <the same overrides>, or submit anyway with force=true",
    ) for c in failed]


def failing(checks: Iterable[Verdict]) -> list[str]:
    """Names of the failed checks (for tests and messages)."""
    return [c.check for c in checks if c.verdict == FAIL]
