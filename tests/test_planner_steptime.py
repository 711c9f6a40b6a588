"""Step time against published throughput, and the terms that rank layouts."""
from __future__ import annotations

import dataclasses

import pytest

from analysis.flops import hardware_flops
from launch.compose import compose_job
from launch.config import ClusterConfig, DataConfig, Job, ModelConfig, ParallelismConfig, TrainingConfig
from launch.planner.steptime import step_time
from launch.vocab import padded_vocab_size

# Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
# Megatron-LM" (SC'21, arXiv:2104.04473), Table 1 (weak scaling on Selene, A100 80GB): model
# size (B), attention heads, hidden size, layers, tensor-parallel size, pipeline-parallel size,
# GPUs, batch size, achieved teraFLOP/s per GPU. Sequence 2048, vocabulary 51,200 (section 5.1).
NARAYANAN_TABLE_1 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]
SEQ, VOCAB = 2048, 51200


def a100_cluster(nodes: int) -> ClusterConfig:
    """Selene-like DGX A100 profile: A100 80GB, NVLink 3 at 300 GB/s per direction, 8 x 200 Gb/s
    HDR InfiniBand per node (25 GB/s per GPU). ``achievable_fraction`` is the schema's default,
    not fitted to this table."""
    return ClusterConfig(name="selene", nodes=nodes, gpus_per_node=8, gpu="a100", gpu_memory_gb=80,
                         nvlink_bandwidth_gbs=300, ib_bandwidth_gbs=8 * 200 / 8 / 8,
                         achievable_fraction=ClusterConfig.achievable_fraction)


def paper_flops(batch: int, layers: int, hidden: int) -> float:
    """The paper's own count (section 5.1, with full activation recomputation):
    96 B s l h^2 (1 + s/6h + V/16lh)."""
    return 96 * batch * SEQ * layers * hidden**2 * (1 + SEQ / (6 * hidden) + VOCAB / (16 * layers * hidden))


@pytest.mark.parametrize("size, heads, hidden, layers, tp, pp, gpus, batch, published", NARAYANAN_TABLE_1,
                         ids=[f"{r[0]}B" for r in NARAYANAN_TABLE_1])
def test_narayanan_table1_within_15_percent(size, heads, hidden, layers, tp, pp, gpus, batch, published):
    """Estimated teraFLOP/s per GPU within +-15% of Table 1, like with like.

    The paper's teraFLOP/s divide *its* FLOP count (full recompute included: 4 passes = 96, and
    the full s^2 attention square, the logits) by the measured step time. Our step time is
    built from ``analysis.flops`` (Megatron's current, causal-halved formula, plus the
    recomputed forward) at ``peak * achievable_fraction``, plus communication and memory-bound
    kernels. So we estimate the *step time* and divide the paper's FLOP count by it: the same
    numerator as the published number, only the denominator is ours.

    What the 2021 runs used and we therefore set: GPT (GeLU, f = 4h, LayerNorm, learned
    positions, tied embeddings, biases), fp16, full recomputation, micro-batch 1, the plain 1F1B
    schedule, no distributed optimizer (2021), and unfused attention (the scores went through
    HBM: ``attention="unfused"``; today's default is TransformerEngine's fused attention).
    """
    model = ModelConfig(name=f"gpt-{size}b", num_layers=layers, hidden_size=hidden, ffn_hidden_size=4 * hidden,
                        num_attention_heads=heads, seq_length=SEQ, vocab_size=VOCAB, swiglu=False,
                        position_embedding_type="learned_absolute", normalization="LayerNorm",
                        untie_embeddings_and_output_weights=False, add_bias_linear=True)
    job = Job(model=model, cluster=a100_cluster(gpus // 8),
              parallelism=ParallelismConfig(tp=tp, pp=pp, recompute="full", distributed_optimizer=False),
              training=TrainingConfig(global_batch_size=batch, micro_batch_size=1, precision="fp16"),
              data=DataConfig())
    st = step_time(job, attention="unfused")
    estimated = paper_flops(batch, layers, hidden) / st.step_time_s / gpus / 1e12
    assert estimated == pytest.approx(published, rel=0.15), f"{size}B: {estimated:.1f} vs {published}"


def _job(*overrides: str) -> Job:
    return compose_job(["model=70b", "cluster=lustre", *overrides])


def test_bubble_is_p_minus_1_over_m_v_of_the_pipeline():
    for vpp in (None, 2, 4):
        j = _job("parallelism.tp=8", "parallelism.pp=4", f"parallelism.vpp={vpp or 'null'}")
        st = step_time(j)
        v = vpp or 1
        per_microbatch = (st.step_time_s - st.dp_comm_s) / (st.microbatches + 3 / v)
        assert st.pp_bubble_s == pytest.approx(3 / v * per_microbatch)


def test_tensor_parallel_across_nodes_is_slower():
    inside = step_time(_job("parallelism.tp=8", "parallelism.pp=4"))
    across = step_time(_job("parallelism.tp=16", "parallelism.pp=2", "parallelism.allow_tp_across_nodes=true",
                            "model.num_query_groups=16"))
    assert across.tp_comm_s > 5 * inside.tp_comm_s  # InfiniBand (50 GB/s) instead of NVLink (450 GB/s)


def test_recompute_costs_compute():
    none = step_time(_job("parallelism.recompute=none"))
    sel = step_time(_job("parallelism.recompute=selective"))
    full = step_time(_job("parallelism.recompute=full"))
    assert none.compute_s < sel.compute_s < full.compute_s
    for st, rc in ((none, "none"), (sel, "selective"), (full, "full")):  # the one audited formula
        j = _job()
        vocab = padded_vocab_size(j.model.vocab_size, j.model.make_vocab_size_divisible_by, 8)
        assert st.hardware_flops == pytest.approx(hardware_flops(j.model, j.training.global_batch_size, recompute=rc,
                                                                 padded_vocab_size=vocab))


def test_faster_network_and_gpu_mean_faster_steps():
    j = _job()
    slow = dataclasses.replace(j, cluster=dataclasses.replace(j.cluster, ib_bandwidth_gbs=5, nvlink_bandwidth_gbs=50))
    assert step_time(slow).step_time_s > step_time(j).step_time_s
    a100 = dataclasses.replace(j, cluster=dataclasses.replace(j.cluster, gpu="a100"))
    assert step_time(a100).compute_s > 2 * step_time(j).compute_s


def test_expert_parallel_all_to_all_only_for_moe_with_ep():
    moe = compose_job(["model=mixtral_8x7b", "cluster=lustre"])
    assert step_time(moe).ep_comm_s > 0
    dense = step_time(_job())
    assert dense.ep_comm_s == 0 and dense.cp_comm_s == 0
