"""Step time of one layout: compute at an achievable rate, plus the communication that is not hidden.

Why this shape of model: a planner that ranks layouts needs the terms that *differ* between
layouts (tensor-parallel collectives, pipeline bubble, data-parallel traffic, context-parallel
ring, expert all-to-all, recompute), each from the cluster's own numbers, and nothing fitted per
model. Every term is per GPU and per optimizer step:

* **Compute**: FLOPs from ``analysis.flops`` (the one audited formula; recompute adds what
  :func:`analysis.flops.hardware_flops` adds) at ``peak(cluster.gpu, precision) *
  cluster.achievable_fraction``. Layers split over tp and cp; the logits run on the last stage.
* **Tensor parallel**: per layer and microbatch two all-reduces forward and two backward (two
  more when the forward is recomputed), each ``2(tp-1)/tp * b*s*h*2`` bytes at
  ``cluster.nvlink_bandwidth_gbs`` (InfiniBand when tp leaves the node). With sequence
  parallelism they become all-gather + reduce-scatter pairs of the same volume. Not overlapped.
* **Pipeline**: ``(m + (pp-1)/vpp) * t_stage``: the bubble fraction (pp-1)/(m*vpp) of
  Narayanan et al. 2021, with the slowest stage setting t_stage; plus the point-to-point
  activation sends (2 per chunk and microbatch) at the inter-stage bandwidth.
* **Context parallel**: the ring passes K and V ``3(cp-1)`` times per layer (forward, and the
  backward's K/V plus their gradients); hidden behind the core-attention compute where it fits.
* **Expert parallel**: four all-to-alls per MoE layer and microbatch (dispatch and combine,
  forward and backward), ``(ep-1)/ep`` of the routed tokens, not overlapped.
* **Data parallel**: reduce-scatter of fp32 gradients and all-gather of bf16 weights with the
  distributed optimizer (one fp32 all-reduce without), on InfiniBand once the group leaves a
  node. Megatron overlaps the reduce with the last microbatch's backward and the gather with
  the first microbatch's forward, so only the excess over those windows is exposed.

* **Memory-bound kernels** (norms, activation functions, dropout, residual adds, softmax when
  attention is unfused, the fp32 cross-entropy): every activation byte of
  :func:`launch.planner.memory.layer_activation_bytes` crosses HBM ``ELEMENTWISE_PASSES`` times
  (written and read back by the forward, its gradient written and read by the backward, and
  the kernels' own reads: 6; a full-recompute forward adds 2) at the device's HBM bandwidth.
  This is the term that makes small hidden sizes slower per FLOP: GEMM work grows as h^2 per
  token, this traffic as h (and as a*s for unfused attention).

Not modelled: kernel launch latency, the optimizer step, data loading and stragglers; they,
and GEMM shapes below the peak, are what ``cluster.achievable_fraction`` absorbs.

Login-node code: no torch, no megatron.
"""
from __future__ import annotations

from dataclasses import dataclass

from analysis.flops import flops_breakdown, peak_flops
from launch.config import Job
from launch.planner.memory import distinct_stages, layer_activation_bytes, num_microbatches
from launch.planner.shapes import Shape, chunks, shape_of, stage_layers

GB = 1e9  # bandwidths in the cluster config are GB/s (10**9 bytes)
ELEMENTWISE_PASSES = 6.0  # HBM passes per activation byte in memory-bound kernels (see module docstring)

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
    dp_comm_s: float  # exposed part of the gradient/weight collectives
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
    return peak * job.cluster.achievable_fraction


def _bw(cluster, group: int) -> float:
    """Bytes/s per GPU for a collective whose group spans ``group`` consecutive ranks."""
    inside = group <= cluster.gpus_per_node
    return (cluster.nvlink_bandwidth_gbs if inside else cluster.ib_bandwidth_gbs) * GB


def step_time(job: Job, shape: Shape | None = None, flops: dict | None = None, attention: str = "fused",
              rate: float | None = None) -> StepTime:
    """Estimate one optimizer step of ``job`` (see the module docstring for every term).

    ``flops`` may pass :func:`analysis.flops.flops_breakdown` for the global batch and ``rate``
    :func:`achievable_rate`, so a layout enumeration computes them once instead of per layout.
    """
    p, c, t = job.parallelism, job.cluster, job.training
    shape = shape or shape_of(job.model, p.tp)
    gbs = t.global_batch_size
    parts = flops or flops_breakdown(job.model, gbs, padded_vocab_size=shape.vocab)
    tp, pp, cp, ep, v = max(1, p.tp), max(1, p.pp), max(1, p.cp), max(1, p.ep), chunks(p)
    mb, m = t.micro_batch_size, num_microbatches(job)
    rate = rate or achievable_rate(job)

    layer_model = parts["attn_proj"] + parts["attn_core"] + parts["mlp"] + parts["mtp"]
    if p.recompute == "full":
        layer_hw = layer_model * 4 / 3
    elif p.recompute == "selective":
        layer_hw = layer_model + parts["attn_core"] / 3
    else:
        layer_hw = layer_model
    per_seq_layer = layer_hw / (gbs * shape.layers)  # FLOPs of one layer for one sequence
    t_layer = per_seq_layer * mb / (tp * cp) / rate
    t_logits = parts["logits"] / gbs * mb / (tp * cp) / rate
    hbm = HBM_BANDWIDTH_GBS.get(c.gpu.strip().lower(), HBM_BANDWIDTH_GBS["a100"]) * GB
    passes = ELEMENTWISE_PASSES + (2 if p.recompute == "full" else 0)
    t_elem = passes * layer_activation_bytes(shape, job, attention, stored=False) / hbm
    t_elem_logits = passes * 4 * mb * shape.seq / cp * shape.vocab / tp / hbm
    t_core = parts["attn_core"] / (gbs * shape.layers) * mb / (tp * cp) / rate * (4 / 3 if p.recompute != "none" else 1)

    tokens = mb * shape.seq / cp
    act_bytes = tokens * shape.h * 2
    n_tp = 6 if p.recompute == "full" else 4
    tp_layer = n_tp * 2 * (tp - 1) / tp * act_bytes / _bw(c, tp) if tp > 1 else 0.0
    cp_layer = 0.0
    if cp > 1:
        ring = 3 * (cp - 1) * tokens * 2 * shape.kv * 2 / tp / _bw(c, tp * cp)
        cp_layer = max(0.0, ring - t_core)
    ep_layer = 0.0
    if ep > 1 and shape.num_experts:
        n_a2a = 6 if p.recompute == "full" else 4
        routed = tokens * shape.topk * shape.h * 2 / (tp if p.sequence_parallel else 1)
        ep_layer = n_a2a * (ep - 1) / ep * routed / _bw(c, tp * ep)
    p2p = 0.0
    if pp > 1:
        stride = tp * cp * max(1, job.dp)  # Megatron's rank order is tp, cp, dp, pp: stages are this far apart
        p2p = 2 * v * act_bytes / (tp if p.sequence_parallel else 1) / _bw(c, stride + 1)

    layers = stage_layers(shape.layers, p)
    stage_times = []
    for k in distinct_stages(pp, p.account_for_embedding_in_pipeline_split):  # the others equal stage 1
        n = layers[k]
        compute = n * (t_layer + t_elem) + (t_logits + t_elem_logits if k == pp - 1 else 0.0)
        comm = n * (tp_layer + cp_layer + ep_layer)
        stage_times.append((compute + comm + p2p, compute, n * tp_layer, n * cp_layer, n * ep_layer))
    slow = max(stage_times, key=lambda x: x[0])
    t_stage, compute_mb, tp_mb, cp_mb, ep_mb = slow
    bubble_mb = (pp - 1) / v
    pipeline = (m + bubble_mb) * t_stage

    # Data parallel: the parameters of the most loaded stage (embedding or output layer included).
    dp_group = max(1, job.dp) * cp
    stage_params = _stage_params(shape, job, layers)
    dp_exposed = 0.0
    if dp_group > 1:
        bw = _bw(c, tp * dp_group)
        frac = (dp_group - 1) / dp_group
        weight_b = 4 if t.precision == "fp32" else 2  # gradients are reduced in fp32 either way
        fwd, bwd = t_stage / 3, 2 * t_stage / 3
        if p.distributed_optimizer:
            reduce = frac * 4 * stage_params / bw
            gather = frac * weight_b * stage_params / bw
            dp_exposed = max(0.0, reduce - bwd) + max(0.0, gather - fwd)
        else:
            reduce = 2 * frac * 4 * stage_params / bw
            dp_exposed = max(0.0, reduce - bwd)
    total = pipeline + dp_exposed
    model_total = sum(parts.values())
    hw_total = model_total - layer_model + layer_hw
    return StepTime(
        step_time_s=total, compute_s=m * compute_mb, tp_comm_s=m * tp_mb, pp_bubble_s=bubble_mb * t_stage,
        pp_p2p_s=m * p2p, cp_comm_s=m * cp_mb, ep_comm_s=m * ep_mb, dp_comm_s=dp_exposed,
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
