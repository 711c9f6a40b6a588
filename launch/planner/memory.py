"""Memory per GPU for every pipeline stage of a layout, and the fit check.

Why per stage: the stages are not alike. Stage 0 holds the embedding and the most in-flight
microbatches of the 1F1B schedule; the last stage holds the output layer and the fp32 logits.
Refusing on an average would pass layouts whose first stage runs out of memory.

Accounting (bytes; GiB = 2**30 in every report, and ``cluster.gpu_memory_gb`` is read as GiB):

* **Weights, gradients, optimizer** per parameter on the GPU: bf16/fp16 weights 2, fp32 main
  gradients 4 (Megatron accumulates and reduces grads in fp32 by default for bf16), fp32 main
  weights + two Adam moments 12. The distributed optimizer (ZeRO-1) shards the 12 over the
  data-parallel-with-context group (dp * cp, as Megatron-Core's ``data_parallel_group_with_cp``);
  expert parameters over the expert-data-parallel group dp * cp / ep. fp32 training keeps no
  extra main copy: 4 + 4 + 8. Tensor parallelism shards everything but the norms and a
  learned position table; ``ep`` divides the experts.
* **Activations** per layer and microbatch follow Korthikanti et al. 2022 ("Reducing Activation
  Recomputation in Large Transformer Models", arXiv:2205.05198, Table 2): ``sbh(34 + 5as/h)``
  with ``10 sbh`` replicated across tp unless sequence parallelism shards it too. Generalised,
  per token: ``10h`` (norm inputs, the QKV and MLP inputs, two 1-byte dropout masks) +
  ``4q + 4kv`` (Q, K, V and the attention output, 2 bytes each; q = heads*d, kv = groups*d, so GQA
  shrinks the K/V terms) + the MLP's ``4f`` (GeLU input and output) or ``6f`` with SwiGLU
  (gate, up and their product), + ``5as`` for the attention scores, softmax and its dropout
  mask. For MHA with f = 4h this is exactly 34h + 5as. ``selective`` recompute drops the 5as
  term; ``full`` keeps only each layer's 2-byte input plus one layer's working set. Context
  parallelism divides s by cp. Megatron-Core on GPUs runs TransformerEngine's fused (flash)
  attention, which never materialises the scores: the 5as term is then absent whatever the
  recompute, which is the default here (``attention="fused"``); ``"unfused"`` models the 2021
  Megatron of the papers.
* **In-flight microbatches**: stage k of 1F1B holds ``min(pp - k, m)`` microbatches of its
  layers; the interleaved schedule holds ``2(pp - k - 1) + (vpp - 1)pp + 1`` chunks (Megatron's
  warm-up count + the current one), which for stage 0 is Megatron's penalty
  ``1 + (pp - 1)/(pp * vpp)`` times the layers.
* **Embedding / logits**: stage 0 keeps the token ids (8 B) and the embedding dropout mask (1 B
  per element) of each in-flight microbatch; the last stage keeps the fp32 logits and their
  input, ``4sb(h + V)/tp``, for the one microbatch it back-propagates at a time.
* **Sharding** (``parallelism.sharding``): ``optimizer`` is the above; ``full`` (ZeRO-3 / FSDP)
  shards the weights and gradients over the same group too, and adds what FSDP holds unsharded
  while it works: the gathered bf16 weights of :data:`FSDP_GATHERED_LAYERS` layers (the one
  computing and the one prefetched) and the fp32 gradients of one layer before its
  reduce-scatter.
* **Workspace**, term by term instead of one constant (all on GPUs only; a CPU run has none):
  - ``context``: the CUDA context and the kernel images of torch, cuBLAS/cuDNN, TransformerEngine
    and NCCL, :data:`CUDA_CONTEXT_GIB` (what ``nvidia-smi`` shows beyond
    ``torch.cuda.memory_reserved`` in an idle process: 0.5-1 GiB on A100/H100 with lazy loading);
  - ``nccl``: :data:`NCCL_COMM_GIB` per communicator the rank belongs to (tp, cp, dp, pp, ep, the
    embedding group): NCCL_BUFFSIZE 4 MiB x 2 directions x up to 16 channels, plus proxy buffers;
  - ``transient``: the backward of one layer allocates its activation gradients beside the stored
    activations, about one layer's working set (the scores included when attention is unfused;
    with full recompute the recomputed layer's own working set is counted in ``activations``);
  - ``fragmentation``: the caching allocator's slack, :data:`ALLOCATOR_SLACK` of everything
    allocated and freed per step (activations, the transient set and the logits).
  This is what made a fixed 3 GiB wrong both ways: +30% and more for small models, too little for
  long sequences.
* **Framework** (``framework=``, a planner argument for reading other frameworks' published
  measurements; a slurmtron job is always ``megatron-core``), :data:`FRAMEWORKS`:
  - ``deepspeed-bf16``: DeepSpeed's ``BF16_Optimizer`` (deepspeed/runtime/bf16_optimizer.py, the
    optimizer BLOOM trained with) accumulates into an fp32 gradient buffer for every parameter of the
    rank (``fp32_groups_gradients_flat``) and leaves the bf16 ``.grad`` of each parameter allocated
    (``clear_lp_grads=False``): 2 + 4 gradient bytes per parameter instead of Megatron's 4.
  - ``torchtitan``: FSDP2 keeps the sharded parameters in fp32 (4 bytes, the optimizer updates them
    in place: 8 bytes of Adam moments, no separate main copy), and ``recompute="selective"`` is its
    per-op policy (``selective_ac_option = 'op'``: torchtitan's ``_apply_ac_to_transformer_block``
    saves the outputs of the ops in its save list, every other ``mm`` and the attention, and
    recomputes the rest): per token a layer keeps its input (2h), the outputs of the 1st, 3rd, 5th
    and 7th matmul (wq 2q, wv 2kv, w1 2f, w2 2h) and the attention output (2q). Its loss casts the
    bf16 logits to fp32 (``pred.float()`` before ``cross_entropy``): bf16 logits, their fp32 copy and
    the fp32 log-softmax live together, 10 bytes per logit instead of Megatron's fused 4.

Login-node code: no torch, no megatron.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from launch.config import Job
from launch.planner.accuracy import MEMORY_OVER, MEMORY_UNDER
from launch.planner.shapes import Shape, chunks, shape_of, stage_layers
from launch.problems import Problem

GIB = 2**30
CUDA_CONTEXT_GIB = 0.75  # CUDA context + kernel images (torch, cuBLAS/cuDNN, TransformerEngine, NCCL)
NCCL_COMM_GIB = 0.125  # per NCCL communicator: 4 MiB buffers x 2 directions x 16 channels
ALLOCATOR_SLACK = 0.08  # caching-allocator fragmentation, as a fraction of the per-step dynamic memory
FSDP_GATHERED_LAYERS = 2  # full sharding: layers whose weights are gathered at once (current + prefetch)
FRAMEWORKS = ("megatron-core", "deepspeed-bf16", "torchtitan")  # whose memory behaviour (module docstring)
LOGIT_BYTES = {"megatron-core": 4.0, "deepspeed-bf16": 4.0, "torchtitan": 10.0}  # per logit at the loss


@dataclass(frozen=True)
class StageMemory:
    """One pipeline stage's memory per GPU, in GiB."""

    stage: int
    layers: float
    weights: float
    grads: float
    optimizer: float
    activations: float  # all in-flight microbatches (= per_microbatch * inflight)
    activations_per_microbatch: float
    inflight_microbatches: float  # microbatches whose activations are held at the peak
    embedding_logits: float
    workspace: float  # context + nccl + transient + fragmentation
    workspace_terms: tuple = ()  # ((name, GiB), ...) what the workspace is made of

    @property
    def total(self) -> float:
        return (self.weights + self.grads + self.optimizer + self.activations
                + self.embedding_logits + self.workspace)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["workspace_terms"] = dict(self.workspace_terms)
        d["total"] = self.total
        return d


def bytes_per_param(precision: str, framework: str = "megatron-core") -> tuple[float, float, float]:
    """(weights, grads, optimizer state) bytes per parameter before any sharding."""
    if precision == "fp32" or framework == "torchtitan":
        return 4.0, 4.0, 8.0
    if framework == "deepspeed-bf16":
        return 2.0, 6.0, 12.0
    return 2.0, 4.0, 12.0


def attention_of(job: Job, attention: str | None = None) -> str:
    """The attention kernels to model: ``attention`` when given, else ``model.attention_backend``."""
    return str(getattr(attention or job.model.attention_backend, "value", attention or job.model.attention_backend))


def layer_activation_bytes(shape: Shape, job: Job, attention: str | None = None, stored: bool = True,
                           framework: str = "megatron-core") -> float:
    """Bytes one transformer layer keeps for one microbatch (Korthikanti's Table 2, generalised).

    ``attention="fused"`` (TransformerEngine's flash/fused attention, Megatron-Core's default on
    GPUs) never writes the s x s scores to memory, so the 5as term is absent whatever the
    recompute; ``"unfused"`` (the 2021 Megatron of Korthikanti's and Narayanan's papers)
    stores them unless ``recompute`` is selective or full. ``stored=False`` returns the bytes the
    layer's memory-bound kernels touch instead, scores included when unfused even if recomputed.
    """
    p = job.parallelism
    attention = attention_of(job, attention)
    tp, cp = max(1, p.tp), max(1, p.cp)
    tokens = job.training.micro_batch_size * shape.seq / cp
    if shape.num_experts:
        mlp = shape.topk * ((6 if shape.swiglu else 4) * _moe_ffn(job) + 2 * shape.h)
    else:
        mlp = (6 if shape.swiglu else 4) * shape.ffn
    sharded = 4 * shape.q + 4 * shape.kv + mlp
    if attention == "unfused" and cp == 1 and (p.recompute == "none" or not stored):
        sharded += 5 * shape.heads * shape.seq
    replicated = 10 * shape.h
    if framework == "torchtitan" and stored and p.recompute == "selective" and not shape.num_experts:
        sharded = 2 * shape.q + 2 * shape.kv + 2 * shape.ffn + 2 * shape.h + 2 * shape.q  # per-op policy
        replicated = 2 * shape.h  # the layer's input
    if p.sequence_parallel:
        replicated /= tp
    working = tokens * (replicated + sharded / tp)
    return working


def layer_checkpoint_bytes(shape: Shape, job: Job) -> float:
    """Bytes a fully recomputed layer keeps: its 2-byte input (sharded by tp under SP)."""
    p = job.parallelism
    tokens = job.training.micro_batch_size * shape.seq / max(1, p.cp)
    return tokens * 2 * shape.h / (max(1, p.tp) if p.sequence_parallel else 1)


def inflight_layer_sets(stage: int, layers: float, job: Job, microbatches: int) -> tuple[float, float]:
    """(microbatch-equivalents held by ``stage``, layer activations sets held) at its peak."""
    p = job.parallelism
    pp, v = max(1, p.pp), chunks(p)
    m = max(1, microbatches)
    if pp == 1:
        return 1.0, layers
    if v == 1:
        held = min(pp - stage, m)
        return float(held), held * layers
    held_chunks = min(2 * (pp - stage - 1) + (v - 1) * pp + 1, m * v)
    return held_chunks / v, held_chunks * layers / v


def num_microbatches(job: Job) -> int:
    """:attr:`launch.config.Job.num_microbatches`, at least 1 (a layout without a dp rank is refused elsewhere)."""
    return max(1, job.num_microbatches)


def distinct_stages(pp: int, embedding_is_a_layer: bool = True) -> list[int]:
    """Stages that can be the worst: 0 (embedding, most in flight), 1 (one layer more than stage
    0 when the embedding counts as a layer), and the last (output layer, logits). Stages in
    between hold stage 1's layers with fewer microbatches in flight, so they never exceed it;
    without the embedding counted as a layer, stage 1 never exceeds stage 0 either."""
    return sorted({0, min(1 if embedding_is_a_layer else 0, pp - 1), pp - 1})


def communicators(job: Job) -> int:
    """NCCL communicators one rank holds: one per parallel group with more than one member."""
    p = job.parallelism
    groups = [p.tp, p.cp, max(1, job.dp) * max(1, p.cp), p.ep]
    n = sum(1 for g in groups if g and g > 1)
    if p.pp > 1:
        n += 2  # the pipeline group and the embedding/position group of the first and last stage
    return n


def stage_memory(job: Job, shape: Shape | None = None, attention: str | None = None,
                 stages: list[int] | None = None, framework: str = "megatron-core") -> list[StageMemory]:
    """Memory of each pipeline stage in ``stages`` (all by default; see the module docstring)."""
    if framework not in FRAMEWORKS:
        raise ValueError(f"framework {framework!r} is not one of {FRAMEWORKS}")
    p = job.parallelism
    attention = attention_of(job, attention)
    on_gpu = job.cluster.gpu != "cpu"
    fsdp = p.sharding == "full"
    shape = shape or shape_of(job.model, p.tp)
    tp, pp, cp, ep = p.tp or 1, p.pp or 1, p.cp or 1, p.ep or 1
    dp = job.world_size // (tp * pp * cp) or 1
    w_b, g_b, o_b = bytes_per_param(job.training.precision, framework)
    gathered_b = 2.0 if framework == "torchtitan" and job.training.precision != "fp32" else w_b  # bf16 all-gather
    shard = dp * cp if (p.distributed_optimizer or fsdp) else 1
    expert_shard = max(1.0, dp * cp / ep) if (p.distributed_optimizer or fsdp) else 1.0
    state_shard, expert_state_shard = (shard, expert_shard) if fsdp else (1, 1.0)
    layer_unsharded = (shape.attn_params + shape.dense_mlp_params + shape.norm_params) / tp \
        + (shape.num_experts / ep) * shape.expert_params / tp
    comm_gib = communicators(job) * NCCL_COMM_GIB
    m = max(1, job.training.global_batch_size // (job.training.micro_batch_size * dp))
    per_layer_act = layer_activation_bytes(shape, job, attention, framework=framework)
    working_set = layer_activation_bytes(shape, job, attention, stored=False)  # one layer computing
    full = p.recompute == "full"
    stored_per_layer = layer_checkpoint_bytes(shape, job) if full else per_layer_act
    tokens = job.training.micro_batch_size * shape.seq / cp
    out = []
    per_stage = stage_layers(shape.layers, p)
    for k in (range(pp) if stages is None else stages):
        layers = per_stage[k]
        dense = layers * (shape.attn_params + shape.dense_mlp_params) / tp + layers * shape.norm_params
        experts = layers * (shape.num_experts / ep) * shape.expert_params / tp
        if k == 0:
            dense += shape.embedding_params / tp + shape.position_params
        if k == pp - 1:
            dense += shape.final_norm_params
            if shape.output_params:
                dense += shape.output_params / tp
            elif pp > 1:  # tied: the last stage keeps a copy of the word embedding for the logits
                dense += shape.embedding_params / tp
        inflight_mb, layer_sets = inflight_layer_sets(k, layers, job, m)
        acts = layer_sets * stored_per_layer + (working_set if full else 0.0)  # + the layer recomputed
        emb_logits = 0.0
        if k == 0:
            emb_logits += inflight_mb * tokens * (8 + shape.h) / (tp if p.sequence_parallel else 1)
        if k == pp - 1:
            emb_logits += tokens * (4 * shape.h + LOGIT_BYTES[framework] * shape.vocab) / tp
        terms: tuple = ()
        if on_gpu:
            transient = working_set
            terms = (("context", CUDA_CONTEXT_GIB), ("nccl", comm_gib), ("transient", transient / GIB),
                     ("fragmentation", ALLOCATOR_SLACK * (acts + transient + emb_logits) / GIB))
        out.append(StageMemory(
            stage=k, layers=layers,
            weights=(dense * w_b / state_shard + experts * w_b / expert_state_shard
                     + (FSDP_GATHERED_LAYERS * gathered_b * layer_unsharded if fsdp else 0.0)) / GIB,
            grads=(dense * g_b / state_shard + experts * g_b / expert_state_shard
                   + (g_b * layer_unsharded if fsdp else 0.0)) / GIB,
            optimizer=(dense * o_b / shard + experts * o_b / expert_shard) / GIB,
            activations=acts / GIB,
            activations_per_microbatch=(layers * stored_per_layer) / GIB,
            inflight_microbatches=inflight_mb,
            embedding_logits=emb_logits / GIB,
            workspace=sum(v for _, v in terms),
            workspace_terms=terms,
        ))
    return out


def worst_stage(job: Job, shape: Shape | None = None, attention: str | None = None,
                framework: str = "megatron-core") -> StageMemory:
    """The stage with the largest total: the one that decides whether the layout fits."""
    p = job.parallelism
    stages = distinct_stages(max(1, p.pp), p.account_for_embedding_in_pipeline_split)
    return max(stage_memory(job, shape, attention, stages, framework), key=lambda s: s.total)


def format_breakdown(s: StageMemory) -> str:
    """One line per term, so a refusal shows where the memory goes."""
    return (
        f"stage {s.stage} ({s.layers:g} layers): weights {s.weights:.1f} + grads {s.grads:.1f} + optimizer "
        f"{s.optimizer:.1f} + activations {s.activations:.1f} ({s.activations_per_microbatch:.2f}/microbatch x "
        f"{s.inflight_microbatches:g} in flight) + embedding/logits {s.embedding_logits:.1f} + workspace "
        f"{s.workspace:.1f}{_terms(s)} = {s.total:.1f} GiB"
    )


def _terms(s: StageMemory) -> str:
    return (" (" + ", ".join(f"{n} {v:.1f}" for n, v in s.workspace_terms) + ")") if s.workspace_terms else ""


FITS, MAY_NOT_FIT, DOES_NOT_FIT = "fits", "inside the error band", "does not fit"


def memory_verdict(total_gib: float, gpu_memory_gb: float) -> str:
    """The one rule for the words every table uses about an estimated memory per GPU: ``fits`` at or below
    ``(1 - MEMORY_UNDER)`` times the GPU's memory (the estimate has been up to that much low), ``inside the error
    band`` up to ``(1 + MEMORY_OVER)`` times it (it may or may not fit: warned, never refused), ``does not fit``
    above (refused). So 79.7 of 80 GiB is inside the band: the estimate may be 15% low."""
    if total_gib <= gpu_memory_gb * (1 - MEMORY_UNDER):
        return FITS
    return MAY_NOT_FIT if total_gib <= gpu_memory_gb * (1 + MEMORY_OVER) else DOES_NOT_FIT


def memory_problems(job: Job) -> list[Problem]:
    """Refuse a layout whose worst stage exceeds ``cluster.gpu_memory_gb`` by more than the planner's
    demonstrated overestimate (:data:`launch.planner.accuracy.MEMORY_OVER`); [] on CPU clusters.
    Inside the error band :func:`memory_warnings` speaks instead."""
    c, p = job.cluster, job.parallelism
    if c.gpu == "cpu" or job.dp < 1:
        return []
    worst = worst_stage(job)
    bound = c.gpu_memory_gb * (1 + MEMORY_OVER)
    if memory_verdict(worst.total, c.gpu_memory_gb) != DOES_NOT_FIT:
        return []
    fixes = memory_fixes(job)
    return [Problem(
        "parallelism", f"estimated memory per GPU exceeds cluster.gpu_memory_gb {c.gpu_memory_gb:g} by more "
                       f"than the planner's error (+{100 * MEMORY_OVER:.0f}%)",
        format_breakdown(worst) + f" > {c.gpu_memory_gb:g} x {1 + MEMORY_OVER:g} = {bound:.1f}",
        "try " + ", or ".join(fixes),
    )]


def memory_fixes(job: Job) -> list[str]:
    """The overrides that lower the memory per GPU of ``job``'s layout, most effective first: recompute, sequence
    parallelism, the distributed optimizer, a smaller micro-batch, more pipeline stages, or the planner's pick."""
    p = job.parallelism
    fixes = []
    if p.recompute != "full":
        fixes.append("parallelism.recompute=" + ("selective" if p.recompute == "none" else "full"))
    if p.tp > 1 and not p.sequence_parallel:
        fixes.append("parallelism.sequence_parallel=true")
    if not p.distributed_optimizer:
        fixes.append("parallelism.distributed_optimizer=true")
    if job.training.micro_batch_size > 1:
        fixes.append("training.micro_batch_size=1")
    fixes.append(f"parallelism.pp={p.pp * 2}")
    fixes.append("parallelism=auto (let the planner pick a layout that fits)")
    return fixes


def memory_plan(job: Job) -> dict:
    """What ``<run_dir>/memory_plan.json`` holds (written at submit, read by the ranks and the report): the worst
    stage's estimate per GPU with its terms (GiB), the one-line breakdown, and the fixes that lower it."""
    worst = worst_stage(job)
    return {"layout": job.layout_label, "gpu": job.cluster.gpu, "gpu_memory_gb": job.cluster.gpu_memory_gb,
            "total_gib": worst.total, "terms": worst.to_dict(), "breakdown": format_breakdown(worst),
            "fixes": memory_fixes(job)}


def memory_warnings(job: Job) -> list[str]:
    """Warnings for a layout inside the planner's error band: it may or may not fit."""
    c = job.cluster
    if c.gpu == "cpu" or job.dp < 1:
        return []
    worst = worst_stage(job)
    low, high = c.gpu_memory_gb * (1 - MEMORY_UNDER), c.gpu_memory_gb * (1 + MEMORY_OVER)
    if memory_verdict(worst.total, c.gpu_memory_gb) != MAY_NOT_FIT:
        return []
    side = "above" if worst.total > c.gpu_memory_gb else "below"
    return [f"WARNING: estimated memory per GPU {worst.total:.1f} GiB is {side} cluster.gpu_memory_gb "
            f"{c.gpu_memory_gb:g} but inside the planner's error band ({low:.1f}..{high:.1f} GiB: -"
            f"{100 * MEMORY_UNDER:.0f}%/+{100 * MEMORY_OVER:.0f}% in its validation), so it may or may not fit "
            f"({format_breakdown(worst)}). Run launch/preflight.py on this layout first and "
            "watch the peak memory of the worst stage's ranks (torch.cuda.max_memory_reserved, or nvidia-smi) and "
            "any CUDA out-of-memory in the rank logs; parallelism=auto lists layouts with more headroom"]


def _moe_ffn(job: Job) -> int:
    return job.model.moe_ffn_hidden_size or job.model.ffn_hidden_size



__all__ = ["GIB", "FRAMEWORKS", "CUDA_CONTEXT_GIB", "NCCL_COMM_GIB", "ALLOCATOR_SLACK", "attention_of", "communicators", "StageMemory", "stage_memory", "worst_stage", "memory_problems",
           "format_breakdown", "num_microbatches", "memory_warnings",
           "memory_verdict", "FITS", "MAY_NOT_FIT", "DOES_NOT_FIT", "layer_activation_bytes", "bytes_per_param"]
