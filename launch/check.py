"""The login-node job check: one pure function that returns *every* problem of a job.

Why one function returning a list: a user who waits a day in the queue to learn that
``global_batch_size`` does not divide, and then another day to learn that ``num_query_groups``
does not divide either, loses two days. ``check(job)`` reports all of them at once, each with
the dotted field, the arithmetic that fails and an override that fixes it. Nothing is submitted
while the list is non-empty (see ``launch/pretrain.py``).

The mesh rules mirror Megatron-Core 0.16 ``parallel_state.initialize_model_parallel``:
``dp = world / (tp * pp * cp)`` for the dense layers and, for MoE layers, an expert mesh of
``etp * ep * pp`` with expert-tensor-parallel ``etp = tp`` (the default).

Optional collaborators are imported lazily and skipped when absent, so this module stays
importable on a login node without torch: ``analysis.flops`` (peak table, unknown GPU types),
``launch.planner`` (memory fit and the cost estimate used by the budget guard).
"""
from __future__ import annotations

import importlib
import math
import os
import re
from typing import Any, Callable, Iterable, Optional

from launch import vocab
from launch.config import Job
from launch.problems import Problem

RECOMPUTE = ("none", "selective", "full")
PRECISIONS = ("bf16", "fp16", "fp32", "fp8")
LR_DECAY_STYLES = ("cosine", "linear", "constant")
WANDB_MODES = ("offline", "online")
LAUNCHERS = ("slurm", "local")
DATA_KINDS = ("mock", "indexed")
POSITION_EMBEDDINGS = ("rope", "learned_absolute")
NORMALIZATIONS = ("RMSNorm", "LayerNorm")
PLAN_FORMATS = ("table", "json")
SLURM_MAX_SIGNAL_S = 65535  # --signal=<sig>@<time>: Slurm accepts 0..65535 seconds

_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SBATCH_KEY = re.compile(r"^[a-z][a-z0-9-]*$")


def padded_vocab_size(job: Job) -> int:
    """The vocabulary the worker builds: a multiple of lcm(make_vocab_size_divisible_by, tp) (launch/vocab.py)."""
    return vocab.padded_vocab_size(job.model.vocab_size, job.model.make_vocab_size_divisible_by, job.parallelism.tp)


def notes(job: Job) -> list[str]:
    """Facts worth printing that are not problems (vocab padding, derived dp, microbatches)."""
    out = []
    padded = padded_vocab_size(job)
    if padded != job.model.vocab_size:
        multiple = vocab.padding_multiple(job.model.make_vocab_size_divisible_by, job.parallelism.tp)
        out.append(
            f"model.vocab_size {job.model.vocab_size} is padded to {padded} "
            f"(ceil({job.model.vocab_size} / lcm(make_vocab_size_divisible_by {job.model.make_vocab_size_divisible_by}"
            f", tp {job.parallelism.tp}) = {multiple}) * {multiple}; {padded - job.model.vocab_size} unused rows)"
        )
    if mock_data_at_scale(job):
        out.append(f"data=mock: {job.cluster.nodes} nodes would train on synthetic tokens; a real submission "
                   "is refused without data=indexed data.path=<prefix> or force=true")
    if job.dp >= 1 and job.training.micro_batch_size >= 1:
        out.append(
            f"dp {job.dp} = world {job.world_size} / (tp {job.parallelism.tp} * pp {job.parallelism.pp}"
            f" * cp {job.parallelism.cp}); microbatches per step = {num_microbatches(job)}"
        )
    planner = _optional("launch.planner")
    if planner is not None and hasattr(planner, "memory_warnings") and job.parallelism.name != "auto":
        out.extend(planner.memory_warnings(job))  # inside the planner's error band: may or may not fit
    return out


def num_microbatches(job: Job) -> int:
    """Gradient-accumulation steps per optimizer step: gbs / (mbs * dp) (floored)."""
    denom = job.training.micro_batch_size * job.dp
    return job.training.global_batch_size // denom if denom > 0 else 0


def check(job: Job, *, path_exists: Callable[[str], bool] = os.path.exists) -> list[Problem]:
    """Every reason ``job`` cannot run as configured (empty list: it can).

    ``path_exists`` is injected so tests can describe a dataset without creating files.
    """
    problems: list[Problem] = []
    for rule in (_positive_sizes, _mesh, _model_split, _batch, _features, _recipe_support, _enums, _lifecycle,
                 _time, _cluster, _numbers, _strings):
        problems.extend(rule(job))
    problems.extend(_data(job, path_exists))
    if not _has_size_errors(problems):
        problems.extend(_optional_collaborators(job))
    return problems


def layout_problems(job: Job) -> list[Problem]:
    """The layout rules alone (sizes, mesh, model split, batch, features): what the planner
    uses to discard candidate layouts before estimating them. Pure and fast."""
    out = _positive_sizes(job)
    for rule in (_mesh, _model_split, _batch, _features):
        out.extend(rule(job))
    return out


def _has_size_errors(problems: Iterable[Problem]) -> bool:
    return any(p.message.startswith("must be >= 1") for p in problems)


def _positive_sizes(job: Job) -> list[Problem]:
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


def _mesh(job: Job) -> list[Problem]:
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


def _model_split(job: Job) -> list[Problem]:
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


def _batch(job: Job) -> list[Problem]:
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


def _features(job: Job) -> list[Problem]:
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


def _recipe_support(job: Job) -> list[Problem]:
    """Settings the planner models but the training recipe (train/train_loop.py: Megatron-Core DDP +
    the distributed optimizer, ZeRO-1, no overlap) does not run yet. ``launch/plan.py`` still
    estimates them; a job that would train with them is refused rather than silently run without."""
    p = job.parallelism
    out = []
    if p.sharding == "full":
        out.append(Problem(
            "parallelism.sharding", "the training recipe does not shard weights and gradients yet (ZeRO-3/FSDP)",
            "sharding=full, but train/train_loop.py builds Megatron-Core DDP + the distributed optimizer (ZeRO-1)",
            "set parallelism.sharding=optimizer with parallelism.distributed_optimizer=true "
            "(launch/plan.py estimates sharding=full for planning)"))
    if p.overlap_grad_reduce:
        out.append(Problem(
            "parallelism.overlap_grad_reduce", "the training recipe does not overlap the gradient reduce yet",
            "overlap_grad_reduce=true, but train/train_loop.py builds DDP with overlap_grad_reduce=False",
            "set parallelism.overlap_grad_reduce=false (launch/plan.py estimates the overlap for planning)"))
    return out


def _enum(field: str, value: Any, allowed: tuple[str, ...]) -> Optional[Problem]:
    if value in allowed:
        return None
    return Problem(field, f"unknown value {value!r}", f"{value!r} not in {list(allowed)}",
                   f"set {field}= one of {', '.join(allowed)}")


def _enums(job: Job) -> list[Problem]:
    pairs = [
        ("parallelism.recompute", job.parallelism.recompute, RECOMPUTE),
        ("training.precision", job.training.precision, PRECISIONS),
        ("training.lr_decay_style", job.training.lr_decay_style, LR_DECAY_STYLES),
        ("cluster.launcher", job.cluster.launcher, LAUNCHERS),
        ("data.kind", job.data.kind, DATA_KINDS),
        ("model.position_embedding_type", job.model.position_embedding_type, POSITION_EMBEDDINGS),
        ("model.normalization", job.model.normalization, NORMALIZATIONS),
        ("plan.format", job.plan.format, PLAN_FORMATS),
        ("tracking.wandb_mode", job.tracking.wandb_mode, WANDB_MODES),
    ]
    return [p for p in (_enum(*pair) for pair in pairs) if p is not None]


def _lifecycle(job: Job) -> list[Problem]:
    t = job.training
    out = []
    ci = t.checkpoint_interval
    if not (ci == "auto" or (isinstance(ci, int) and not isinstance(ci, bool) and ci > 0)):
        out.append(Problem(
            "training.checkpoint_interval", "must be a positive step count or 'auto' (Young/Daly)",
            f"checkpoint_interval = {ci!r}", "set training.checkpoint_interval=auto or e.g. =500"))
    if t.train_iters is None and t.train_tokens is None:
        out.append(Problem(
            "training.train_iters", "the run needs a length: train_iters or train_tokens",
            "train_iters = null and train_tokens = null", "set training.train_iters=N or training.train_tokens=T"))
    if t.train_iters is not None and t.train_iters < 1:
        out.append(Problem("training.train_iters", "must be >= 1", f"train_iters = {t.train_iters}",
                           "set training.train_iters=1 or more"))
    if t.train_tokens is not None and t.train_tokens < 1:
        out.append(Problem("training.train_tokens", "must be >= 1", f"train_tokens = {t.train_tokens}",
                           "set training.train_tokens to a positive count or null"))
    for name, value in (("training.max_restarts", t.max_restarts),
                        ("training.zero_progress_restarts", t.zero_progress_restarts),
                        ("run.dependency_chain", job.run.dependency_chain)):
        if value < 0:
            out.append(Problem(name, "must be >= 0", f"{name} = {value}", f"set {name}=0 or more"))
    if t.keep_checkpoints < 1:
        out.append(Problem("training.keep_checkpoints", "must keep at least one checkpoint",
                           f"keep_checkpoints = {t.keep_checkpoints}", "set training.keep_checkpoints=1 or more"))
    return out


def _time(job: Job) -> list[Problem]:
    if job.cluster.launcher != "slurm":
        return []
    r, c, t = job.run, job.cluster, job.training
    out = []
    if r.time_limit_min < 1:
        out.append(Problem("run.time_limit_min", "must be >= 1 minute", f"time_limit_min = {r.time_limit_min}",
                           "set run.time_limit_min=60 (or more)"))
        return out
    if r.time_limit_min > c.max_time_min:
        out.append(Problem(
            "run.time_limit_min", "longer than the partition allows (the run continues over requeued slices)",
            f"time_limit_min {r.time_limit_min} > cluster.max_time_min {c.max_time_min}",
            f"set run.time_limit_min<={c.max_time_min}; long runs continue by requeue or run.dependency_chain"))
    limit_s = r.time_limit_min * 60
    lead = t.signal_lead_time_s
    if lead < 1 or lead > SLURM_MAX_SIGNAL_S:
        out.append(Problem(
            "training.signal_lead_time_s", "Slurm's --signal lead must be between 1 and 65535 seconds",
            f"signal_lead_time_s = {lead}", "set training.signal_lead_time_s=300"))
    elif lead >= limit_s:
        out.append(Problem(
            "training.signal_lead_time_s", "the warning would arrive before the job even starts training",
            f"signal_lead_time_s {lead} >= run.time_limit_min {r.time_limit_min} * 60 = {limit_s}",
            f"set training.signal_lead_time_s well below {limit_s} or raise run.time_limit_min"))
    elif lead > limit_s // 2:
        out.append(Problem(
            "training.signal_lead_time_s", "the lead time leaves less than half of each slice for training",
            f"signal_lead_time_s {lead} > run.time_limit_min {r.time_limit_min} * 60 / 2 = {limit_s // 2}",
            f"set training.signal_lead_time_s<={limit_s // 2} or raise run.time_limit_min"))
    return out


def _cluster(job: Job) -> list[Problem]:
    c = job.cluster
    out = []
    if c.launcher == "local" and c.nodes != 1:
        out.append(Problem("cluster.nodes", "the local launcher runs on this machine only",
                           f"nodes {c.nodes} with cluster.launcher=local", "set cluster.nodes=1"))
    if c.launcher == "slurm" and c.gpus_per_node >= 1 and c.cpus_per_node < c.gpus_per_node:
        out.append(Problem(
            "cluster.cpus_per_node", "every task (one per GPU) needs at least one CPU",
            f"cpus_per_task = cpus_per_node {c.cpus_per_node} // gpus_per_node {c.gpus_per_node} = "
            f"{c.cpus_per_node // c.gpus_per_node}", f"set cluster.cpus_per_node>={c.gpus_per_node}"))
    if c.lustre_stripe_count < 0:
        out.append(Problem("cluster.lustre_stripe_count", "must be 0 (no striping) or a positive OST count",
                           f"lustre_stripe_count = {c.lustre_stripe_count}", "set cluster.lustre_stripe_count=0 or 8"))
    if c.mem_per_node_gb < 0:
        out.append(Problem("cluster.mem_per_node_gb", "must be >= 0 (0 = Slurm default)",
                           f"mem_per_node_gb = {c.mem_per_node_gb}", "set cluster.mem_per_node_gb=0"))
    for key in c.env:
        if not _ENV_KEY.match(str(key)):
            out.append(Problem(f"cluster.env.{key}", "not a valid environment variable name",
                               f"{key!r} does not match [A-Za-z_][A-Za-z0-9_]*", "rename the variable"))
    for key in c.sbatch_extra:
        if not _SBATCH_KEY.match(str(key)):
            out.append(Problem(f"cluster.sbatch_extra.{key}", "not a valid sbatch option name",
                               f"{key!r} does not match [a-z][a-z0-9-]*", "use the long option name, e.g. constraint"))
    if job.run.budget_gpu_hours is not None and job.run.budget_gpu_hours <= 0:
        out.append(Problem("run.budget_gpu_hours", "a budget must be positive (or null for none)",
                           f"budget_gpu_hours = {job.run.budget_gpu_hours}", "set run.budget_gpu_hours=null"))
    return out


def _numbers(job: Job) -> list[Problem]:
    """Rates, fractions and learning rates the planner and the optimizer divide by or multiply with."""
    c, t = job.cluster, job.training
    out = []
    positive = {
        "cluster.nvlink_bandwidth_gbs": c.nvlink_bandwidth_gbs,
        "cluster.ib_bandwidth_gbs": c.ib_bandwidth_gbs,
        "cluster.fs_write_bandwidth_gbs": c.fs_write_bandwidth_gbs,
        "cluster.node_mtbf_hours": c.node_mtbf_hours,
        "cluster.gpu_memory_gb": c.gpu_memory_gb,
    }
    for name, value in positive.items():
        if not _finite(value) or value <= 0:
            out.append(Problem(name, "must be a positive, finite number (the planner divides by it)",
                               f"{name} = {value!r}, not > 0", f"set {name} to the measured value"))
    calibration = {  # the planner's per-site constants (launch/planner/steptime.py): 0 turns a term off
        "cluster.nvlink_latency_us": c.nvlink_latency_us, "cluster.ib_latency_us": c.ib_latency_us,
        "cluster.kernel_launch_us": c.kernel_launch_us, "cluster.step_overhead_s": c.step_overhead_s,
        "cluster.step_jitter": c.step_jitter,
    }
    for name, value in calibration.items():
        if not _finite(value) or value < 0:
            out.append(Problem(name, "a planner calibration constant must be a finite number >= 0",
                               f"{name} = {value!r}, not >= 0",
                               f"set {name} to the schema default or a value fitted with launch.planner.compare"))
    frac = c.achievable_fraction
    if not _finite(frac) or not 0 < frac <= 1:
        out.append(Problem("cluster.achievable_fraction", "the fraction of peak a GEMM reaches lies in (0, 1]",
                           f"achievable_fraction = {frac!r}, not in (0, 1]",
                           "set cluster.achievable_fraction=0.7 (or a measured value)"))
    for name, value in (("training.lr", t.lr), ("training.min_lr", t.min_lr)):
        if not _finite(value) or value < 0:
            out.append(Problem(name, "a learning rate must be a finite number >= 0",
                               f"{name} = {value!r}", f"set {name}=3e-4 (or your schedule's value)"))
    if _finite(t.lr) and _finite(t.min_lr) and 0 <= t.lr < t.min_lr:
        out.append(Problem("training.min_lr", "the decay floor is above the peak learning rate",
                           f"min_lr {t.min_lr} > lr {t.lr}", f"set training.min_lr<={t.lr}"))
    return out


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


NAME_MAX = 255  # bytes in one path component on Linux filesystems (ext4, xfs, Lustre, NFS)


def _strings(job: Job) -> list[Problem]:
    """Values rendered into ``#SBATCH`` lines or paths cannot hold newlines: a newline would end
    the directive and start a shell line. Refuse them here instead of rendering garbage."""
    c, r = job.cluster, job.run
    single_line = {
        "run.name": r.name, "run.dir": r.dir, "cluster.run_root": c.run_root, "cluster.partition": c.partition,
        "cluster.account": c.account, "cluster.qos": c.qos, "cluster.exclude": c.exclude,
        "cluster.python": c.python, "cluster.checkpoint_root": c.checkpoint_root,
        "cluster.container.image": c.container.image, "cluster.container.workdir": c.container.workdir,
        "cluster.lustre_stripe_size": c.lustre_stripe_size, "data.path": job.data.path,
    }
    single_line.update({f"cluster.modules[{i}]": m for i, m in enumerate(c.modules)})
    single_line.update({f"cluster.container.mounts[{i}]": m for i, m in enumerate(c.container.mounts)})
    single_line.update({f"cluster.sbatch_extra.{k}": str(v) for k, v in c.sbatch_extra.items()})
    out = []
    for name, value in single_line.items():
        if "\n" in value or "\r" in value or "\0" in value:
            out.append(Problem(name, "must be a single line (it is rendered into an #SBATCH line or a path)",
                               f"{name} = {value!r} contains a newline or NUL", f"remove the newline from {name}"))
    name = r.name
    if not name or "/" in name or name in (".", ".."):
        out.append(Problem("run.name", "must be a plain directory name", f"run.name = {name!r}",
                           "set run.name=<letters, digits, - _ .> without '/'"))
    elif len(name.encode("utf-8")) > NAME_MAX:
        out.append(Problem("run.name", "too long for a directory name on the filesystem",
                           f"{len(name.encode('utf-8'))} bytes > NAME_MAX {NAME_MAX}",
                           f"use a run.name of at most {NAME_MAX} bytes"))
    if not c.python.strip():
        out.append(Problem("cluster.python", "the compute-node interpreter is empty", "cluster.python = ''",
                           "set cluster.python=python3"))
    for i, mount in enumerate(c.container.mounts):
        if "," in mount:
            out.append(Problem(f"cluster.container.mounts[{i}]", "one mount per list item (pyxis joins them by ',')",
                               f"{mount!r} contains ','", "split it into two list items"))
    return out


def _resolve_data_path(job: Job) -> str:
    path = job.data.path
    if path and not os.path.isabs(path) and job.cluster.data_root:
        return os.path.join(job.cluster.data_root, path)
    return path


def _data(job: Job, path_exists: Callable[[str], bool]) -> list[Problem]:
    if job.data.kind != "indexed":
        return []
    if not job.data.path:
        return [Problem("data.path", "an indexed dataset needs its prefix (without .bin/.idx)", "data.path = ''",
                        "set data.path=<prefix> (made by python -m launch.preprocess) or data=mock")]
    prefix = _resolve_data_path(job)
    missing = [prefix + ext for ext in (".bin", ".idx") if not path_exists(prefix + ext)]
    if missing and not job.force:
        return [Problem("data.path", "the indexed dataset files are missing (checked on this machine)",
                        f"not found: {', '.join(missing)}",
                        "check data.path (a prefix: data/corpus_text_document for corpus_text_document.bin/.idx); "
                        "a path only the compute nodes see needs force=true")]
    return []


def mock_data_at_scale(job: Job) -> bool:
    """A multi-node GPU Slurm job on synthetic tokens: almost certainly a forgotten ``data=``."""
    c = job.cluster
    return job.data.kind == "mock" and c.launcher == "slurm" and c.nodes > 1 and c.gpu != "cpu"


def submission_problems(job: Job) -> list[Problem]:
    """What only a real submission refuses (``plan.py`` and dry runs just note it)."""
    if not mock_data_at_scale(job) or job.force or job.dry_run:
        return []
    c = job.cluster
    return [Problem("data.kind", "a multi-node GPU job would pretrain on synthetic tokens (data=mock)",
                    f"data=mock on {c.nodes} nodes x {c.gpus_per_node} {c.gpu}",
                    "set data=indexed data.path=<prefix> (python -m launch.preprocess), "
                    "or force=true to train on mock data on purpose")]


def _optional(module: str) -> Any:
    """Import a collaborator module if it exists; None if it does not (yet)."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (module == exc.name or module.startswith(exc.name + ".")):
            return None
        raise


def _optional_collaborators(job: Job) -> list[Problem]:
    out: list[Problem] = []
    if job.cluster.launcher == "slurm" and job.cluster.gpu != "cpu":
        flops = _optional("analysis.flops")
        if flops is not None and hasattr(flops, "peak_flops"):
            try:
                flops.peak_flops(job.cluster.gpu, job.training.precision)
            except getattr(flops, "UnknownDtype", ()) as exc:
                out.append(Problem(
                    "training.precision", "the GPU has no dense peak for this precision (no MFU, likely a mistake)",
                    f"{job.training.precision!r} on cluster.gpu {job.cluster.gpu!r}: {exc}",
                    "set training.precision=bf16"))
            except flops.UnknownDevice as exc:
                known = sorted(getattr(flops, "PEAK_FLOPS", {}) or [])
                out.append(Problem(
                    "cluster.gpu", "unknown GPU type (no peak FLOP/s to plan or report MFU against)",
                    f"{job.cluster.gpu!r}: {exc}", f"set cluster.gpu to one of {known}" if known else
                    "add the device to analysis/flops.py"))
    planner = _optional("launch.planner")
    if planner is None or job.dp < 1:
        return out
    if job.parallelism.name != "auto" and hasattr(planner, "memory_problems"):
        out.extend(planner.memory_problems(job))
    est = None
    if hasattr(planner, "lead_time_problems") or (job.run.budget_gpu_hours and hasattr(planner, "estimate")):
        est = planner.estimate(job) if hasattr(planner, "estimate") else None
    if hasattr(planner, "lead_time_problems") and job.cluster.launcher == "slurm":
        out.extend(planner.lead_time_problems(job, est))
    budget = job.run.budget_gpu_hours
    if budget is not None and budget > 0:
        if hasattr(planner, "budget_problems"):
            out.extend(planner.budget_problems(job, est))
        elif est is not None:  # the cost guard: refuse at submit time when the estimate overshoots
            hours = estimated_gpu_hours(est)
            if hours is not None and hours > budget:
                out.append(Problem(
                    "run.budget_gpu_hours", "the planner's estimate exceeds the budget",
                    f"estimated {hours:,.0f} GPU-hours > budget {budget:,.0f}",
                    "raise run.budget_gpu_hours, shorten training.train_iters/train_tokens, or pick a cheaper layout"))
    return out


def estimated_gpu_hours(estimate: Any) -> Optional[float]:
    """Read ``gpu_hours`` off the planner's estimate (an object or a mapping)."""
    if isinstance(estimate, dict):
        value = estimate.get("gpu_hours")
    else:
        value = getattr(estimate, "gpu_hours", None)
    return float(value) if value is not None else None
