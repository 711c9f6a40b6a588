"""Parameter counts and the pipeline split of a model, as Megatron-Core lays them out.

Memory, step time and checkpoint size all start from "how many parameters live on which GPU";
this module answers that once. Counts follow Megatron's modules (``GPTModel`` with
``TransformerLayer``): QKV and output projections, the MLP (two matrices, three with SwiGLU),
two norms per layer, the word embedding, an optional learned position embedding, the output
layer (or a copy of the tied embedding on the last stage when pp > 1), and a final norm.

Login-node code: no torch, no megatron.
"""
from __future__ import annotations

from dataclasses import dataclass

from launch import vocab as vocab_mod
from launch.config import ModelConfig, ParallelismConfig


@dataclass(frozen=True)
class Shape:
    """Sizes of one model, independent of the layout except for the tp-padded vocabulary."""

    h: int  # hidden size
    q: int  # query width = heads * kv_channels
    kv: int  # key/value width = groups * kv_channels
    ffn: int  # dense MLP width
    heads: int
    layers: int
    vocab: int  # padded vocabulary (a multiple of lcm(make_vocab_size_divisible_by, tp), launch/vocab.py)
    seq: int
    attn_params: int  # per layer: QKV + output projection (+ biases)
    dense_mlp_params: int  # per layer, dense models (0 for MoE layers)
    expert_params: int  # per expert per layer (0 for dense models)
    num_experts: int  # 0 for dense
    topk: int
    norm_params: int  # per layer: two norms
    swiglu: bool
    embedding_params: int  # word embedding V*h
    position_params: int  # learned absolute position embedding (not tp-sharded), else 0
    output_params: int  # separate output layer V*h when untied, else 0
    final_norm_params: int
    tied: bool

    @property
    def layer_params(self) -> int:
        """All parameters of one transformer layer (all experts counted)."""
        return self.attn_params + self.dense_mlp_params + self.num_experts * self.expert_params + self.norm_params

    @property
    def total_params(self) -> int:
        return (self.layers * self.layer_params + self.embedding_params + self.position_params
                + self.output_params + self.final_norm_params)


def shape_of(model: ModelConfig, tp: int = 1) -> Shape:
    """Count the parameters of ``model`` with the vocabulary padded for ``tp`` (launch/vocab.py: the same in every layout)."""
    h = model.hidden_size
    heads = model.num_attention_heads
    d = model.kv_channels or h // heads
    groups = model.num_query_groups or heads
    q, kv = heads * d, groups * d
    bias = model.add_bias_linear
    attn = h * q + 2 * h * kv + q * h + ((q + 2 * kv + h) if bias else 0)
    mats = 3 if model.swiglu else 2

    def mlp(width: int) -> int:
        return mats * h * width + (((2 if model.swiglu else 1) * width + h) if bias else 0)

    norm = h if model.normalization == "RMSNorm" else 2 * h
    experts = model.num_experts or 0
    moe_ffn = model.moe_ffn_hidden_size or model.ffn_hidden_size
    vocab = vocab_mod.padded_vocab_size(model.vocab_size, model.make_vocab_size_divisible_by, tp)
    tied = not model.untie_embeddings_and_output_weights
    positions = (model.max_position_embeddings or model.seq_length) if model.position_embedding_type == "learned_absolute" else 0
    return Shape(
        h=h, q=q, kv=kv, ffn=model.ffn_hidden_size, heads=heads, layers=model.num_layers, vocab=vocab,
        seq=model.seq_length, attn_params=attn,
        dense_mlp_params=0 if experts else mlp(model.ffn_hidden_size),
        expert_params=mlp(moe_ffn) if experts else 0, num_experts=experts,
        topk=model.moe_router_topk if experts else 0,
        norm_params=2 * norm + (h * experts if experts else 0),  # the router's h x E matrix rides with the norms
        swiglu=model.swiglu, embedding_params=vocab * h, position_params=positions * h,
        output_params=0 if tied else vocab * h, final_norm_params=norm, tied=tied,
    )


def stage_layers(layers: int, par: ParallelismConfig) -> list[float]:
    """Transformer layers held by each pipeline stage (all its virtual chunks together).

    With ``account_for_embedding_in_pipeline_split`` the embedding counts as one layer of the
    first chunk (so stage 0 holds one transformer layer fewer), likewise the loss for the last
    chunk. An uneven split (which the job check refuses) is spread as a float so the planner
    never crashes on it.
    """
    pp = max(1, par.pp)
    emb = int(par.account_for_embedding_in_pipeline_split)
    loss = int(par.account_for_loss_in_pipeline_split)
    per_stage = (layers + emb + loss) / pp
    out = [per_stage] * pp
    out[0] -= emb
    out[-1] -= loss
    return out


def chunks(par: ParallelismConfig) -> int:
    """Virtual pipeline chunks per stage (1 without interleaving)."""
    return par.vpp if (par.vpp and par.pp > 1) else 1
