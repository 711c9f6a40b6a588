"""training.on_save_failure (recovery/savefail.py): the judgement of a failed save, the same for sync and async."""
from __future__ import annotations

import pytest

from recovery.savefail import judge_failure


@pytest.mark.parametrize("policy", ["stop", "retry", "skip"])
@pytest.mark.parametrize("save", ["signal", "final"])
def test_a_stop_or_final_save_always_stops(policy, save):
    go_on, why = judge_failure(policy, save, 1, 3)
    assert not go_on and save in why


def test_stop_stops_at_the_first_failure():
    assert judge_failure("stop", "interval", 1, 3) == (False, "training.on_save_failure=stop")


def test_retry_saves_again_once_then_stops():
    assert judge_failure("retry", "interval", 1, 3)[0]
    go_on, why = judge_failure("retry", "interval", 2, 3)
    assert not go_on and "the retry at the next interval failed too" in why


def test_skip_goes_on_up_to_the_bound_in_a_row():
    assert [judge_failure("skip", "interval", n, 3)[0] for n in (1, 2, 3, 4)] == [True, True, True, False]
    assert "4 failed periodic saves in a row > training.max_skipped_saves=3" in judge_failure("skip", "interval", 4, 3)[1]
    assert "(2 of training.max_skipped_saves=3 in a row)" in judge_failure("skip", "interval", 2, 3)[1]


def test_save_cost_is_blocked_durable_and_the_median_step_time_dip():
    from train.async_ckpt import cost_words, save_cost

    c = save_cost(0.4, 9.0, [1.2, 1.3, 1.1], [1.0, 1.0, 0.9, 1.1])
    assert (c["blocked_s"], c["durable_s"], c["steps_during"]) == (0.4, 9.0, 3)
    assert c["step_s_during"] == 1.2 and c["step_s_outside"] == 1.0 and c["dip"] == pytest.approx(0.2)
    assert "training blocked 0.40 s, durable 9.00 s after the start" in cost_words(c)
    assert "1200.0 ms vs 1000.0 ms outside (+20.0%, 3 step(s))" in cost_words(c)
    sync = save_cost(2.0, 2.0, [], [1.0])
    assert sync["dip"] is None and "no step trained during the write" in cost_words(sync)


def test_save_figures_count_saves_failures_abandons_and_replay_checks():
    from analysis.figures import save_figures

    ev = [{"event": "checkpoint_cost", "rank": 0, "blocked_s": b, "durable_s": d, "dip": dip}
          for b, d, dip in ((0.2, 5.0, 0.1), (0.4, 7.0, None), (0.3, 6.0, 0.3))]
    ev += [{"event": "save_failed", "rank": 0, "cause": "storage_error"}, {"event": "save_failed", "cause": "writer_stuck"},
           {"event": "checkpoint_abandoned", "rank": 0}, {"event": "replay_match", "rank": 0},
           {"event": "replay_mismatch", "rank": 0}, {"event": "replay_mismatch", "rank": 0}]
    f = save_figures(ev)
    assert (f["saves"], f["blocked_s"], f["durable_s"], f["step_time_dip"]) == (3, 0.3, 6.0, pytest.approx(0.2))
    assert f["failed"] == 2 and f["failed_by_cause"] == {"storage_error": 1, "writer_stuck": 1}
    assert (f["abandoned"], f["replay_matches"], f["replay_mismatches"]) == (1, 1, 2)
    assert save_figures([])["saves"] == 0 and save_figures([])["blocked_s"] is None
