"""The command-line surface shared by the entry points, in-process: the one-line override errors
and their "did you mean", the one unknown-key check of pretrain/plan/preflight, plan's options and
no-fit advice, the sweep's exit status and fit marks, and stop.py on a complete run."""
from __future__ import annotations

import dataclasses
import io
import json

import pytest
from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException

from launch import plan, preflight, pretrain, stop
from launch.cli import compose_config, job_or_refusal, override_error_line, schema_suggestion
from launch.compose import compose_job
from launch.planner.advice import fit_advice
from launch.planner.layouts import NoLayoutFits, choose_layout
from recovery import stop as stopping


@pytest.mark.parametrize("dotted, bad, guess", [
    ("trainig.lr", "trainig", "training.lr"),
    ("parallelism.tpp", "parallelism.tpp", "parallelism.tp"),
    ("cluster.nodez", "cluster.nodez", "cluster.nodes"),
    ("training.lr", "training.lr", None),  # nothing wrong: no suggestion
    ("zzzz.qqqq", "zzzz", None),  # nothing close: no guess
])
def test_schema_suggestion_walks_the_dataclasses(dotted, bad, guess):
    assert schema_suggestion(dotted) == (bad, guess)


@pytest.mark.parametrize("override, expected", [
    ("trainig.lr=1", "refused: unknown key trainig in trainig.lr=1; did you mean training.lr=1?"),
    ("parallelism.tpp=2", "did you mean parallelism.tp=2?"),
    ("modle=7b", "did you mean model=7b?"),
    ("model=7bb", "refused: unknown choice model=7bb; did you mean model=7b? (choices: "),
    ("parallelism.tp=abc", "refused: parallelism.tp=abc: Value 'abc' of type 'str' could not be converted to Integer"),
    ("run.name=héllo wörld", "refused: cannot parse the override 'run.name=héllo wörld'"),
    ("parallelism.tp=[1", "refused: cannot parse the override 'parallelism.tp=[1'"),
    ("model=70", "refused: model=70: model takes one of its choices by name; did you mean model=70b? (choices: "),
    ("cluster=1", "refused: cluster=1: cluster takes one of its choices by name; (choices: "),
])
def test_every_hydra_override_error_is_one_line(override, expected):
    with pytest.raises((ConfigCompositionException, OverrideParseException, ValueError)) as info:
        compose_config([override])
    line = override_error_line(info.value, [override])
    assert "\n" not in line and expected in line, line
    assert "+" not in line.split(";")[-1]  # never Hydra's "append with +key" advice


def test_a_missing_choice_lists_the_choices_and_guesses_only_when_close():
    with pytest.raises(MissingConfigException) as info:
        compose_config(["cluster=qqqqq"])
    line = override_error_line(info.value, ["cluster=qqqqq"])
    assert "did you mean" not in line and "lustre" in line and "\n" not in line


@pytest.mark.parametrize("extra", ["+plan.topp=3", "+training.eval_intervall=5", "+bogus=1"])
def test_plan_and_preflight_refuse_the_plus_keys_pretrain_refuses(extra):
    job, refusal = job_or_refusal(compose_config([extra]))
    assert job is None and "is not a field of the schema" in refusal
    err: list[str] = []
    assert plan.main(compose_config([extra]), out=lambda s: pytest.fail("planned: " + s), err=err.append) == 2
    assert err == [refusal.replace("nothing was submitted", "nothing was planned")]
    perr = io.StringIO()
    assert preflight.main([extra], out=io.StringIO(), err=perr,
                          popen=lambda *a, **k: pytest.fail("a refused preflight started a process")) == 2
    assert "is not a field of the schema" in perr.getvalue()
    pout = io.StringIO()
    assert pretrain.main(compose_config([extra, "dry_run=true"]), out=pout, err=(e := io.StringIO())) == 2
    assert "is not a field of the schema" in e.getvalue() and pout.getvalue() == ""


def test_preflight_gives_hydra_errors_one_line_with_a_guess():
    err = io.StringIO()
    assert preflight.main(["preflight.stepz=3"], out=io.StringIO(), err=err,
                          popen=lambda *a, **k: pytest.fail("started")) == 2
    assert err.getvalue() == "refused: unknown key preflight.stepz in preflight.stepz=3; did you mean " \
                             "preflight.steps=3?\n"


@pytest.mark.parametrize("top", [-5, 0])
def test_plan_top_below_one_is_refused_in_one_line(top):
    err: list[str] = []
    assert plan.main(compose_config([f"plan.top={top}", "parallelism=auto"]), out=lambda s: pytest.fail(s),
                     err=err.append) == 2
    assert err == [f"refused: plan.top={top}: the ranked table needs at least one row; "
                   f"fix: plan.top=10 (or any N >= 1)"]


def test_no_fit_advice_names_a_node_count_on_which_the_planner_fits_a_layout():
    job = compose_job(["cluster=lustre", "model=405b", "parallelism=auto", "cluster.nodes=2"])
    text, status = plan.plan(job)
    assert status == 1
    fix = text.splitlines()[-1]
    assert fix.startswith("fix: cluster.nodes=") and "GiB per GPU" in fix
    nodes = int(fix.split("cluster.nodes=", 1)[1].split()[0])
    assert nodes > 2 and nodes % 2 == 0
    # the advice is true: on that many nodes a layout fits in memory (the one named); on half of them none does
    chosen, _ = choose_layout(compose_job(["cluster=lustre", "model=405b", "parallelism=auto",
                                           f"cluster.nodes={nodes}"]))
    assert f": {chosen.parallelism.name.removeprefix('auto:')} at " in fix
    with pytest.raises(NoLayoutFits):
        choose_layout(compose_job(["cluster=lustre", "model=405b", "parallelism=auto", f"cluster.nodes={nodes // 2}"]))


def test_no_fit_advice_says_when_more_nodes_cannot_help():
    job = compose_job(["cluster=lustre", "model=7b", "model.seq_length=1048576", "training.micro_batch_size=1",
                       "cluster.gpu_memory_gb=1"])
    line = fit_advice(job, factors=(2, 4))
    assert line.startswith("fix: more nodes do not help") and "micro_batch_size" in line
    # the refusal's own line names no remedy, so it never says "add nodes" beside "more nodes do not help"
    with pytest.raises(NoLayoutFits) as refused:
        choose_layout(dataclasses.replace(job, parallelism=dataclasses.replace(job.parallelism, name="auto")))
    last = str(refused.value).splitlines()[-1]
    assert last == f"no valid layout fits in 1 GiB per GPU on {job.cluster.nodes} node(s)"
    assert "add nodes" not in str(refused.value)


def test_a_sweep_with_no_accepted_member_exits_2():
    refused = {"member": "a", "layout": "x", "status": "refused", "detail": "", "job_id": ""}
    failed = dict(refused, status="failed")
    assert pretrain.sweep_exit([refused, refused], 0) == 2
    assert pretrain.sweep_exit([failed, failed], 0) == 2
    assert pretrain.sweep_exit([refused, failed], 0) == 2
    assert pretrain.sweep_exit([refused, dict(refused, status="ok (dry run)")], 0) == 0
    assert pretrain.sweep_exit([refused, dict(refused, status="may not fit (dry run)")], 0) == 0
    assert pretrain.sweep_exit([], 0) == 0
    assert pretrain.sweep_exit([refused], 1) == 1  # an error of its own keeps its status


def test_fit_status_marks_a_layout_over_the_gpus_memory():
    over = compose_job(["cluster=lustre", "model=30b", "parallelism.tp=2", "parallelism.pp=1"])
    under = compose_job(["cluster=lustre", "model=30b", "parallelism.tp=2", "parallelism.pp=2"])
    assert pretrain._estimate(over)["memory_gb_per_gpu"] > over.cluster.gpu_memory_gb
    assert pretrain.fit_status(over, "ok (dry run)") == "may not fit (dry run)"
    assert pretrain.fit_status(over, "submitted") == "submitted, may not fit"
    assert pretrain._estimate(under)["memory_gb_per_gpu"] < under.cluster.gpu_memory_gb
    assert pretrain.fit_status(under, "ok (dry run)") == "ok (dry run)"


# ---- stop.py ----------------------------------------------------------------------------------

def _run(tmp_path, events, submissions=()):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("{}\n")
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    if submissions:
        (run / "submissions.jsonl").write_text("".join(json.dumps(s) + "\n" for s in submissions))
    return run


START = {"event": "job_start", "time": 100.0}
DONE = {"event": "exit", "reason": "completed", "code": 0, "step": 20, "time": 200.0}


def test_stop_on_a_complete_run_writes_nothing_and_says_so_in_one_line(tmp_path):
    run = _run(tmp_path, [START, DONE], [{"job_id": "7", "time": 50.0}])
    before = sorted(p.name for p in run.iterdir())
    out, err = io.StringIO(), io.StringIO()
    assert stop.main([str(run)], out=out, err=err) == stop.EXIT_COMPLETE == 3
    assert not (run / "stop.json").exists() and sorted(p.name for p in run.iterdir()) == before
    (line,) = out.getvalue().splitlines()
    assert "is complete" in line and "step 20" in line and err.getvalue() == ""


@pytest.mark.parametrize("events, submissions", [
    ([START, DONE, dict(START, time=300.0)], ()),  # a new attempt started after the completion
    ([START, DONE], [{"job_id": "8", "time": 250.0}]),  # a job submitted after it (longer train_iters)
    ([START, dict(DONE, reason="requeue", code=42)], ()),  # stopped for a requeue: it will run again
    ([START], ()),  # running
])
def test_stop_writes_the_request_when_the_run_can_still_run(tmp_path, events, submissions):
    run = _run(tmp_path, events, submissions)
    assert stop.main([str(run)], out=io.StringIO(), err=io.StringIO()) == 0
    assert (run / "stop.json").exists()


def test_stop_refuses_an_unknown_option_and_helps_on_help(tmp_path):
    err = io.StringIO()
    assert stop.main(["--bogus"], out=io.StringIO(), err=err) == 2 and "unknown option --bogus" in err.getvalue()
    out = io.StringIO()
    assert stop.main(["--help"], out=out, err=io.StringIO()) == 0 and out.getvalue().startswith("usage:")
    assert not (tmp_path / "--help").exists()


def test_a_cleared_stop_request_is_one_line(tmp_path):
    job = compose_job([f"cluster.run_root={tmp_path}"])
    run = tmp_path / "tiny"
    run.mkdir()
    path = job.paths_at(run).stop_request
    stopping.request_stop(path, at_step=12, clock=lambda: 1_700_000_000.0, by="ann@login1")
    stopping.mark_stopped(path, "user_stop", 12, "77", clock=lambda: 1_700_000_100.0)
    assert len(path.read_text().splitlines()) > 1  # the file itself is several lines of JSON
    err = io.StringIO()
    pretrain.clear_stop_request(job, run, err)
    (line,) = err.getvalue().splitlines()
    assert line == ("note: continuing a stopped run; cleared stop.json (stopped, by ann@login1, reason user_stop, "
                    "at step 12, stopped at step 12, 2023-11-14 22:15:00 UTC)")
    assert not path.exists()
    path.write_bytes(b"\x00\xff{garbage\n\nmore\n")
    err = io.StringIO()
    pretrain.clear_stop_request(job, run, err)
    assert len(err.getvalue().splitlines()) <= 1


def test_a_fixed_layout_over_memory_gets_advice_the_planner_checked():
    # 128 GPUs: parallelism=auto finds a layout, and the line names it with its memory
    text, status = plan.plan(compose_job(["cluster=lustre", "model=70b", "parallelism.tp=1", "parallelism.pp=1"]))
    assert status == 1
    (fix,) = [ln for ln in text.splitlines() if ln.startswith("fix: ")]
    assert fix.startswith("fix: parallelism=auto fits on these 16 node(s): ") and "GiB per GPU" in fix
    # one node: no layout fits, so the line names the node count instead of parallelism=auto
    text, status = plan.plan(compose_job(["cluster=lustre", "model=70b", "cluster.nodes=1", "parallelism.pp=1"]))
    (fix,) = [ln for ln in text.splitlines() if ln.startswith("fix: ")]
    assert status == 1 and fix.startswith("fix: no layout fits on these nodes; cluster.nodes=")
