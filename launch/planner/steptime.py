"""Step time of one layout: compute at an achievable rate, plus the communication that is not hidden.

Why this shape of model: a planner that ranks layouts needs the terms that *differ* between
layouts (tensor-parallel collectives, pipeline bubble, data-parallel traffic, context-parallel
ring, expert all-to-all, recompute), each from the cluster's own numbers, and nothing fitted per
model. Every term is per GPU and per optimizer step:

* **Compute**: FLOPs from ``analysis.flops`` (the one audited formula; recompute adds what
  :func:`analysis.flops.hardware_flops` adds) at ``peak(cluster.gpu, precision) *
  cluster.planner.achievable_fraction``. Layers split over tp and cp; the logits run on the last stage.
  Fused (flash) attention runs its s x s FLOPs at :data:`FUSED_ATTENTION_RELATIVE_RATE` of the
  GEMM rate (FlashAttention-2/3 reach about 70-75% of peak forward and less backward, against
  ~70% for large GEMMs); unfused attention runs them as batched GEMMs and pays the scores in HBM.
* **Kernel launches**: a layer issues :data:`KERNELS_PER_LAYER` kernels per microbatch; a layer
  whose GPU work is shorter than ``KERNELS_PER_LAYER * cluster.planner.kernel_launch_us`` is host-bound.
  This is what keeps a tiny model from looking 30x faster than it runs.
* **Tensor parallel**: per layer and microbatch two all-reduces forward and two backward (two
  more when the forward is recomputed), each ``2(tp-1)/tp * b*s*h*2`` bytes at
  ``cluster.nvlink_bandwidth_gbs`` (InfiniBand when tp leaves the node) plus ``2(tp-1)`` hops of
  latency. With sequence parallelism they become all-gather + reduce-scatter pairs of the same
  volume and hops. Counted exposed, also with ``parallelism.tp_comm_overlap`` (TransformerEngine's
  userbuffers): crediting it as hidden behind the layer's GEMMs made Megatron-Core's published H100
  runs, which used it, 10-17% too fast (benchmarks/RESULTS.md), so the planner does not assume a
  saving no measurement here supports.
* **Pipeline**: ``(m + (pp-1)/vpp) * t_stage``: the bubble fraction (pp-1)/(m*vpp) of
  Narayanan et al. 2021, with the slowest stage setting t_stage; plus the point-to-point
  activation sends (2 per chunk and microbatch) at the inter-stage bandwidth, each with one hop
  of latency. Megatron-Core sends the whole activation from every tensor-parallel rank (a 1/tp
  slice with sequence parallelism); engines that split it (``framework=``, below) send 1/tp.
  At a fixed global batch more data-parallel replicas mean fewer microbatches each, so the
  bubble's share grows with scale.
* **Context parallel**: the ring passes K and V ``3(cp-1)`` times per layer (forward, and the
  backward's K/V plus their gradients); hidden behind the core-attention compute where it fits.
* **Expert parallel**: four all-to-alls per MoE layer and microbatch (dispatch and combine,
  forward and backward), ``(ep-1)/ep`` of the routed tokens, not overlapped.
* **Data parallel** (once per step): Megatron-Core DDP reduces gradients bucket by bucket
  (:func:`dp_bucket_params`: max(40M, 1M x dp) parameters). With the distributed optimizer a
  reduce-scatter of fp32 gradients and an all-gather of the weights per bucket, without it one
  fp32 all-reduce. Every collective is alpha-beta (:func:`collective_s`): ring ``(n-1)`` hops of
  ``cluster.planner.ib_latency_us`` (``nvlink_latency_us`` inside a node) plus ``(n-1)/n`` of the bytes
  at the bandwidth; an all-reduce takes the faster of the ring and the double binary tree
  (``2 log2 n`` hops), as NCCL does. Across nodes the bandwidth is that of the NICs the group has
  in each node (:func:`_bw`: a dp group with tp=1 has 8 members and 8 NICs per node, with tp=8
  one). With ``parallelism.overlap_grad_reduce`` the reduce hides behind the last microbatch's
  backward (Megatron-Core marks gradients ready only in the last microbatch), with
  ``overlap_param_gather`` the gather behind the next step's first forward (dispatched from the
  forward pre-hooks), except the last bucket each; without them all of it is exposed.
  ``parallelism.bucket_size`` replaces the default bucket when set.
* **Full sharding** (``parallelism.sharding=full``, ZeRO-3/FSDP): every microbatch gathers the
  stage's weights for the forward and again for the backward and reduce-scatters its gradients;
  exposed beyond the microbatch's compute with overlap, all of it without.
* **Stragglers**: a synchronous step waits for the slowest of ``world`` ranks:
  ``1 + cluster.planner.step_jitter * sqrt(2 ln world)`` times the pipeline time (the expected maximum of
  normal per-rank times with relative spread ``step_jitter``).
* **Per-step fixed costs**: the optimizer, memory-bound: :data:`OPTIMIZER_BYTES_PER_PARAM` per
  parameter of the local optimizer shard and :data:`GRAD_PASS_BYTES_PER_PARAM` per local gradient
  (norm for clipping, zeroing) at HBM bandwidth; and ``cluster.planner.step_overhead_s`` of host work
  (logging, timers, the data hand-off, the loss-scale and grad-norm syncs).
* **Memory-bound kernels** (norms, activation functions, dropout, residual adds, softmax when
  attention is unfused, the fp32 cross-entropy): every activation byte of
  :func:`launch.planner.memory.layer_activation_bytes` crosses HBM ``ELEMENTWISE_PASSES`` times
  (written and read back by the forward, its gradient written and read by the backward, and
  the kernels' own reads: 6; a full-recompute forward adds 2) at the device's HBM bandwidth. The
  loss reads and writes each logit :data:`LOSS_BYTES_PER_LOGIT` bytes, counted op by op from
  Megatron-Core's vocab-parallel cross-entropy (fp32 copy, max, subtract, exp, sum, divide; the
  backward's scale and the cast back to bf16).
  This is the term that makes small hidden sizes slower per FLOP: GEMM work grows as h^2 per
  token, this traffic as h (and as a*s for unfused attention).

**Engine** (``framework=``, a planner argument for reading other engines' published runs; a
slurmtron job is always ``megatron-core``), :data:`ENGINES`:

* ``megatron-lm-2021``: Megatron-LM before its pipeline code moved into Megatron-Core (2021 to
  March 2023, the code of Narayanan et al. 2021): ``--scatter-gather-tensors-in-pipeline`` (on by
  default since 2021-02) sends 1/tp of each activation between stages and all-gathers it over
  NVLink (``megatron/p2p_communication.py``); and the gradients are all-reduced in the
  parameters' dtype (the local DDP without ``--accumulate-allreduce-grads-in-fp32``, and torch
  DDP), so an fp16 run moves 2 bytes per gradient instead of 4.
* ``deepspeed``: DeepSpeed's pipeline engine partitions the activations it sends between stages
  over the model-parallel group (``is_pipe_partitioned = is_model_parallel``,
  ``deepspeed/runtime/pipe/engine.py``): 1/tp per send.

So MFU falls with scale for named reasons: fewer microbatches per replica (bubble), more hops per
collective (alpha), a fixed per-step cost over a shorter step, and a slower slowest rank.

**Calibration** (``cluster.*``, one set per site, never per layout): run a sweep of short jobs
(``python launch/pretrain.py -m cluster=<site> ... training.train_iters=20``), then
``python -m launch.planner.compare <run_root>/sweeps/<id>.jsonl`` prints estimated vs measured step
time and MFU per layout (``est_over_meas``). Fit in this order, each from the layouts where its
term dominates: ``achievable_fraction`` from one-node, large-hidden, tp=1 runs (compute-bound:
ratio measured/estimated compute); ``kernel_launch_us`` and ``step_overhead_s`` from a tiny
model on one GPU at two batch sizes (the intercept is the per-step overhead, the per-layer
slope below the GEMM time the launch floor); ``nvlink_latency_us`` / ``ib_latency_us`` from
nccl-tests ``all_reduce_perf`` small-message times (time / hops) or dp-only runs at 2 and many
nodes; the bandwidths from the preflight's ``allreduce_bandwidth``; ``step_jitter`` from the
spread of per-rank step times in the logs (std / mean). Refit when the estimate's
median error over the sweep exceeds the bars in ``launch/planner/accuracy.py``.

Login-node code: no torch, no megatron.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from analysis.flops import flops_breakdown, peak_flops
from launch.config import Job
from launch.planner.memory import attention_of, distinct_stages, layer_activation_bytes, num_microbatches
from launch.planner.shapes import Shape, chunks, shape_of, stage_layers

GB = 1e9  # bandwidths in the cluster config are GB/s (10**9 bytes)
ELEMENTWISE_PASSES = 6.0  # HBM passes per activation byte in memory-bound kernels (see module docstring)
FUSED_ATTENTION_RELATIVE_RATE = 0.8  # flash/fused attention FLOP rate over the GEMMs' (see module docstring)
# Megatron-Core's vocab-parallel cross-entropy (tensor_parallel/cross_entropy.py, the unfused default) per logit:
# forward .float() 2+4, max 4, in-place subtract 4+4, in-place exp 4+4, sum 4, in-place divide 4+4 (38);
# backward mul_ by the loss gradient 4+4, and autograd's cast of the fp32 gradient back to bf16 4+2 (14).
LOSS_BYTES_PER_LOGIT = 52.0
KERNELS_PER_LAYER = 60  # kernels one layer launches per microbatch: ~20 forward, ~40 backward
OPTIMIZER_BYTES_PER_PARAM = 30.0  # Adam: read grad 4, read+write main weight 8, moments 16, write bf16 weight 2
GRAD_PASS_BYTES_PER_PARAM = 8.0  # grad-norm read 4 + zeroing the gradient buffer 4
ENGINES = ("megatron-core", "megatron-lm-2021", "deepspeed")  # whose step-time behaviour (module docstring)

# HBM bandwidth per GPU, GB/s, from the vendors' datasheets (A100 80GB SXM 2,039; H100 SXM 3,350;
# H100 PCIe 2,000; H200 4,800; B200 8,000; MI300X 5,300; V100 SXM2 900). The memory-bound
# kernels run at this rate; an unknown device falls back to the A100's (the slowest modern part).
HBM_BANDWIDTH_GBS: dict[str, float] = {
    "a100": 2039.0, "a100_sxm": 2039.0, "a100_pcie": 1935.0, "h100_sxm": 3350.0, "h100_pcie": 2000.0,
    "h200": 4800.0, "b200": 8000.0, "mi300x": 5300.0, "v100": 900.0,
}


@dataclass(frozen=True)
class StepTime:
    """Seconds per optimizer step, split by cause."""

    step_time_s: float
    compute_s: float  # GEMMs and memory-bound kernels of the slowest stage, over all microbatches
    tp_comm_s: float
    pp_bubble_s: float
    pp_p2p_s: float
    cp_comm_s: float  # exposed part of the ring exchange
    ep_comm_s: float
    dp_comm_s: float  # exposed part of the gradient/weight collectives (FSDP's per-microbatch ones too)
    straggler_s: float  # waiting for the slowest rank (cluster.planner.step_jitter over the world size)
    optimizer_s: float  # the optimizer step and the gradient passes, memory-bound
    overhead_s: float  # cluster.planner.step_overhead_s: host work per step
    model_flops: float  # per step, whole job (MFU numerator)
    hardware_flops: float  # per step, whole job, with recompute (HFU numerator)
    microbatches: int

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def precision_dtype(precision: str) -> str:
    """The peak-table dtype a training precision runs its GEMMs in (fp32 -> TF32 tensor cores)."""
    return "tf32" if precision == "fp32" else precision


def achievable_rate(job: Job) -> float:
    """FLOP/s one GPU sustains on the model's GEMMs; raises analysis.flops.UnknownDevice."""
    peak = peak_flops(job.cluster.gpu, precision_dtype(job.training.precision))
    return peak * job.cluster.planner.achievable_fraction


def hbm_bandwidth(gpu: str) -> float:
    """Bytes/s of the device's HBM (the A100's for an unknown device)."""
    return HBM_BANDWIDTH_GBS.get(gpu.strip().lower(), HBM_BANDWIDTH_GBS["a100"]) * GB


def _bw(cluster, group: int, stride: int | None = None) -> float:
    """Bytes/s per GPU for a collective whose group spans ``group`` consecutive ranks.

    Inside a node: NVLink. Across nodes, a point-to-point send (``stride=None``) has one GPU's NIC.
    A ring/tree collective whose members sit ``stride`` ranks apart has ``k = gpus_per_node //
    stride`` members in each node, and NCCL spreads its channels over their k NICs (each channel
    leaves the node on a different NIC; the other groups running at the same time use the other
    GPUs' NICs), so the node's share of the ring moves at ``k * ib_bandwidth_gbs``, capped by the
    NVLink hops inside the node. This is nccl-tests' bus bandwidth of a multi-node collective on a
    node with one NIC per GPU (nccl-tests doc/PERFORMANCE.md): about 8 x 50 GB/s, NVLink-bound,
    for a dp-only group on DGX H100; one NIC's 50 GB/s for a dp group with tp=8 (one member per node).
    """
    inside = group <= cluster.gpus_per_node
    if inside:
        return cluster.nvlink_bandwidth_gbs * GB
    k = 1 if stride is None else max(1, cluster.gpus_per_node // max(1, stride))
    return min(cluster.nvlink_bandwidth_gbs, k * cluster.ib_bandwidth_gbs) * GB


def _alpha(cluster, group: int) -> float:
    """Seconds of latency per step of a collective over ``group`` consecutive ranks (the alpha of alpha-beta)."""
    inside = group <= cluster.gpus_per_node
    return (cluster.planner.nvlink_latency_us if inside else cluster.planner.ib_latency_us) * 1e-6


def collective_s(kind: str, nbytes: float, n: int, bw: float, alpha: float) -> float:
    """Alpha-beta time of one NCCL collective of ``nbytes`` (the full buffer) over ``n`` ranks.

    Ring reduce-scatter / all-gather: ``(n-1) alpha + (n-1)/n * S/bw``. All-reduce: the faster of
    the ring (``2(n-1) alpha + 2(n-1)/n * S/bw``) and the double binary tree
    (``2 log2(n) alpha + 2 S/bw``), as NCCL picks per size: the tree wins for small buffers on
    many ranks, where the ring's latency grows with n.
    """
    if n <= 1 or nbytes <= 0:
        return 0.0
    if kind == "all_reduce":
        ring = 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes / bw
        tree = 2 * math.ceil(math.log2(n)) * alpha + 2 * nbytes / bw
        return min(ring, tree)
    return (n - 1) * alpha + (n - 1) / n * nbytes / bw


def straggler_factor(cluster, ranks: int) -> float:
    """Expected slowest-of-``ranks`` step over the mean: ``1 + step_jitter * sqrt(2 ln ranks)``
    (the expected maximum of n normal variables); every synchronous step waits for it."""
    return 1.0 + max(0.0, cluster.planner.step_jitter) * math.sqrt(2 * math.log(max(1, ranks)))


def dp_bucket_params(dp_group: int, bucket_size: int | None = None) -> float:
    """Megatron-Core DDP's gradient bucket: ``parallelism.bucket_size`` parameters when set, else
    Megatron-LM's default max(40M, 1M x dp) (``DistributedDataParallelConfig.bucket_size``)."""
    return float(bucket_size) if bucket_size else max(40e6, 1e6 * dp_group)


def step_time(job: Job, shape: Shape | None = None, flops: dict | None = None, attention: str | None = None,
              rate: float | None = None, framework: str = "megatron-core") -> StepTime:
    """Estimate one optimizer step of ``job`` (see the module docstring for every term).

    ``flops`` may pass :func:`analysis.flops.flops_breakdown` for the global batch and ``rate``
    :func:`achievable_rate`, so a layout enumeration computes them once instead of per layout.
    ``framework`` is the engine whose behaviour to assume (:data:`ENGINES`; unknown raises).
    """
    if framework not in ENGINES:
        raise ValueError(f"framework {framework!r} is not one of {ENGINES}")
    p, c, t = job.parallelism, job.cluster, job.training
    attention = attention_of(job, attention)
    shape = shape or shape_of(job.model, p.tp)
    gbs = t.global_batch_size
    parts = flops or flops_breakdown(job.model, gbs, padded_vocab_size=shape.vocab)
    tp, pp, cp, ep, v = max(1, p.tp), max(1, p.pp), max(1, p.cp), max(1, p.ep), chunks(p)
    mb, m = t.micro_batch_size, num_microbatches(job)
    rate = rate or achievable_rate(job)
    fsdp = p.sharding == "full"

    layer_model = parts["attn_proj"] + parts["attn_core"] + parts["mlp"] + parts["mtp"]
    if p.recompute == "full":
        layer_hw = layer_model * 4 / 3
    elif p.recompute == "selective":
        layer_hw = layer_model + parts["attn_core"] / 3
    else:
        layer_hw = layer_model
    core_hw = parts["attn_core"] * (layer_hw / layer_model if p.recompute == "full" else
                                    (4 / 3 if p.recompute == "selective" else 1.0))
    core_rate = rate * (FUSED_ATTENTION_RELATIVE_RATE if attention == "fused" else 1.0)
    per_seq = mb / (gbs * shape.layers * tp * cp)  # one layer, one microbatch, one GPU's share
    t_layer = (layer_hw - core_hw) * per_seq / rate + core_hw * per_seq / core_rate
    t_logits = parts["logits"] / gbs * mb / (tp * cp) / rate
    hbm = hbm_bandwidth(c.gpu)
    passes = ELEMENTWISE_PASSES + (2 if p.recompute == "full" else 0)
    t_elem = passes * layer_activation_bytes(shape, job, attention, stored=False) / hbm
    t_elem_logits = LOSS_BYTES_PER_LOGIT * mb * shape.seq / cp * shape.vocab / tp / hbm
    t_core = core_hw * per_seq / core_rate

    tokens = mb * shape.seq / cp
    act_bytes = tokens * shape.h * 2
    n_tp = 6 if p.recompute == "full" else 4
    # n_tp all-reduces (or all-gather + reduce-scatter pairs with SP: the same volume and hops) per layer
    tp_layer = n_tp * (2 * (tp - 1) * _alpha(c, tp) + 2 * (tp - 1) / tp * act_bytes / _bw(c, tp)) if tp > 1 else 0.0
    cp_layer = 0.0
    if cp > 1:
        kv_bytes = tokens * 2 * shape.kv * 2 / tp
        ring = 3 * (cp - 1) * (kv_bytes / _bw(c, tp * cp) + _alpha(c, tp * cp))
        cp_layer = max(0.0, ring - t_core)
    ep_layer = 0.0
    if ep > 1 and shape.num_experts:
        n_a2a = 6 if p.recompute == "full" else 4
        routed = tokens * shape.topk * shape.h * 2 / (tp if p.sequence_parallel else 1)
        ep_layer = n_a2a * ((ep - 1) / ep * routed / _bw(c, tp * ep) + (ep - 1) * _alpha(c, tp * ep))
    p2p = 0.0
    if pp > 1:
        stride = tp * cp * max(1, job.dp)  # Megatron's rank order is tp, cp, dp, pp: stages are this far apart
        split = p.sequence_parallel or framework != "megatron-core"  # SP, Megatron-LM's scatter/gather, DeepSpeed
        p2p = 2 * v * (act_bytes / (tp if split else 1) / _bw(c, stride + 1) + _alpha(c, stride + 1))

    # Kernel launches: the host issues KERNELS_PER_LAYER kernels per layer and microbatch (more with a
    # recomputed forward); a layer whose GPU work is shorter than that is launch-bound.
    launches = KERNELS_PER_LAYER * (4 / 3 if p.recompute == "full" else 1.0) * c.planner.kernel_launch_us * 1e-6

    layers = stage_layers(shape.layers, p)
    dp_group = max(1, job.dp) * cp
    stage_params = _stage_params(shape, job, layers)
    weight_b = 4 if t.precision == "fp32" else 2
    # Megatron-Core reduces gradients in fp32 (slurmtron sets grad_reduce_in_fp32); Megatron-LM 2021 fp16 did not
    grad_b = 2 if framework == "megatron-lm-2021" and t.precision == "fp16" else 4
    fsdp_mb = 0.0  # FSDP: per microbatch, gather the weights for forward and backward, reduce-scatter grads
    if fsdp and dp_group > 1:
        bw, a = _bw(c, tp * dp_group, stride=tp), _alpha(c, tp * dp_group)
        buckets = max(1.0, math.ceil(stage_params / dp_bucket_params(dp_group, p.bucket_size)))
        fsdp_mb = (2 * collective_s("all_gather", weight_b * stage_params, dp_group, bw, a)
                   + collective_s("reduce_scatter", grad_b * stage_params, dp_group, bw, a)
                   + 3 * (buckets - 1) * (dp_group - 1) * a)
    stage_times = []
    for k in distinct_stages(pp, p.account_for_embedding_in_pipeline_split):  # the others equal stage 1
        n = layers[k]
        compute = n * max(t_layer + t_elem, launches) + (t_logits + t_elem_logits if k == pp - 1 else 0.0)
        comm = n * (tp_layer + cp_layer + ep_layer)
        exposed_fsdp = max(0.0, fsdp_mb - compute) if p.overlap_grad_reduce else fsdp_mb
        stage_times.append((compute + comm + p2p + exposed_fsdp, compute, n * tp_layer, n * cp_layer,
                            n * ep_layer, exposed_fsdp))
    slow = max(stage_times, key=lambda x: x[0])
    t_stage, compute_mb, tp_mb, cp_mb, ep_mb, fsdp_exposed = slow
    bubble_mb = (pp - 1) / v
    stragglers = straggler_factor(c, job.world_size)
    pipeline = (m + bubble_mb) * t_stage * stragglers

    # Data parallel (ZeRO-1 / plain DDP): once per step, bucket by bucket; the reduce overlapped with the last
    # microbatch's backward (overlap_grad_reduce), the gather with the next first forward (overlap_param_gather).
    dp_exposed = 0.0
    if dp_group > 1 and not fsdp:
        bw, a = _bw(c, tp * dp_group, stride=tp), _alpha(c, tp * dp_group)
        buckets = max(1.0, math.ceil(stage_params / dp_bucket_params(dp_group, p.bucket_size)))
        per_bucket = stage_params / buckets
        if p.distributed_optimizer:
            reduce = buckets * collective_s("reduce_scatter", grad_b * per_bucket, dp_group, bw, a)
            gather = buckets * collective_s("all_gather", weight_b * per_bucket, dp_group, bw, a)
        else:
            reduce = buckets * collective_s("all_reduce", grad_b * per_bucket, dp_group, bw, a)
            gather = 0.0
        fwd, bwd = t_stage / 3, 2 * t_stage / 3
        dp_exposed = (max(reduce / buckets, reduce - bwd) if p.overlap_grad_reduce else reduce) \
            + (max(gather / buckets, gather - fwd) if p.overlap_param_gather else gather)

    # Per-step fixed costs: the optimizer (memory-bound Adam over the local shard, the grad-norm and
    # zeroing passes over the local gradients) and the host's own per-step work.
    local_grads = stage_params / (dp_group if fsdp else 1)
    local_state = stage_params / (dp_group if (p.distributed_optimizer or fsdp) else 1)
    optimizer_s = (OPTIMIZER_BYTES_PER_PARAM * local_state + GRAD_PASS_BYTES_PER_PARAM * local_grads) / hbm
    fixed = optimizer_s + max(0.0, c.planner.step_overhead_s)
    total = pipeline + dp_exposed + fixed
    model_total = sum(parts.values())
    hw_total = model_total - layer_model + layer_hw
    return StepTime(
        step_time_s=total, compute_s=m * compute_mb, tp_comm_s=m * tp_mb, pp_bubble_s=bubble_mb * t_stage,
        pp_p2p_s=m * p2p, cp_comm_s=m * cp_mb, ep_comm_s=m * ep_mb, dp_comm_s=dp_exposed + m * fsdp_exposed,
        straggler_s=(stragglers - 1) * (m + bubble_mb) * t_stage, optimizer_s=optimizer_s,
        overhead_s=max(0.0, c.planner.step_overhead_s),
        model_flops=model_total * 1.0, hardware_flops=hw_total, microbatches=m,
    )


def _stage_params(shape: Shape, job: Job, layers: list[float]) -> float:
    """Parameters on one GPU of the most loaded stage (what its data-parallel collectives move)."""
    p = job.parallelism
    tp, pp, ep = max(1, p.tp), max(1, p.pp), max(1, p.ep)
    best = 0.0
    for k in distinct_stages(pp, p.account_for_embedding_in_pipeline_split):
        n = layers[k]
        params = n * ((shape.attn_params + shape.dense_mlp_params) / tp + shape.norm_params)
        params += n * shape.num_experts / ep * shape.expert_params / tp
        if k == 0:
            params += shape.embedding_params / tp
        if k == pp - 1 and (shape.output_params or pp > 1):
            params += shape.embedding_params / tp
        best = max(best, params)
    return best
