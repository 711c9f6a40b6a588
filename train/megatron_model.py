"""Our model config -> Megatron-Core: the ONE translator, the layer spec and the GPT model.

:func:`to_transformer_config`, :func:`to_ddp_config` and :func:`to_optimizer_config` are the
only places where slurmtron's schema meets Megatron-Core's ``TransformerConfig``,
``DistributedDataParallelConfig`` and ``OptimizerConfig``. Each is one explicit constructor
call (no ``setattr`` loops), so a renamed Megatron field fails loudly here and in
``tests/test_translator.py``.

Two choices differ from Megatron-LM's defaults, both so that a run's numbers do not
depend on its layout (and therefore a checkpoint reshards and TP1 == TP2 == PP2):

* :func:`padded_vocab_size` pads to a multiple of ``make_vocab_size_divisible_by`` (and of
  tp), not of ``divisible_by * tp``; Megatron-LM's rule changes the embedding's global
  shape with tp, which breaks loading a TP2 checkpoint under TP1.
* :func:`init_layout_independent` draws every weight from a generator seeded by
  (seed, global parameter name) on the full (unsharded) shape and keeps this rank's slice,
  instead of Megatron's per-shard RNG streams, whose position depends on tp and on which
  layers a pipeline stage holds.

Dropout is 0 (as in Llama/Mixtral pretraining recipes), so training is deterministic.
"""
from __future__ import annotations

import math
import zlib
from typing import List, Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.transformer_config import TransformerConfig

from launch import vocab
from launch.config import ModelConfig, ParallelismConfig, TrainingConfig

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def padded_vocab_size(model: ModelConfig, tp: int) -> int:
    """Vocabulary padded to a multiple of lcm(make_vocab_size_divisible_by, tp): see launch/vocab.py."""
    return vocab.padded_vocab_size(model.vocab_size, model.make_vocab_size_divisible_by, tp)


def params_dtype(training: TrainingConfig) -> torch.dtype:
    if training.precision not in _DTYPES:
        raise ValueError(f"training.precision={training.precision!r}; expected one of {sorted(_DTYPES)}")
    return _DTYPES[training.precision]


def _recompute(parallelism: ParallelismConfig) -> tuple[Optional[str], Optional[str], Optional[int]]:
    if parallelism.recompute == "none":
        return None, None, None
    if parallelism.recompute == "selective":
        return "selective", None, None
    if parallelism.recompute == "full":
        return "full", "uniform", 1
    raise ValueError(f"parallelism.recompute={parallelism.recompute!r}; expected none | selective | full")


def to_transformer_config(
    model: ModelConfig,
    parallelism: ParallelismConfig,
    training: TrainingConfig,
    *,
    cuda: bool = False,
) -> TransformerConfig:
    """Translate the composed job into Megatron-Core's TransformerConfig.

    ``cuda`` selects GPU initialization; on the CPU the weights are built on the CPU.
    """
    dtype = params_dtype(training)
    granularity, method, num_layers = _recompute(parallelism)
    if model.normalization not in ("RMSNorm", "LayerNorm"):
        raise ValueError(f"model.normalization={model.normalization!r}; expected RMSNorm | LayerNorm")
    moe = model.num_experts is not None and model.num_experts > 1
    return TransformerConfig(
        # shape
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        kv_channels=model.kv_channels,
        gated_linear_unit=model.swiglu,
        activation_func=F.silu if model.swiglu else F.gelu,
        normalization=model.normalization,
        add_bias_linear=model.add_bias_linear,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # fused (flash/cuDNN, TE's choice) unless the job asks for the s x s scores in memory
        attention_backend=AttnBackend.unfused if model.attention_backend == "unfused" else AttnBackend.auto,
        init_method_std=0.02,
        # MoE
        num_moe_experts=model.num_experts if moe else None,
        moe_router_topk=model.moe_router_topk,
        moe_router_pre_softmax=moe and model.moe_router_topk == 1,  # Megatron requires it for top-1
        moe_ffn_hidden_size=(model.moe_ffn_hidden_size or model.ffn_hidden_size) if moe else None,
        moe_token_dispatcher_type="alltoall" if (moe and cuda) else "allgather",  # gloo: no list-less all_to_all
        moe_aux_loss_coeff=1e-2 if moe else 0.0,
        # parallelism
        tensor_model_parallel_size=parallelism.tp,
        pipeline_model_parallel_size=parallelism.pp,
        virtual_pipeline_model_parallel_size=parallelism.vpp,
        context_parallel_size=parallelism.cp,
        expert_model_parallel_size=parallelism.ep,
        sequence_parallel=parallelism.sequence_parallel,
        tp_comm_overlap=parallelism.tp_comm_overlap,  # TE userbuffers (train.worker initialises them)
        account_for_embedding_in_pipeline_split=parallelism.account_for_embedding_in_pipeline_split,
        account_for_loss_in_pipeline_split=parallelism.account_for_loss_in_pipeline_split,
        # with two stages "previous" and "next" are the same rank: batched isend/irecv then pairs a
        # gradient with an activation of the same shape (seen with vpp on gloo); the unbatched
        # path orders the ops by rank parity and matches them
        batch_p2p_comm=not (parallelism.pp == 2 and parallelism.vpp),
        recompute_granularity=granularity,
        recompute_method=method,
        recompute_num_layers=num_layers,
        # precision and device
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=training.precision == "bf16",
        fp16=training.precision == "fp16",
        use_cpu_initialization=not cuda,
        perform_initialization=True,  # also tags TP attributes; init_layout_independent() then redraws
        gradient_accumulation_fusion=False,
        bias_activation_fusion=cuda and model.swiglu,
        masked_softmax_fusion=cuda and fused_softmax_available(),
        apply_rope_fusion=False,
        persist_layer_norm=False,
    )


def to_ddp_config(parallelism: ParallelismConfig) -> DistributedDataParallelConfig:
    """Megatron-Core's DDP: grads reduced in fp32; with ``overlap_grad_reduce`` the reduce of each bucket
    of ``bucket_size`` parameters starts in the backward pass as soon as its grads are ready, and with
    ``overlap_param_gather`` (distributed optimizer only) the updated weights are all-gathered bucket by
    bucket in the next forward pass instead of right after the optimizer step."""
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=parallelism.overlap_grad_reduce,
        overlap_param_gather=parallelism.overlap_param_gather,
        bucket_size=parallelism.bucket_size,
        use_distributed_optimizer=parallelism.distributed_optimizer,
    )


def to_optimizer_config(training: TrainingConfig, parallelism: ParallelismConfig) -> OptimizerConfig:
    """Megatron's Adam (decoupled weight decay) with grad clipping; distributed (ZeRO-1) if asked.

    fp16 uses Megatron's dynamic loss scaler (``loss_scale=None``): an overflowing step is skipped and the
    scale halved (after ``hysteresis`` overflows), then grown again every ``loss_scale_window`` clean steps.
    """
    return OptimizerConfig(
        optimizer="adam",
        lr=training.lr,
        min_lr=training.min_lr,
        weight_decay=training.weight_decay,
        adam_beta1=training.adam_beta1,
        adam_beta2=training.adam_beta2,
        adam_eps=1e-8,
        clip_grad=training.clip_grad,
        bf16=training.precision == "bf16",
        fp16=training.precision == "fp16",
        params_dtype=params_dtype(training),
        loss_scale=None,  # dynamic
        initial_loss_scale=training.initial_loss_scale,
        min_loss_scale=1.0,
        loss_scale_window=training.loss_scale_window,
        hysteresis=training.hysteresis,
        use_distributed_optimizer=parallelism.distributed_optimizer,
        overlap_param_gather=parallelism.overlap_param_gather,  # the same value as the DDP config's (Megatron)
    )


def init_tp_comm_overlap(model: ModelConfig, parallelism: ParallelismConfig, training: TrainingConfig) -> None:
    """TransformerEngine's userbuffers for ``parallelism.tp_comm_overlap``, before the model is built, as
    Megatron-LM's ``_initialize_tp_communicators`` does (TE >= 1.9, default buffer configs)."""
    from transformer_engine.pytorch import module as te_module

    shape = [model.seq_length * training.micro_batch_size // parallelism.cp, model.hidden_size]
    te_module.base.initialize_ub(shape=shape, tp_size=parallelism.tp, use_fp8=training.precision == "fp8",
                                 dtype=params_dtype(training))


def fused_softmax_available() -> bool:
    """Megatron-LM's compiled softmax kernels: not in the megatron-core wheel. With the fusion on
    and the module absent, the first bf16 attention forward raises ModuleNotFoundError."""
    import importlib.util

    return importlib.util.find_spec("scaled_upper_triang_masked_softmax_cuda") is not None


def have_transformer_engine() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # ImportError, or a broken install raising at import
        return False
    return True


def layer_spec(model: ModelConfig, *, use_te: bool):
    """TransformerEngine spec when TE is importable (GPU), Megatron's local spec otherwise."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    experts = model.num_experts if (model.num_experts or 0) > 1 else None
    if use_te:
        return specs.get_gpt_layer_with_transformer_engine_spec(num_experts=experts, moe_grouped_gemm=False)
    return specs.get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False, normalization=model.normalization)


def build_model_chunks(
    model: ModelConfig, config: TransformerConfig, tp: int, *, use_te: bool, device: torch.device
) -> List[torch.nn.Module]:
    """One GPTModel per virtual pipeline stage held by this rank (one without vpp)."""
    from megatron.core.models.gpt import GPTModel

    spec = layer_spec(model, use_te=use_te)
    vpp = config.virtual_pipeline_model_parallel_size
    stages = range(vpp) if vpp else [None]
    chunks = []
    for vp in stages:
        chunk = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=padded_vocab_size(model, tp),
            max_sequence_length=model.max_position_embeddings or model.seq_length,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
            share_embeddings_and_output_weights=not model.untie_embeddings_and_output_weights,
            position_embedding_type=model.position_embedding_type,
            rotary_base=model.rotary_base,
            parallel_output=True,
            vp_stage=vp,
        )
        chunks.append(chunk.to(device))
    return chunks


def _global_names(chunk: torch.nn.Module, model: ModelConfig):
    """(global name, param) for a chunk: local layer indices -> global ones, local experts -> global."""
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    layer_names = {}
    decoder = getattr(chunk, "decoder", None)
    if decoder is not None:
        for i, layer in enumerate(decoder.layers):
            layer_names[f"decoder.layers.{i}."] = f"decoder.layers.{layer.layer_number - 1}."
    for name, p in chunk.named_parameters():
        gname = name
        for local, glob in layer_names.items():
            if name.startswith(local):
                gname = glob + name[len(local):]
                break
        if ".local_experts." in gname:
            head, tail = gname.split(".local_experts.", 1)
            idx, rest = tail.split(".", 1)
            n_local = (model.num_experts or 1) // parallel_state.get_expert_model_parallel_world_size()
            gname = f"{head}.local_experts.{ep_rank * n_local + int(idx)}.{rest}"
        if gname == "output_layer.weight" and not model.untie_embeddings_and_output_weights:
            gname = "embedding.word_embeddings.weight"  # tied: the same values on both ends
        yield gname, p


def init_layout_independent(chunks: List[torch.nn.Module], model: ModelConfig, seed: int, std: float = 0.02) -> None:
    """Draw each weight matrix from (seed, global name) on its full shape; keep this rank's slice.

    Normal(0, std) like Megatron's ``init_method_normal``; the residual-output projections
    (``linear_proj``, ``linear_fc2``) use ``std / sqrt(2 * num_layers)`` like its scaled
    init. Norm weights (ones) and biases (zeros) are already layout independent.
    """
    scaled = std / math.sqrt(2.0 * model.num_layers)
    for chunk in chunks:
        for gname, p in _global_names(chunk, model):
            if p.dim() < 2 or "norm" in gname.split(".")[-2] or gname.endswith("bias"):
                continue
            dim, _stride, _rank, world = _tp_split(p)
            full_shape = list(p.shape)
            full_shape[dim] *= world
            # drawn on the parameter's device: the same values for every layout on one device type
            gen = torch.Generator(device=p.device).manual_seed(seed * 1_000_003 + zlib.crc32(gname.encode()))
            s = scaled if gname.endswith(("linear_proj.weight", "linear_fc2.weight")) else std
            full = torch.empty(full_shape, dtype=torch.float32, device=p.device).normal_(0.0, s, generator=gen)
            with torch.no_grad():
                p.copy_(rank_slice(full, p).to(dtype=p.dtype))


def _tp_split(p: torch.nn.Parameter) -> tuple[int, int, int, int]:
    """(partition dim, stride, rank, world) of a parameter's tensor-parallel split; (0, 1, 0, 1) if unsplit."""
    if not getattr(p, "tensor_model_parallel", False):
        return 0, 1, 0, 1
    if not getattr(p, "allreduce", True):  # an expert's weight: the expert tensor-parallel group
        rank = parallel_state.get_expert_tensor_parallel_rank()
        world = parallel_state.get_expert_tensor_parallel_world_size()
    else:
        rank = parallel_state.get_tensor_model_parallel_rank()
        world = parallel_state.get_tensor_model_parallel_world_size()
    return p.partition_dim, getattr(p, "partition_stride", 1), rank, world


def rank_slice(full: torch.Tensor, p: torch.nn.Parameter) -> torch.Tensor:
    """This rank's piece of the full (TP1) tensor of parameter ``p``, with the interleaving of Megatron's
    ``_initialize_affine_weight_cpu`` (a stride-2 SwiGLU ``linear_fc1`` holds ``[gate_r; up_r]``)."""
    dim, stride, rank, world = _tp_split(p)
    if world == 1:
        return full
    pieces = torch.split(full, full.shape[dim] // (world * stride), dim=dim)
    return torch.cat(pieces[rank::world], dim=dim)
