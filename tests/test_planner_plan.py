"""launch/plan.py: the table, the one JSON object, parallelism=auto, and no torch on the login node."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir

from launch.compose import CONFIG_DIR
from launch.config import register_configs
from launch.plan import main

REPO = Path(__file__).resolve().parent.parent


def _cfg(*overrides: str):
    register_configs()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def _run(*overrides: str) -> tuple[int, str]:
    lines: list[str] = []
    status = main(_cfg(*overrides), out=lines.append)
    return status, "\n".join(lines)


def test_table_shows_memory_step_time_mfu_and_cost():
    status, text = _run("model=70b", "cluster=lustre")
    assert status == 0
    for word in ("layout tp8-pp4-sp-sel", "weights", "activations", "fits", "step time", "MFU", "GPU-hours",
                 "checkpoint"):
        assert word in text


def test_json_is_one_object_with_the_contract_fields():
    status, text = _run("model=70b", "cluster=lustre", "plan.format=json")
    assert status == 0
    obj = json.loads(text)
    for key in ("memory_gb_per_gpu", "step_time_s", "tflops_per_gpu", "mfu", "fits"):
        assert key in obj
    assert obj["fits"] is True and 0 < obj["mfu"] < 1 and obj["problems"] == []


def test_auto_prints_the_ranked_layouts_then_the_chosen_estimate():
    status, text = _run("model=70b", "cluster=lustre", "parallelism=auto", "plan.top=3")
    assert status == 0
    assert "rank" in text and "why not first" in text and "chosen: parallelism.name=auto:" in text


def test_a_layout_that_does_not_fit_is_reported_as_a_problem():
    status, text = _run("model=405b", "cluster=lustre", "cluster.nodes=2048", "parallelism.pp=4", "parallelism.vpp=null",
                        "parallelism.cp=1", "parallelism.recompute=none", "parallelism.sequence_parallel=false",
                        "parallelism.account_for_embedding_in_pipeline_split=false",
                        "parallelism.account_for_loss_in_pipeline_split=false")
    assert status == 1
    assert "DOES NOT FIT" in text and "problem: parallelism" in text
    # the refusal leads; the numbers follow, labelled as no plan
    assert text.splitlines()[0].startswith("refused: pretrain.py would refuse this job")
    assert text.index("problem: parallelism") < text.index("for reference only, not a plan") < text.index("MFU")


def test_a_layout_inside_the_error_band_warns_and_is_not_refused():
    status, text = _run("model=70b", "cluster=lustre", "cluster.gpu_memory_gb=30")
    assert status == 0, text
    assert "MAY NOT FIT" in text and "warning: estimated memory per GPU" in text and "preflight" in text
    status, text = _run("model=70b", "cluster=lustre", "cluster.gpu_memory_gb=30", "plan.format=json")
    out = json.loads(text)
    assert out["memory_verdict"] == "inside the error band" and out["warnings"] and out["problems"] == []


def test_a_broken_job_prints_the_check_instead_of_crashing():
    status, text = _run("model=70b", "cluster=lustre", "training.micro_batch_size=0", "plan.format=json")
    assert status == 2
    assert any("training.micro_batch_size" in p for p in json.loads(text)["problems"])


def test_nothing_fits_exits_1():
    status, text = _run("model=405b", "cluster=lustre", "cluster.nodes=1", "parallelism=auto", "plan.format=json")
    assert status == 1 and json.loads(text)["fits"] is False


def test_cli_json_without_torch(tmp_path):
    """The script, as a user runs it, prints one JSON object and never imports torch or megatron."""
    probe = (
        "import runpy, sys; sys.argv = ['plan.py', 'model=13b', 'cluster=lustre', 'plan.format=json', "
        "'hydra.run.dir=.', 'hydra.output_subdir=null'];\n"
        "try:\n    runpy.run_path(%r, run_name='__main__')\n"
        "except SystemExit:\n    pass\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron')]\n"
        "print('IMPORTED', bad)\n" % str(REPO / "launch" / "plan.py")
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    first, last = out.stdout.strip().splitlines()[0], out.stdout.strip().splitlines()[-1]
    assert json.loads(first)["fits"] is True
    assert last == "IMPORTED []"
