"""The compute-node entry: ``python -m train.worker RUN_DIR`` (one process per rank).

Reads ``RUN_DIR/config.yaml`` (the resolved composed job), finds its place from Slurm's or
torchrun's variables (:mod:`launch.dist_env`), initialises torch.distributed (NCCL with
CUDA, gloo without) and Megatron-Core's ``parallel_state``, finds the newest *verified*
checkpoint (:func:`recovery.resume.find_latest_verified`), asks the requeue policy whether
this attempt may train (:func:`recovery.policy.start_decision`), builds the model and
trains (:mod:`train.train_loop`). A stop signal only sets a flag; at the next step
boundary all ranks agree, save, commit, and exit 42 after rank 0 asked for a requeue.

Exit codes (:mod:`recovery.policy`): 0 completed, 42 checkpointed on a stop signal and
requeue requested, 3 zero-progress guard, 4 max restarts, 1 crash (or a refused checkpoint).

Test hooks, read only here (never set them in production):

``SLURMTRON_TEST_STEP_SLEEP_S``
    sleep this many seconds in every step, so a test's signal lands mid-run;
``SLURMTRON_TEST_SAVE_SLEEP_S``
    rank 0 sleeps this long inside every save, after all shards are written and before the
    commit, so a test can kill the job mid-save (a torn checkpoint).

``SLURMTRON_TEST_PARAM_DIGEST``
    when set, every rank prints ``parameter digest rank R: <sha256>`` of its local
    parameters at the end, so a test can show data-parallel replicas are identical.

``training.fail_at_iter=N`` raises at iteration N on every rank (a deterministic crash).

Everything runs under ``if __name__ == "__main__":``: dist_checkpointing's writer starts a
helper process that re-imports the main module.
"""
from __future__ import annotations

import os
import socket
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

EXIT_CRASH = 1


@dataclass
class Hooks:
    """The worker's test hooks (see the module docstring)."""

    step_sleep_s: float = 0.0
    save_sleep_s: float = 0.0
    param_digest: bool = False

    @staticmethod
    def from_env(env: Mapping[str, str]) -> "Hooks":
        return Hooks(
            step_sleep_s=float(env.get("SLURMTRON_TEST_STEP_SLEEP_S") or 0.0),
            save_sleep_s=float(env.get("SLURMTRON_TEST_SAVE_SLEEP_S") or 0.0),
            param_digest=bool(env.get("SLURMTRON_TEST_PARAM_DIGEST")),
        )


def layout_of(job: Any) -> dict:
    p = job.parallelism
    return {"tp": p.tp, "pp": p.pp, "vpp": p.vpp, "dp": job.dp, "cp": p.cp, "ep": p.ep}


def model_shape(job: Any) -> dict:
    m = job.model
    return {
        "name": m.name, "num_layers": m.num_layers, "hidden_size": m.hidden_size,
        "ffn_hidden_size": m.ffn_hidden_size, "num_attention_heads": m.num_attention_heads,
        "num_query_groups": m.num_query_groups, "seq_length": m.seq_length, "vocab_size": m.vocab_size,
        "num_experts": m.num_experts,
    }


def param_digest(chunks: list) -> str:
    """SHA-256 over this rank's parameters (names and bytes), for replica-equality tests."""
    import hashlib

    h = hashlib.sha256()
    for chunk in chunks:
        for name, p in getattr(chunk, "module", chunk).named_parameters():
            h.update(name.encode())
            h.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _broadcast(obj: Any, src: int = 0) -> Any:
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def main(argv: Optional[list[str]] = None, env: Optional[Mapping[str, str]] = None) -> int:
    """Run this rank; returns its exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    env = dict(os.environ if env is None else env)
    if len(argv) != 1:
        print("usage: python -m train.worker RUN_DIR", file=sys.stderr)
        return 2
    run_dir = Path(argv[0])

    from launch.compose import load_job
    from recovery.events import EventLog
    from recovery.policy import restart_count_from_env
    from recovery.signals import StopFlag, ignore_stop_signals, install_handlers

    flag = StopFlag()
    install_handlers(flag)  # first: a signal during start-up is kept, not lost
    job = load_job(run_dir / "config.yaml")
    from train.versions import refuse_unsupported  # before anything imports torch or megatron
    if (refused := refuse_unsupported(run_dir, env, job.training.precision)) is not None:
        return refused

    from launch import dist_env

    denv = dist_env.from_env(env)
    restart = restart_count_from_env(env)
    events = EventLog(run_dir / "events.jsonl", rank=denv.rank, job_id=env.get("SLURM_JOB_ID"),
                      restart_count=restart, enabled=denv.rank == 0)
    try:
        return _run_reporting(job, run_dir, env, denv, restart, flag, events)
    finally:
        # The outcome is decided and durable: a late warning or SIGTERM has nothing left to stop,
        # and during interpreter shutdown Python restores the default action (terminate), which
        # would turn a completed rank into a FAILED job step.
        ignore_stop_signals()


def _run_reporting(job, run_dir: Path, env: Mapping[str, str], denv, restart: int, flag, events) -> int:
    try:
        return _run(job, run_dir, env, denv, restart, flag, events)
    except BaseException as e:  # report every failure, then let the code say crash
        import traceback

        traceback.print_exc()
        reason = "optimizer_mismatch" if type(e).__name__ == "CheckpointMismatch" else "crash"
        events.emit("stop", reason=reason, code=EXIT_CRASH, detail=f"{type(e).__name__}: {e}"[:2000])
        code = _requeue_away_from_faulty_node(traceback.format_exc(), run_dir, env, job, events)
        events.emit("exit", reason="error" if code == EXIT_CRASH else "requeue", code=code, step=None)
        return code


def _exclude_recorded_nodes(run_dir: Path, env: Mapping[str, str], job: Any, events: Any) -> None:
    """Rank 0, right after its own ``scontrol requeue``: keep recorded bad nodes out of the next
    attempt (Slurm accepts an ExcNodeList update only once the job is pending again)."""
    from recovery import exclusion

    hosts = exclusion.recorded_hosts(run_dir)
    if hosts and env.get("SLURM_JOB_ID") and job.cluster.requeue_allowed:
        r = exclusion.set_excluded(env["SLURM_JOB_ID"], hosts, exclusion.default_runner)
        events.emit("exclude", hosts=hosts, ok=r.ok, detail=r.detail)


def _requeue_away_from_faulty_node(text: str, run_dir: Path, env: Mapping[str, str], job: Any, events: Any) -> int:
    """A crash that names a hardware fault of this node (ECC, Xid, NVLink, IB) records the node
    and requeues the job without it; any other crash stays a crash (a Python error on a healthy
    rank usually comes from a peer, and must not blame this node)."""

    from recovery import exclusion, policy

    why = exclusion.hardware_fault(text)
    job_id = env.get("SLURM_JOB_ID")
    if not (why and job_id and job.cluster.requeue_allowed):
        return EXIT_CRASH
    host = env.get("SLURMD_NODENAME") or socket.gethostname()
    policy.record_failed_node(run_dir, host, why, job_id=job_id)
    r = exclusion.requeue_excluding(job_id, exclusion.recorded_hosts(run_dir))
    events.emit("exclude", hosts=[host], ok=r.ok, detail=r.detail, reason=why)
    return policy.EXIT_REQUEUE if r.ok else EXIT_CRASH


def _quiet_known_warnings() -> None:
    """Megatron-Core warns once per rank and module that Apex/TE are absent; say it once, not 20 times."""
    import warnings

    for pattern in (".*Transformer Engine and Apex are not installed.*", ".*Apex is not installed.*",
                    ".*CUDA_DEVICE_MAX_CONNECTIONS.*"):
        warnings.filterwarnings("ignore", message=pattern)


def _run(job, run_dir: Path, env: Mapping[str, str], denv, restart: int, flag, events) -> int:
    import datetime

    import torch
    import torch.distributed as dist

    from launch import dist_env
    from train import cpu_shim

    _quiet_known_warnings()
    cuda = torch.cuda.is_available()
    if not cuda:
        cpu_shim.apply()
    if denv.world_size != job.world_size:
        raise ValueError(
            f"{denv.world_size} ranks started but the job wants cluster.nodes * cluster.gpus_per_node = "
            f"{job.cluster.nodes} * {job.cluster.gpus_per_node} = {job.world_size}"
        )
    if cuda:
        torch.cuda.set_device(denv.local_rank)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dist.init_process_group(
        backend=dist_env.backend(cuda), init_method=denv.init_method, rank=denv.rank,
        world_size=denv.world_size, timeout=datetime.timedelta(minutes=30),
    )
    _start_checkpoint_helpers()
    try:
        return _train(job, run_dir, env, denv, restart, flag, events, cuda, device)
    finally:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def _start_checkpoint_helpers() -> None:
    """Start dist_checkpointing's helper processes now, with the stop signals blocked.

    Slurm signals every process of the job step, and Megatron-Core's writer-results queue lives
    in a spawned Manager process that starts with the default action (terminate) for SIGTERM
    and SIGUSR2. Started lazily inside the first save, it costs that save an interpreter boot
    (seconds) and, started unprotected, it dies on the very preemption SIGTERM whose
    checkpoint it must carry. Spawned under the mask, it inherits the mask and survives.
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from recovery.signals import deferred

    with deferred():
        filesystem_async._get_write_results_queue()


def _train(job, run_dir: Path, env, denv, restart: int, flag, events, cuda: bool, device) -> int:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from train import megatron_ckpt, megatron_model, train_loop
    from train.data import build_source
    from recovery import commit as rcommit
    from recovery import policy
    from recovery.interval import resolve_interval
    from recovery.resume import find_latest_verified
    from recovery.signals import deferred

    rank, world = denv.rank, denv.world_size
    last = world - 1
    hooks = Hooks.from_env(env)
    p, t = job.parallelism, job.training

    def log(msg: str) -> None:
        if rank == last:
            print(msg, flush=True)

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=p.tp, pipeline_model_parallel_size=p.pp,
        virtual_pipeline_model_parallel_size=p.vpp, context_parallel_size=p.cp,
        expert_model_parallel_size=p.ep,
    )
    ckpt_root = job.paths_at(run_dir).checkpoints
    iters = train_loop.train_iters(t, t.global_batch_size, job.model.seq_length)

    # ---- resume search and the start decision: rank 0 decides, everyone follows ----
    found = None
    if rank == 0:
        res = find_latest_verified(ckpt_root)
        decision = policy.start_decision(run_dir, restart, res.step, t, job_id=env.get("SLURM_JOB_ID"))
        found = (str(res.path) if res.path else None, res.step, res.meta,
                 [(str(a), str(b)) for a, b in res.skipped], asdict(decision))
    path_s, ck_step, ck_meta, skipped, dec = _broadcast(found)
    events.emit("job_start", world_size=world, layout=layout_of(job), train_iters=iters,
                nodes=denv.nodes, source=denv.source)
    if not dec["ok"]:
        events.emit("stop", reason=dec["reason"], code=dec["code"], detail=dec["detail"])
        events.emit("exit", reason=dec["reason"], code=dec["code"], step=ck_step)
        log(f"not starting: {dec['reason']}: {dec['detail']}")
        return int(dec["code"])
    for spath, why in skipped:
        events.emit("resume_fallback", skipped=spath, reason=why)
        log(f"WARNING: skipping checkpoint {spath}: {why}")
    if path_s and "distributed_optimizer" in (ck_meta or {}):
        megatron_ckpt.check_optimizer_type(ck_meta, p.distributed_optimizer, Path(path_s))

    # ---- model, DDP, optimizer, schedule ----
    chunks, optimizer, scheduler = train_loop.build_training(job, iters, cuda=cuda, device=device)
    state = train_loop.TrainState()
    if path_s:
        log(f"loading checkpoint from {path_s} at iteration {ck_step}")
        loaded = megatron_ckpt.load(Path(path_s), chunks, optimizer, scheduler,
                                    distributed_optimizer=p.distributed_optimizer)
        ts = loaded.training_state
        state = train_loop.TrainState(step=int(ts["step"]), consumed_samples=int(ts["consumed_samples"]))
        log(f"  successfully loaded checkpoint from {path_s} at iteration {state.step} "
            f"({loaded.seconds:.2f} s)")
        events.emit("resume", step=state.step, checkpoint=path_s, consumed_samples=state.consumed_samples,
                    from_layout=ts.get("layout"), seconds=loaded.seconds)

    source = build_source(job.data, job.model, iters * t.global_batch_size, run_dir / "data_cache")
    saved_steps = {state.step} if path_s else set()

    def save(st: train_loop.TrainState, reason: str) -> float:
        if st.step == 0 or st.step in saved_steps:
            # Nothing new to make durable: a step-0 checkpoint holds no optimizer state (Adam's
            # is created by the first step) and would break the next attempt's load; a step
            # already committed needs no second copy. A stop here requeues without saving, and
            # the zero-progress guard counts it as a restart that made no progress.
            log(f"no checkpoint needed at iteration {st.step} ({reason}): "
                f"{'nothing trained yet' if st.step == 0 else 'already saved'}")
            return 0.0
        with deferred():  # a stop signal during the save is delivered after it (recovery/signals.py)
            return _save(st, reason)

    def _save(st: train_loop.TrainState, reason: str) -> float:
        t0 = time.monotonic()
        log(f"saving checkpoint at iteration {st.step:7d} to {rcommit.final_path(ckpt_root, st.step)}")
        if rank == 0:
            rcommit.prepare_staging(ckpt_root, st.step)
        dist.barrier()
        staging = rcommit.staging_path(ckpt_root, st.step)
        meta = {
            "step": st.step, "consumed_samples": st.consumed_samples, "layout": layout_of(job),
            "distributed_optimizer": bool(p.distributed_optimizer), "restart_count": restart,
            "model": model_shape(job), "seed": t.seed,
        }
        sd = megatron_ckpt.sharded_state(chunks, optimizer, scheduler, meta,
                                         distributed_optimizer=p.distributed_optimizer, is_loading=False)
        megatron_ckpt.save_shards(staging, sd, distributed_optimizer=p.distributed_optimizer)
        dist.barrier()
        if rank == 0:
            if hooks.save_sleep_s > 0:
                time.sleep(hooks.save_sleep_s)
            result = rcommit.commit(ckpt_root, st.step, meta, keep=t.keep_checkpoints)
            seconds = time.monotonic() - t0
            events.emit("checkpoint_saved", step=st.step, path=str(result.path), seconds=seconds,
                        bytes=result.bytes, reason=reason)
        dist.barrier()
        saved_steps.add(st.step)
        seconds = time.monotonic() - t0
        log(f"  successfully saved checkpoint at iteration {st.step:7d} to "
            f"{rcommit.final_path(ckpt_root, st.step)} ({seconds:.2f} s)")
        return seconds

    def resolve_auto(step_s: float, save_s: float) -> int:
        steps, why = resolve_interval(t.checkpoint_interval, save_s=save_s, step_s=step_s,
                                      node_mtbf_hours=job.cluster.node_mtbf_hours, nodes=job.cluster.nodes)
        events.emit("checkpoint_interval", interval=steps, reasoning=why)
        log(f"checkpoint interval: {why}")
        return steps

    def check_lead(step_s: float, save_s: float) -> None:
        warn = policy.lead_time_warning(t.signal_lead_time_s, step_s, save_s)
        if warn:
            log(f"WARNING: {warn}")
            events.emit("lead_time_warning", lead_s=t.signal_lead_time_s, step_s=step_s, save_s=save_s, detail=warn)

    flops = peak = None
    try:
        from analysis import flops as aflops

        flops = aflops.num_floating_point_operations(
            job.model, t.global_batch_size, padded_vocab_size=megatron_model.padded_vocab_size(job.model, p.tp))
        if job.cluster.gpu != "cpu":
            peak = aflops.peak_flops(job.cluster.gpu, t.precision)
    except (ImportError, KeyError, ValueError) as e:
        log(f"WARNING: no throughput/MFU in the log: {e}")

    io = train_loop.LoopIO(
        log=log, emit=events.emit, save=save, stop_signum=lambda: flag.signum, step_sleep_s=hooks.step_sleep_s,
        flops_per_step=flops, peak_flops=peak, resolve_auto=resolve_auto, check_lead=check_lead,
    )
    result = train_loop.run_loop(job, chunks, optimizer, scheduler, source, state, iters, io, device)
    if hooks.param_digest:
        print(f"parameter digest rank {rank}: {param_digest(chunks)}", flush=True)

    if result.reason == "signal":
        code = policy.EXIT_REQUEUE
        if rank == 0:
            code = policy.after_stop_save(result.signum, env, requeue_allowed=job.cluster.requeue_allowed,
                                          events=events, step=result.state.step)
            _exclude_recorded_nodes(run_dir, env, job, events)
        code = int(_broadcast(code))
        events.emit("exit", reason="requeue", code=code, step=result.state.step)
        return code
    if result.state.step not in saved_steps:
        save(result.state, "final")
    events.emit("train_end", step=result.state.step, consumed_samples=result.state.consumed_samples)
    events.emit("exit", reason="completed", code=policy.EXIT_COMPLETED, step=result.state.step)
    return policy.EXIT_COMPLETED


if __name__ == "__main__":
    sys.exit(main())
