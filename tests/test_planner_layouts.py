"""parallelism=auto: every candidate is valid by the job check, the winner fits and has the best MFU."""
from __future__ import annotations

import dataclasses

import pytest

from launch.check import check
from launch.compose import compose_job
from launch.planner import NoLayoutFits, choose_layout, estimate, rank_layouts
from launch.planner.memory import worst_stage


@pytest.fixture(scope="module")
def ranked_70b():
    job = compose_job(["model=70b", "cluster=lustre", "parallelism=auto"])
    return job, *rank_layouts(job)


def test_winner_fits_passes_the_check_and_has_the_best_mfu(ranked_70b):
    job, rows, _ = ranked_70b
    chosen, table = choose_layout(job)
    assert chosen.parallelism.name.startswith("auto:tp")
    assert check(chosen, path_exists=lambda p: True) == []
    est = estimate(chosen)
    assert est.fits and est.memory_gb_per_gpu <= job.cluster.gpu_memory_gb
    best_mfu = max(r.mfu for r in rows if r.fits)
    assert est.mfu == pytest.approx(best_mfu)
    assert chosen.parallelism.name.split(":", 1)[1] in table.splitlines()[2]


def test_ranked_rows_are_valid_and_sorted(ranked_70b):
    job, rows, invalid = ranked_70b
    fitting = [r for r in rows if r.fits]
    assert fitting and all(a.mfu >= b.mfu for a, b in zip(fitting, fitting[1:]))
    for r in fitting[:: max(1, len(fitting) // 25)]:  # a spread sample: the check agrees each is valid
        assert check(dataclasses.replace(job, parallelism=dataclasses.replace(r.par, name="x")),
                     path_exists=lambda p: True) == []
    for r in rows:
        if r.memory is not None:
            assert r.fits == (r.memory.total <= job.cluster.gpu_memory_gb)


def test_pruned_rows_really_do_not_fit():
    job = compose_job(["model=405b", "cluster=lustre", "cluster.nodes=64", "parallelism=auto"])
    rows, _ = rank_layouts(job)
    pruned = [r for r in rows if r.memory is None]
    assert pruned
    for r in pruned[:: max(1, len(pruned) // 20)]:
        assert worst_stage(dataclasses.replace(job, parallelism=r.par)).total > job.cluster.gpu_memory_gb


def test_table_says_why_the_others_lost(ranked_70b):
    job, _, _ = ranked_70b
    _, table = choose_layout(dataclasses.replace(job, plan=dataclasses.replace(job.plan, top=4)))
    lines = table.splitlines()
    assert "best" in lines[2]
    assert all("s/step" in line or "ties" in line for line in lines[3:6])
    assert any("does not fit in 80 GiB" in line for line in lines)


def test_invalid_layouts_are_counted_with_the_check_reason():
    job = compose_job(["model=mixtral_8x7b", "cluster=lustre", "parallelism=auto"])
    _, invalid = rank_layouts(job)
    assert any(reason.startswith("parallelism.ep") for reason in invalid)


def test_405b_on_16k_gpus_picks_a_layout_that_fits():
    job = compose_job(["model=405b", "cluster=lustre", "cluster.nodes=2048", "parallelism=auto"])
    chosen, _ = choose_layout(job)
    assert check(chosen, path_exists=lambda p: True) == []
    assert estimate(chosen).fits


def test_nothing_fits_raises_with_the_table():
    job = compose_job(["model=405b", "cluster=lustre", "cluster.nodes=1", "parallelism=auto"])
    with pytest.raises(NoLayoutFits, match="no valid layout fits"):
        choose_layout(job)


def test_cpu_cluster_prefers_the_plainest_layout():
    chosen, _ = choose_layout(compose_job(["parallelism=auto"]))  # tiny on 4 CPU ranks
    p = chosen.parallelism
    assert (p.tp, p.pp, p.cp, p.recompute) == (1, 1, 1, "none")
