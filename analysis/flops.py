"""The one FLOP formula and the one dense-peak table of slurmtron.

Everything that prints or reports TFLOP/s, MFU or HFU (the training worker's log line, the
planner's step-time estimate, ``analysis/report.py``) calls this module, so the numbers agree
and are audited in one place.

Source of the model-FLOP formula
--------------------------------
``num_floating_point_operations(args, batch_size)`` -> ``transformer_flops()`` in
``megatron/training/training.py`` of NVIDIA/Megatron-LM, read at commit
``001b00c2734d8f0fad096fe48a382fedf755d321`` (main branch, after core 0.16). Term by term:

* attention (MHA/GQA), per layer and token::

      3 * 2 * ( h * (q + 2*kv)            # Q, K, V projections (q = heads*d, kv = groups*d)
              + q * s / 2 * 2            # QK^T and (QK^T)V; "/2": causal mask, half is zero
              + q * h )                  # output projection

  The ``s / 2`` causal halving arrived with the Megatron core 0.12 line (it is in commit
  250b7941 of July 2025, which AI-Hypercomputer/maxtext#1972 cites; core 0.7's
  ``training.py`` still counted ``q * s * 2``, the full square). ``causal=False``
  reproduces the older numbers, for reading TFLOP/s printed by older Megatron versions.
* MLP, per layer and token: ``3 * 2 * h * ffn * (3 if swiglu else 2)`` (SwiGLU has the
  gate, up and down matrices; GeLU two). MoE layers use ``moe_ffn_hidden_size * topk``
  plus the shared expert ``moe_shared_expert_intermediate_size``; ``moe_layer_freq`` picks
  which layers are MoE (default 1: all).
* MTP (multi-token prediction, DeepSeek-V3): ``mtp_num_layers`` extra transformer layers
  (MoE or dense like the last layer), ``3*2*(3h + 2h^2)`` each for the norms and the eh
  projection, and one extra logit computation each.
* logits, per token: ``3 * 2 * h * padded_vocab * (mtp_num_layers + 1)``.

Everything is multiplied by ``batch_size * seq_length``. The factor 3 is forward + weight
gradient + data gradient; the factor 2 is one multiply-add per (m, n, k). Not counted, as in
Megatron: norms, softmax, activations, embeddings lookup, optimizer.

Not supported (raises ``ValueError``): multi-latent attention, linear-attention variants,
hybrid Mamba models. They are not in ``launch/config.py``'s schema.

Hardware FLOPs (HFU)
--------------------
MFU counts the model FLOPs above. HFU counts what the GPU really executes:
``recompute="full"`` re-runs every transformer layer's forward before its backward (+1/3
of the layer FLOPs; the output layer is not recomputed), ``recompute="selective"`` re-runs
only the core attention (QK^T, softmax, AV) forward (+1/3 of the core-attention term).
See Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models" (arXiv:2205.05198), section 4 and appendix.

This module must stay free of torch, megatron and slurmtron's other packages: the model is
duck-typed (an object with Megatron's argument names, e.g. ``launch.config.ModelConfig``, an
omegaconf node, or a plain mapping).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = [
    "PEAK_FLOPS",
    "UnknownDevice",
    "UnknownDtype",
    "flops_breakdown",
    "hardware_flops",
    "mfu",
    "num_floating_point_operations",
    "pad_vocab_size",
    "peak_flops",
    "tflops_per_gpu",
]

_MISSING = object()


def _get(model: Any, name: str, default: Any = _MISSING) -> Any:
    """Read ``name`` from an attribute object or a mapping; ``default`` when absent or None."""
    if isinstance(model, Mapping):
        value = model.get(name, None)
    else:
        value = getattr(model, name, None)
    if value is None:
        if default is _MISSING:
            raise ValueError(f"model config has no value for {name!r}, which the FLOP formula needs")
        return default
    return value


def pad_vocab_size(vocab_size: int, divisible_by: int = 128, tp: int = 1) -> int:
    """Megatron's padded vocabulary: rounded up to a multiple of ``divisible_by * tp``.

    Megatron's logit term uses the padded size (``_vocab_size_with_padding`` in
    ``megatron/training/tokenizer``), so reports must too, or MFU drifts with tp.
    """
    multiple = int(divisible_by) * int(tp)
    if multiple <= 0:
        raise ValueError(f"divisible_by * tp must be positive, got {divisible_by} * {tp}")
    return ((int(vocab_size) + multiple - 1) // multiple) * multiple


def _moe_layer_count(model: Any, num_layers: int) -> tuple[int, int]:
    """(number of MoE layers, 1 if the last layer is MoE) from ``moe_layer_freq``."""
    freq = _get(model, "moe_layer_freq", 1)
    if isinstance(freq, int):
        if freq <= 0:
            raise ValueError(f"moe_layer_freq must be positive, got {freq}")
        pattern = [1 if i % freq == 0 else 0 for i in range(num_layers)]
    else:
        pattern = [int(x) for x in freq]
        if len(pattern) != num_layers:
            raise ValueError(
                f"moe_layer_freq has {len(pattern)} entries but num_layers is {num_layers}"
            )
    return sum(pattern), pattern[-1] if pattern else 0


def flops_breakdown(
    model: Any,
    batch_size: int,
    *,
    causal: bool = True,
    padded_vocab_size: int | None = None,
    tp: int = 1,
) -> dict[str, float]:
    """Model FLOPs of one training step (forward + backward), split by term.

    Keys: ``attn_proj`` (QKV and output projections), ``attn_core`` (QK^T and AV), ``mlp``
    (dense, routed experts and shared experts), ``mtp`` (MTP norms and eh projections),
    ``logits``. Their sum is :func:`num_floating_point_operations`. The split exists so HFU
    can add recompute per term, and so a test can pin each term by hand.
    """
    if _get(model, "multi_latent_attention", False):
        raise ValueError("multi-latent attention is not supported by slurmtron's FLOP formula")
    if batch_size < 0:
        raise ValueError(f"batch_size must be >= 0, got {batch_size}")
    h = int(_get(model, "hidden_size"))
    s = int(_get(model, "seq_length"))
    layers = int(_get(model, "num_layers"))
    heads = int(_get(model, "num_attention_heads"))
    groups = int(_get(model, "num_query_groups", heads))
    d = int(_get(model, "kv_channels", h // heads))
    ffn = int(_get(model, "ffn_hidden_size"))
    swiglu = bool(_get(model, "swiglu", False))
    if padded_vocab_size is None:
        padded_vocab_size = _get(model, "padded_vocab_size", None)
    if padded_vocab_size is None:
        padded_vocab_size = pad_vocab_size(
            int(_get(model, "vocab_size")), int(_get(model, "make_vocab_size_divisible_by", 128)), tp
        )
    vocab = int(padded_vocab_size)
    mtp = int(_get(model, "mtp_num_layers", 0))

    num_experts = _get(model, "num_experts", None)
    if num_experts is None:
        dense_layers, moe_layers, routed, last_is_moe = layers, 0, 0, 0
    else:
        moe_layers, last_is_moe = _moe_layer_count(model, layers)
        dense_layers = layers - moe_layers
        routed = int(_get(model, "moe_router_topk", 2))
    moe_layers += last_is_moe * mtp
    dense_layers += (1 - last_is_moe) * mtp
    total_layers = layers + mtp
    moe_ffn = int(_get(model, "moe_ffn_hidden_size", ffn))
    shared_ffn = int(_get(model, "moe_shared_expert_intermediate_size", 0))

    fb = 3  # forward, backward wgrad, backward dgrad
    fma = 2  # one multiply-add = 2 FLOPs
    ffn_mult = 3 if swiglu else 2
    q = d * heads
    kv = d * groups
    gate = q if _get(model, "attention_output_gate", False) else 0
    tokens = batch_size * s

    attn_proj = fb * fma * (h * (q + 2 * kv + gate) + q * h) * total_layers * tokens
    core_per_token = q * s * 2 / 2 if causal else q * s * 2
    attn_core = fb * fma * core_per_token * total_layers * tokens
    mlp = (
        fb * fma * h
        * (
            ffn * ffn_mult * dense_layers
            + moe_ffn * routed * ffn_mult * moe_layers
            + shared_ffn * ffn_mult * moe_layers
        )
        * tokens
    )
    mtp_flops = fb * fma * mtp * (3 * h + 2 * h * h) * tokens
    logits = fb * fma * h * vocab * (mtp + 1) * tokens
    return {
        "attn_proj": float(attn_proj),
        "attn_core": float(attn_core),
        "mlp": float(mlp),
        "mtp": float(mtp_flops),
        "logits": float(logits),
    }


def num_floating_point_operations(
    model: Any,
    batch_size: int,
    *,
    causal: bool = True,
    padded_vocab_size: int | None = None,
    tp: int = 1,
) -> float:
    """Model FLOPs of one training step over ``batch_size`` sequences (forward + backward).

    Matches Megatron-LM's ``num_floating_point_operations`` (``megatron/training/training.py``,
    commit 001b00c2); see the module docstring for each term. ``causal=True`` is Megatron
    core >= 0.12 (half of the attention square); ``causal=False`` is the older full-square
    count, to compare with TFLOP/s printed by older Megatron. The vocabulary is
    ``padded_vocab_size`` if given, else ``model.padded_vocab_size``, else ``vocab_size``
    padded to ``make_vocab_size_divisible_by (128) * tp`` as Megatron does.
    """
    return sum(
        flops_breakdown(model, batch_size, causal=causal, padded_vocab_size=padded_vocab_size, tp=tp).values()
    )


def hardware_flops(
    model: Any,
    batch_size: int,
    *,
    recompute: str = "none",
    causal: bool = True,
    padded_vocab_size: int | None = None,
    tp: int = 1,
) -> float:
    """FLOPs the hardware executes in one step, for HFU: model FLOPs plus recomputation.

    ``recompute`` is ``launch.config.ParallelismConfig.recompute``: ``none``; ``selective``
    (Megatron's ``--recompute-granularity selective``: the core attention forward runs
    again, + attn_core / 3); ``full`` (every transformer layer's forward runs again, + the
    layer terms / 3; the output layer and loss are not recomputed).
    """
    parts = flops_breakdown(model, batch_size, causal=causal, padded_vocab_size=padded_vocab_size, tp=tp)
    total = sum(parts.values())
    if recompute in ("none", "", None):
        return total
    if recompute == "selective":
        return total + parts["attn_core"] / 3
    if recompute == "full":
        return total + (parts["attn_proj"] + parts["attn_core"] + parts["mlp"] + parts["mtp"]) / 3
    raise ValueError(f"recompute must be one of none, selective, full; got {recompute!r}")


# ---------------------------------------------------------------------------------------------
# Dense peak FLOP/s per GPU. DENSE, never the "with sparsity" figure that NVIDIA datasheets
# print with an asterisk (that is 2x dense; using it halves every MFU, Megatron-LM #1565/#1276).
# NVIDIA datasheets print sparse figures for Hopper/Blackwell; the dense value is half.
# ---------------------------------------------------------------------------------------------
_T = 1e12
PEAK_FLOPS: dict[str, dict[str, float]] = {
    # NVIDIA A100 Tensor Core GPU datasheet (SXM4 and PCIe, 40/80 GB): TF32 156,
    # BF16/FP16 312 dense (624 sparse). No FP8 tensor cores.
    "a100": {"bf16": 312 * _T, "fp16": 312 * _T, "tf32": 156 * _T},
    "a100_sxm": {"bf16": 312 * _T, "fp16": 312 * _T, "tf32": 156 * _T},
    "a100_pcie": {"bf16": 312 * _T, "fp16": 312 * _T, "tf32": 156 * _T},
    # NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column: TF32 989*, BF16/FP16 1,979*,
    # FP8 3,958* TFLOPS (* = with sparsity) -> dense 494.5 / 989 / 1979.
    "h100_sxm": {"bf16": 989 * _T, "fp16": 989 * _T, "fp8": 1979 * _T, "tf32": 494.5 * _T},
    # Same datasheet, H100 PCIe column: TF32 756*, BF16/FP16 1,513*, FP8 3,026* (sparse)
    # -> dense 378 / 756 / 1513.
    "h100_pcie": {"bf16": 756 * _T, "fp16": 756 * _T, "fp8": 1513 * _T, "tf32": 378 * _T},
    # NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column: the same tensor cores as
    # H100 SXM (TF32 989*, BF16/FP16 1,979*, FP8 3,958* sparse) -> dense as H100 SXM.
    "h200": {"bf16": 989 * _T, "fp16": 989 * _T, "fp8": 1979 * _T, "tf32": 494.5 * _T},
    # NVIDIA HGX B200 datasheet (8 GPUs): TF32 18 PF, FP16/BF16 36 PF, FP8 72 PF, all with
    # sparsity -> per GPU dense 1125 / 2250 / 4500 TFLOPS.
    "b200": {"bf16": 2250 * _T, "fp16": 2250 * _T, "fp8": 4500 * _T, "tf32": 1125 * _T},
    # AMD Instinct MI300X datasheet: FP16/BF16 1307.4, FP8 2614.9, TF32 653.7 TFLOPS dense
    # (the sparsity figures are twice these).
    "mi300x": {"bf16": 1307.4 * _T, "fp16": 1307.4 * _T, "fp8": 2614.9 * _T, "tf32": 653.7 * _T},
    # NVIDIA V100 SXM2 datasheet: 125 TFLOPS FP16 tensor (no BF16, TF32 or FP8). For old logs.
    "v100": {"fp16": 125 * _T},
}


class UnknownDevice(KeyError):
    """A device that is not in :data:`PEAK_FLOPS`. Never guessed: a wrong peak is a wrong MFU."""

    def __init__(self, device: str) -> None:
        self.device = device
        super().__init__(
            f"no dense peak FLOP/s for device {device!r}; known devices: "
            f"{', '.join(sorted(PEAK_FLOPS))} (add a row to analysis/flops.py::PEAK_FLOPS "
            "with its datasheet citation)"
        )

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class UnknownDtype(UnknownDevice):
    """A known device without a tensor-core peak for that dtype (e.g. fp8 on A100)."""

    def __init__(self, device: str, dtype: str) -> None:
        self.device = device
        self.dtype = dtype
        KeyError.__init__(
            self,
            f"device {device!r} has no dense peak for dtype {dtype!r}; "
            f"known dtypes for it: {', '.join(sorted(PEAK_FLOPS[device]))}",
        )


_DTYPE_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float8": "fp8", "e4m3": "fp8"}


def _norm(name: str) -> str:
    return str(name).strip().lower().replace("-", "_").replace(" ", "_")


def peak_flops(device: str, dtype: str) -> float:
    """Dense peak FLOP/s of one ``device`` (``ClusterConfig.gpu``) for ``dtype``.

    Raises :class:`UnknownDevice` (a ``KeyError``) for a device not in the table, and
    :class:`UnknownDtype` (a subclass) for a dtype the device lacks. There is no fallback
    (an unknown GPU silently given the A100 peak is how MFU above 100% gets published).
    """
    dev = _norm(device)
    if dev not in PEAK_FLOPS:
        raise UnknownDevice(device)
    dt = _norm(dtype)
    dt = _DTYPE_ALIASES.get(dt, dt)
    if dt not in PEAK_FLOPS[dev]:
        raise UnknownDtype(dev, dtype)
    return PEAK_FLOPS[dev][dt]


def tflops_per_gpu(flops_per_step: float, step_time_s: float, num_gpus: int) -> float:
    """Achieved TFLOP/s per GPU, as Megatron prints ``throughput per GPU (TFLOP/s/GPU)``."""
    if step_time_s <= 0 or num_gpus <= 0:
        raise ValueError(f"step_time_s and num_gpus must be positive, got {step_time_s}, {num_gpus}")
    return flops_per_step / (step_time_s * num_gpus) / 1e12


def mfu(
    flops_per_step: float, step_time_s: float, num_gpus: int, device: str, dtype: str = "bf16"
) -> float:
    """Model FLOPs utilisation as a fraction (0.4123 prints as ``MFU: 41.23%``).

    ``flops_per_step`` is :func:`num_floating_point_operations` over the global batch (or
    :func:`hardware_flops` for HFU); ``step_time_s`` the elapsed time per iteration;
    ``num_gpus`` the world size. Raises :class:`UnknownDevice` for an unknown device.
    """
    return tflops_per_gpu(flops_per_step, step_time_s, num_gpus) * 1e12 / peak_flops(device, dtype)
