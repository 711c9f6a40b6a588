"""Goodput under failures: the simulation against first-order theory and the Llama 3 405B case."""
from __future__ import annotations

import pytest

from launch.planner.simulate import Scenario, compare_intervals, llama3_scenario, main, simulate

LLAMA3_SAVE_LUSTRE_S = 5682e9 / 40e9  # 405B checkpoint (14 B/param) at cluster=lustre's 40 GB/s
LLAMA3_SAVE_FAST_S = 5682e9 / 2e12  # the same at 2 TB/s (Meta's Tectonic-class storage, or async)


def test_seeded_and_reproducible():
    s = Scenario(work_h=200, nodes=64, gpus_per_node=8, node_mtbf_h=5000, save_h=0.02, restart_h=0.1)
    assert simulate(s, 0.5, trials=300, seed=7) == simulate(s, 0.5, trials=300, seed=7)
    assert simulate(s, 0.5, trials=300, seed=7) != simulate(s, 0.5, trials=300, seed=8)


def test_no_failures_means_only_saves_are_lost():
    s = Scenario(work_h=10, nodes=1, gpus_per_node=8, node_mtbf_h=1e12, save_h=0.1, restart_h=1)
    o = simulate(s, 1.0, trials=50)
    assert o.failures_mean == 0
    assert o.wall_h_mean == pytest.approx(10 + 10 * 0.1)
    assert o.lost_gpu_hours_mean == pytest.approx(1.0 * 8)


def test_agrees_with_first_order_theory_and_daly_beats_the_extremes():
    s = Scenario(work_h=500, nodes=512, gpus_per_node=8, node_mtbf_h=8000, save_h=60 / 3600, restart_h=0.2)
    outcomes = {o.label: o for o in compare_intervals(s, trials=1500, seed=1)}
    for o in outcomes.values():
        assert o.effective_mean == pytest.approx(o.first_order_effective, abs=0.01)
        assert o.effective_p05 <= o.effective_mean <= o.effective_p95
    daly = outcomes["Daly"].effective_mean
    assert daly > outcomes["0.25 x Daly"].effective_mean
    assert daly > outcomes["4 x Daly"].effective_mean
    assert outcomes["Daly"].failures_mean == pytest.approx(outcomes["Daly"].wall_h_mean / s.job_mtbf_h, rel=0.05)


def test_llama3_405b_case():
    """Llama 3 405B (Dubey et al. 2024, section 3.3.4): 419 unexpected interruptions in 54 days on
    16,384 GPUs, effective training time above 90%.

    What the model predicts: a job MTBF of 54*24/419 = 3.09 h. The result hinges on the save
    and restart costs, which the paper does not state. With saves of a few seconds (a 5.7 TB
    checkpoint at ~2 TB/s, or asynchronous/in-memory checkpointing) and restarts of ~10 min,
    Daly's interval is ~4 min and the run keeps ~93%: consistent with "> 90%". With the same
    checkpoint written synchronously to a 40 GB/s Lustre (142 s per save) the optimum interval
    is ~28 min and the run keeps only ~80%: > 90% at this failure rate is out of reach without
    fast saves, and a 30-minute restart alone costs ~10 points. The simulated failure count
    lands near the published 419 for the 54-day window.
    """
    fast = {o.label: o for o in compare_intervals(llama3_scenario(LLAMA3_SAVE_FAST_S, 10), trials=400, seed=0)}
    assert fast["Daly"].effective_mean > 0.90
    assert 380 <= fast["Daly"].failures_mean <= 460
    slow = {o.label: o for o in compare_intervals(llama3_scenario(LLAMA3_SAVE_LUSTRE_S, 10), trials=400, seed=0)}
    assert slow["Daly"].effective_mean < 0.85
    assert slow["Daly"].interval_h > 5 * fast["Daly"].interval_h
    slow_restart = simulate(llama3_scenario(LLAMA3_SAVE_FAST_S, 30), fast["Daly"].interval_h, trials=400)
    assert slow_restart.effective_mean < fast["Daly"].effective_mean - 0.05


def test_cli_llama3_table():
    lines: list[str] = []
    assert main(["--case", "llama3", "--save-s", "3", "--trials", "200"], out=lines.append) == 0
    text = "\n".join(lines)
    assert "job MTBF 3.09 h" in text and "Daly" in text and "Young" in text


def test_cli_from_a_composed_job_includes_the_chosen_interval():
    lines: list[str] = []
    assert main(["model=70b", "cluster=lustre", "--trials", "50"], out=lines.append) == 0
    assert "\nchosen " in "\n".join(lines)
