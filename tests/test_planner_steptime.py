"""Step time against published throughput, and the terms that rank layouts."""
from __future__ import annotations

import dataclasses

import pytest

from analysis.flops import hardware_flops
from launch.compose import compose_job
from launch.config import Job
from launch.planner.steptime import step_time
from launch.vocab import padded_vocab_size

# Published throughput (Narayanan et al. 2021 Table 1 and four more sources) is checked per source in
# tests/test_planner_published.py; this file tests the terms themselves.


def _job(*overrides: str) -> Job:
    return compose_job(["model=70b", "cluster=lustre", *overrides])


def test_bubble_is_p_minus_1_over_m_v_of_the_pipeline():
    for vpp in (None, 2, 4):
        j = _job("parallelism.tp=8", "parallelism.pp=4", f"parallelism.vpp={vpp or 'null'}")
        st = step_time(j)
        v = vpp or 1
        pipeline = st.step_time_s - st.dp_comm_s - st.straggler_s - st.optimizer_s - st.overhead_s
        per_microbatch = pipeline / (st.microbatches + 3 / v)
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


def test_collectives_pay_latency_per_hop_and_the_tree_wins_small_buffers_on_many_ranks():
    from launch.planner.steptime import collective_s
    bw, alpha = 50e9, 10e-6
    assert collective_s("reduce_scatter", 1e9, 8, bw, alpha) == pytest.approx(7 * alpha + 7 / 8 * 1e9 / bw)
    small_ring = 2 * 4095 * alpha + 2 * 4095 / 4096 * 1e3 / bw
    assert collective_s("all_reduce", 1e3, 4096, bw, alpha) < small_ring  # tree: 2 log2(n) hops
    assert collective_s("all_reduce", 1e10, 8, bw, alpha) == pytest.approx(2 * 7 * alpha + 2 * 7 / 8 * 1e10 / bw)


def test_fixed_costs_dominate_a_tiny_model_on_a_gpu():
    """Per-step host work, the optimizer and kernel launches: a tiny model is not 30x faster than its FLOPs allow."""
    tiny = compose_job(["model=tiny", "cluster=lustre", "cluster.nodes=1", "parallelism=tp1"])
    st = step_time(tiny)
    assert st.overhead_s == tiny.cluster.planner.step_overhead_s > 0
    assert st.step_time_s > st.overhead_s + st.optimizer_s > 0
    # the launch floor: many kernels per layer take longer to issue than the tiny GEMMs take to run
    from launch.planner.steptime import KERNELS_PER_LAYER
    assert st.compute_s >= st.microbatches * tiny.model.num_layers * KERNELS_PER_LAYER * 4e-6 * 0.999


def test_mfu_falls_with_data_parallel_scale_for_named_reasons():
    """Weak scaling of dp at a fixed global batch: fewer microbatches per replica (a larger bubble share),
    per-step fixed costs over a shorter step, a slower slowest rank. Each of those grows; MFU falls."""
    from launch.planner import estimate
    small = compose_job(["model=70b", "cluster=lustre", "cluster.nodes=32", "training.global_batch_size=1024"])
    large = compose_job(["model=70b", "cluster=lustre", "cluster.nodes=1024", "training.global_batch_size=1024"])
    a, b = estimate(small), estimate(large)
    assert b.mfu < a.mfu
    sa, sb = a.breakdown["step_time"], b.breakdown["step_time"]
    assert sb["pp_bubble_s"] / sb["step_time_s"] > sa["pp_bubble_s"] / sa["step_time_s"]
    fixed = ("overhead_s", "optimizer_s", "dp_comm_s")
    assert sum(sb[k] for k in fixed) / sb["step_time_s"] > sum(sa[k] for k in fixed) / sa["step_time_s"]
    from launch.planner.steptime import straggler_factor
    assert straggler_factor(large.cluster, large.world_size) > straggler_factor(small.cluster, small.world_size)


def test_overlap_hides_the_data_parallel_reduce_behind_the_backward_and_the_gather_behind_the_forward():
    j = _job("cluster.nodes=64")

    def dp(**kw):
        return step_time(dataclasses.replace(j, parallelism=dataclasses.replace(j.parallelism, **kw))).dp_comm_s
    exposed, reduce_hidden = dp(), dp(overlap_grad_reduce=True)
    both_hidden = dp(overlap_grad_reduce=True, overlap_param_gather=True)
    assert 0 < both_hidden < reduce_hidden < exposed
    # smaller buckets: more of the reduce overlaps (only the last bucket is always exposed), more latency each
    assert dp(overlap_grad_reduce=True, bucket_size=10_000_000) != reduce_hidden


def test_fused_attention_runs_the_scores_below_the_gemm_rate_and_unfused_pays_hbm():
    j = compose_job(["model=7b", "cluster=lustre", "model.seq_length=32768", "training.global_batch_size=128"])
    fused = step_time(j)
    unfused = step_time(dataclasses.replace(j, model=dataclasses.replace(j.model, attention_backend="unfused")))
    assert unfused.compute_s > fused.compute_s  # s x s scores through HBM


def test_a_data_parallel_ring_across_nodes_uses_the_nics_its_members_have_in_each_node():
    """NCCL spreads a collective's channels over the NICs of the group's members in a node: a dp group with
    tp=1 (8 members per node) moves at 8 NICs' bandwidth up to NVLink's, one with tp=8 at one NIC's; a
    point-to-point send (pipeline) always has one NIC."""
    from launch.planner.steptime import _bw
    c = compose_job(["model=7b", "cluster=lustre", "cluster.nodes=4"]).cluster
    nic, nvl = c.ib_bandwidth_gbs * 1e9, c.nvlink_bandwidth_gbs * 1e9
    assert _bw(c, 32, stride=1) == min(nvl, c.gpus_per_node * nic)
    assert _bw(c, 32, stride=2) == min(nvl, c.gpus_per_node // 2 * nic)
    assert _bw(c, 32, stride=8) == nic
    assert _bw(c, 32) == nic
    assert _bw(c, 8, stride=1) == nvl


def test_the_loss_pays_its_fp32_passes_over_every_logit():
    """The vocab-parallel cross-entropy's memory traffic (LOSS_BYTES_PER_LOGIT per logit, op by op) is on the last
    stage's compute: a larger vocabulary costs its logits GEMM plus that traffic, split over tp."""
    from analysis.flops import flops_breakdown
    from launch.planner.shapes import shape_of
    from launch.planner.steptime import LOSS_BYTES_PER_LOGIT, achievable_rate, hbm_bandwidth

    def last_stage(vocab: int, tp: int) -> tuple[float, Job]:
        j = _job(f"parallelism.tp={tp}", "parallelism.pp=1", f"model.vocab_size={vocab}")
        return step_time(j).compute_s, j

    for tp in (1, 4):
        small, j = last_stage(32000, tp)
        large, j2 = last_stage(256000, tp)
        t = j.training
        v1, v2 = shape_of(j.model, tp).vocab, shape_of(j2.model, tp).vocab
        gemm = (flops_breakdown(j2.model, t.global_batch_size, padded_vocab_size=v2)["logits"]
                - flops_breakdown(j.model, t.global_batch_size, padded_vocab_size=v1)["logits"]) / tp
        traffic = LOSS_BYTES_PER_LOGIT * t.global_batch_size * j.model.seq_length * (v2 - v1) / tp
        expected = gemm / achievable_rate(j) + traffic / hbm_bandwidth(j.cluster.gpu)
        assert large - small == pytest.approx(expected / j.dp, rel=0.02), tp


def test_engines_that_split_pipeline_sends_over_tp_and_reduce_fp16_gradients_in_fp16():
    """``framework=``: Megatron-LM 2021's scatter/gather and DeepSpeed's partitioned pipeline sends move 1/tp of
    an activation between stages (Megatron-Core the whole one without SP); Megatron-LM 2021 all-reduces fp16
    gradients in fp16 (Megatron-Core here in fp32); an unknown engine is an error, not a silent default."""
    j = _job("parallelism.tp=8", "parallelism.pp=4", "parallelism.sequence_parallel=false", "cluster.nodes=16",
             "parallelism.distributed_optimizer=false", "training.precision=fp16")
    core, old, ds = (step_time(j, framework=f) for f in ("megatron-core", "megatron-lm-2021", "deepspeed"))
    assert old.pp_p2p_s == pytest.approx(ds.pp_p2p_s) and old.pp_p2p_s < core.pp_p2p_s / 4
    assert old.dp_comm_s < core.dp_comm_s and ds.dp_comm_s == pytest.approx(core.dp_comm_s)
    sp = dataclasses.replace(j, parallelism=dataclasses.replace(j.parallelism, sequence_parallel=True))
    assert step_time(sp, framework="megatron-lm-2021").pp_p2p_s == pytest.approx(step_time(sp).pp_p2p_s)
    bf16 = dataclasses.replace(j, training=dataclasses.replace(j.training, precision="bf16"))
    assert step_time(bf16, framework="megatron-lm-2021").dp_comm_s == pytest.approx(step_time(bf16).dp_comm_s)
    with pytest.raises(ValueError, match="framework 'megatron' is not one of"):
        step_time(j, framework="megatron")
