"""The layout rules: whether a (model, parallelism, cluster, batch) combination can run at all.

One module that both the job check (:func:`launch.check.check`) and the planner
(:mod:`launch.planner.layouts`, which discards invalid candidate layouts with them) import
directly; neither imports the other for them.

The mesh rules mirror Megatron-Core 0.16 ``parallel_state.initialize_model_parallel``:
``dp = world / (tp * pp * cp)`` for the dense layers and, for MoE layers, an expert mesh of
``etp * ep * pp`` with expert-tensor-parallel ``etp = tp`` (the default). Pure and fast (the
planner runs them on thousands of candidates); no torch.
"""
from __future__ import annotations

import math
from typing import Iterable

from launch.config import Job
from launch.problems import Problem


def layout_problems(job: Job) -> list[Problem]:
    """The layout rules alone (sizes, mesh, model split, batch, features): what the planner
    uses to discard candidate layouts before estimating them."""
    out = positive_sizes(job)
    for rule in (mesh, model_split, batch, features):
        out.extend(rule(job))
    return out


def has_size_errors(problems: Iterable[Problem]) -> bool:
    """A size below 1 makes every derived quantity meaningless: later rules are skipped."""
    return any(p.message.startswith("must be >= 1") for p in problems)


def positive_sizes(job: Job) -> list[Problem]:
    out = []
    sizes = {
        "cluster.nodes": job.cluster.nodes,
        "cluster.gpus_per_node": job.cluster.gpus_per_node,
        "parallelism.tp": job.parallelism.tp,
        "parallelism.pp": job.parallelism.pp,
        "parallelism.cp": job.parallelism.cp,
        "parallelism.ep": job.parallelism.ep,
        "training.micro_batch_size": job.training.micro_batch_size,
        "training.global_batch_size": job.training.global_batch_size,
        "model.num_layers": job.model.num_layers,
        "model.num_attention_heads": job.model.num_attention_heads,
        "model.hidden_size": job.model.hidden_size,
        "model.ffn_hidden_size": job.model.ffn_hidden_size,
        "model.seq_length": job.model.seq_length,
        "model.vocab_size": job.model.vocab_size,
        "model.make_vocab_size_divisible_by": job.model.make_vocab_size_divisible_by,
    }
    if job.parallelism.vpp is not None:
        sizes["parallelism.vpp"] = job.parallelism.vpp
    for name, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            out.append(Problem(name, "must be >= 1", f"{name} = {value!r}", f"set {name}=1 or more"))
    return out


def mesh(job: Job) -> list[Problem]:
    p, c = job.parallelism, job.cluster
    if min(p.tp, p.pp, p.cp, p.ep, c.nodes, c.gpus_per_node) < 1:
        return []
    out = []
    world = job.world_size
    mp = p.tp * p.pp * p.cp
    world_s = f"world {world} (cluster.nodes {c.nodes} * cluster.gpus_per_node {c.gpus_per_node})"
    if mp > world:
        out.append(Problem(
            "cluster.nodes", "data-parallel size would be 0: the model-parallel group is larger than the job",
            f"{world_s} < tp {p.tp} * pp {p.pp} * cp {p.cp} = {mp}, so dp = {world} // {mp} = 0",
            f"request cluster.nodes={math.ceil(mp / c.gpus_per_node)} or more, or shrink parallelism.tp/pp/cp"))
    elif world % mp:
        out.append(Problem(
            "cluster.nodes", "world size is not divisible by the model-parallel size (Megatron's dp must be whole)",
            f"{world_s} % (tp {p.tp} * pp {p.pp} * cp {p.cp} = {mp}) = {world % mp}, not 0",
            f"use cluster.nodes so that nodes * {c.gpus_per_node} is a multiple of {mp}, or change parallelism.tp/pp/cp"))
    expert_mesh = p.tp * p.ep * p.pp
    if p.ep > 1 and (expert_mesh > world or world % expert_mesh):
        out.append(Problem(
            "parallelism.ep", "world size is not divisible by the expert mesh (expert-tensor-parallel = tp)",
            f"{world_s} % (tp {p.tp} * ep {p.ep} * pp {p.pp} = {expert_mesh}) = {world % expert_mesh}, not 0",
            f"choose parallelism.ep so that tp * ep * pp divides {world}, or change cluster.nodes"))
    if p.tp > c.gpus_per_node and not p.allow_tp_across_nodes:
        out.append(Problem(
            "parallelism.tp", "tensor parallelism would cross the NVLink domain (TP traffic on InfiniBand)",
            f"tp {p.tp} > cluster.gpus_per_node {c.gpus_per_node}",
            f"set parallelism.tp<={c.gpus_per_node} and use pp for the rest, "
            "or parallelism.allow_tp_across_nodes=true if you really mean it"))
    if p.vpp is not None and p.pp <= 1:
        out.append(Problem(
            "parallelism.vpp", "virtual pipeline chunks need pipeline parallelism",
            f"vpp {p.vpp} with pp {p.pp} (interleaving needs pp > 1)",
            "set parallelism.vpp=null, or parallelism.pp=2 or more"))
    return out


def model_split(job: Job) -> list[Problem]:
    m, p = job.model, job.parallelism
    if min(p.tp, p.pp, m.num_attention_heads, m.num_layers) < 1:
        return []
    out = []
    if m.num_attention_heads % p.tp:
        out.append(Problem(
            "model.num_attention_heads", "attention heads must split evenly across tensor-parallel ranks",
            f"num_attention_heads {m.num_attention_heads} % tp {p.tp} = {m.num_attention_heads % p.tp}, not 0",
            f"choose parallelism.tp dividing {m.num_attention_heads}"))
    groups = m.num_query_groups
    if groups is not None:
        if groups < 1:
            out.append(Problem("model.num_query_groups", "must be >= 1 (or null for multi-head attention)",
                               f"num_query_groups = {groups}", "set model.num_query_groups=null"))
        else:
            if m.num_attention_heads % groups:
                out.append(Problem(
                    "model.num_query_groups", "query heads must split evenly into KV groups",
                    f"num_attention_heads {m.num_attention_heads} % num_query_groups {groups} = "
                    f"{m.num_attention_heads % groups}, not 0",
                    f"choose model.num_query_groups dividing {m.num_attention_heads}"))
            if groups % p.tp:
                out.append(Problem(
                    "model.num_query_groups", "KV groups must split evenly across tensor-parallel ranks",
                    f"num_query_groups {groups} % tp {p.tp} = {groups % p.tp}, not 0",
                    f"choose parallelism.tp dividing {groups}"))
    if m.kv_channels is None and m.hidden_size >= 1 and m.hidden_size % m.num_attention_heads:
        out.append(Problem(
            "model.hidden_size", "hidden size must split evenly into heads (or set model.kv_channels)",
            f"hidden_size {m.hidden_size} % num_attention_heads {m.num_attention_heads} = "
            f"{m.hidden_size % m.num_attention_heads}, not 0",
            "set model.kv_channels explicitly or pick a divisible hidden_size"))
    vpp = p.vpp if (p.vpp is not None and p.vpp >= 1) else 1
    extra = int(p.account_for_embedding_in_pipeline_split) + int(p.account_for_loss_in_pipeline_split)
    layers = m.num_layers + extra
    chunks = p.pp * vpp
    if layers % chunks:
        extra_s = f" + {extra} (embedding/loss counted as layers)" if extra else ""
        out.append(Problem(
            "model.num_layers", "layers must split evenly over pipeline stages x virtual chunks",
            f"(num_layers {m.num_layers}{extra_s}) = {layers} % (pp {p.pp} * vpp {vpp} = {chunks}) = "
            f"{layers % chunks}, not 0",
            f"choose parallelism.pp/vpp whose product divides {layers}"))
    return out


def batch(job: Job) -> list[Problem]:
    t, p = job.training, job.parallelism
    if min(t.micro_batch_size, t.global_batch_size, p.tp, p.pp, p.cp) < 1 or job.dp < 1:
        return []
    out = []
    dp = job.dp
    per_step = t.micro_batch_size * dp
    if t.global_batch_size % per_step:
        out.append(Problem(
            "training.global_batch_size", "global batch must be a whole number of micro-batches on every dp rank",
            f"global_batch_size {t.global_batch_size} % (micro_batch_size {t.micro_batch_size} * dp {dp} = "
            f"{per_step}) = {t.global_batch_size % per_step}, not 0",
            f"set training.global_batch_size to a multiple of {per_step}"))
        return out
    micro = t.global_batch_size // per_step
    if p.pp > 1 and micro < p.pp:
        out.append(Problem(
            "training.global_batch_size", "too few micro-batches to fill the pipeline",
            f"microbatches {micro} = {t.global_batch_size} / ({t.micro_batch_size} * dp {dp}) < pp {p.pp}",
            f"set training.global_batch_size>={p.pp * per_step} or reduce parallelism.pp"))
    if p.pp > 1 and p.vpp is not None and p.vpp > 1 and micro % p.pp:
        out.append(Problem(
            "training.global_batch_size", "the interleaved schedule needs microbatches divisible by pp",
            f"microbatches {micro} % pp {p.pp} = {micro % p.pp}, not 0",
            f"set training.global_batch_size to a multiple of {p.pp * per_step}"))
    return out


def features(job: Job) -> list[Problem]:
    m, p, c, t = job.model, job.parallelism, job.cluster, job.training
    out = []
    if p.sequence_parallel and p.tp <= 1:
        out.append(Problem(
            "parallelism.sequence_parallel", "sequence parallelism shards over tensor-parallel ranks; there is one",
            f"sequence_parallel=true with tp {p.tp}", "set parallelism.sequence_parallel=false or parallelism.tp>1"))
    if p.cp > 1 and m.seq_length >= 1 and m.seq_length % (2 * p.cp):
        out.append(Problem(
            "model.seq_length", "context parallelism splits each sequence into 2*cp load-balanced chunks",
            f"seq_length {m.seq_length} % (2 * cp {p.cp} = {2 * p.cp}) = {m.seq_length % (2 * p.cp)}, not 0",
            f"set model.seq_length to a multiple of {2 * p.cp}"))
    if p.ep > 1 and not m.num_experts:
        out.append(Problem(
            "parallelism.ep", "expert parallelism needs a mixture-of-experts model",
            f"ep {p.ep} with model.num_experts = {m.num_experts}", "set parallelism.ep=1 or pick an MoE model"))
    if m.num_experts is not None:
        if m.num_experts < 1:
            out.append(Problem("model.num_experts", "must be >= 1 or null (dense)", f"num_experts = {m.num_experts}",
                               "set model.num_experts=null for a dense model"))
        else:
            if p.ep >= 1 and m.num_experts % p.ep:
                out.append(Problem(
                    "parallelism.ep", "experts must split evenly across expert-parallel ranks",
                    f"num_experts {m.num_experts} % ep {p.ep} = {m.num_experts % p.ep}, not 0",
                    f"choose parallelism.ep dividing {m.num_experts}"))
            if not 1 <= m.moe_router_topk <= m.num_experts:
                out.append(Problem(
                    "model.moe_router_topk", "each token is routed to between 1 and num_experts experts",
                    f"moe_router_topk {m.moe_router_topk} not in [1, num_experts {m.num_experts}]",
                    f"set model.moe_router_topk<={m.num_experts}"))
    if c.gpu == "cpu":
        if p.cp > 1:
            out.append(Problem(
                "parallelism.cp", "context parallelism needs TransformerEngine, which needs GPUs",
                f"cp {p.cp} on cluster.gpu=cpu", "set parallelism.cp=1 on a CPU cluster"))
        if t.precision == "fp8":
            out.append(Problem(
                "training.precision", "fp8 needs TransformerEngine on Hopper-class GPUs",
                "precision fp8 on cluster.gpu=cpu", "set training.precision=fp32 on a CPU cluster"))
    return out
