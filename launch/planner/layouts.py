"""``parallelism=auto``: enumerate every valid layout, estimate each, rank by MFU among those that fit.

Why enumerate instead of search: the space is small once the mesh arithmetic prunes it (the
405B model on 16,384 GPUs has a few thousand candidates), every estimate is closed-form, and an
exhaustive table can say *why* each runner-up lost, which a search cannot.

Validity is the job check's own mesh arithmetic (``launch.check``: mesh, model split, batch
and feature rules), run on each candidate, so ``auto`` can never pick a layout that
``check(job)`` would refuse; there is no second rule set here.

Login-node code: no torch, no megatron.
"""
from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from typing import Iterator, Optional

from analysis.flops import UnknownDevice, flops_breakdown, peak_flops
from launch.config import Job, ParallelismConfig
from launch.layout_rules import layout_problems
from launch.planner.estimate import layout_name
from launch.planner.memory import StageMemory, worst_stage
from launch.planner.shapes import Shape, shape_of
from launch.planner.steptime import StepTime, achievable_rate, precision_dtype, step_time

RECOMPUTES = ("full", "selective", "none")  # most memory-saving first: if one does not fit, the rest do not
_LESS = {"selective": "full", "none": "selective", "full": None}  # the next more memory-saving recompute
VARIANTS = tuple((dopt, rc) for dopt in (True, False) for rc in RECOMPUTES)  # per mesh, in that order
MFU_DIGITS = 9  # MFUs equal to this many decimals tie (float noise): the one with less memory per GPU ranks first
MAX_VPP = 16  # more chunks per stage only multiplies point-to-point sends; Megatron recipes stay below


@dataclass(frozen=True)
class Row:
    """One candidate layout and its estimate."""

    par: ParallelismConfig
    memory: Optional[StageMemory]  # None: not computed, a less memory-hungry variant already did not fit
    fits: bool
    step: Optional[StepTime]
    mfu: Optional[float]

    @property
    def name(self) -> str:
        return layout_name(self.par)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _powers_of_two(limit: int) -> list[int]:
    out, x = [], 1
    while x <= limit:
        out.append(x)
        x *= 2
    return out


def meshes(job: Job) -> Iterator[ParallelismConfig]:
    """Every mesh (tp, pp, vpp, cp, ep, sp) worth checking; :data:`VARIANTS` then multiplies each
    by recompute and the distributed optimizer, which the mesh rules do not depend on.

    Ranges: tp up to the NVLink domain (beyond it only if the user allowed it); pp and vpp whose
    chunks split the layers evenly, counting the embedding and the loss as layers only where
    that is what makes the split even (so no two candidates differ only in that); cp a power
    of two; ep dividing the experts. Everything else the mesh rules of the job check decide.
    """
    m, c, base = job.model, job.cluster, job.parallelism
    world = job.world_size
    tp_max = world if base.allow_tp_across_nodes else c.gpus_per_node
    eps = _divisors(m.num_experts) if m.num_experts else [1]
    cps = _powers_of_two(max(1, m.seq_length // 2))
    layers = m.num_layers
    for tp in _powers_of_two(min(tp_max, m.num_attention_heads)):
        for pp in sorted(set(_divisors(layers)) | set(_divisors(layers + 2))):
            if world % (tp * pp):
                continue
            for vpp in [None] + (list(range(2, MAX_VPP + 1)) if pp > 1 else []):
                chunks = pp * (vpp or 1)
                if layers % chunks == 0:
                    split = False
                elif pp > 1 and (layers + 2) % chunks == 0:
                    split = True  # the embedding and the loss count as layers (Llama 3 405B: 126 + 2 = 128)
                else:
                    continue
                for cp in cps:
                    if world % (tp * pp * cp):
                        break
                    for ep in eps:
                        for sp in ((False, True) if tp > 1 else (False,)):
                            yield dataclasses.replace(
                                base, name="auto", tp=tp, pp=pp, vpp=vpp, cp=cp, ep=ep,
                                sequence_parallel=sp, recompute="none", distributed_optimizer=True,
                                account_for_embedding_in_pipeline_split=split,
                                account_for_loss_in_pipeline_split=split)


def _copy_with(obj, **changes):
    """``dataclasses.replace`` without re-running ``__init__``: a shallow copy for the hot loop
    (thousands of candidates per second); the schema classes have no ``__post_init__``."""
    new = object.__new__(type(obj))
    new.__dict__.update(obj.__dict__)
    new.__dict__.update(changes)
    return new


def rank_layouts(job: Job, *, attention: str | None = None) -> tuple[list[Row], Counter]:
    """Estimate every valid layout; returns (rows sorted best first, counts of invalid reasons).

    Rows that fit come first, by estimated MFU (ties: less memory); rows that do not fit follow,
    by memory. Memory falls monotonically with the distributed optimizer and with more
    recompute, so once a variant does not fit, the hungrier ones of the same mesh are recorded
    as not fitting without being computed (``memory`` None). Step time is computed for fitting
    rows only. On a CPU cluster nothing has a speed: the plainest layouts come first.
    """
    rules = layout_problems
    invalid: Counter = Counter()
    shapes: dict[int, tuple[Shape, dict]] = {}
    limit = job.cluster.gpu_memory_gb
    on_gpu = job.cluster.gpu != "cpu"
    peak = rate = None
    if on_gpu:
        try:
            peak = peak_flops(job.cluster.gpu, precision_dtype(job.training.precision))
            rate = achievable_rate(job)
        except UnknownDevice:
            peak = rate = None
    rows = []
    for mesh in meshes(job):
        problems = rules(dataclasses.replace(job, parallelism=mesh))
        if problems:
            invalid[f"{problems[0].field}: {problems[0].message}"] += len(VARIANTS)
            continue
        if mesh.tp not in shapes:
            shape = shape_of(job.model, mesh.tp)
            shapes[mesh.tp] = (shape, flops_breakdown(job.model, job.training.global_batch_size,
                                                      padded_vocab_size=shape.vocab))
        shape, flops = shapes[mesh.tp]
        failed: set = set()  # (dopt, rc) that did not fit; anything using more memory cannot either
        for dopt, rc in VARIANTS:
            par = _copy_with(mesh, recompute=rc, distributed_optimizer=dopt)
            if (True, rc) in failed or (dopt, _LESS[rc]) in failed:
                rows.append(Row(par=par, memory=None, fits=False, step=None, mfu=None))
                failed.add((dopt, rc))
                continue
            cand = _copy_with(job, parallelism=par)
            mem = worst_stage(cand, shape, attention)
            fits = (not on_gpu) or mem.total <= limit
            if not fits:
                failed.add((dopt, rc))
            st = mfu = None
            if fits and peak is not None:
                st = step_time(cand, shape, flops, attention, rate)
                mfu = st.model_flops / st.step_time_s / cand.world_size / peak
            rows.append(Row(par=par, memory=mem, fits=fits, step=st, mfu=mfu))
    if peak is None:  # no speed to rank by: the plainest layout (no recompute, least model parallelism)
        rows.sort(key=lambda r: (not r.fits, r.par.recompute != "none", r.par.tp * r.par.pp * r.par.cp * r.par.ep,
                                 bool(r.par.vpp), r.memory.total if r.memory else float("inf")))
    else:
        rows.sort(key=lambda r: (not r.fits, -round(r.mfu or 0.0, MFU_DIGITS),
                                 r.memory.total if r.memory else float("inf")))
    return rows, invalid


def why_lost(row: Row, best: Row, limit: float) -> str:
    """One phrase: what this layout spends that the winner does not."""
    if not row.fits:
        if row.memory is None:
            return f"does not fit in {limit:g} GiB (a leaner variant already did not)"
        return f"does not fit: {row.memory.total:.1f} > {limit:g} GiB"
    if row.step is None or best.step is None:
        return "plainer layouts first (no MFU without a GPU peak)"
    if f"{row.step.step_time_s:.3f}" == f"{best.step.step_time_s:.3f}":  # the table shows a tie: say what broke it
        return tie_reason(row, best)
    terms = {
        "compute (recompute/imbalance)": row.step.compute_s - best.step.compute_s,
        "tp collectives": row.step.tp_comm_s - best.step.tp_comm_s,
        "pipeline bubble": row.step.pp_bubble_s - best.step.pp_bubble_s,
        "pp sends": row.step.pp_p2p_s - best.step.pp_p2p_s,
        "cp ring": row.step.cp_comm_s - best.step.cp_comm_s,
        "ep all-to-all": row.step.ep_comm_s - best.step.ep_comm_s,
        "dp collectives": row.step.dp_comm_s - best.step.dp_comm_s,
    }
    term, extra = max(terms.items(), key=lambda kv: kv[1])
    if extra <= 0:
        return "ties the winner"
    net = row.step.step_time_s - best.step.step_time_s
    if net < extra - 5e-4:  # other terms gave some of it back: the table's step times differ by less
        return f"+{net:.3g} s/step: +{extra:.3g} {term}, less elsewhere"
    return f"+{extra:.3g} s/step {term}"


def tie_reason(row: Row, best: Row) -> str:
    """Why ``row`` ranks below ``best`` at the same step time (to the ms the table shows): the ranking's own keys,
    MFU then memory per GPU (:func:`rank_layouts`), never a step-time term."""
    lower = round(best.mfu or 0.0, MFU_DIGITS) - round(row.mfu or 0.0, MFU_DIGITS)
    if lower > 0:
        return f"same step time to the ms, MFU {100 * lower:.2g} points lower"
    if row.memory is not None and best.memory is not None and row.memory.total > best.memory.total:
        digits = next(d for d in range(2, 12) if f"{row.memory.total:.{d}f}" != f"{best.memory.total:.{d}f}")
        return (f"same MFU, more memory per GPU ({row.memory.total:.{digits}f} vs {best.memory.total:.{digits}f} "
                "GiB)")
    return "ties the winner (listed first)"


def format_table(job: Job, rows: list[Row], invalid: Counter, top: int) -> str:
    """The ranked table: top rows, then how many lost and why."""
    limit = job.cluster.gpu_memory_gb
    fitting = [r for r in rows if r.fits]
    lines = [f"parallelism=auto: {job.model.name} on {job.world_size} GPUs ({job.cluster.nodes} x "
             f"{job.cluster.gpus_per_node} {job.cluster.gpu}), gbs {job.training.global_batch_size}, "
             f"mbs {job.training.micro_batch_size}; {len(rows) + sum(invalid.values())} candidates, "
             f"{sum(invalid.values())} invalid, {len(rows) - len(fitting)} do not fit, {len(fitting)} ranked"]
    header = f"{'rank':>4}  {'layout':<34} {'dp':>5} {'mem GiB':>8} {'step s':>8} {'MFU':>6}  why not first"
    lines.append(header)
    best = fitting[0] if fitting else None
    shown = fitting[:top] if fitting else [r for r in rows if r.memory is not None][:top]
    for i, r in enumerate(shown, 1):
        dp = job.world_size // (r.par.tp * r.par.pp * r.par.cp)
        step = f"{r.step.step_time_s:8.3f}" if r.step else f"{'-':>8}"
        mfu = f"{100 * r.mfu:5.1f}%" if r.mfu is not None else f"{'-':>6}"
        why = "best" if r is best else why_lost(r, best or r, limit)
        lines.append(f"{i:>4}  {r.name:<34} {dp:>5} {r.memory.total:8.1f} {step} {mfu}  {why}")
    losers = Counter()
    shown_ids = {id(r) for r in shown}
    for r in rows:
        if id(r) not in shown_ids:
            lost = ("lower MFU" if best is not None and best.mfu is not None else "ranked lower") if r.fits \
                else f"does not fit in {limit:g} GiB"
            losers[lost] += 1
    for reason, n in sorted(losers.items(), key=lambda kv: -kv[1]):
        lines.append(f"      {n} more: {reason}")
    for reason, n in invalid.most_common(6):
        lines.append(f"      {n} invalid: {reason}")
    return "\n".join(lines)


class NoLayoutFits(ValueError):
    """No valid layout fits in memory; the message carries the table."""


def choose_layout(job: Job, *, attention: str | None = None) -> tuple[Job, str]:
    """The best layout by estimated MFU among those that fit, and the printable ranked table.

    The returned job's ``parallelism.name`` is ``auto:<layout>`` (e.g. ``auto:tp8-pp8-vpp2-sp-sel``)
    so run names and sweep registries record what was chosen. On a CPU cluster (no MFU) it is
    the plainest layout that fits. Raises :class:`NoLayoutFits` when nothing fits.
    """
    rows, invalid = rank_layouts(job, attention=attention)
    table = format_table(job, rows, invalid, max(1, job.plan.top))
    fitting = [r for r in rows if r.fits]
    if not fitting:
        # no remedy here: whether more nodes help is what launch.planner.advice.fit_advice works out (the callers
        # print its line after this message), so it is never said both ways
        raise NoLayoutFits(table + f"\nno valid layout fits in {job.cluster.gpu_memory_gb:g} GiB per GPU on "
                                   f"{job.cluster.nodes} node(s)")
    # The variants were validated per mesh; re-run the rules on the winner with its own recompute
    # and optimizer, in case a rule ever looks at them.
    rules = layout_problems
    best = next((r for r in fitting if not rules(_copy_with(job, parallelism=r.par))), fitting[0])
    chosen = dataclasses.replace(best.par, name=f"auto:{best.name}")
    return dataclasses.replace(job, parallelism=chosen), table
