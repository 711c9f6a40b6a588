"""Bring-your-own-data on real Megatron-Core training (CPU, gloo, 2 ranks, tp1 x dp2).

One module fixture trains a small byte-level BPE with ``tokenizers`` (offline, milliseconds),
preprocesses two corpora with it (``python -m launch.preprocess --tokenizer hf:... --workers 2``)
and runs the same 0.3/0.7 blend twice: uninterrupted, and stopped by SIGUSR2 (the time-limit
warning) then resumed, like Slurm's requeue (:mod:`tests.faults`). Shown:

* the blend Megatron-Core's ``BlendedMegatronDatasetBuilder`` built draws each source's share:
  after every consumed prefix the per-source counts are within one sample of weight x consumed
  (Megatron's greedy blending keeps the error below one sample);
* the resumed attempt starts at exactly the per-source position the stopped one ended at, and
  every loss is bitwise equal to the uninterrupted run's;
* with the HF tokenizer end to end (preprocess -> train), the loss falls.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from datafiles import corpus, train_bpe
from faults import Fault, losses_by_attempt, run_until_done, write_rank_logs_tail

from recovery.events import read_events

pytestmark = pytest.mark.training

WORLD = 2
ITERS = 12
WEIGHTS = (0.3, 0.7)
REPO = Path(__file__).resolve().parent.parent


def _write_job(run_dir: Path, data: dict) -> None:
    from launch.compose import compose_job, job_to_yaml

    run_dir.mkdir(parents=True, exist_ok=True)
    job = compose_job([
        "parallelism=tp1", f"cluster.gpus_per_node={WORLD}", "cluster.nodes=1", f"training.train_iters={ITERS}",
        "training.checkpoint_interval=4", "training.global_batch_size=8", "training.clip_grad=10.0",
        "training.lr=1e-3", "data=indexed", f"data.tokenizer=hf:{data['tokenizer']}",
        f"model.vocab_size={data['vocab']}",
        f"data.blend='{WEIGHTS[0]} {data['web']} {WEIGHTS[1]} {data['code']}'", f"run.dir={run_dir}",
    ])
    (run_dir / "config.yaml").write_text(job_to_yaml(job))


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("byod")
    web = corpus(tmp / "web.jsonl", docs=300, seed=1)
    code = corpus(tmp / "code.jsonl", docs=300, seed=2, words=["def f", "return x", "import os", "class A"])
    texts = web.read_text().splitlines() + code.read_text().splitlines()
    tok = train_bpe(tmp / "tokenizer.json", [json.loads(t)["text"] for t in texts], vocab_size=320)
    out = {"tokenizer": tok, "vocab": 320}
    for name, src in (("web", web), ("code", code)):
        prefix = tmp / "data" / name
        proc = subprocess.run([sys.executable, "-m", "launch.preprocess", "--input", str(src), "--output-prefix",
                               str(prefix), "--tokenizer", f"hf:{tok}", "--workers", "2"],
                              cwd=REPO, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "set model.vocab_size=320" in proc.stdout
        out[name] = prefix
    return out


@pytest.fixture(scope="module")
def runs(data, tmp_path_factory) -> dict:
    ref = tmp_path_factory.mktemp("ref")
    _write_job(ref, data)
    atts = run_until_done(ref, WORLD, max_attempts=1, timeout_s=300)
    assert [a.codes for a in atts] == [[0] * WORLD], write_rank_logs_tail(ref)
    stopped = tmp_path_factory.mktemp("stopped")
    _write_job(stopped, data)
    plan = [[Fault("signal_all", 6, signal.SIGUSR2, env={"SLURMTRON_TEST_STEP_SLEEP_S": "0.3"})]]
    atts = run_until_done(stopped, WORLD, plan, max_attempts=3, timeout_s=300)
    assert [a.codes for a in atts] == [[42, 42], [0, 0]], ([a.codes for a in atts], write_rank_logs_tail(stopped))
    return {"ref": ref, "stopped": stopped}


def _events(run_dir: Path, name: str) -> list:
    return [e for e in read_events(run_dir / "events.jsonl") if e["event"] == name and e.get("rank") == 0]


def test_the_blend_draws_each_source_by_its_weight(runs):
    (start,) = _events(runs["ref"], "data")
    n = ITERS * 8
    assert start["num_samples"] == n and start["seed"] == 1234 and start["consumed_samples"] == 0
    web, code = start["sources"]
    assert (web["weight"], code["weight"]) == WEIGHTS and web["path"].endswith("web")
    assert web["samples"] + code["samples"] == n
    for s, w in ((web, WEIGHTS[0]), (code, WEIGHTS[1])):
        assert abs(s["samples"] - w * n) <= 1, (s, w * n)  # Megatron's greedy blending: error below one sample
    (end,) = _events(runs["ref"], "data_position")
    assert end["consumed_samples"] == n and end["consumed_per_source"] == [web["samples"], code["samples"]]


def test_resume_restores_the_per_source_position_and_the_losses_bitwise(runs):
    stopped = runs["stopped"]
    starts = _events(stopped, "data")
    ends = _events(stopped, "data_position")
    assert [e["restart_count"] for e in starts] == [0, 1] and len(ends) == 2
    stop_at = ends[0]["consumed_samples"]
    assert 0 < stop_at < ITERS * 8
    resumed = starts[1]
    assert resumed["consumed_samples"] == stop_at
    assert [s["consumed"] for s in resumed["sources"]] == ends[0]["consumed_per_source"]
    assert not _events(stopped, "data_changed")  # the same blend, seed and length: no warning
    for c, w in zip(ends[0]["consumed_per_source"], WEIGHTS):
        assert abs(c - w * stop_at) <= 1, (ends[0], w * stop_at)
    ref = losses_by_attempt(runs["ref"])[0]
    by_attempt = losses_by_attempt(stopped)
    merged = {**by_attempt[0], **by_attempt[1]}  # the resumed attempt recomputes steps after the checkpoint
    assert sorted(merged) == list(range(1, ITERS + 1))
    for attempt in by_attempt.values():
        for step, loss in attempt.items():
            assert loss == ref[step], (step, loss, ref[step])


def test_a_trained_hf_tokenizer_drives_preprocess_train_and_the_loss_falls(runs):
    losses = [float(v) for _, v in sorted(losses_by_attempt(runs["ref"])[0].items())]
    assert len(losses) == ITERS
    assert losses[0] > 5.0  # ~ln(padded vocab 320) = 5.77 at the start
    assert max(losses[-3:]) < losses[0] - 0.5, losses


def test_a_prefix_missing_on_the_compute_node_is_a_final_stop_in_one_line(tmp_path):
    """force=true submits a prefix the login node cannot see; the rank that cannot see it either stops for good."""
    from trainutil import train

    res = train(tmp_path / "run", ["data=indexed", f"data.path={tmp_path / 'nowhere' / 'corpus'}", "force=true",
                                   "parallelism=tp1"], world=1, timeout=180)
    assert res.codes == [7], res.all_logs()
    (stop,) = [e for e in res.events if e["event"] == "stop"]
    assert stop["reason"] == "storage_error" and f"{tmp_path / 'nowhere' / 'corpus'}.bin" in stop["detail"]
    log = res.all_logs()
    assert "refused to start: data files missing on this node" in log and "Traceback" not in log


def test_megatron_builds_a_separate_validation_blend(tmp_path):
    """data.valid_blend becomes Megatron's blend_per_split: the train blend uses its prefixes whole, the
    validation blend its own, each drawn by weight (one process, gloo world of 1)."""
    from datafiles import write_index

    web, code = write_index(tmp_path / "web", [100] * 50), write_index(tmp_path / "code", [100] * 50, seed=1)
    val1, val2 = write_index(tmp_path / "v1", [100] * 10, seed=2), write_index(tmp_path / "v2", [100] * 10, seed=3)
    script = f"""
import json, torch.distributed as dist
from launch.compose import compose_job
from launch.tokenizer import get_tokenizer
from train.data import build_indexed_dataset, per_source
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
job = compose_job(["data=indexed", "data.blend='0.3 {web} 0.7 {code}'", "data.valid_blend='1 {val1} 3 {val2}'",
                   "data.split='50,50,0'"])
train, valid = build_indexed_dataset(job.data, 64, 160, {str(tmp_path / 'cache')!r}, get_tokenizer("byte"), 16)
print(json.dumps([len(train), len(valid), per_source(train, 160, 160), per_source(valid, 16, 16),
                  [len(d.indices) for d in train.datasets]]))
"""
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    n_train, n_valid, tr, va, documents = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (n_train, n_valid) == (160, 16)
    assert tr["samples"] == [48, 112] and va["samples"] == [4, 12]  # 0.3/0.7 of 160; 1/4 and 3/4 of 16
    assert documents == [50, 50]  # every document of each prefix trains: data.split (50,50,0) no longer applies


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
