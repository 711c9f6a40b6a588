"""The Hugging Face side of a model, torch-free: which HF architecture a model maps to, and whether an HF
checkpoint's ``config.json`` fits a job (``training.init_from=hf:DIR``).

Both sides read this module: the job check refuses a shape mismatch at submit from ``config.json`` alone
(no torch on the login node), and the ranks and ``python -m train.export`` map the weights
(:mod:`train.hf_bridge`) for the architecture named here.

Two families are mapped: a dense decoder with SwiGLU, RoPE and RMSNorm (GQA or MHA, biases or not, tied or
untied output layer) is exactly ``LlamaForCausalLM``; one with a GeLU MLP, LayerNorm and learned absolute
positions (MHA; GPT-3 style) is exactly ``GPT2LMHeadModel`` (exact GeLU; zero biases where Megatron has none).
Everything else (MoE, mixed choices) is refused in one line naming what fits neither. Only a Llama
initialises a run (``training.init_from``).
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable, Optional, Union

from launch.problems import Problem

HF_PREFIX = "hf:"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
LLAMA = "LlamaForCausalLM"
GPT2 = "GPT2LMHeadModel"
NORM_EPS = 1e-5  # Megatron-Core's TransformerConfig.layernorm_epsilon (the translator keeps the default)
# training.precision -> the dtype of the exported weights by default (fp8 trains bf16 weights)
EXPORT_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp8": "bfloat16"}


def llama_misfits(model: Any) -> list[str]:
    """What of ``model`` has no ``LlamaForCausalLM`` equivalent (empty: it is a Llama)."""
    why = []
    if not model.swiglu:
        why.append("a GeLU MLP (model.swiglu=false)")
    if model.normalization != "RMSNorm":
        why.append(f"{model.normalization} (model.normalization)")
    if model.position_embedding_type != "rope":
        why.append(f"{model.position_embedding_type} positions (model.position_embedding_type)")
    if (model.num_experts or 0) > 1:
        why.append(f"{model.num_experts} experts (model.num_experts)")
    return why


def gpt2_misfits(model: Any) -> list[str]:
    """What of ``model`` has no ``GPT2LMHeadModel`` equivalent (empty: it is a GPT-2/GPT-3-style model)."""
    why = []
    if model.swiglu:
        why.append("a SwiGLU MLP (model.swiglu=true)")
    if model.normalization != "LayerNorm":
        why.append(f"{model.normalization} (model.normalization)")
    if model.position_embedding_type != "learned_absolute":
        why.append(f"{model.position_embedding_type} positions (model.position_embedding_type)")
    if (model.num_experts or 0) > 1:
        why.append(f"{model.num_experts} experts (model.num_experts)")
    if query_groups(model) != model.num_attention_heads:
        why.append(f"grouped-query attention (model.num_query_groups {query_groups(model)} < "
                   f"{model.num_attention_heads} heads)")
    if head_dim(model) * model.num_attention_heads != model.hidden_size:
        why.append(f"a head dimension {head_dim(model)} x {model.num_attention_heads} heads != hidden_size "
                   f"{model.hidden_size}")
    return why


def architecture(model: Any) -> Optional[str]:
    """The Hugging Face class an export of ``model`` is: Llama, GPT-2, or None (no equivalent)."""
    if not llama_misfits(model):
        return LLAMA
    if not gpt2_misfits(model):
        return GPT2
    return None


def unsupported(model: Any) -> Optional[str]:
    """Why ``model`` has no Hugging Face equivalent this toolkit maps (None: it has one)."""
    if architecture(model) is not None:
        return None
    return (f"no Hugging Face architecture fits this model: as {LLAMA} it has {', '.join(llama_misfits(model))}; "
            f"as {GPT2} it has {', '.join(gpt2_misfits(model))}")


def head_dim(model: Any) -> int:
    return model.kv_channels or model.hidden_size // model.num_attention_heads


def query_groups(model: Any) -> int:
    return model.num_query_groups or model.num_attention_heads


def llama_fields(model: Any, padded_vocab: int) -> dict:
    """The ``LlamaConfig`` arguments of ``model`` with ``padded_vocab`` ids (an export gives the tokenizer's,
    ``model.vocab_size``; the check compares with the padded one the ranks build and accepts either)."""
    return {
        "vocab_size": padded_vocab,
        "hidden_size": model.hidden_size,
        "intermediate_size": model.ffn_hidden_size,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_attention_heads,
        "num_key_value_heads": query_groups(model),
        "head_dim": head_dim(model),
        "hidden_act": "silu",
        "max_position_embeddings": model.max_position_embeddings or model.seq_length,
        "rms_norm_eps": NORM_EPS,
        "rope_theta": float(model.rotary_base),
        "tie_word_embeddings": not model.untie_embeddings_and_output_weights,
        "attention_bias": bool(model.add_bias_linear),
        "mlp_bias": bool(model.add_bias_linear),
    }


def gpt2_fields(model: Any, padded_vocab: int) -> dict:
    """The ``GPT2Config`` arguments of a GPT-2/GPT-3-style ``model`` (exact GeLU as Megatron's ``F.gelu``)."""
    return {
        "vocab_size": padded_vocab,
        "n_embd": model.hidden_size,
        "n_layer": model.num_layers,
        "n_head": model.num_attention_heads,
        "n_inner": model.ffn_hidden_size,
        "n_positions": model.max_position_embeddings or model.seq_length,
        "activation_function": "gelu",
        "layer_norm_epsilon": NORM_EPS,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
        "tie_word_embeddings": not model.untie_embeddings_and_output_weights,
    }


def rope_theta(cfg: dict) -> Optional[float]:
    """RoPE base of an HF config: ``rope_theta`` (transformers 4) or ``rope_parameters.rope_theta`` (5)."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and params.get("rope_theta") is not None:
        return float(params["rope_theta"])
    return float(cfg["rope_theta"]) if cfg.get("rope_theta") is not None else None


def hf_dir(init_from: str) -> Optional[Path]:
    """The directory of ``training.init_from=hf:DIR`` ('' -> None)."""
    if not init_from:
        return None
    return Path(init_from[len(HF_PREFIX):]).expanduser() if init_from.startswith(HF_PREFIX) else None


INDEX_MAX_BYTES = 64 << 20  # an index of a 405B model is a few MB


def index_shards(index: Any) -> Union[list, str]:
    """The shard files a ``model.safetensors.index.json`` document names (sorted), or why it names none usable: its
    ``weight_map`` must map tensor names to ``*.safetensors`` file names in the same directory."""
    wmap = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(wmap, dict) or not wmap:
        return "no weight_map of tensor names to shard files"
    shards = sorted({v for v in wmap.values() if isinstance(v, str)})
    bad = [v for v in wmap.values() if not isinstance(v, str) or not v.endswith(".safetensors") or "/" in v]
    if bad:
        return f"weight_map names {bad[0]!r}, not a .safetensors file of this directory (only safetensors are read)"
    return shards


def read_config(directory: Path) -> dict:
    """``DIR/config.json`` as a dict (OSError / ValueError on a missing or bad file)."""
    doc = json.loads((Path(directory) / CONFIG_FILE).read_text(encoding="utf-8"))
    if not isinstance(doc, dict):
        raise ValueError("config.json is not a JSON object")
    return doc


def shape_problems(model: Any, padded_vocab: int, cfg: dict, field: str = "training.init_from") -> list[Problem]:
    """Every way an HF ``config.json`` (``cfg``) does not fit ``model``: each with the arithmetic and the fix."""
    archs = cfg.get("architectures") or []
    if cfg.get("model_type") != "llama" and LLAMA not in archs:
        return [Problem(field, "only Llama checkpoints (LlamaForCausalLM) can initialise a run",
                        f"config.json: model_type {cfg.get('model_type')!r}, architectures {archs}",
                        "export a Llama-style checkpoint, or start without training.init_from")]
    want = llama_fields(model, padded_vocab)
    heads = cfg.get("num_attention_heads")
    got = {
        "hidden_size": cfg.get("hidden_size"),
        "num_hidden_layers": cfg.get("num_hidden_layers"),
        "num_attention_heads": heads,
        "num_key_value_heads": cfg.get("num_key_value_heads", heads),
        "intermediate_size": cfg.get("intermediate_size"),
        "vocab_size": cfg.get("vocab_size"),
        "head_dim": cfg.get("head_dim") or (cfg["hidden_size"] // heads
                                            if isinstance(cfg.get("hidden_size"), int) and isinstance(heads, int)
                                            and heads > 0 else None),
        "rope_theta": rope_theta(cfg),
        "rms_norm_eps": cfg.get("rms_norm_eps"),
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "attention_bias": bool(cfg.get("attention_bias", False)),
        "mlp_bias": bool(cfg.get("mlp_bias", False)),
    }
    ours = {  # HF name -> (our field, how to set it)
        "hidden_size": "model.hidden_size", "num_hidden_layers": "model.num_layers",
        "num_attention_heads": "model.num_attention_heads", "num_key_value_heads": "model.num_query_groups",
        "intermediate_size": "model.ffn_hidden_size", "head_dim": "model.kv_channels",
        "rope_theta": "model.rotary_base", "tie_word_embeddings": "model.untie_embeddings_and_output_weights",
        "attention_bias": "model.add_bias_linear", "mlp_bias": "model.add_bias_linear",
    }
    out = []
    for key, mine in want.items():
        if key not in got:
            continue
        theirs = got[key]
        if key in ("rope_theta", "rms_norm_eps"):
            same = isinstance(theirs, (int, float)) and math.isclose(float(theirs), float(mine), rel_tol=1e-9)
        else:
            same = theirs == mine
        if same or (key == "vocab_size" and theirs == model.vocab_size):  # the tokenizer's (an export): padded back
            continue
        if key == "vocab_size":
            out.append(Problem(
                field, "the HF vocabulary differs from the one this job builds",
                f"config.json vocab_size {theirs} is neither model.vocab_size {model.vocab_size} nor the padded "
                f"vocabulary {padded_vocab} (model.vocab_size padded to a multiple of "
                f"model.make_vocab_size_divisible_by {model.make_vocab_size_divisible_by} and of tp)",
                f"set model.vocab_size={theirs} and a model.make_vocab_size_divisible_by that divides {theirs}"))
        elif key == "rms_norm_eps":
            out.append(Problem(field, "the HF model normalises with another epsilon than Megatron-Core's RMSNorm",
                               f"config.json rms_norm_eps {theirs} != {NORM_EPS}",
                               "initialise from a checkpoint with rms_norm_eps 1e-05"))
        elif key == "tie_word_embeddings":
            out.append(Problem(field, "the HF model and this job tie the output layer differently",
                               f"config.json tie_word_embeddings {theirs} != not model.untie_embeddings_and_output_"
                               f"weights ({mine})",
                               f"set model.untie_embeddings_and_output_weights={str(not theirs).lower()}"))
        elif key in ("attention_bias", "mlp_bias"):
            if key == "mlp_bias" and any(p.arithmetic.startswith("config.json attention_bias") for p in out):
                continue
            out.append(Problem(field, "the HF model and this job differ in linear-layer biases",
                               f"config.json {key} {theirs} != model.add_bias_linear {mine}",
                               f"set model.add_bias_linear={str(theirs).lower()}" if
                               got["attention_bias"] == got["mlp_bias"] else
                               "attention and MLP biases must agree (Megatron's add_bias_linear sets both)"))
        else:
            out.append(Problem(field, f"the HF model's {key} differs from this job's {ours[key]}",
                               f"config.json {key} {theirs} != {ours[key]} {mine}",
                               f"set {ours[key]}={theirs}"))
    return out


def init_from_problems(job: Any, path_exists: Callable[[str], bool],
                       read: Callable[[Path], dict] = read_config) -> list[Problem]:
    """The job check's rule for ``training.init_from``: the form, the files, the architecture, the shapes."""
    init_from = job.training.init_from
    if not init_from:
        return []
    field = "training.init_from"
    if not init_from.startswith(HF_PREFIX) or not init_from[len(HF_PREFIX):]:
        return [Problem(field, "a run initialises from a Hugging Face model directory",
                        f"training.init_from={init_from!r}", "set training.init_from=hf:DIR (DIR holds config.json "
                        "and model.safetensors) or leave it empty")]
    if misfits := llama_misfits(job.model):
        return [Problem(field, "only Llama-style models initialise from Hugging Face weights",
                        f"this model has {', '.join(misfits)}",
                        "use a Llama-style model (model.swiglu=true, rope, RMSNorm, dense)")]
    directory = hf_dir(init_from)
    if not path_exists(str(directory / CONFIG_FILE)):
        return [Problem(field, "no Hugging Face model there", f"{directory / CONFIG_FILE} does not exist",
                        "point training.init_from=hf:DIR at a directory written by save_pretrained")]
    if not (path_exists(str(directory / WEIGHTS_FILE)) or path_exists(str(directory / WEIGHTS_INDEX))):
        return [Problem(field, "no safetensors weights there",
                        f"neither {WEIGHTS_FILE} nor {WEIGHTS_INDEX} in {directory}",
                        "save the HF model with safe_serialization (the default), or convert its .bin weights")]
    if not path_exists(str(directory / WEIGHTS_FILE)):
        try:
            shards = index_shards(json.loads((directory / WEIGHTS_INDEX).read_bytes()[:INDEX_MAX_BYTES + 1]))
        except (OSError, ValueError) as e:
            shards = f"cannot be read ({e})"
        if isinstance(shards, str):
            return [Problem(field, "the weights' index cannot be used", f"{directory / WEIGHTS_INDEX}: {shards}",
                            "point training.init_from at a directory written by save_pretrained (safetensors)")]
        missing = [s for s in shards if not path_exists(str(directory / s))]
        if missing:
            return [Problem(field, "a shard the weights' index names is missing",
                            f"{directory / missing[0]} does not exist ({len(missing)} of {len(shards)} missing)",
                            "copy the whole Hugging Face directory")]
    try:
        cfg = read(directory)
    except (OSError, ValueError, UnicodeDecodeError) as e:
        return [Problem(field, "config.json cannot be read", f"{directory / CONFIG_FILE}: {e}",
                        "point training.init_from at a directory written by save_pretrained")]
    return shape_problems(job.model, job.padded_vocab_size, cfg, field)
