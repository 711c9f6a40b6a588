"""Advice that can help when no layout fits: the smallest node count the planner finds room on.

"Add nodes" alone does not say how many, and may not help at all (one micro-batch's activations
can exceed a GPU however the model is split). :func:`fit_advice` answers with the planner's own
memory arithmetic: it ranks the layouts again on 2x, 4x, ... the nodes and names the first node
count where one fits, with that layout and its memory, or says that more nodes do not help.

Login-node code: no torch, no megatron.
"""
from __future__ import annotations

import dataclasses

from launch.config import Job
from launch.planner.layouts import rank_layouts

FACTORS = (2, 4, 8, 16, 32, 64)  # node multiples tried (each is one closed-form ranking, well under a second)


def fit_advice(job: Job, factors: tuple[int, ...] = FACTORS) -> str:
    """One line: the fix for a job on which no layout fits in the GPU's memory."""
    c = job.cluster
    limit = c.gpu_memory_gb
    best_mem = None
    for f in factors:
        nodes = c.nodes * f
        bigger = dataclasses.replace(job, cluster=dataclasses.replace(c, nodes=nodes))
        try:
            rows, _ = rank_layouts(bigger)
        except (ArithmeticError, ValueError, KeyError):
            continue
        fit = [r for r in rows if r.fits and r.memory is not None]
        if fit:
            r = fit[0]  # the planner's pick on that many nodes
            return (f"fix: cluster.nodes={nodes} ({nodes * c.gpus_per_node} x {c.gpu}) is the smallest "
                    f"multiple of the nodes (x{', x'.join(str(x) for x in factors)}) on which a layout fits: {r.name} at "
                    f"{r.memory.total:.1f} of {limit:g} GiB per GPU (planner estimate); or a GPU with more "
                    f"memory (cluster.gpu_memory_gb), or lower training.micro_batch_size / model.seq_length")
        sized = [r.memory.total for r in rows if r.memory is not None]
        if sized:
            best_mem = min(sized) if best_mem is None else min(best_mem, min(sized))
    low = f" (the leanest layout on up to {c.nodes * factors[-1]} nodes still needs {best_mem:.1f} GiB)" \
        if best_mem is not None else ""
    return (f"fix: more nodes do not help{low}: one micro-batch does not fit in {limit:g} GiB; lower "
            f"training.micro_batch_size or model.seq_length, or use a GPU with more memory")


def layout_advice(job: Job) -> str:
    """One line for a fixed layout over the GPU's memory: the layout ``parallelism=auto`` would pick on
    these nodes (so that advice is known to help), or, when none fits, :func:`fit_advice`."""
    try:
        rows, _ = rank_layouts(job)
    except (ArithmeticError, ValueError, KeyError):
        return fit_advice(job)
    fit = [r for r in rows if r.fits and r.memory is not None]
    if fit:
        return (f"fix: parallelism=auto fits on these {job.cluster.nodes} node(s): {fit[0].name} at "
                f"{fit[0].memory.total:.1f} of {job.cluster.gpu_memory_gb:g} GiB per GPU (planner estimate)")
    return fit_advice(job).replace("fix: ", "fix: no layout fits on these nodes; ", 1)
