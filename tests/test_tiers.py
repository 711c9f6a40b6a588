"""The two checkpoint tiers planned together: the interval arithmetic, the simulation, and the dry-run line."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from launch.compose import compose_job
from launch.planner.estimate import estimate
from launch.planner.simulate import (Tiers, compare_tiers, llama3_scenario, main, simulate,
                                     simulate_two_tier)
from launch.planner.tiers import NODE_LOSS, local_save_time_s, local_share, node_shard_bytes, plan_tiers
from launch.summary import summary
from recovery.interval import interval_steps, two_tier_steps

M = 3 * 3600.0  # a job MTBF of 3 h (Llama 3 405B: one interruption every 3.09 h)
LOCAL = ["training.local_checkpoint.interval=10", "cluster.local_checkpoint_dir=/dev/shm/slurmtron"]


def test_each_tier_gets_young_s_optimum_against_its_own_share_of_the_failures() -> None:
    local, glob, why = two_tier_steps(2.0, 120.0, 5.0, M, 0.9)
    assert local == round(math.sqrt(2 * 2.0 * M / 0.9) / 5.0) == 44
    assert glob % local == 0 and glob == round(math.sqrt(2 * 120.0 * M / 0.1) / 5.0 / local) * local == 1012
    assert "sqrt(2 C_l M / p)" in why and "every 44 step(s)" in why and "every 1012 step(s)" in why


def test_no_failure_needs_the_global_tier_at_p_1_and_none_can_use_the_local_one_at_p_0() -> None:
    local, glob, why = two_tier_steps(2.0, 120.0, 5.0, M, 1.0)
    assert local == round(math.sqrt(2 * 2.0 * M) / 5.0) and glob is None and "p = 1" in why
    local, glob, why = two_tier_steps(2.0, 120.0, 5.0, M, 0.0)
    assert (local, glob) == (0, interval_steps(120.0, 5.0, M)[0]) and "p = 0" in why


def test_a_local_save_no_cheaper_than_the_global_one_does_not_pay() -> None:
    local, glob, why = two_tier_steps(120.0, 2.0, 5.0, M, 1.0)
    assert (local, glob) == (0, interval_steps(2.0, 5.0, M)[0]) and "does not pay" in why
    with pytest.raises(ValueError):
        two_tier_steps(2.0, 120.0, 5.0, M, 1.5)


def test_two_tier_simulation_reduces_to_the_one_tier_one_and_matches_first_order() -> None:
    s = llama3_scenario(142.0, 10.0)
    one = simulate(s, 0.5, trials=400)
    same = simulate_two_tier(s, Tiers(0.5, 0.0, 1, 0.0), trials=400)  # every save global: one tier
    assert same.effective_mean == pytest.approx(one.effective_mean, abs=0.005)
    assert same.first_order_effective == pytest.approx(one.first_order_effective, abs=1e-9)
    for o in compare_tiers(s, 5 / 3600, 1.0, trials=400):
        assert o.effective_mean == pytest.approx(o.first_order_effective, abs=0.01), o


def test_cheap_local_sets_win_only_when_failures_can_use_them() -> None:
    s = llama3_scenario(142.0, 10.0)
    alone, both = compare_tiers(s, 5 / 3600, 1.0, trials=400)
    assert both.effective_mean > alone.effective_mean + 0.08, (alone, both)  # Llama 3: 80% -> 92%
    assert [o.label for o in compare_tiers(s, 5 / 3600, 0.0, trials=400)] == ["global only, Daly"]
    useless = simulate_two_tier(s, Tiers(0.1, 5 / 3600, 5, 0.0), trials=400)  # saves that no failure can use
    assert useless.effective_mean < alone.effective_mean


def test_a_failure_that_cannot_use_the_local_set_goes_back_to_the_newest_global_one() -> None:
    # free local saves that no failure can use: the run is the one-tier run at the global interval (each failure
    # goes back to the newest global save, however many local ones came after it)
    s = llama3_scenario(142.0, 10.0)
    lost = simulate_two_tier(s, Tiers(0.125, 1e-9, 4, 0.0), trials=400)
    assert lost.effective_mean == pytest.approx(simulate(s, 0.5, trials=400).effective_mean, abs=0.005)
    served = simulate_two_tier(s, Tiers(0.125, 1e-9, 4, 1.0), trials=400)  # the same saves, every failure served
    assert served.effective_mean > lost.effective_mean + 0.05


def test_which_failures_a_local_set_serves_follows_where_the_restart_runs() -> None:
    assert local_share(compose_job(["cluster=local", *LOCAL]))[0] == 1.0
    share, why = local_share(compose_job(["cluster=lustre", "model=7b", *LOCAL]))
    assert share == 0.0 and "requeued" in why
    assert local_share(compose_job(["cluster=lustre", "model=7b", "cluster.spare_nodes=1", *LOCAL]))[0] == 1.0
    one_copy = compose_job(["cluster=lustre", "model=7b", "cluster.spare_nodes=1", *LOCAL,
                            "training.local_checkpoint.replication=1"])
    assert local_share(one_copy)[0] == pytest.approx(1 - NODE_LOSS)


def test_a_local_save_writes_every_copy_and_sends_the_peers_theirs() -> None:
    job = compose_job(["cluster=lustre", "model=7b", *LOCAL, "cluster.local_write_bandwidth_gbs=4"])
    shard, c = node_shard_bytes(job), job.cluster
    want = 2 * shard / 4e9 + shard / (c.ib_bandwidth_gbs * c.gpus_per_node * 1e9)
    assert local_save_time_s(job) == pytest.approx(want)


def test_the_dry_run_shows_both_tiers_configured_and_recommended() -> None:
    over = ["cluster=lustre", "model=7b", *LOCAL, "cluster.spare_nodes=1", "training.async_save=false",
            "cluster.fs_write_bandwidth_gbs=2", "cluster.local_write_bandwidth_gbs=20",
            "parallelism.distributed_optimizer=true"]
    job = compose_job(over)
    est = estimate(job)
    plan = plan_tiers(job, est)
    assert plan is not None and plan.share == 1.0 and 0 < plan.local_save_s < plan.global_save_s
    assert plan.best_local > 0 and plan.best_global is None
    text = summary(job, Path("/tmp/run"), est=est)
    line = [x for x in text.splitlines() if x.strip().startswith("local tier")]
    assert len(line) == 1 and "every 10 steps to /dev/shm/slurmtron, replication 2, keep 1" in line[0], text
    assert f"local save {plan.local_save_s:.3g} s" in line[0] and f"recommended: local every {plan.best_local}" \
        in line[0], line
    off = summary(compose_job(["cluster=lustre", "model=7b"]), Path("/tmp/run"))
    assert "local tier" not in off


def test_simulate_tiers_on_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    lines: list[str] = []
    assert main(["--case", "llama3", "--tiers", "--trials", "200"], out=lines.append) == 0
    table = "\n".join(lines)
    assert "global only, Daly" in table and "two tiers, recommended" in table
    assert "local save 5 s; share of failures a local set serves p = 1.00" in table


@pytest.mark.parametrize("flag, value", [("--local-share", "1.5"), ("--local-share", "x"), ("--local-save-s", "-1")])
def test_a_bad_tier_flag_is_one_usage_line_and_exit_2(flag: str, value: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--case", "llama3", "--tiers", flag, value], out=lambda _line: None)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}:" in err and "Traceback" not in err
