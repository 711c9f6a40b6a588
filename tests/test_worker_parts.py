"""Unit tests of the worker's pure parts: rank environment, data slicing, tokenizer, log line, launcher policy."""
from __future__ import annotations

import datetime
import os
import subprocess

import pytest

from launch import dist_env
from launch.local import Attempt, LocalLauncher, rank_env
from launch.tokenizer import get_tokenizer


def test_expand_nodelist():
    assert dist_env.expand_nodelist("node[01-03,7],gpu-a") == ["node01", "node02", "node03", "node7", "gpu-a"]
    assert dist_env.expand_nodelist("c1") == ["c1"]
    assert dist_env.expand_nodelist("a[8-10]x") == ["a8x", "a9x", "a10x"]


def test_slurm_environment_wins_and_resolves_the_first_node():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1", "SLURM_JOB_NODELIST": "n[3-4]",
           "SLURM_JOB_ID": "1234"}
    d = dist_env.from_env(env, resolver=lambda host: {"n3": "10.0.0.3"}[host])
    assert (d.rank, d.world_size, d.local_rank, d.source) == (5, 16, 1, "slurm")
    assert d.master_addr == "10.0.0.3" and d.nodes == ["n3", "n4"]
    assert d.master_port == dist_env.default_port("1234") != dist_env.default_port("1235")
    pinned = dist_env.from_env({**env, "MASTER_ADDR": "head", "MASTER_PORT": "6000"}, resolver=lambda h: h)
    assert (pinned.master_addr, pinned.master_port) == ("head", 6000)


def test_torchrun_environment_and_single_process():
    d = dist_env.from_env({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": "29999"})
    assert (d.rank, d.world_size, d.master_port, d.source) == (1, 4, 29999, "torchrun")
    assert d.init_method == "tcp://127.0.0.1:29999"
    assert dist_env.from_env({}).world_size == 1
    assert dist_env.backend(True) == "nccl" and dist_env.backend(False) == "gloo"


def test_unresolvable_host_falls_back_to_its_name():
    def fail(host):
        raise OSError("no DNS")

    assert dist_env.resolve_address("nodeX", resolver=fail) == "nodeX"


@pytest.mark.parametrize("dp,mbs", [(1, 1), (2, 1), (4, 2)])
def test_dp_ranks_split_each_global_batch_and_steps_never_overlap(dp, mbs):
    from train.data import microbatch_indices

    gbs = 8
    nmb = gbs // (mbs * dp)
    seen = []
    for step in range(3):
        per_rank = [sum(microbatch_indices(step * gbs, nmb, mbs, dp, r), []) for r in range(dp)]
        batch = sorted(sum(per_rank, []))
        assert batch == list(range(step * gbs, (step + 1) * gbs))  # the same global batch whatever dp is
        seen += batch
    assert len(seen) == len(set(seen))  # no sample repeated or skipped across steps (resume included)


def test_mock_dataset_is_deterministic_and_in_vocab():
    from train.data import MockGPTDataset

    a, b = MockGPTDataset(16, 257, seed=3), MockGPTDataset(16, 257, seed=3)
    assert all((a[i]["tokens"] == b[i]["tokens"]).all() for i in range(5))
    assert not (a[0]["tokens"] == MockGPTDataset(16, 257, seed=4)[0]["tokens"]).all()
    s = a[7]
    assert s["tokens"].shape == (16,) and (s["labels"][:-1] == s["tokens"][1:]).all()
    assert int(s["tokens"].max()) < 256


def test_byte_tokenizer_roundtrip():
    tok = get_tokenizer("byte")
    assert tok.vocab_size == 257 and tok.eod == 256
    ids = tok.tokenize("héllo")
    assert all(0 <= i < 256 for i in ids) and tok.detokenize(ids + [tok.eod]) == "héllo"
    with pytest.raises(ValueError, match="byte"):
        get_tokenizer("gpt2")


def test_preprocess_reads_jsonl_and_text(tmp_path):
    from launch.preprocess import iter_documents

    (tmp_path / "c.jsonl").write_text('{"text": "a b"}\n\n{"text": "c"}\n')
    (tmp_path / "c.txt").write_text("one\n\ntwo\n")
    assert list(iter_documents(tmp_path / "c.jsonl")) == ["a b", "c"]
    assert list(iter_documents(tmp_path / "c.txt")) == ["one", "two"]
    (tmp_path / "bad.jsonl").write_text('{"body": 1}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        list(iter_documents(tmp_path / "bad.jsonl"))


def test_iteration_line_is_megatrons_and_parses():
    from analysis.parse_megatron import parse_iteration_text
    from train.train_loop import format_iteration

    kw = dict(now=datetime.datetime(2026, 11, 29, 10, 0, 0, 123456), iteration=5, train_iters=20, consumed=40,
              elapsed_ms=812.34, lr=3e-4, gbs=8, loss=5.512345, loss_scale=1.0, grad_norm=1.2344,
              skipped=0, nan=0)
    line = format_iteration(**kw, tflops=0.123)
    assert line == (
        "[2026-11-29 10:00:00.123456] iteration        5/      20 | consumed samples:           40 | "
        "elapsed time per iteration (ms): 812.3 | throughput per GPU (TFLOP/s/GPU): 0.1 | "
        "learning rate: 3.000000E-04 | global batch size:     8 | lm loss: 5.512345E+00 | loss scale: 1.0 | "
        "grad norm: 1.234 | number of skipped iterations:   0 | number of nan iterations:   0 |"
    )
    with_mfu = format_iteration(**kw, tflops=400.0, mfu=0.4123)
    assert "throughput per GPU (TFLOP/s/GPU): 400.0 | MFU: 41.23% | learning rate" in with_mfu
    df, skipped = parse_iteration_text(line + "\n" + with_mfu + "\n")
    assert skipped == 0 and df["iteration"].tolist() == [5, 5]
    assert df["mfu_pct"].tolist()[1] == pytest.approx(41.23) and df["lm_loss"].tolist() == [5.512345] * 2


def test_attempt_code_follows_the_slurm_policy():
    assert Attempt(0, [0, 0]).code == 0
    assert Attempt(0, [42, 42]).code == 42
    assert Attempt(0, [42, 1]).code == 1  # a crash beats a requeue request
    assert Attempt(0, [0, -9]).code == 1  # killed by a signal counts as a crash
    assert Attempt(0, [3, 3]).code == 3 and Attempt(0, [4, 4]).code == 4


def test_rank_env_is_torchrun_style_and_drops_slurm():
    env = rank_env({"SLURM_PROCID": "3", "PATH": "/bin"}, rank=1, world=2, port=1234, attempt=2, repo_root="/r")
    assert "SLURM_PROCID" not in env and env["PATH"] == "/bin"
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["MASTER_PORT"]) == ("1", "2", "1", "1234")
    assert env["SLURMTRON_RESTART_COUNT"] == "2" and env["PYTHONPATH"].split(":")[0] == "/r"


class _FakeProc:
    """A rank at the subprocess boundary: exits with ``code`` after ``polls`` polls (None = runs forever)."""

    def __init__(self, code, polls):
        self.code, self.polls, self.pid, self.killed, self.signals = code, polls, 99999999, False, []

    def poll(self):
        if self.killed:
            return -9
        if self.polls is None:
            return None
        self.polls -= 1
        return self.code if self.polls < 0 else None

    def wait(self):
        return self.poll()

    def kill(self):
        self.killed = True

    def send_signal(self, s):
        self.signals.append(s)


def test_one_rank_dying_kills_the_others(tmp_path):
    procs = iter([_FakeProc(1, 0), _FakeProc(None, None)])
    t = [0.0]

    def sleep(dt):
        t[0] += 1.0

    launcher = LocalLauncher(run_dir=tmp_path, world=2, popen=lambda *a, **k: next(procs), echo=None,
                             clock=lambda: t[0], sleep=sleep)
    result = launcher.launch(0)
    assert result.codes[0] == 1 and launcher.procs[1].killed
    assert result.code == 1


def test_forwarded_signal_marks_the_attempt_interrupted(tmp_path):
    import signal

    procs = iter([_FakeProc(42, 3), _FakeProc(42, 3)])
    launcher = LocalLauncher(run_dir=tmp_path, world=2, popen=lambda *a, **k: next(procs), echo=None)

    def sleep(dt):  # the user presses Ctrl-C while the ranks run
        if not launcher.interrupted:
            launcher.forward(signal.SIGINT)

    launcher.sleep = sleep
    result = launcher.launch(0)
    assert [p.signals for p in launcher.procs] == [[signal.SIGINT], [signal.SIGINT]]
    assert result.interrupted and result.code == 42  # run() does not relaunch an interrupted attempt


def _rank_context(tmp_path, overrides, rank=0, world=1):
    from launch.compose import compose_job
    from recovery.events import EventLog
    from recovery.signals import StopFlag
    from train.context import Hooks, RankContext

    job = compose_job(["model=tiny", f"cluster.gpus_per_node={world}", *overrides])
    paths = job.paths_at(tmp_path)
    return RankContext(job=job, paths=paths, dist=dist_env.DistEnv(rank, world, rank, "127.0.0.1", 1),
                       env={}, restart=0, flag=StopFlag(), events=EventLog(paths.events, rank=rank),
                       hooks=Hooks())


class _RecordingCheckpointer:
    """The Checkpointer's schedule with the collective save replaced by a record (2 s per save)."""

    @staticmethod
    def make(ctx):
        from train.checkpointer import Checkpointer

        ckpt = Checkpointer(ctx, parts=None)
        ckpt.saves = []

        def save(state, reason):
            ckpt.saves.append((state.step, reason))
            ckpt.saved_steps.add(state.step)
            return 2.0

        ckpt.save = save
        return ckpt


def test_checkpointer_saves_at_the_interval_but_never_after_the_last_step(tmp_path):
    from train.train_loop import TrainState

    ckpt = _RecordingCheckpointer.make(_rank_context(tmp_path, ["training.checkpoint_interval=3",
                                                                "training.async_save=false"]))
    for step in range(1, 10):
        ckpt.after_step(TrainState(step, step * 8), step_s=1.0, iters=9)
    assert ckpt.saves == [(3, "interval"), (6, "interval")]  # 9 is the final save's, not the interval's
    ckpt.save_final(TrainState(9, 72))
    ckpt.save_final(TrainState(9, 72))
    assert ckpt.saves[-1] == (9, "final") and len(ckpt.saves) == 3


def test_checkpointer_resolves_auto_after_the_first_save_and_checks_the_lead_time_once(tmp_path):
    from recovery.events import read_events
    from train.train_loop import TrainState

    ctx = _rank_context(tmp_path, ["training.checkpoint_interval=auto", "training.signal_lead_time_s=1",
                                   "training.async_save=false"])
    ckpt = _RecordingCheckpointer.make(ctx)
    assert ckpt.interval is None
    for step in range(1, 4):
        ckpt.after_step(TrainState(step, step * 8), step_s=1.0, iters=100)
    assert ckpt.saves[0] == (1, "interval") and ckpt.interval >= 1
    events = read_events(ctx.paths.events)
    assert [e["interval"] for e in events if e["event"] == "checkpoint_interval"] == [ckpt.interval]
    warnings = [e for e in events if e["event"] == "lead_time_warning"]
    assert len(warnings) == 1 and warnings[0]["save_s"] == 2.0  # 1 s lead < 1 s step + 2 s save, said once


def _async_recording(ctx):
    """The async schedule with the collective start and poll replaced: a save stays in flight until finished."""
    from train.async_ckpt import InFlight
    from train.checkpointer import Checkpointer

    ckpt = Checkpointer(ctx, parts=None)
    ckpt.started = []

    def start(state, reason):
        ckpt.started.append(state.step)
        ckpt.pending = InFlight(state.step, reason, 0.0, 0.5, {})

    ckpt._start_async = start
    ckpt.poll = lambda blocking=False: None
    return ckpt


def test_async_saves_one_in_flight_a_due_save_is_delayed_and_said_once(tmp_path):
    from recovery.events import read_events
    from train.train_loop import TrainState

    ctx = _rank_context(tmp_path, ["training.checkpoint_interval=2", "training.async_save=true"])
    ckpt = _async_recording(ctx)
    for step in range(1, 7):
        ckpt.after_step(TrainState(step, step * 8), step_s=1.0, iters=20)
    assert ckpt.started == [2]  # 4 and 6 came due while 2 was still in flight
    delayed = [e for e in read_events(ctx.paths.events) if e["event"] == "checkpoint_delayed"]
    assert [(e["step"], e["pending_step"]) for e in delayed] == [(4, 2)] and "delayed" in delayed[0]["detail"]
    ckpt.saved_steps.add(2)
    ckpt.pending = None  # the save of step 2 committed
    ckpt.after_step(TrainState(7, 56), step_s=1.0, iters=20)  # the delayed save happens at the next boundary
    assert ckpt.started == [2, 7]
    ckpt.pending = None
    ckpt.saved_steps.add(7)
    ckpt.after_step(TrainState(8, 64), step_s=1.0, iters=20)  # and the schedule goes on
    assert ckpt.started == [2, 7, 8]


def test_async_save_is_the_default_and_can_be_turned_off():
    from launch.compose import compose_job

    assert compose_job(["model=tiny"]).training.async_save is True
    assert compose_job(["model=tiny", "training.async_save=false"]).training.async_save is False


def test_test_hooks_come_from_the_environment_only():
    from train.context import Hooks

    assert Hooks.from_env({}) == Hooks()
    hooks = Hooks.from_env({"SLURMTRON_TEST_FAIL_AT_ITER": "4", "SLURMTRON_TEST_STEP_SLEEP_S": "0.5"})
    assert hooks.fail_at_iter == 4 and hooks.step_sleep_s == 0.5
    from launch.config import TrainingConfig

    assert not hasattr(TrainingConfig(), "fail_at_iter")  # no test hook in the user's schema


def test_preflight_local_run_reports_killed_ranks_as_none(tmp_path):
    from launch import preflight
    from launch.compose import compose_job

    procs = iter([_FakeProc(1, 0), _FakeProc(None, None)])
    t = [0.0]

    def sleep(dt):
        t[0] += 1.0

    job = compose_job(["model=tiny", "cluster.gpus_per_node=2", "parallelism=tp2"])
    codes = preflight.run_local(job, tmp_path, 100, popen=lambda *a, **k: next(procs), env={}, clock=lambda: t[0],
                                sleep=sleep)
    assert codes == [1, None]  # rank 1 waited in a collective; killed 10 s after rank 0 failed


class _StillWriting:
    """The writers never finish (the collective "still writing?" answer); rank 0's deadline verdict is everyone's."""

    def __init__(self) -> None:
        self.abandoned = 0

    def finalized(self, blocking):
        return False

    def agree(self, mine):
        return mine

    def abandon(self):
        self.abandoned += 1


@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_a_write_past_the_save_deadline_is_abandoned_and_the_save_policy_decides(tmp_path, policy):
    from recovery.events import read_events
    from train.async_ckpt import InFlight
    from train.checkpointer import Checkpointer, SaveFailed
    from train.train_loop import TrainState

    ctx = _rank_context(tmp_path, ["training.async_save=true", "training.watchdog.save_floor_s=60",
                                   "training.watchdog.save_factor=3", f"training.on_save_failure={policy}",
                                   "training.checkpoint_interval=100"])
    now = [100.0]
    ctx.clock = lambda: now[0]
    said = []
    ctx.log = said.append
    ckpt = Checkpointer(ctx, parts=None)
    ckpt.async_saves.writer = writer = _StillWriting()
    ckpt._slowest_save_s = 30.0  # deadline max(3 x 30, 60) = 90 s
    ckpt.pending = InFlight(6, "interval", 100.0, 0.4, {})
    for t in (150.0, 189.0):
        now[0] = t
        ckpt.after_step(TrainState(step=7), 1.0, 1000)
    kinds = lambda: [e["event"] for e in read_events(ctx.paths.events)]  # noqa: E731
    assert kinds() == [] and ckpt.pending is not None and writer.abandoned == 0
    now[0] = 191.0
    if policy == "stop":
        with pytest.raises(SaveFailed) as e:
            ckpt.after_step(TrainState(step=8), 1.0, 1000)
        assert e.value.stop["reason"] == "storage_error" and e.value.stop["cause"] == "writer_stuck"
    else:
        ckpt.after_step(TrainState(step=8), 1.0, 1000)  # training goes on
        assert any(line.startswith("WARNING: the checkpoint of iteration 6 failed") for line in said)
    assert ckpt.pending is None and writer.abandoned == 1
    ev = read_events(ctx.paths.events)
    assert [e["event"] for e in ev] == ["checkpoint_abandoned", "save_failed"]
    (ab, failed) = ev
    assert (ab["step"], ab["cause"], ab["limit_s"]) == (6, "writer_stuck", 90.0)
    assert "3 x slowest save 30.0 s" in ab["detail"] and "iter_0000006.tmp" in ab["detail"]
    assert (failed["cause"], failed["policy"], failed["go_on"]) == ("writer_stuck", policy, policy == "skip")


def test_a_crash_with_a_save_in_flight_says_the_save_is_abandoned_unless_its_commit_finished(tmp_path):
    from concurrent.futures import Future

    from recovery.events import read_events
    from train.async_ckpt import InFlight
    from train.checkpointer import Checkpointer

    ctx = _rank_context(tmp_path, ["training.async_save=true"])
    said = []
    ctx.log = said.append
    ckpt = Checkpointer(ctx, parts=None)
    ckpt.abandon("RuntimeError")  # nothing in flight: nothing to say
    assert said == [] and not ctx.paths.events.exists()
    ckpt.pending = InFlight(4, "interval", 0.0, 0.3, {})  # still being written
    ckpt.abandon("RuntimeError")
    (event,) = [e for e in read_events(ctx.paths.events) if e["event"] == "checkpoint_abandoned"]
    assert (event["step"], event["phase"]) == (4, "write") and "iter_0000004.tmp" in event["detail"]
    assert said[-1].startswith("WARNING: ") and ckpt.pending is None
    committed = Future()
    committed.set_result(("ok", None))
    ckpt.pending = InFlight(6, "interval", 0.0, 0.3, {}, phase="commit", commit=committed)
    ckpt.abandon("RuntimeError")  # rank 0's commit needs no other rank: it finished, the save is durable
    assert len([e for e in read_events(ctx.paths.events) if e["event"] == "checkpoint_abandoned"]) == 1
    assert "durable" in said[-1] and not said[-1].startswith("WARNING")


def test_the_local_launcher_holds_the_run_over_its_attempts_and_a_second_launch_changes_nothing(tmp_path):
    """cluster=local: the launcher takes the run lock before any rank starts and keeps it between attempts
    (its ranks get the record's token); a second launch meanwhile is refused with exit 9 and writes nothing."""
    import io
    import os

    from launch import local
    from launch.compose import compose_job, job_to_yaml
    from recovery import lock
    from recovery.policy import EXIT_RUN_LOCKED

    run_dir = tmp_path / "r"
    cfg = ["cluster=local", "model=tiny", "cluster.gpus_per_node=1", f"run.dir={run_dir}", "run.name=r"]
    job = compose_job(cfg)
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(job_to_yaml(job))
    seen = []

    def popen(argv, env, stdout, **_kw):  # one rank per attempt: a crash, then done
        record = lock.Holder.from_text((run_dir / "run.lock").read_text())
        files = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
        assert local.run(job, run_dir, popen=_no_popen, echo=io.StringIO(), install_signals=False) \
            == EXIT_RUN_LOCKED
        assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == files
        seen.append((record.pid, env[lock.HANDOVER_ENV] == record.token, int(env["SLURMTRON_RESTART_COUNT"])))
        rank = _FakeProc(1 if not seen[:-1] else 0, 1)
        rank.stdout = io.BytesIO(b"")  # the last rank's output is echoed
        return rank

    echo = io.StringIO()
    assert local.run(job, run_dir, popen=popen, echo=echo, install_signals=False) == 0
    assert seen == [(os.getpid(), True, 0), (os.getpid(), True, 1)]
    said = [line for line in echo.getvalue().splitlines() if line.startswith("launcher: ")]
    assert said[0].startswith(f"launcher: attempt 0: starting 1 rank(s) of run r on this machine; rank logs "
                              f"{run_dir / 'logs'}/local_0_rank*.out")
    assert said[1] == ("launcher: attempt 0 ended with exit 1 (a crash: rank 0 exit 1); relaunching as attempt 1, "
                       f"as Slurm's --requeue would; rank logs {run_dir / 'logs'}/local_1_rank*.out")
    assert said[2].startswith("launcher: run r ended (exit 0) after ") and "and 2 attempt(s)" in said[2]
    assert "(attempts 0-1; 2 in the run)" in said[2]  # the rank logs know both, though the fake ranks wrote no event
    assert f"python launch/status.py {run_dir}" in said[2] and len(said) == 3  # one line per attempt
    assert not (run_dir / "run.lock").exists()  # released at the end of the chain


def _no_popen(*_a, **_kw):
    raise AssertionError("a refused launch started a rank")


def test_each_rank_seals_the_shards_torch_names_for_it(tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp

    from train.megatron_ckpt import own_shard_files

    dcp.save({"w": torch.arange(10.0)}, storage_writer=dcp.FileSystemWriter(str(tmp_path)), no_dist=True)
    written = sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".distcp")
    assert written and own_shard_files(tmp_path, 0) == written  # torch's own naming: __<rank>_<n>.distcp
    assert own_shard_files(tmp_path, 1) == []


def test_a_rank_that_cannot_seal_its_shards_is_said_and_rank_0_hashes_them(tmp_path):
    from recovery.events import read_events
    from train.checkpointer import Checkpointer

    ctx = _rank_context(tmp_path, [])
    said = []
    ctx.log = said.append
    ckpt = Checkpointer(ctx, parts=None)
    digests = ckpt._digests([("ok", {"__0_0.distcp": (5, "ab")}), ("error", "OSError: [Errno 5] EIO")], 3)
    assert digests == {"__0_0.distcp": (5, "ab")}  # rank 1's files are left to the commit, which hashes them
    (event,) = [e for e in read_events(ctx.paths.events) if e["event"] == "checkpoint_seal_fallback"]
    assert (event["step"], event["rank"]) == (3, 1) and "EIO" in event["detail"]
    assert said[-1].startswith("WARNING: rank 1 could not hash")


def test_the_rendezvous_port_lies_below_the_ephemeral_range_and_moves_with_every_restart():
    ports = {(j, r): dist_env.rendezvous_port(j, r) for j in (1, 7, 19999, 20000, 40000, 1234567, 9876543210)
             for r in range(0, 60)}
    assert all(dist_env.PORT_BASE <= p < dist_env.EPHEMERAL_LOW for p in ports.values())
    # a requeued job (same id, the next restart count) and a relaunched step (the next in-job offset) move
    for job in (1, 1234567):
        seq = [ports[(job, r)] for r in range(60)]
        assert len(set(seq)) == len(seq)
    # the old 20000 + id % 40000 reached the ephemeral range for these ids
    assert 20000 + 19999 % 40000 >= dist_env.EPHEMERAL_LOW and ports[(19999, 0)] < dist_env.EPHEMERAL_LOW
    # concurrent jobs on one node: consecutive ids differ at the same restart count
    assert ports[(1234567, 0)] != dist_env.rendezvous_port(1234568, 0)
    # the rank's fallback (no MASTER_PORT exported) reads the same restart count as the script
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_NODELIST": "n1", "SLURM_JOB_ID": "1234567",
           "SLURM_RESTART_COUNT": "3", "SLURMTRON_IN_JOB_OFFSET": "2"}
    assert dist_env.from_env(env, resolver=lambda h: h).master_port == ports[(1234567, 5)]


@pytest.mark.parametrize("job, restart, offset", [("0", "", ""), ("70", "0", "0"), ("19999", "1", "0"),
                                                  ("1234567", "3", "2"), ("9876543210", "41", "7")])
def test_the_rendered_port_expression_is_the_python_formula(job, restart, offset):
    """The script's MASTER_PORT (bash arithmetic from rendezvous_port_shell) equals rendezvous_port."""
    env = {"PATH": os.environ.get("PATH", ""), "SLURM_JOB_ID": job}
    if restart:
        env["SLURM_RESTART_COUNT"] = restart
    if offset:
        env["SLURMTRON_IN_JOB_OFFSET"] = offset
    out = subprocess.run(["bash", "-c", f"echo {dist_env.rendezvous_port_shell()}"], env=env, capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == dist_env.rendezvous_port(int(job), int(restart or 0) + int(offset or 0))
