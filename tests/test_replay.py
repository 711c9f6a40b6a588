"""Replay parity's rules (recovery/replay.py): what was logged, bitwise or a tolerance, the verdict, the policy."""
from __future__ import annotations

import math

import pytest

from recovery.replay import ReplayCheck, compare, expectation, logged_steps, rel_diff, resolve_policy

NUM = {"layout": {"tp": 1, "pp": 1, "dp": 2}, "world_size": 2, "precision": "fp32"}
OTHER = {"layout": {"tp": 2, "pp": 1, "dp": 1}, "world_size": 2, "precision": "fp32"}


def events(losses: dict, *, restart=0, numerics=NUM, recipe="r1", job_id=None, consumed_per_step=8):
    out = [{"event": "job_start", "job_id": job_id, "restart_count": restart, "numerics": numerics, "recipe": recipe}]
    for step, loss in losses.items():
        out.append({"event": "iteration", "job_id": job_id, "restart_count": restart, "step": step,
                    "loss": repr(loss), "grad_norm": repr(loss / 10), "consumed_samples": step * consumed_per_step})
    return out


def test_logged_steps_ties_each_record_to_its_attempt_and_keeps_the_first():
    ev = events({1: 2.5, 2: 2.25, 3: 2.125}) + events({3: 9.0, 4: 1.5}, restart=1, numerics=OTHER)
    got = logged_steps(ev)
    assert sorted(got) == [1, 2, 3, 4]
    assert got[3].loss == 2.125 and got[3].numerics == NUM  # the step as first computed
    assert got[4].numerics == OTHER and got[4].attempt == (None, 1)
    assert got[2].grad_norm == 0.225 and got[2].consumed_samples == 16


def test_start_over_forgets_the_log_before_it_and_torn_records_are_skipped():
    ev = events({1: 2.5}) + [{"event": "start_over"}] + events({2: 2.0}, restart=1)
    ev.append({"event": "iteration", "step": 3, "loss": "garbage", "grad_norm": "1.0"})
    assert sorted(logged_steps(ev)) == [2]


def test_expectation_bitwise_tolerance_or_off():
    logged = list(logged_steps(events({5: 2.0, 6: 1.9})).values())
    assert expectation(logged, NUM, "r1")[0] == "bitwise"
    mode, why = expectation(logged, OTHER, "r1")
    assert mode == "tolerance" and "layout" in why
    assert expectation(logged, NUM, "r2")[0] == "off"  # another recipe trains other numbers
    assert expectation([], NUM, "r1")[0] == "off"
    old = list(logged_steps(events({5: 2.0}, numerics=None, recipe=None)).values())
    assert expectation(old, NUM, "r1")[0] == "off"  # an attempt from before these were logged


def test_default_policy_stops_only_when_bitwise_was_expected():
    assert resolve_policy("auto", "bitwise") == "stop"
    assert resolve_policy("auto", "tolerance") == "warn"
    assert resolve_policy("rollback", "bitwise") == "rollback"


def test_compare_bitwise_means_every_bit_and_the_data_position_always():
    (lg,) = logged_steps(events({7: 2.0})).values()
    assert compare(lg, 2.0, 0.2, 56, mode="bitwise", rtol=1e-3) == []
    d = compare(lg, math.nextafter(2.0, 3.0), 0.2, 56, mode="bitwise", rtol=1e-3)
    assert [x.field for x in d] == ["loss"] and 0 < d[0].rel < 1e-15
    assert compare(lg, 2.0001, 0.2, 56, mode="tolerance", rtol=1e-3) == []
    assert [x.field for x in compare(lg, 2.01, 0.2, 56, mode="tolerance", rtol=1e-3)] == ["loss"]
    assert [x.field for x in compare(lg, 2.0, 0.2, 64, mode="tolerance", rtol=1e-3)] == ["consumed_samples"]
    assert [x.field for x in compare(lg, float("nan"), 0.2, 56, mode="tolerance", rtol=1e-3)] == ["loss"]


def test_rel_diff_edges():
    assert rel_diff(1.0, 1.0) == 0.0 and rel_diff(float("nan"), float("nan")) == 0.0
    assert rel_diff(0.0, 1e-9) == math.inf and rel_diff(1.0, float("inf")) == math.inf
    assert rel_diff(2.0, 2.002) == pytest.approx(1e-3)


def test_check_matches_the_first_n_replayed_steps_then_says_so_once():
    table = logged_steps(events({s: 3.0 - s / 10 for s in range(1, 10)}))
    check = ReplayCheck(table, 5, 3, mode="bitwise", rtol=1e-3, policy="auto")
    same = lambda s: check.on_step(s, table[s].loss, table[s].grad_norm, 8 * s)  # noqa: E731
    assert check.pending and same(6) is None
    assert same(7) is None
    v = same(8)
    assert v.match and v.steps == [6, 7, 8] and v.policy == "stop" and not check.pending
    assert v.line(1e-3) == "replayed steps 6\u20138 match the lost attempt bitwise"
    assert check.on_step(9, 0.0, 0.0, 72) is None  # past the check: nothing more is said


def test_check_reports_the_first_mismatch_with_its_numbers():
    table = logged_steps(events({s: 3.0 - s / 10 for s in range(1, 10)}))
    check = ReplayCheck(table, 5, 4, mode="bitwise", rtol=1e-3, policy="rollback")
    assert check.on_step(6, table[6].loss, table[6].grad_norm, 48) is None
    v = check.on_step(7, math.nextafter(table[7].loss, 9.0), table[7].grad_norm, 64)
    assert not v.match and v.steps == [6, 7] and v.policy == "rollback"
    assert {d.field for d in v.diffs} == {"loss", "consumed_samples"}
    line = v.line(1e-3)
    assert line.startswith("replayed step 7 does not match the lost attempt (bitwise expected)")
    assert f"loss logged {table[7].loss!r} replayed {math.nextafter(table[7].loss, 9.0)!r}" in line and "consumed_samples logged 56 replayed 64" in line
    f = v.fields()
    assert f["step"] == 7 and f["mode"] == "bitwise" and len(f["diffs"]) == 2
    assert not check.pending


def test_tolerance_match_names_the_largest_difference_and_off_checks_nothing():
    table = logged_steps(events({6: 2.0, 7: 1.9}))
    check = ReplayCheck(table, 5, 4, mode="tolerance", rtol=1e-3, policy="auto")
    check.on_step(6, 2.0000001, 0.2, 48)
    v = check.on_step(7, 1.9, 0.19, 56)
    assert v.match and v.policy == "warn" and 0 < v.max_rel < 1e-6
    assert "within the relative tolerance 0.001" in v.line(1e-3)
    off = ReplayCheck(table, 5, 4, mode="off", rtol=1e-3, policy="auto")
    assert not off.pending and off.on_step(6, 9.0, 9.0, 0) is None


def test_a_check_cut_short_reports_what_it_compared():
    table = logged_steps(events({6: 2.0, 7: 1.9, 8: 1.8}))
    check = ReplayCheck(table, 5, 3, mode="bitwise", rtol=1e-3, policy="auto")
    assert check.partial() is None  # nothing compared yet: nothing to say
    check.on_step(6, 2.0, 0.2, 48)
    v = check.partial()
    assert v.match and v.steps == [6] and v.span() == "step 6"
