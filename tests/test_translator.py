"""The one translator from our model config to Megatron-Core's TransformerConfig (no training)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from launch.compose import compose_job
from train.megatron_model import padded_vocab_size, to_ddp_config, to_optimizer_config, to_transformer_config

MODELS = sorted(p.stem for p in (Path(__file__).resolve().parent.parent / "hydra_conf" / "model").glob("*.yaml"))


def _config(*overrides: str, cuda: bool = False):
    job = compose_job(list(overrides))
    return job, to_transformer_config(job.model, job.parallelism, job.training, cuda=cuda)


def test_tiny_maps_every_shape_field():
    job, cfg = _config("model=tiny", "parallelism=tp2_sp")
    m = job.model
    assert (cfg.num_layers, cfg.hidden_size, cfg.ffn_hidden_size) == (m.num_layers, m.hidden_size, m.ffn_hidden_size)
    assert (cfg.num_attention_heads, cfg.num_query_groups) == (4, 2)  # GQA
    assert cfg.kv_channels == 16  # hidden / heads when unset
    assert cfg.gated_linear_unit and cfg.activation_func is F.silu  # SwiGLU
    assert cfg.normalization == "RMSNorm" and cfg.add_bias_linear is False
    assert cfg.tensor_model_parallel_size == 2 and cfg.sequence_parallel is True
    assert cfg.hidden_dropout == 0.0 and cfg.attention_dropout == 0.0
    assert cfg.params_dtype == torch.float32 and not cfg.bf16  # tiny trains in fp32
    assert cfg.use_cpu_initialization and cfg.num_moe_experts is None


def test_mha_gelu_bias_layernorm_model():
    _, cfg = _config("model=125m", "parallelism=tp1", "model.swiglu=false", "model.add_bias_linear=true",
                     "model.normalization=LayerNorm", "model.num_query_groups=null")
    assert not cfg.gated_linear_unit and cfg.activation_func is F.gelu
    assert cfg.add_bias_linear and cfg.normalization == "LayerNorm"
    assert cfg.num_query_groups == cfg.num_attention_heads  # MHA


def test_moe_and_expert_parallel():
    job, cfg = _config("model=mixtral_8x7b")
    assert cfg.num_moe_experts == 8 and cfg.moe_router_topk == 2
    assert cfg.moe_ffn_hidden_size == job.model.ffn_hidden_size
    assert cfg.expert_model_parallel_size == job.parallelism.ep
    assert cfg.bf16 and cfg.params_dtype == torch.bfloat16
    _, top1 = _config("model=mixtral_8x7b", "model.moe_router_topk=1")  # Switch-style routing
    assert top1.moe_router_topk == 1 and top1.moe_router_pre_softmax


def test_pipeline_fields():
    _, cfg = _config("model=1.3b", "parallelism.pp=2", "parallelism.vpp=2", "parallelism.tp=1",
                     "parallelism.account_for_embedding_in_pipeline_split=false", "parallelism.recompute=full")
    assert cfg.pipeline_model_parallel_size == 2 and cfg.virtual_pipeline_model_parallel_size == 2
    assert cfg.recompute_granularity == "full" and cfg.recompute_method == "uniform"
    assert cfg.pipeline_dtype == cfg.params_dtype


def test_account_for_embedding_and_loss_in_pipeline_split():
    _, cfg = _config("model=tiny", "parallelism=pp2", "model.num_layers=6",
                     "parallelism.account_for_embedding_in_pipeline_split=true",
                     "parallelism.account_for_loss_in_pipeline_split=true")
    assert cfg.account_for_embedding_in_pipeline_split and cfg.account_for_loss_in_pipeline_split


@pytest.mark.parametrize("model", MODELS)
def test_every_shipped_model_translates_with_its_recipe(model):
    job, cfg = _config(f"model={model}")
    assert cfg.num_layers == job.model.num_layers
    assert cfg.tensor_model_parallel_size == job.parallelism.tp
    assert cfg.pipeline_model_parallel_size == job.parallelism.pp
    assert cfg.sequence_parallel == job.parallelism.sequence_parallel
    assert (cfg.num_moe_experts or None) == (job.model.num_experts if (job.model.num_experts or 0) > 1 else None)


def test_every_model_field_reaches_megatron_or_the_gpt_model():
    """Changing a shape field changes the TransformerConfig, unless it is a GPTModel argument."""
    job = compose_job(["model=tiny", "parallelism=tp1"])
    gpt_model_args = {"name", "seq_length", "max_position_embeddings", "vocab_size", "make_vocab_size_divisible_by",
                      "position_embedding_type", "rotary_base", "untie_embeddings_and_output_weights"}
    base = to_transformer_config(job.model, job.parallelism, job.training)
    changed = {
        "num_layers": 6, "hidden_size": 128, "ffn_hidden_size": 512, "num_attention_heads": 8,
        "num_query_groups": 4, "kv_channels": 32, "swiglu": False, "normalization": "LayerNorm",
        "add_bias_linear": True, "num_experts": 4, "moe_router_topk": 4, "moe_ffn_hidden_size": 128,
        "attention_backend": "unfused",
    }
    fields = {f.name for f in dataclasses.fields(job.model)}
    assert fields == set(changed) | gpt_model_args, "a new ModelConfig field needs a line in the translator and here"
    for name, value in changed.items():
        model = dataclasses.replace(job.model, **{name: value})
        if name in ("moe_router_topk", "moe_ffn_hidden_size"):
            model = dataclasses.replace(model, num_experts=4)
            ref = to_transformer_config(dataclasses.replace(job.model, num_experts=4), job.parallelism, job.training)
        else:
            ref = base
        assert to_transformer_config(model, job.parallelism, job.training) != ref, name


def test_user_errors_are_raised_not_asserted():
    job = compose_job(["model=tiny"])
    with pytest.raises(ValueError, match="recompute"):
        to_transformer_config(job.model, dataclasses.replace(job.parallelism, recompute="some"), job.training)
    with pytest.raises(ValueError, match="precision"):
        to_transformer_config(job.model, job.parallelism, dataclasses.replace(job.training, precision="fp8"))
    with pytest.raises(ValueError, match="normalization"):
        to_transformer_config(dataclasses.replace(job.model, normalization="L1"), job.parallelism, job.training)


def test_padded_vocab_does_not_depend_on_tp():
    job = compose_job(["model=tiny"])
    assert {padded_vocab_size(job.model, tp) for tp in (1, 2, 4, 8)} == {320}  # 257 -> 5 * 64
    llama = compose_job(["model=7b"]).model
    assert padded_vocab_size(llama, 8) == 32000  # already a multiple of 128 (Megatron-LM: 32768 at tp 8)
    odd = dataclasses.replace(job.model, make_vocab_size_divisible_by=64)
    assert padded_vocab_size(odd, 3) % 3 == 0 and padded_vocab_size(odd, 3) % 64 == 0


def test_overlap_options_reach_the_ddp_and_optimizer_configs():
    job = compose_job(["model=7b", "parallelism.overlap_grad_reduce=true", "parallelism.overlap_param_gather=true",
                       "parallelism.bucket_size=12345", "parallelism.tp_comm_overlap=true"])
    ddp = to_ddp_config(job.parallelism)
    assert ddp.overlap_grad_reduce and ddp.overlap_param_gather and ddp.bucket_size == 12345
    assert ddp.use_distributed_optimizer and ddp.grad_reduce_in_fp32
    opt = to_optimizer_config(job.training, job.parallelism)
    assert opt.overlap_param_gather and opt.use_distributed_optimizer  # Megatron wants the DDP config's value
    assert to_transformer_config(job.model, job.parallelism, job.training).tp_comm_overlap
    plain = compose_job(["model=7b", "parallelism.distributed_optimizer=false"])
    ddp = to_ddp_config(plain.parallelism)
    assert not (ddp.overlap_grad_reduce or ddp.overlap_param_gather or ddp.use_distributed_optimizer)
    assert ddp.bucket_size is None  # Megatron's default, max(40M, 1M * dp)
    assert not to_transformer_config(plain.model, plain.parallelism, plain.training).tp_comm_overlap


@pytest.mark.parametrize("precision,dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16),
                                             ("fp16", torch.float16)])
def test_precision_reaches_the_optimizer_with_dynamic_loss_scaling_for_fp16(precision, dtype):
    job = compose_job(["model=tiny", f"training.precision={precision}", "training.initial_loss_scale=4096",
                       "training.loss_scale_window=7", "training.hysteresis=1"])
    opt = to_optimizer_config(job.training, job.parallelism)
    assert (opt.bf16, opt.fp16, opt.params_dtype) == (precision == "bf16", precision == "fp16", dtype)
    assert opt.loss_scale is None  # dynamic, never a static scale
    assert (opt.initial_loss_scale, opt.loss_scale_window, opt.hysteresis) == (4096, 7, 1)
    cfg = to_transformer_config(job.model, job.parallelism, job.training)
    assert (cfg.bf16, cfg.fp16, cfg.params_dtype) == (precision == "bf16", precision == "fp16", dtype)
