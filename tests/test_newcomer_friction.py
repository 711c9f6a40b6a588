"""Small frictions a newcomer meets on the way: a sweep's dry run that buries its table, a memory verdict worded two
ways, the ``auto`` table's reasons, the preprocess progress line (the export's are in tests/test_hf_training.py)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from launch import plan, pretrain
from launch.compose import compose_job
from launch.planner import estimate, memory_problems, memory_warnings
from launch.planner.layouts import choose_layout
from launch.planner.memory import memory_verdict
from launch.summary import summary

REPO = Path(__file__).resolve().parent.parent
PRETRAIN = REPO / "launch" / "pretrain.py"
EDGE = ["cluster=lustre", "model=70b", "parallelism.tp=4", "parallelism.pp=2"]  # 79.7 of 80 GiB per GPU


def test_one_memory_rule_words_every_table_alike():
    assert memory_verdict(68.0, 80) == "fits" and memory_verdict(68.1, 80) == "inside the error band"
    assert memory_verdict(79.7, 80) == "inside the error band" and memory_verdict(112.0, 80) == "inside the error band"
    assert memory_verdict(112.1, 80) == "does not fit"
    job = compose_job(EDGE)
    est = estimate(job)
    assert 79 < est.memory_gb_per_gpu < 80 and est.memory_verdict == "inside the error band"
    assert pretrain.fit_status(job, "ok (dry run)") == "may not fit (dry run)"  # the sweep's table
    assert "MAY NOT FIT" in summary(job, Path("/nonexistent"))  # the single run's summary
    assert "MAY NOT FIT" in plan.format_estimate(job, est)  # plan.py
    assert memory_warnings(job) and not memory_problems(job)  # the check warns, does not refuse
    roomy = compose_job(["cluster=lustre", "model=70b", "parallelism.tp=8", "parallelism.pp=2"])
    assert estimate(roomy).memory_gb_per_gpu < 68 and pretrain.fit_status(roomy, "ok (dry run)") == "ok (dry run)"
    assert not memory_warnings(roomy) and "(fits; estimate)" in summary(roomy, Path("/nonexistent"))


def test_a_dry_run_sweep_prints_a_line_per_member_then_the_table(tmp_path):
    proc = subprocess.run([sys.executable, str(PRETRAIN), "-m", "cluster=lustre", "model=70b", "parallelism.tp=2,4,8",
                           "parallelism.pp=1,2", "dry_run=true", f"cluster.run_root={tmp_path / 'runs'}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout == ""  # no batch script per member
    before, table = proc.stderr.split(" 6 member(s)\n", 1)
    assert len(before.splitlines()) < 6 * 6, before  # a few lines per member
    lines = {ln.split()[2]: ln for ln in before.splitlines() if ln.startswith("sweep member ") and "script:" in ln}
    assert sorted(lines) == ["70b_tp4-pp2", "70b_tp8-pp1", "70b_tp8-pp2"], before
    edge = lines["70b_tp4-pp2"]
    assert ": may not fit (dry run), 79.7 GiB/GPU" in edge, edge
    command = edge.split("script: ", 1)[1]
    assert command.startswith("python launch/pretrain.py ") and "parallelism.tp=4 parallelism.pp=2" in command
    row = next(ln for ln in table.splitlines() if ln.startswith("70b_tp4-pp2 "))
    assert " may not fit (dry run) " in row, row
    # the member's command prints its whole script
    alone = subprocess.run([sys.executable, str(PRETRAIN), *command.split()[2:], f"cluster.run_root={tmp_path / 'r'}"],
                           cwd=tmp_path, capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert alone.returncode == 0 and alone.stdout.startswith("#!/bin/bash"), alone.stderr[-2000:]
    assert "MAY NOT FIT" in alone.stderr


def _rows(table: str) -> list[list[str]]:
    """The ranked rows of the auto table: rank, layout, dp, mem, step, MFU, then the reason's words."""
    return [ln.split() for ln in table.splitlines()[2:] if ln[:4].strip().isdigit()]


def test_the_auto_table_explains_a_tie_in_step_time_by_what_broke_it():
    ties = 0
    for model in (["model=7b"], ["model=405b", "cluster.nodes=2048"], ["model=tiny"]):
        job = compose_job(["cluster=lustre", "parallelism=auto", "plan.top=8", *model])
        _, table = choose_layout(job)
        rows = _rows(table)
        best = rows[0]
        assert best[6:] == ["best"], table
        for row in rows[1:]:
            why = " ".join(row[6:])
            if row[4] == best[4]:  # equal step time as shown
                ties += 1
                assert "s/step" not in why, (row, table)
                assert why.startswith(("same MFU, more memory per GPU", "same step time to the ms, MFU",
                                       "ties the winner")), why
                if why.startswith("same MFU"):  # the claim is true: more memory than the winner
                    mine, theirs = why.split("(", 1)[1].split(" GiB")[0].split(" vs ")
                    assert float(mine) > float(theirs) and float(row[3]) >= float(best[3]), why
            else:  # a real difference: the net one is the one quoted first
                net = float(why.split(" s/step")[0].lstrip("+"))
                assert abs(net - (float(row[4]) - float(best[4]))) <= 0.0011 or "less elsewhere" not in why, why
    assert ties >= 3  # the tables above do have ties (7b: tp1-pp1 vs tp1-pp1-cp2)
