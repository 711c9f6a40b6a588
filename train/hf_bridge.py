"""Megatron-Core GPT weights <-> Hugging Face Llama weights (-> GPT-2 for GPT-3-style models), and the one-process
model of a checkpoint.

Written by hand because neither existing bridge installs here: Megatron-Bridge needs TransformerEngine (CUDA
builds), mamba-ssm and ``megatron-core[dev,mlm]``, and Megatron-Core's wheel has no HF converter
(Megatron-LM's ``tools/checkpoint`` drives Megatron-LM's own argument parser and training loop).

The mapping works on *full* (TP1) tensors named as a TP1/PP1 model names them (``decoder.layers.{global}.``);
two Megatron fusions are split here:

* ``linear_qkv``: rows grouped per query group ``g``: ``[q (heads/groups * d), k (d), v (d)]`` for each group
  in turn (so a TP shard holds whole groups);
* ``linear_fc1`` (SwiGLU): ``[gate; up]`` on the full tensor (a TP shard holds ``[gate_r; up_r]``:
  ``partition_stride`` 2, which :func:`train.megatron_model.rank_slice` follows).

Megatron's RoPE rotates the two halves of each head (``rotary_interleaved=False``), as HF Llama does: no
permutation of q/k rows is needed. The export trims the padded vocabulary to the tokenizer's (``model.vocab_size``:
a generating model cannot pick an id its tokenizer cannot decode) and keeps the rows it cut in
:data:`VOCAB_PADDING_FILE`, beside the weights; an import pads back to the job's padded size with those rows (the
padded rows are part of the softmax the run trained with, so a run started from the export continues with the same
loss), or with zero rows for a model that has no such file.
"""
from __future__ import annotations

import contextlib
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any, Dict, Iterator

import torch

from launch import hf_config
from train.distributed import quiet_known_warnings

Tensors = Dict[str, torch.Tensor]

# the TransformerEngine spec fuses the norms into the next linear layer; checkpoints use these names for both
TE_ALIASES = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
              "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
              "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
              "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias"}


VOCAB_PADDING_FILE = "slurmtron_vocab_padding.safetensors"  # the padded rows an export cut, by Megatron name
VOCAB_ROWS = ("embedding.word_embeddings.weight", "output_layer.weight")  # the tensors with a row per token id


def trim_vocab(full: Tensors, vocab: int) -> tuple:
    """(``full`` with the embedding and output layer cut to the first ``vocab`` rows, the rows cut off by name)."""
    kept, padding = dict(full), {}
    for name in VOCAB_ROWS:
        if name in full and full[name].shape[0] > vocab:
            kept[name], padding[name] = full[name][:vocab], full[name][vocab:].contiguous()
    return kept, padding


def pad_vocab(full: Tensors, padded_vocab: int, padding: Tensors) -> Tensors:
    """``full`` with the embedding and output layer padded back to ``padded_vocab`` rows: the rows of ``padding``
    (what the export cut) as far as they go, zero rows after them."""
    out = dict(full)
    for name in VOCAB_ROWS:
        t = out.get(name)
        if t is None or t.shape[0] >= padded_vocab:
            continue
        rows = torch.zeros((padded_vocab - t.shape[0], *t.shape[1:]), dtype=t.dtype)
        saved = padding.get(name)
        if saved is not None and tuple(saved.shape[1:]) == tuple(t.shape[1:]):
            n = min(rows.shape[0], saved.shape[0])
            rows[:n] = saved[:n].to(t.dtype)
        out[name] = torch.cat([t, rows], dim=0)
    return out


def local_name(gname: str) -> str:
    """A TE-spec parameter name as the local spec (and this mapping) names it."""
    for te, local in TE_ALIASES.items():
        if gname.endswith("." + te):
            return gname[: -len(te)] + local
    return gname


def to_hf(sd: Tensors, model: Any) -> Tensors:
    """Full Megatron tensors (TP1 names, TE or local spec) -> ``LlamaForCausalLM`` state dict."""
    sd = {local_name(k): v for k, v in sd.items() if not k.endswith("_extra_state")}
    out = {"model.embed_tokens.weight": sd["embedding.word_embeddings.weight"],
           "model.norm.weight": sd["decoder.final_layernorm.weight"]}
    if model.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = sd["output_layer.weight"]
    for i in range(model.num_layers):
        m, a, f = f"decoder.layers.{i}.", f"decoder.layers.{i}.self_attention.", f"decoder.layers.{i}.mlp."
        hf = f"model.layers.{i}."
        out[hf + "input_layernorm.weight"] = sd[m + "input_layernorm.weight"]
        out[hf + "post_attention_layernorm.weight"] = sd[m + "pre_mlp_layernorm.weight"]
        for suffix in ("weight", "bias"):
            qkv = sd.get(a + "linear_qkv." + suffix)
            if qkv is None:
                continue
            q, k, v = _qkv_split(qkv, model)
            out[hf + "self_attn.q_proj." + suffix], out[hf + "self_attn.k_proj." + suffix] = q, k
            out[hf + "self_attn.v_proj." + suffix] = v
            out[hf + "self_attn.o_proj." + suffix] = sd[a + "linear_proj." + suffix]
            gate, up = sd[f + "linear_fc1." + suffix].chunk(2, dim=0)
            out[hf + "mlp.gate_proj." + suffix], out[hf + "mlp.up_proj." + suffix] = gate, up
            out[hf + "mlp.down_proj." + suffix] = sd[f + "linear_fc2." + suffix]
    return {k: v.contiguous() for k, v in out.items()}


def _qkv_split(qkv: torch.Tensor, model: Any) -> tuple:
    """Megatron's fused QKV (rows grouped per query group) -> (q, k, v), each in head order."""
    nq, g, d = model.num_attention_heads, hf_config.query_groups(model), hf_config.head_dim(model)
    per = nq // g
    rest = qkv.shape[1:]
    grouped = qkv.reshape(g, (per + 2) * d, *rest)
    return (grouped[:, : per * d].reshape(nq * d, *rest), grouped[:, per * d:(per + 1) * d].reshape(g * d, *rest),
            grouped[:, (per + 1) * d:].reshape(g * d, *rest))


def to_gpt2(sd: Tensors, model: Any) -> Tensors:
    """Full Megatron tensors of a GPT-3-style model (LayerNorm, GeLU, learned positions, MHA) -> ``GPT2LMHeadModel``.

    GPT-2's ``Conv1D`` layers hold ``[in, out]`` (the transpose of a Linear) and its ``c_attn`` is ``[q; k; v]``
    over all heads; GPT-2 always has biases: a Megatron model without them gets zeros (the same function)."""
    sd = {local_name(k): v for k, v in sd.items() if not k.endswith("_extra_state")}

    def bias(name: str, n: int) -> torch.Tensor:
        ref = sd["embedding.word_embeddings.weight"]
        return sd[name] if name in sd else torch.zeros(n, dtype=ref.dtype)

    h, f = model.hidden_size, model.ffn_hidden_size
    out = {"transformer.wte.weight": sd["embedding.word_embeddings.weight"],
           "transformer.wpe.weight": sd["embedding.position_embeddings.weight"],
           "transformer.ln_f.weight": sd["decoder.final_layernorm.weight"],
           "transformer.ln_f.bias": bias("decoder.final_layernorm.bias", h)}
    if model.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = sd["output_layer.weight"]
    for i in range(model.num_layers):
        m, a, mlp = f"decoder.layers.{i}.", f"decoder.layers.{i}.self_attention.", f"decoder.layers.{i}.mlp."
        hf = f"transformer.h.{i}."
        out[hf + "ln_1.weight"] = sd[m + "input_layernorm.weight"]
        out[hf + "ln_1.bias"] = bias(m + "input_layernorm.bias", h)
        out[hf + "ln_2.weight"] = sd[m + "pre_mlp_layernorm.weight"]
        out[hf + "ln_2.bias"] = bias(m + "pre_mlp_layernorm.bias", h)
        out[hf + "attn.c_attn.weight"] = torch.cat(_qkv_split(sd[a + "linear_qkv.weight"], model), dim=0).t()
        qkv_bias = sd.get(a + "linear_qkv.bias")
        out[hf + "attn.c_attn.bias"] = (torch.cat(_qkv_split(qkv_bias, model), dim=0) if qkv_bias is not None
                                        else bias(a + "linear_qkv.bias", 3 * h))
        out[hf + "attn.c_proj.weight"] = sd[a + "linear_proj.weight"].t()
        out[hf + "attn.c_proj.bias"] = bias(a + "linear_proj.bias", h)
        out[hf + "mlp.c_fc.weight"] = sd[mlp + "linear_fc1.weight"].t()
        out[hf + "mlp.c_fc.bias"] = bias(mlp + "linear_fc1.bias", f)
        out[hf + "mlp.c_proj.weight"] = sd[mlp + "linear_fc2.weight"].t()
        out[hf + "mlp.c_proj.bias"] = bias(mlp + "linear_fc2.bias", h)
    return {k: v.contiguous() for k, v in out.items()}


def to_hf_for(sd: Tensors, model: Any) -> Tensors:
    """The state dict of the Hugging Face class :func:`launch.hf_config.architecture` names for ``model``, whose
    vocabulary is the tokenizer's (``model.vocab_size``: the padded rows are cut, :func:`trim_vocab`)."""
    sd = trim_vocab(sd, model.vocab_size)[0]
    return to_gpt2(sd, model) if hf_config.architecture(model) == hf_config.GPT2 else to_hf(sd, model)


def from_hf(hf: Tensors, model: Any) -> Tensors:
    """``LlamaForCausalLM`` state dict -> full Megatron tensors (TP1 local-spec names); the inverse of :func:`to_hf`."""
    nq, g, d = model.num_attention_heads, hf_config.query_groups(model), hf_config.head_dim(model)
    per = nq // g
    out = {"embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
           "decoder.final_layernorm.weight": hf["model.norm.weight"]}
    if model.untie_embeddings_and_output_weights:
        out["output_layer.weight"] = hf["lm_head.weight"]
    for i in range(model.num_layers):
        m, a, f = f"decoder.layers.{i}.", f"decoder.layers.{i}.self_attention.", f"decoder.layers.{i}.mlp."
        src = f"model.layers.{i}."
        out[m + "input_layernorm.weight"] = hf[src + "input_layernorm.weight"]
        out[m + "pre_mlp_layernorm.weight"] = hf[src + "post_attention_layernorm.weight"]
        for suffix in ("weight", "bias"):
            q = hf.get(src + "self_attn.q_proj." + suffix)
            if q is None:
                continue
            rest = q.shape[1:]
            k, v = hf[src + "self_attn.k_proj." + suffix], hf[src + "self_attn.v_proj." + suffix]
            grouped = torch.cat([q.reshape(g, per * d, *rest), k.reshape(g, d, *rest), v.reshape(g, d, *rest)], dim=1)
            out[a + "linear_qkv." + suffix] = grouped.reshape(g * (per + 2) * d, *rest)
            out[a + "linear_proj." + suffix] = hf[src + "self_attn.o_proj." + suffix]
            out[f + "linear_fc1." + suffix] = torch.cat([hf[src + "mlp.gate_proj." + suffix],
                                                         hf[src + "mlp.up_proj." + suffix]], dim=0)
            out[f + "linear_fc2." + suffix] = hf[src + "mlp.down_proj." + suffix]
    return out


# ---- reading an HF model directory (safetensors only: no pickle) ------------------------------------

def read_hf_weights(directory: Path) -> Tensors:
    """Every tensor of ``DIR/model.safetensors`` or of the shards its index names."""
    import json

    from safetensors.torch import load_file

    directory = Path(directory)
    single = directory / hf_config.WEIGHTS_FILE
    if single.exists():
        return load_file(str(single))
    index = json.loads((directory / hf_config.WEIGHTS_INDEX).read_text(encoding="utf-8"))
    shards = hf_config.index_shards(index)
    if isinstance(shards, str):
        raise ValueError(f"{hf_config.WEIGHTS_INDEX}: {shards}")
    out: Tensors = {}
    for shard in shards:
        target = (directory / shard).resolve()
        if target.parent != directory.resolve():
            raise ValueError(f"{hf_config.WEIGHTS_INDEX} names {shard!r}, outside {directory}")
        out.update(load_file(str(target)))
    return out


def read_vocab_padding(directory: Path) -> Tensors:
    """The padded rows an export cut (:data:`VOCAB_PADDING_FILE`), {} for a model without that file."""
    from safetensors.torch import load_file

    path = directory / VOCAB_PADDING_FILE
    return load_file(str(path)) if path.exists() else {}


class HFWeightsError(ValueError):
    """An HF directory this run cannot start from; every rank reaches the same verdict (each reads all tensors)."""


def full_shapes(model: Any, padded_vocab: int) -> Dict[str, tuple]:
    """The full (TP1) shape of every Megatron tensor :func:`from_hf` must give ``model``."""
    h, f, v = model.hidden_size, model.ffn_hidden_size, padded_vocab
    nq, g, d = model.num_attention_heads, hf_config.query_groups(model), hf_config.head_dim(model)
    out = {"embedding.word_embeddings.weight": (v, h), "decoder.final_layernorm.weight": (h,)}
    if model.untie_embeddings_and_output_weights:
        out["output_layer.weight"] = (v, h)
    for i in range(model.num_layers):
        m = f"decoder.layers.{i}."
        out.update({m + "input_layernorm.weight": (h,), m + "pre_mlp_layernorm.weight": (h,),
                    m + "self_attention.linear_qkv.weight": ((nq + 2 * g) * d, h),
                    m + "self_attention.linear_proj.weight": (h, nq * d),
                    m + "mlp.linear_fc1.weight": (2 * f, h), m + "mlp.linear_fc2.weight": (h, f)})
        if model.add_bias_linear:
            out.update({m + "self_attention.linear_qkv.bias": ((nq + 2 * g) * d,),
                        m + "self_attention.linear_proj.bias": (h,), m + "mlp.linear_fc1.bias": (2 * f,),
                        m + "mlp.linear_fc2.bias": (h,)})
    return out


def read_full(directory: Path, model: Any, padded_vocab: int) -> Tensors:
    """An HF directory's weights as full Megatron tensors, each present with its shape, or HFWeightsError."""
    from safetensors import SafetensorError

    try:
        full = from_hf(read_hf_weights(directory), model)
        embedding = full.get(VOCAB_ROWS[0])
        if embedding is not None and embedding.shape[0] == model.vocab_size:  # the tokenizer's: pad it back
            full = pad_vocab(full, padded_vocab, read_vocab_padding(Path(directory)))
    except KeyError as e:
        raise HFWeightsError(f"{directory} has no tensor {e.args[0]} (is it a LlamaForCausalLM of this shape?)")
    except (OSError, ValueError, RuntimeError, SafetensorError) as e:  # SafetensorError: not a safetensors file
        raise HFWeightsError(f"cannot read the weights in {directory}: {(str(e).splitlines() or [''])[0][:300]}")
    for name, shape in full_shapes(model, padded_vocab).items():
        got = tuple(full[name].shape) if name in full else None
        if got != shape:
            raise HFWeightsError(f"{directory}: {name} has shape {got}, the model needs {shape}")
    return full


def load_into(chunks: list, model: Any, directory: Path, padded_vocab: int) -> int:
    """Copy an HF Llama model's weights into this rank's (unwrapped) model chunks, in any layout: each
    parameter gets its slice of the full tensor. Returns the number of parameters set; raises HFWeightsError
    (the job check compares config.json at submit; this checks the tensors themselves)."""
    from train.megatron_model import _global_names, rank_slice

    full = read_full(directory, model, padded_vocab)
    n = 0
    for chunk in chunks:
        for gname, p in _global_names(getattr(chunk, "module", chunk), model):
            mine = rank_slice(full[local_name(gname)], p)
            with torch.no_grad():
                p.copy_(mine.to(dtype=p.dtype, device=p.device))
            n += 1
    return n


# ---- one process holding a whole checkpoint -----------------------------------------------------------

@contextlib.contextmanager
def one_process() -> Iterator[None]:
    """A one-rank gloo group and Megatron's parallel state with tp = pp = 1, for this process only: what
    ``dist_checkpointing`` needs to read a checkpoint of any layout into one model (no launcher, no Slurm)."""
    import torch.distributed as dist

    quiet_known_warnings({})  # before Megatron-Core's first import (train.megatron_model and cpu_shim import it)
    from megatron.core import parallel_state, tensor_parallel

    from train import cpu_shim

    if not torch.cuda.is_available():
        cpu_shim.apply()
    store = tempfile.mkdtemp(prefix="slurmtron-export-")
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}/store", rank=0, world_size=1)
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
        tensor_parallel.model_parallel_cuda_manual_seed(0)  # its RNG tracker (no dropout: nothing is drawn)
        yield
    finally:
        parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()
        shutil.rmtree(store, ignore_errors=True)


def single_rank_job(job: Any) -> Any:
    """The same model on one process: tp = pp = cp = ep = 1, no vpp/SP (inside :func:`one_process`)."""
    par = replace(job.parallelism, tp=1, pp=1, vpp=None, cp=1, ep=1, sequence_parallel=False,
                  tp_comm_overlap=False)
    return replace(job, parallelism=par, cluster=replace(job.cluster, nodes=1, gpus_per_node=1))


def load_checkpoint_model(job: Any, path: Path) -> torch.nn.Module:
    """The model of checkpoint ``path`` (saved in any layout) as one TP1/PP1 GPTModel on the CPU, inside
    :func:`one_process`. The caller has verified the checkpoint; the pickle allow-list is asked again here,
    right before torch reads it."""
    from megatron.core import dist_checkpointing

    from train import megatron_model
    from train.megatron_ckpt import refuse_unsafe_pickles

    one = single_rank_job(job)
    config = megatron_model.to_transformer_config(one.model, one.parallelism, one.training)
    # the vocabulary padded as the run built it (a multiple of lcm(divisible_by, its tp))
    chunk = megatron_model.build_model_chunks(one.model, config, job.parallelism.tp, use_te=False,
                                              device=torch.device("cpu"))[0]
    refuse_unsafe_pickles(path)
    state = dist_checkpointing.load({"model": chunk.sharded_state_dict()}, str(path))
    chunk.load_state_dict(state["model"])
    return chunk.eval()


def megatron_logits(chunk: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """[batch, seq, padded vocab] fp32 logits of a TP1/PP1 GPTModel (causal attention, positions 0..s-1)."""
    positions = torch.arange(tokens.shape[1], dtype=torch.int64).unsqueeze(0).expand_as(tokens)
    with torch.no_grad():
        out = chunk(tokens, positions, None)
    return out.float()


def full_state(chunk: torch.nn.Module, model: Any) -> Tensors:
    """The full tensors of a TP1/PP1 chunk by global name (the tied output layer is the embedding)."""
    from train.megatron_model import _global_names

    return {local_name(g): p.detach() for g, p in _global_names(chunk, model)}
