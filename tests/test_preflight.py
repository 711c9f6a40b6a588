"""The preflight: verdict rules and the submit gate (pure), the Slurm rendering (fake sbatch), and
real CPU/gloo preflights of the tiny model that pass, plus two deliberately broken ones that fail.

The real runs call the login entry ``python launch/preflight.py`` as a user would, with a
timeout; each starts the target ranks and the single-process reference.
"""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fake_slurm import FakeSlurm

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from launch import preflight  # noqa: E402
from launch import preflight_checks as pc  # noqa: E402
from launch.check import check as check_job  # noqa: E402
from launch.compose import compose_job  # noqa: E402
from recovery.storage import atomic_write_json  # noqa: E402


# ---- pure verdicts --------------------------------------------------------------------------

def test_grad_flow_names_the_params_without_gradient():
    ok = pc.judge_grad_flow([], 27)
    bad = pc.judge_grad_flow(["decoder.layers.0.mlp.linear_fc1.weight"], 27)
    assert ok.verdict == pc.PASS
    assert bad.verdict == pc.FAIL and "decoder.layers.0.mlp.linear_fc1.weight" in bad.detail
    assert pc.judge_grad_flow([], 0).verdict == pc.FAIL  # nothing trainable is not a pass


def test_parity_uses_the_precision_tolerance_and_reports_the_worst_step():
    ref = [5.0, 4.0, 3.0]
    assert pc.judge_parity("loss_parity", [5.0, 4.0, 3.0 * (1 + 1e-6)], ref, "fp32").verdict == pc.PASS
    bad = pc.judge_parity("loss_parity", [5.0, 4.0 * (1 + 1e-3), 3.0], ref, "fp32")
    assert bad.verdict == pc.FAIL and "step 2" in bad.detail
    assert pc.judge_parity("loss_parity", [5.0, 4.0 * (1 + 1e-3), 3.0], ref, "bf16").verdict == pc.PASS
    assert pc.judge_parity("loss_parity", [float("nan")] * 3, ref, "bf16").verdict == pc.FAIL
    missing = pc.judge_parity("loss_parity", ref, None, "fp32", "the reference process exited 1")
    assert missing.verdict == pc.FAIL and "exited 1" in missing.detail


def test_hash_comparison_fails_on_a_differing_or_missing_param():
    saved = {"a": "h1", "b": "h2"}
    assert pc.compare_hashes("checkpoint_reshard", saved, dict(saved), "load").verdict == pc.PASS
    differ = pc.compare_hashes("checkpoint_reshard", saved, {"a": "h1", "b": "XX"}, "load")
    assert differ.verdict == pc.FAIL and "b" in differ.detail
    assert pc.compare_hashes("checkpoint_reshard", saved, {"a": "h1"}, "load").verdict == pc.FAIL
    assert pc.compare_hashes("checkpoint_reshard", saved, None, "load", "timeout").verdict == pc.FAIL


def test_bandwidth_is_informational_on_cpu_and_judged_on_gpu():
    rated, field = pc.rated_bandwidth(nodes=2, nvlink_gbs=450, ib_gbs=50)
    assert (rated, field) == (50.0, "cluster.ib_bandwidth_gbs")
    assert pc.rated_bandwidth(nodes=1, nvlink_gbs=450, ib_gbs=50)[0] == 450.0
    assert pc.judge_bandwidth(0.001, 50, field, gpu=False, world_size=4).verdict == pc.WARN
    assert pc.judge_bandwidth(40.0, 50, field, gpu=True, world_size=16).verdict == pc.PASS
    assert pc.judge_bandwidth(20.0, 50, field, gpu=True, world_size=16).verdict == pc.WARN
    assert pc.judge_bandwidth(5.0, 50, field, gpu=True, world_size=16).verdict == pc.FAIL
    assert pc.judge_bandwidth(None, 50, field, gpu=True, world_size=1).verdict == pc.WARN


def test_data_wait_fraction_thresholds():
    assert pc.judge_data_wait(0.01, 1.0).verdict == pc.PASS
    assert pc.judge_data_wait(0.10, 1.0).verdict == pc.WARN
    assert pc.judge_data_wait(0.50, 1.0).verdict == pc.FAIL
    assert pc.judge_data_wait(0.0, 0.0).verdict == pc.FAIL


def _report(*verdicts: str) -> pc.Report:
    return pc.Report(checks=[pc.Verdict(f"c{i}", 1.0, "t", v, f"detail {i}") for i, v in enumerate(verdicts)])


def test_preflight_problems_refuses_only_a_failed_or_unreadable_preflight(tmp_path):
    assert pc.preflight_problems(tmp_path) == []  # no preflight run: nothing to refuse
    pc.write_report(tmp_path, _report(pc.PASS, pc.WARN), atomic_write_json)
    assert pc.preflight_problems(tmp_path) == []
    pc.write_report(tmp_path, _report(pc.PASS, pc.FAIL, pc.FAIL), atomic_write_json)
    problems = pc.preflight_problems(tmp_path)
    assert [p.field for p in problems] == ["preflight", "preflight"]
    assert "c1" in problems[0].message and "force=true" in problems[0].fix
    (tmp_path / pc.PREFLIGHT_FILE).write_text("{not json")
    assert len(pc.preflight_problems(tmp_path)) == 1


def test_report_round_trips_through_json_and_prints_a_table(tmp_path):
    report = _report(pc.PASS, pc.WARN)
    path = pc.write_report(tmp_path, report, atomic_write_json)
    doc = json.loads(path.read_text())
    assert doc["verdict"] == pc.WARN and [c["check"] for c in doc["checks"]] == ["c0", "c1"]
    back = pc.read_report(tmp_path)
    assert back.checks == report.checks
    table = pc.format_table(back)
    assert "c0" in table and "preflight verdict: WARN" in table
    assert pc.Report(checks=[]).verdict == pc.FAIL


# ---- the login entry ------------------------------------------------------------------------

def test_preflight_options_are_typed_schema_fields_validated_by_the_check():
    job = compose_job(["model=tiny", "preflight.steps=2", "preflight.wait=true"])
    assert (job.preflight.steps, job.preflight.wait, job.preflight.timeout_s) == (2, True, 600.0)
    for bad in ("preflight.wait=maybe", "preflight.bogus=1", "preflight.steps=two", "preflight.steps"):
        with pytest.raises(Exception):
            compose_job([bad])
    fields = {p.field for p in check_job(compose_job(["preflight.steps=0", "preflight.timeout_s=0"]))}
    assert {"preflight.steps", "preflight.timeout_s"} <= fields
    assert check_job(compose_job([])) == []  # the defaults are valid
    # the test-only breakage is an environment switch, never a config field
    assert preflight.breakage({preflight.BREAK_ENV: "detach"}) == "detach" and preflight.breakage({}) == ""
    with pytest.raises(ValueError, match="tp_split"):
        preflight.breakage({preflight.BREAK_ENV: "oops"})


def test_refused_job_is_not_run(tmp_path):
    err = io.StringIO()
    code = preflight.main([f"cluster.run_root={tmp_path}", "parallelism.tp=3"], out=io.StringIO(), err=err,
                          popen=_no_popen)
    assert code == preflight.EXIT_REFUSED and "parallelism.tp" in err.getvalue()
    assert preflight.main(["preflight.steps=0"], out=io.StringIO(), err=io.StringIO(),
                          popen=_no_popen) == preflight.EXIT_REFUSED
    assert preflight.main([], out=io.StringIO(), err=io.StringIO(), env={preflight.BREAK_ENV: "oops"},
                          popen=_no_popen) == preflight.EXIT_REFUSED


def _no_popen(*a, **k):
    raise AssertionError("a refused preflight must start no process")


def test_login_entry_does_not_import_torch():
    code = ("import sys; import launch.preflight, launch.preflight_checks; "
            "bad = [m for m in ('torch', 'megatron') if m in sys.modules]; sys.exit(1 if bad else 0)")
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO, timeout=60).returncode == 0


def test_slurm_preflight_is_rendered_by_the_pretrain_renderer_and_submitted(tmp_path):
    run_dir = tmp_path / "runs" / "pf"
    run_dir.mkdir(parents=True)
    (run_dir / "failed_nodes.json").write_text(json.dumps([{"host": "stn3", "reason": "ECC"}]))
    fake, out = FakeSlurm(job_id="4242"), io.StringIO()
    code = preflight.main(["cluster=slurm_local", "run.name=pf", "run.time_limit_min=10", f"cluster.run_root={tmp_path / 'runs'}"],
                          runner=fake, out=out, err=io.StringIO(), popen=_no_popen)
    assert code == 0 and "4242" in out.getvalue()
    assert fake.calls == [["sbatch", "--parsable", str(run_dir / "preflight" / "sbatch.sh")]]
    script = (run_dir / "preflight" / "sbatch.sh").read_text()
    assert "-m train.preflight_worker" in script and "-m train.worker " not in script
    assert "--no-requeue" in script and "--exclude=stn3" in script and "--job-name=pf-preflight" in script
    assert subprocess.run(["bash", "-n", str(run_dir / "preflight" / "sbatch.sh")], timeout=30).returncode == 0
    pf_job = (run_dir / "preflight" / "config.yaml").read_text()
    assert "train_iters: 3" in pf_job and not (run_dir / "config.yaml").exists()


def test_slurm_preflight_submission_failure_is_reported(tmp_path):
    err = io.StringIO()
    code = preflight.main(["cluster=slurm_local", "run.time_limit_min=10", f"cluster.run_root={tmp_path}"],
                          runner=FakeSlurm(fail={"sbatch"}, fail_words="sbatch: error: invalid partition"),
                          out=io.StringIO(), err=err)
    assert code == preflight.EXIT_FAIL and "invalid partition" in err.getvalue()


def test_crashed_ranks_are_a_failed_preflight(tmp_path):
    job = compose_job([f"cluster.run_root={tmp_path}", "run.name=x"])
    run_dir = Path(job.run_dir)
    pf_dir = preflight.write_preflight_dir(job, job.preflight, run_dir)
    out = io.StringIO()
    assert preflight.finish(run_dir, pf_dir, [1, 0, None, 0], out) == preflight.EXIT_FAIL
    assert pc.failing(pc.read_report(run_dir).checks) == ["preflight_job"]
    assert "preflight verdict: FAIL" in out.getvalue()


# ---- real preflights (CPU, gloo) ------------------------------------------------------------

def _preflight(tmp_path: Path, name: str, *args: str, brk: str = "", timeout: float = 300) -> tuple[int, dict, str]:
    env = {**os.environ, preflight.BREAK_ENV: brk}
    proc = subprocess.run(
        [sys.executable, "launch/preflight.py", f"run.name={name}", f"cluster.run_root={tmp_path}",
         "preflight.timeout_s=240", *args],
        cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)
    path = tmp_path / name / pc.PREFLIGHT_FILE
    doc = json.loads(path.read_text()) if path.exists() else {}
    logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted((tmp_path / name).glob("preflight/logs/*")))
    return proc.returncode, doc, proc.stdout + proc.stderr + logs


def _verdicts(doc: dict) -> dict:
    return {c["check"]: c["verdict"] for c in doc.get("checks", [])}


@pytest.mark.training
@pytest.mark.timeout(360)
def test_tiny_model_passes_preflight_on_tp2_dp2(tmp_path):
    code, doc, out = _preflight(tmp_path, "ok")  # cluster=local: 4 ranks, tiny's tp=2, so dp=2
    v = _verdicts(doc)
    assert code == 0, out
    assert doc["layout"]["tp"] == 2 and doc["layout"]["dp"] == 2 and doc["world_size"] == 4
    for check in ("grad_flow", "loss_parity", "grad_norm_parity", "checkpoint_roundtrip", "checkpoint_reshard"):
        assert v[check] == pc.PASS, out
    assert v["allreduce_bandwidth"] == pc.WARN  # CPU: informational
    # a timing: a loaded CI machine can push the wait past the 5% WARN line; a starving loader (FAIL) still fails
    wait = next(c for c in doc["checks"] if c["check"] == "data_wait_fraction")
    assert v["data_wait_fraction"] in (pc.PASS, pc.WARN) and 0 <= wait["value"] <= 0.2, out
    assert doc["verdict"] == pc.WARN
    assert "preflight verdict" in out
    assert pc.preflight_problems(tmp_path / "ok") == []
    assert not (tmp_path / "ok" / "checkpoints").exists()  # the preflight never writes the run's checkpoints


@pytest.mark.training
@pytest.mark.timeout(360)
def test_detached_module_fails_grad_flow(tmp_path):
    code, doc, out = _preflight(tmp_path, "detach", "cluster.gpus_per_node=2", brk="detach")
    v = _verdicts(doc)
    assert code == preflight.EXIT_FAIL, out
    assert v["grad_flow"] == pc.FAIL, out
    grad = next(c for c in doc["checks"] if c["check"] == "grad_flow")
    assert "decoder.layers.0.mlp.linear_fc1.weight" in grad["detail"]
    assert v["checkpoint_roundtrip"] == pc.PASS and v["checkpoint_reshard"] == pc.PASS
    problems = pc.preflight_problems(tmp_path / "detach")
    assert any("grad_flow" in p.message for p in problems)


@pytest.mark.training
@pytest.mark.timeout(360)
def test_wrong_tp_split_fails_parity(tmp_path):
    code, doc, out = _preflight(tmp_path, "tpsplit", "cluster.gpus_per_node=2", brk="tp_split")
    v = _verdicts(doc)
    assert code == preflight.EXIT_FAIL, out
    assert v["loss_parity"] == pc.FAIL and v["grad_norm_parity"] == pc.FAIL, out
    assert v["grad_flow"] == pc.PASS  # gradients still flow: only the numbers are wrong


@pytest.mark.parametrize("verdict, code", [(_report(pc.PASS, pc.WARN), 0), (_report(pc.FAIL), 1), (None, 1)])
def test_slurm_preflight_wait_returns_the_jobs_verdict(tmp_path, verdict, code):
    run_dir = tmp_path / "w"
    # squeue lists the job twice, then not; the job writes its verdict (or dies without one) as it leaves
    leave = (lambda: pc.write_report(run_dir, verdict, atomic_write_json)) if verdict is not None else None
    fake, out = FakeSlurm(queue_polls=2, on_leave=leave), io.StringIO()
    assert preflight.main(["cluster=slurm_local", "run.name=w", "run.time_limit_min=10", "preflight.wait=true",
                           f"cluster.run_root={tmp_path}"], runner=fake, out=out, err=io.StringIO(),
                           sleep=lambda s: None) == code
    assert sum(c[0] == "squeue" for c in fake.calls) == 3
    report = pc.read_report(run_dir)
    assert report is not None and (verdict is not None or pc.failing(report.checks) == ["preflight_job"])


@pytest.mark.slurm
@pytest.mark.timeout(300)
def test_preflight_runs_as_a_real_slurm_job_and_passes(slurm_cluster, tmp_path):
    """The Slurm path for real: rendered, sbatch'ed, two ranks under srun, the verdict waited for."""
    import re
    import socket

    def runner(argv, **kwargs):
        if argv[0] == "sbatch":  # each test cluster numbers jobs from 1: pin a free rendezvous port
            script = Path(argv[-1])
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            script.write_text(re.sub(r"export MASTER_PORT=.*", f"export MASTER_PORT={port}", script.read_text()))
        return subprocess.run(argv, env=slurm_cluster.env, **kwargs)

    out = io.StringIO()
    code = preflight.main(["cluster=slurm_local", "cluster.nodes=1", "run.name=spf", "run.time_limit_min=5",
                           f"cluster.run_root={tmp_path}", "preflight.wait=true", "preflight.timeout_s=180",
                           "preflight.steps=2"], runner=runner, out=out, err=io.StringIO())
    logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted((tmp_path / "spf").glob("preflight/logs/*")))
    assert code == 0, out.getvalue() + logs
    report = pc.read_report(tmp_path / "spf")
    assert report.verdict == pc.WARN and pc.failing(report.checks) == []
    assert report.world_size == 2 and report.layout["tp"] == 2
