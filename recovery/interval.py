"""How often to save: the checkpoint interval from the save cost and the failure rate.

Saving too often wastes the save time; saving too rarely wastes the recomputation after a
failure. With save cost ``C`` (seconds a save stalls training) and mean time between
failures ``M`` of the *whole job*:

* Young's first-order optimum (J. W. Young, "A first order approximation to the optimum
  checkpoint interval", Communications of the ACM 17(9):530-531, 1974):
  ``tau = sqrt(2 C M)``.
* Daly's higher-order optimum (J. T. Daly, "A higher order estimate of the optimum
  checkpoint interval for restart dumps", Future Generation Computer Systems
  22(3):303-312, 2006), which stays accurate when ``C`` is not small against ``M``:
  ``tau = sqrt(2 C M) * (1 + sqrt(C/(2M))/3 + (C/(2M))/9) - C`` for ``C < 2M``, else ``M``.

``tau`` is compute time between the end of one save and the start of the next. The job's
MTBF falls with its size: with independent node failures, ``M_job = M_node / nodes`` (Llama
3 405B on 16k GPUs saw an interruption about every 3 hours). The worker uses
``training.checkpoint_interval=auto`` to call :func:`resolve_interval` after measuring a
step and a save, and logs the reasoning string as a ``checkpoint_interval`` event.

No torch: the planner uses this on the login node.
"""
from __future__ import annotations

import math
from typing import Any, Optional


def job_mtbf_s(node_mtbf_hours: float, nodes: int) -> float:
    """Job-level MTBF in seconds: any one of ``nodes`` independent nodes failing stops the job."""
    if node_mtbf_hours <= 0:
        raise ValueError(f"cluster.node_mtbf_hours must be > 0, got {node_mtbf_hours}")
    if nodes < 1:
        raise ValueError(f"cluster.nodes must be >= 1, got {nodes}")
    return node_mtbf_hours * 3600.0 / nodes


def young_interval_s(save_s: float, mtbf_s: float) -> float:
    """Young (1974): ``sqrt(2 C M)``."""
    _check(save_s, mtbf_s)
    return math.sqrt(2.0 * save_s * mtbf_s)


def daly_interval_s(save_s: float, mtbf_s: float) -> float:
    """Daly (2006) higher-order optimum; equals ``M`` once ``C >= 2M`` (saving is hopeless)."""
    _check(save_s, mtbf_s)
    c, m = save_s, mtbf_s
    if c >= 2.0 * m:
        return m
    x = c / (2.0 * m)
    return math.sqrt(2.0 * c * m) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - c


def expected_waste(interval_s: float, save_s: float, mtbf_s: float) -> float:
    """First-order fraction of time lost: saving (C/tau) plus half an interval redone per failure."""
    return save_s / interval_s + (interval_s + save_s) / (2.0 * mtbf_s)


def interval_steps(save_s: float, step_s: float, mtbf_s: float,
                   write_s: Optional[float] = None) -> tuple[int, str]:
    """Daly's optimum in whole steps (>= 1), and the arithmetic as a sentence for the log.

    ``save_s`` is what one save stalls training (the overhead term C). With asynchronous saves
    the checkpoint becomes durable ``write_s`` (W >= C) after it starts: a failure in that window
    falls back to the previous one, so W replaces C in the exposure term of the expected waste
    (C/tau + (tau+W)/2M); the interval itself is Daly's with the overhead C.
    """
    if step_s <= 0:
        raise ValueError(f"step time must be > 0 s, got {step_s}")
    young = young_interval_s(save_s, mtbf_s)
    daly = daly_interval_s(save_s, mtbf_s)
    steps = max(1, int(round(daly / step_s)))
    floor_txt = ""
    if write_s is not None:
        least = min_async_steps(write_s, step_s)
        if steps < least:
            floor_txt = (f"; raised from {steps} to {least} step(s): an async save is durable W={write_s:.3g} s "
                         f"after it starts and the next may not start before, ceil(W / step {step_s:.3g} s) = {least}")
            steps = least
    tau = steps * step_s
    if write_s is None:
        waste = expected_waste(tau, save_s, mtbf_s)
        cost = f"save C={save_s:.3g} s"
        waste_txt = f"expected waste C/tau+(tau+C)/2M = {100 * waste:.2f}%"
    else:
        waste = save_s / tau + (tau + write_s) / (2.0 * mtbf_s)
        cost = f"async save: blocking C={save_s:.3g} s, durable after W={write_s:.3g} s"
        waste_txt = f"expected waste C/tau+(tau+W)/2M = {100 * waste:.2f}%"
    reasoning = (
        f"{cost}, step {step_s:.3g} s, job MTBF M={mtbf_s:.4g} s ({mtbf_s / 3600:.3g} h): "
        f"Young sqrt(2CM)={young:.4g} s, Daly sqrt(2CM)(1+sqrt(C/2M)/3+C/18M)-C={daly:.4g} s "
        f"= {daly / step_s:.4g} steps{floor_txt} -> every {steps} step(s) ({tau:.4g} s); {waste_txt}"
    )
    return steps, reasoning


def min_async_steps(write_s: float, step_s: float) -> int:
    """The fewest steps between two asynchronous saves: the next save cannot start before the previous one is
    durable (``write_s`` after it started), so the interval is at least ``ceil(write_s / step_s)`` steps."""
    if step_s <= 0:
        raise ValueError(f"step time must be > 0 s, got {step_s}")
    return max(1, math.ceil(write_s / step_s - 1e-9))


def two_tier_steps(local_save_s: float, global_save_s: float, step_s: float, mtbf_s: float,
                   local_share: float) -> tuple[int, Optional[int], str]:
    """Both intervals of a two-tier run (node-local sets every L steps, global checkpoints every G), in whole steps,
    and the arithmetic as a sentence.

    Multilevel checkpointing to first order (Vaidya 1994; Moody et al., "Design, modeling, and evaluation of a
    scalable multi-level checkpointing system", SC 2010): a share ``p`` of the failures can resume from the newest
    local set (the same nodes, or a lost node's replica on a node still in the job), the rest only from the newest
    global checkpoint. Each tier pays its own saves and its own share of the failures, so each gets Young's optimum
    against its own failure rate: ``L = sqrt(2 C_l M / p)`` and ``G = sqrt(2 C_g M / (1 - p))``, G rounded to a
    multiple of L (>= L). ``L`` = 0 (the tier does not pay) when no failure can use a local set (``p = 0``) or when
    ``L`` would not be shorter than the global tier's own Daly interval (a local save no cheaper than a global one); with
    ``p = 1`` no failure needs the global tier and ``G`` is None (the failure rate does not bound it: the
    stop, final and time-limit saves still write global checkpoints).
    """
    if step_s <= 0:
        raise ValueError(f"step time must be > 0 s, got {step_s}")
    if not 0.0 <= local_share <= 1.0:
        raise ValueError(f"the share of failures a local set recovers must be in [0, 1], got {local_share}")
    _check(max(local_save_s, 1e-9), mtbf_s)
    _check(max(global_save_s, 1e-9), mtbf_s)
    p = local_share
    if p <= 0.0:
        steps, why = interval_steps(max(global_save_s, 1e-6), step_s, mtbf_s)
        return 0, steps, f"no failure can use a local set (p = 0): local tier off; global {why}"
    local_s = math.sqrt(2.0 * max(local_save_s, 1e-6) * mtbf_s / p)
    local = max(1, int(round(local_s / step_s)))
    alone, alone_why = interval_steps(max(global_save_s, 1e-6), step_s, mtbf_s)
    if local >= alone:
        return 0, alone, (f"local save C_l={local_save_s:.3g} s is no cheaper than what it replaces: local "
                          f"sqrt(2 C_l M / p)={local_s:.4g} s = {local} step(s) >= the global tier's own interval "
                          f"({alone} step(s)), so the local tier does not pay; global {alone_why}")
    head = (f"p = {p:.2f} of failures resume from a local set; local save C_l={local_save_s:.3g} s, global save "
            f"C_g={global_save_s:.3g} s, step {step_s:.3g} s, job MTBF M={mtbf_s:.4g} s: "
            f"local sqrt(2 C_l M / p)={local_s:.4g} s -> every {local} step(s)")
    if p >= 1.0:
        return local, None, head + "; global: no failure needs it (p = 1), so the failure rate does not bound it"
    global_s = math.sqrt(2.0 * max(global_save_s, 1e-6) * mtbf_s / (1.0 - p))
    glob = max(1, int(round(global_s / step_s / local))) * local
    waste = (local_save_s / (local * step_s) + global_save_s / (glob * step_s)
             + p * local * step_s / (2.0 * mtbf_s) + (1.0 - p) * glob * step_s / (2.0 * mtbf_s))
    return local, glob, (head + f"; global sqrt(2 C_g M / (1 - p))={global_s:.4g} s -> every {glob} step(s) "
                         f"(a multiple of {local}); expected waste C_l/L + C_g/G + pL/2M + (1-p)G/2M = "
                         f"{100 * waste:.2f}%")


def parse_interval(value: Any) -> Optional[int]:
    """``training.checkpoint_interval`` read once: the step count, or None for 'auto' (resolved after a save)."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return None
    try:
        steps = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"training.checkpoint_interval must be a positive int or 'auto', got {value!r}") from None
    if steps < 1:
        raise ValueError(f"training.checkpoint_interval must be >= 1 or 'auto', got {steps}")
    return steps


def resolve_interval(
    value: Any,
    *,
    save_s: float,
    step_s: float,
    node_mtbf_hours: float,
    nodes: int,
    write_s: Optional[float] = None,
) -> tuple[int, str]:
    """``training.checkpoint_interval`` -> (steps, reasoning): an int is used as given, 'auto' is Daly's
    (``save_s``: the blocking time of a save; ``write_s``: until it is durable, async saves only)."""
    steps = parse_interval(value)
    if steps is None:
        mtbf = job_mtbf_s(node_mtbf_hours, nodes)
        steps, why = interval_steps(max(save_s, 1e-6), step_s, mtbf, write_s)
        return steps, f"auto: node MTBF {node_mtbf_hours:g} h / {nodes} node(s); {why}"
    return steps, f"configured: every {steps} step(s)"


def _check(save_s: float, mtbf_s: float) -> None:
    if save_s <= 0:
        raise ValueError(f"save time must be > 0 s, got {save_s}")
    if mtbf_s <= 0:
        raise ValueError(f"MTBF must be > 0 s, got {mtbf_s}")
