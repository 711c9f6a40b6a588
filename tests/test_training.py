"""Real Megatron-Core training on the CPU (gloo): layout equivalences, data, log lines.

Every run is the tiny model (4 layers, hidden 64, GQA, SwiGLU, RoPE) for 8 steps, each rank
a ``python -m train.worker`` subprocess with a timeout (tests/trainutil.py). Runs are
cached per module, so each layout trains once however many tests read it.

What "equal" means here:

* PP2 == TP1, and DP2 with the distributed optimizer == DP2 without it: **bitwise**. A
  pipeline split runs the same kernels on the same shapes; ZeRO-1 sums the same gradients
  in the same order, only sharding the Adam update.
* TP2 and TP2+SP vs TP1: to 1e-6 relative. A row-parallel layer adds the two ranks'
  partial products in an all-reduce, a different float32 summation order than one matmul,
  so losses agree to about one float32 ulp (~5e-7 at 5.7), not bitwise.
* DP replicas: bitwise identical parameters (the SHA-256 of every rank's parameters).
* Interleaved PP2 x VPP2 == PP2: bitwise.
* DP2 with the gradient reduce and the weight gather overlapped (bucketed) == DP2 without: bitwise;
  the same overlaps under DP2 x PP2 x VPP2 vs TP1: to 1e-6 relative (DP averages in another order).
"""
from __future__ import annotations

import json
import math
import random
import re
from pathlib import Path
from typing import Dict

import pytest

from trainutil import RunResult, train

pytestmark = pytest.mark.training

ITERS = 8
# clip_grad=10 keeps the global grad norm (~1 here) below the clip: the clip coefficient is
# computed from a norm whose float32 summation order depends on the split (per-stage or
# per-shard partial sums, then an all-reduce), so with clipping active, layouts agree to ~1e-8
# relative instead of bitwise. The same layout (resume tests) is bitwise either way.
BASE = [f"training.train_iters={ITERS}", "training.checkpoint_interval=100", "training.clip_grad=10.0"]
LAYOUTS = {
    "tp1": (["parallelism=tp1"], 1),
    "tp2": (["parallelism=tp2"], 2),
    "tp2_sp": (["parallelism=tp2_sp"], 2),
    "pp2": (["parallelism=pp2"], 2),
    "dp2": (["parallelism=tp1", "parallelism.distributed_optimizer=false"], 2),
    "dp2_distopt": (["parallelism=tp1", "parallelism.distributed_optimizer=true"], 2),
    "pp2_vpp2": (["parallelism=pp2", "parallelism.vpp=2"], 2),
    # both DDP overlaps, small buckets (the tiny model's ~0.1M parameters split into several)
    "dp2_overlap": (["parallelism=tp1", "parallelism.distributed_optimizer=true", "parallelism.overlap_grad_reduce=true",
                     "parallelism.overlap_param_gather=true", "parallelism.bucket_size=20000"], 2),
    # the same overlaps under the interleaved pipeline schedule (its per-chunk grad sync hooks), DP2 x PP2 x VPP2
    "pp2_vpp2_dp2_overlap": (["parallelism=pp2", "parallelism.vpp=2", "parallelism.distributed_optimizer=true",
                              "parallelism.overlap_grad_reduce=true", "parallelism.overlap_param_gather=true"], 4),
    "moe_ep2": (["parallelism=tp1", "model.num_experts=4", "model.moe_router_topk=2", "parallelism.ep=2"], 2),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Train each layout at most once per module, on first use."""
    cache: Dict[str, RunResult] = {}
    root = tmp_path_factory.mktemp("layouts")

    def get(name: str) -> RunResult:
        if name not in cache:
            overrides, world = LAYOUTS[name]
            res = train(root / name, BASE + overrides, world=world, timeout=300,
                        extra_env={"SLURMTRON_TEST_PARAM_DIGEST": "1"})
            assert res.codes == [0] * world, f"{name} exited {res.codes}\n{res.all_logs()}"
            assert sorted(res.losses) == list(range(1, ITERS + 1)), res.losses
            cache[name] = res
        return cache[name]

    return get


def _digests(res: RunResult) -> Dict[int, str]:
    out = {}
    for p in sorted((res.run_dir / "logs").glob("local_0_rank*.out")):
        m = re.search(r"parameter digest rank (\d+): ([0-9a-f]{64})", p.read_text(errors="replace"))
        assert m, f"no parameter digest in {p.name}"
        out[int(m.group(1))] = m.group(2)
    return out


def test_tp2_and_tp2_sp_match_tp1(runs):
    ref = runs("tp1").losses
    for name in ("tp2", "tp2_sp"):
        got = runs(name).losses
        for step, loss in ref.items():
            assert math.isclose(got[step], loss, rel_tol=1e-6, abs_tol=0.0), (name, step, got[step], loss)


def test_pp2_equals_tp1_bitwise(runs):
    assert runs("pp2").losses == runs("tp1").losses


def test_interleaved_pipeline_equals_pp2_bitwise(runs):
    # two virtual stages per rank (layers 1,3 on rank 0; 2,4 on rank 1), 8 microbatches > pp:
    # catches p2p messages paired with the wrong buffer when "previous" and "next" are one rank
    assert runs("pp2_vpp2").losses == runs("pp2").losses


def test_moe_with_expert_parallelism_trains(runs):
    res = runs("moe_ep2")
    losses = [res.losses[s] for s in sorted(res.losses)]
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 0.1, losses
    assert losses != [runs("tp1").losses[s] for s in sorted(res.losses)]  # really a different (MoE) model


def test_dp_replicas_end_with_equal_parameters(runs):
    digests = _digests(runs("dp2"))
    assert set(digests) == {0, 1}
    assert digests[0] == digests[1]
    assert _digests(runs("dp2_distopt"))[0] == _digests(runs("dp2_distopt"))[1]


def test_distributed_optimizer_equals_ordinary_optimizer(runs):
    assert runs("dp2_distopt").losses == runs("dp2").losses
    assert _digests(runs("dp2_distopt")) == _digests(runs("dp2"))


def test_overlapped_reduce_and_gather_equal_the_plain_distributed_optimizer(runs):
    """overlap_grad_reduce + overlap_param_gather (bucketed, asynchronous on gloo) reduce the same
    gradients and gather the same weights: bitwise equal losses, and equal final weights (the digest
    reads them after the last lazy all-gather is forced, as a save does); its checkpoint resumes (below)."""
    assert runs("dp2_overlap").losses == runs("dp2_distopt").losses
    assert _digests(runs("dp2_overlap")) == _digests(runs("dp2_distopt"))


@pytest.mark.parametrize("distributed_optimizer", [False, True])
def test_a_checkpoint_saved_with_the_overlapped_bucketed_all_reduce_resumes_bitwise(runs, tmp_path,
                                                                                   distributed_optimizer):
    """overlap_grad_reduce with several buckets (20k parameters each): a crash at iteration 6 after the save
    at 4, then a resumed attempt, reproduce DP2 without overlap bitwise. With the distributed optimizer this
    covers Megatron-Core 0.16.1's multi-bucket save bug (d) in train/megatron_ckpt.py: without the fix the
    saved main weights and Adam moments are a neighbour's and step 5 gives 5.644 instead of 5.556."""
    args = [o for o in BASE if not o.startswith("training.checkpoint_interval")] + [
        "parallelism=tp1", f"parallelism.distributed_optimizer={str(distributed_optimizer).lower()}",
        "parallelism.overlap_grad_reduce=true", "parallelism.bucket_size=20000", "training.checkpoint_interval=4",
        "training.async_save=false"]  # the save at 4 commits before the crash at 6 (an async one may not)
    first = train(tmp_path / "run", args, world=2, timeout=300, extra_env={"SLURMTRON_TEST_FAIL_AT_ITER": "6"})
    assert first.codes != [0, 0] and sorted(first.losses) == [1, 2, 3, 4, 5]
    again = train(tmp_path / "run", args, world=2, attempt=1, timeout=300)
    assert again.codes == [0, 0], again.all_logs()
    assert [e["step"] for e in again.events if e["event"] == "resume"] == [4]
    assert again.losses == runs("dp2_distopt" if distributed_optimizer else "dp2").losses


def test_overlap_under_the_interleaved_pipeline_matches_tp1(runs):
    # dp2 averages the loss in another order than one rank (as dp2 vs tp1 below): 1e-6, not bitwise
    ref = runs("tp1").losses
    for step, loss in runs("pp2_vpp2_dp2_overlap").losses.items():
        assert math.isclose(loss, ref[step], rel_tol=1e-6), (step, loss, ref[step])


def test_dp2_matches_tp1(runs):
    # the same global batch of 8, split 4+4 over two ranks: the loss is averaged in another order
    ref = runs("tp1").losses
    for step, loss in runs("dp2").losses.items():
        assert math.isclose(loss, ref[step], rel_tol=1e-6), (step, loss, ref[step])


def test_every_iteration_line_is_parsed_by_the_analysis_parser(runs):
    from analysis.parse_megatron import parse_checkpoint_text, parse_iteration_text

    for name in ("tp2", "pp2"):
        res = runs(name)
        text = res.log()
        lines = [ln for ln in text.splitlines() if re.search(r"\] iteration +\d+/", ln)]
        assert len(lines) == ITERS, lines
        df, skipped = parse_iteration_text(text)
        assert skipped == 0
        assert df["iteration"].tolist() == list(range(1, ITERS + 1))
        assert df["consumed_samples"].tolist() == [8.0 * i for i in range(1, ITERS + 1)]
        assert df["global_batch_size"].eq(8).all() and df["elapsed_ms"].gt(0).all()
        assert df["skipped_iters"].eq(0).all() and df["nan_iters"].eq(0).all()
        assert df["timestamp"].notna().all()
        # the log's %.6E loss is the event log's exact loss, rounded
        for it, loss in zip(df["iteration"], df["lm_loss"]):
            assert float(f"{res.losses[it]:.6E}") == loss
        ck, _ = parse_checkpoint_text(text)
        assert ck["kind"].tolist() == ["save", "saved"] and ck["iteration"].tolist() == [ITERS, ITERS]


def _corpus(path: Path, docs: int = 300, seed: int = 0) -> None:
    """Small generated English: a few hundred documents of simple sentences (learnable bytes)."""
    rng = random.Random(seed)
    subj = ["the cat", "a dog", "the model", "my friend", "the cluster", "a node"]
    verb = ["sees", "trains", "likes", "finds", "checks", "saves"]
    obj = ["the ball", "a checkpoint", "the data", "some tokens", "the log", "a bird"]
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(docs):
            n = rng.randint(3, 8)
            text = " ".join(f"{rng.choice(subj)} {rng.choice(verb)} {rng.choice(obj)}." for _ in range(n))
            f.write(json.dumps({"text": text}) + "\n")


def test_loss_falls_on_an_indexed_dataset(tmp_path):
    import subprocess
    import sys

    from trainutil import REPO

    _corpus(tmp_path / "corpus.jsonl")
    prefix = tmp_path / "data" / "corpus"
    proc = subprocess.run(
        [sys.executable, "-m", "launch.preprocess", "--input", str(tmp_path / "corpus.jsonl"),
         "--output-prefix", str(prefix)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert prefix.with_suffix(".bin").stat().st_size > 0 and prefix.with_suffix(".idx").exists()
    res = train(tmp_path / "run", BASE + ["data=indexed", f"data.path={prefix}", "parallelism=tp2"],
                world=2, timeout=300)
    assert res.codes == [0, 0], res.all_logs()
    losses = [res.losses[s] for s in sorted(res.losses)]
    assert len(losses) == ITERS
    # from ~ln(320) = 5.77 at the start; 8 steps of byte-level English take it well below
    assert losses[0] > 5.5
    assert max(losses[-3:]) < losses[0] - 0.4, losses


def test_local_launcher_relaunches_a_crash_until_the_zero_progress_guard(tmp_path):
    """cluster=local: a rank crash relaunches with attempt+1; the worker's guard ends it with 3."""
    import os
    import subprocess
    import sys

    from trainutil import REPO, write_job

    run_dir = tmp_path / "run"
    write_job(run_dir, ["cluster.gpus_per_node=2", "parallelism=tp2", "training.train_iters=4",
                        "training.zero_progress_restarts=1"])
    code = (
        "import sys; from launch.compose import load_job; from launch.local import run; "
        f"sys.exit(run(load_job({str(run_dir / 'config.yaml')!r}), {str(run_dir)!r}))"
    )
    env = {**os.environ, "SLURMTRON_TEST_FAIL_AT_ITER": "2"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    from recovery.events import read_events

    events = read_events(run_dir / "events.jsonl")
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    logs = sorted(p.name for p in (run_dir / "logs").glob("*.out"))
    assert logs == ["local_0_rank0.out", "local_0_rank1.out", "local_1_rank0.out", "local_1_rank1.out"]
    stops = [e for e in events if e["event"] == "stop"]
    assert [s["reason"] for s in stops] == ["crash", "zero_progress"]
    assert stops[-1]["code"] == 3 and stops[-1]["restart_count"] == 1
    assert "iteration        1/       4" in proc.stdout  # the last rank's output is echoed live
    # progress: the launcher says what it does, the last rank says each long phase as it begins
    said = [line for line in proc.stdout.splitlines() if line.startswith("launcher: ")]
    assert [line.split(";")[0].split(" (")[0] for line in said] == [
        "launcher: attempt 0: starting 2 rank(s) of run tiny on this machine",
        "launcher: attempt 0 ended with exit 1",
        "launcher: run tiny stopped: zero_progress"], said  # one line per attempt
    phases = [line.split("] ", 1)[1].split(":")[0].split(" (")[0] for line in proc.stdout.splitlines()
              if line.startswith("[") and " s] " in line[:12]]
    first = ["attempt 0 of run tiny", "2 rank(s) joined", "building the model", "building the data",
             "training from step 1 to 4; the first step is slower"]
    assert phases[:len(first)] == first, phases
    assert phases[len(first):len(first) + 2] == ["attempt 1 of run tiny", "2 rank(s) joined"], phases


def test_local_drain_at_step_stops_then_pretrain_continues(tmp_path):
    """cluster=local: a drain request (launch/stop.py at_step=3) ends the run at step 3 with exit 0, no
    relaunch; pretrain.py with the same run clears the request and continues from that checkpoint.
    launch/status.py follows it: stopped, running (while pretrain.py trains), completed. The same pretrain.py
    command started again while it trains is refused by the run lock (exit 9) and leaves the run alone."""
    import json
    import subprocess
    import sys

    import io
    import os
    import time

    from launch import status, stop
    from launch.run_state import gather
    from recovery.events import read_events
    from recovery.resume import find_latest_verified
    from trainutil import REPO, write_job

    def no_slurm(argv, **kw):  # a cluster=local run never asks Slurm
        raise AssertionError(f"status ran {argv} for a cluster=local run")

    run_dir = tmp_path / "drained"
    overrides = ["cluster=local", "cluster.gpus_per_node=2", "parallelism=tp2", "training.train_iters=5",
                 "training.checkpoint_interval=100", f"run.dir={run_dir}", "run.name=drained"]
    write_job(run_dir, overrides)
    assert stop.main([str(run_dir), "at_step=3"]) == 0
    code = ("import sys; from launch.compose import load_job; from launch.local import run; "
            f"sys.exit(run(load_job({str(run_dir / 'config.yaml')!r}), {str(run_dir)!r}))")
    first = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    events = read_events(run_dir / "events.jsonl")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert [(e["event"], e.get("reason"), e.get("step")) for e in events if e["event"] in ("stop", "exit")] == [
        ("stop", "user_stop", 3), ("exit", "stopped", 3)]
    assert max(e["step"] for e in events if e["event"] == "iteration") == 3
    assert find_latest_verified(run_dir / "checkpoints").step == 3
    assert json.loads((run_dir / "stop.json").read_text())["state"] == "stopped"
    # status of the stopped run: from the event log, the checkpoint directory and the logs (no Slurm here)
    st = gather(run_dir, runner=no_slurm)
    assert (st.state, st.step, st.target, st.checkpoint_step) == ("stopped", 3, 5, 3), st
    assert "the same command continues it" in st.reason and st.attempts == 1
    assert st.gpu_hours_source == "events" and 0 < st.gpu_hours < 2 * 300 / 3600  # 2 ranks, under the timeout

    # continue it with pretrain.py (steps slowed to 1 s) and ask for the status while it runs, then after
    env = {**os.environ, "SLURMTRON_TEST_STEP_SLEEP_S": "1"}
    proc = subprocess.Popen([sys.executable, str(REPO / "launch" / "pretrain.py"), *overrides], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    seen, second, deadline = [], None, time.time() + 300
    while proc.poll() is None and time.time() < deadline:
        out = io.StringIO()
        assert status.main([str(run_dir), "--json"], runner=no_slurm, out=out, err=io.StringIO()) == 0
        seen.append(json.loads(out.getvalue()))
        if second is None and seen[-1]["state"] == "running":  # the same command again, while it runs
            second = subprocess.run([sys.executable, str(REPO / "launch" / "pretrain.py"), *overrides], cwd=tmp_path,
                                    capture_output=True, text=True, env=env, timeout=120)
            second_alive = proc.poll() is None
        time.sleep(0.5)
    stdout, stderr = proc.communicate(timeout=60)
    # the second launch was refused by the run lock (held by the launcher from its start, over the ranks'
    # start-up too): one line, exit 9, nothing started or appended to the running run's logs and events
    assert second is not None and second_alive, [d["state"] for d in seen]
    assert second.returncode == 9 and second.stdout == "", second.stdout[-3000:] + second.stderr[-3000:]
    assert second.stderr.startswith("refused: run.name: this run is being trained right now by pid "), second.stderr
    assert len(second.stderr.splitlines()) == 1 and f"pid {proc.pid} " in second.stderr, second.stderr
    assert not any("run_locked" in p.read_text() for p in (run_dir / "logs").glob("*.out"))
    running = [d for d in seen if d["state"] == "running"]
    assert running, [d["state"] for d in seen]
    assert f"pid" in running[-1]["reason"] and running[-1]["attempts"] >= 1
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    again = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    assert "cleared stop.json" in again.stderr
    out = io.StringIO()
    assert status.main([str(run_dir)], runner=no_slurm, out=out, err=io.StringIO()) == 0
    text = out.getvalue()
    for fragment in ("state      completed; attempts 2", "progress   step 5 / 5 (100.0%)",
                     "checkpoint step 5 verified", "process-hours so far (from the event log"):
        assert fragment in text, text
    events = read_events(run_dir / "events.jsonl")
    assert [(e["restart_count"], e["step"]) for e in events if e["event"] == "resume"] == [(0, 3)]
    assert [e["reason"] for e in events if e["event"] == "exit"] == ["stopped", "completed"]
    assert [e["rank"] for e in events if e["event"] == "job_start"] == [0, 0]  # none from the refused launch
    assert not (run_dir / "stop.json").exists()
