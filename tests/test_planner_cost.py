"""Run cost, the budget ceiling and the signal lead time."""
from __future__ import annotations

import math

import pytest

from launch.compose import compose_job
from launch.planner import budget_problems, estimate, lead_time_problems
from launch.planner.estimate import checkpoint_bytes, train_iterations
from launch.planner.shapes import shape_of


def test_iterations_and_gpu_hours_follow_the_step_time():
    job = compose_job(["model=70b", "cluster=lustre"])
    est = estimate(job)
    assert est.train_iters == math.ceil(job.training.train_tokens / (job.training.global_batch_size * 4096))
    saves = est.train_iters // est.checkpoint_interval
    block = est.breakdown["cost"]["save_blocking_s"]
    assert est.wall_time_h_total == pytest.approx((est.train_iters * est.step_time_s + saves * block) / 3600)
    assert est.gpu_hours_total == pytest.approx(est.wall_time_h_total * 128)
    assert est.gpu_hours == est.gpu_hours_total


def test_async_saves_charge_only_the_blocking_copy():
    from launch.planner.estimate import HOST_COPY_GBS, blocking_save_time_s

    sync = compose_job(["model=70b", "cluster=lustre", "training.async_save=false"])
    asyn = compose_job(["model=70b", "cluster=lustre", "training.async_save=true"])
    assert blocking_save_time_s(sync) == estimate(sync).save_time_s
    block = blocking_save_time_s(asyn)
    assert block == pytest.approx(checkpoint_bytes(asyn) / asyn.world_size / (HOST_COPY_GBS * 1e9))
    assert block < 0.1 * estimate(asyn).save_time_s
    assert estimate(asyn).gpu_hours_total < estimate(sync).gpu_hours_total


def test_train_iters_used_when_no_tokens():
    job = compose_job(["model=7b", "cluster=lustre", "training.train_tokens=null", "training.train_iters=500"])
    assert train_iterations(job) == 500


def test_checkpoint_is_weights_plus_fp32_adam_state():
    job = compose_job(["model=70b"])
    assert checkpoint_bytes(job) == shape_of(job.model, job.parallelism.tp).total_params * 14


def test_budget_refuses_above_and_passes_below():
    job = compose_job(["model=70b", "cluster=lustre", "training.train_tokens=null", "training.train_iters=1000"])
    hours = estimate(job).gpu_hours_total
    over = compose_job(["model=70b", "cluster=lustre", "training.train_tokens=null", "training.train_iters=1000",
                        f"run.budget_gpu_hours={hours / 2}"])
    (p,) = budget_problems(over)
    assert p.field == "run.budget_gpu_hours" and "GPU-hours > budget" in p.arithmetic
    assert "training.train_iters=" in p.fix
    ok = compose_job(["model=70b", "cluster=lustre", "training.train_tokens=null", "training.train_iters=1000",
                      f"run.budget_gpu_hours={hours * 2}"])
    assert budget_problems(ok) == []
    assert budget_problems(job) == []  # no budget set


def test_lead_time_must_cover_a_step_and_a_save():
    job = compose_job(["model=405b", "cluster=lustre", "cluster.nodes=2048", "parallelism.cp=2",
                       "training.signal_lead_time_s=60"])
    (p,) = lead_time_problems(job)
    est = estimate(job)
    assert p.field == "training.signal_lead_time_s"
    assert f"{est.save_time_s:.3g}" in p.arithmetic and "fs_write_bandwidth_gbs" in p.arithmetic
    assert "the async save in flight" in p.arithmetic  # async saves (the default): the stop waits for it first
    need = est.step_time_s + 2 * est.save_time_s
    fixed = compose_job(["model=405b", "cluster=lustre", "cluster.nodes=2048", "parallelism.cp=2",
                         f"training.signal_lead_time_s={math.ceil(need) + 1}"])
    assert lead_time_problems(fixed) == []
    sync = compose_job(["model=405b", "cluster=lustre", "cluster.nodes=2048", "parallelism.cp=2",
                        "training.async_save=false",
                        f"training.signal_lead_time_s={math.ceil(est.step_time_s + est.save_time_s) + 1}"])
    assert lead_time_problems(sync) == []


def test_lead_time_on_cpu_checks_the_save_alone():
    assert lead_time_problems(compose_job([])) == []
    slow_fs = compose_job(["model=1.3b", "cluster.fs_write_bandwidth_gbs=0.001", "training.signal_lead_time_s=30"])
    (p,) = lead_time_problems(slow_fs)
    assert "step" not in p.arithmetic.split("<")[1].split("save")[0]
