"""The preflight job's ranks: ``python -m train.preflight_worker PREFLIGHT_DIR [--reference]``.

``launch/preflight.py`` (login node, no torch) writes ``<run_dir>/preflight/config.yaml``
(the job, with ``training.train_iters`` = the preflight steps) and ``options.json``, then
starts this module on every rank of the target layout: N local processes on
``cluster=local``, or the srun step of a short Slurm job. Every rank:

1. builds the model exactly as :mod:`train.worker` does (same translator, layout-independent
   init, DDP, optimizer, schedule), trains ``steps`` steps with :func:`train.train_loop.train_step`
   and records loss and grad norm; after step 1 it checks that every trainable parameter's
   gradient is non-zero; it times the sample fetches (the data-loader wait);
2. measures all-reduce bus bandwidth over the whole world;
3. saves a distributed checkpoint, hashes the full (TP-gathered) parameters, overwrites
   them, loads the checkpoint back and hashes again (the round trip).

Rank 0 also starts the **reference**: this module with ``--reference``, one process, the same
job with tp=pp=1 (so dp=1) on the same seed and global batches. It trains the same steps (the
parity numbers), then waits for the target's checkpoint, loads it in its own layout (the
reshard) and hashes the parameters. Rank 0 judges (:mod:`launch.preflight_checks`), prints
the verdict table and writes ``<run_dir>/preflight.json``. Ranks exit 0 when the preflight
ran (whatever the verdicts), 1 on a crash.

Test-only breakages (``options.json`` ``break``, set by ``preflight.break=...``; never in
production), applied to the target only, so the preflight must catch them:

``detach``
    the first decoder layer's MLP output is detached: its parameters get no gradient;
``tp_split``
    the first decoder layer's attention output projection (a RowParallelLinear) skips its
    tensor-parallel all-reduce, so each TP rank keeps only its partial sum (a no-op at tp=1).

Everything runs under ``if __name__ == "__main__":`` (dist_checkpointing's writer re-imports
the main module).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from launch import dist_env
from launch import preflight_checks as pc
from launch.dist_env import free_port
from launch.paths import PREFLIGHT_OPTIONS as OPTIONS_FILE
from launch.paths import RunPaths, checkpoint_name
from launch.preflight_checks import format_table, write_report
from recovery.storage import atomic_write_json
from train.context import layout_of, model_shape
from train.distributed import init_distributed, shutdown_distributed
REFERENCE_FILE = "reference.json"
RESHARD_FILE = "reference_reshard.json"
CKPT_READY = "ckpt_ready"
DEFAULT_OPTIONS = {"steps": 3, "break": "", "timeout_s": 600.0, "run_dir": "", "keep_checkpoint": False}


def read_options(pf_dir: Path) -> dict:
    """``options.json`` over the defaults."""
    opts = dict(DEFAULT_OPTIONS)
    path = Path(pf_dir) / OPTIONS_FILE
    if path.exists():
        opts.update(json.loads(path.read_text()))
    if not opts["run_dir"]:
        opts["run_dir"] = str(Path(pf_dir).parent)
    return opts


def reference_job(job: Any) -> Any:
    """The same job on one process: tp=pp=cp=ep=1, no vpp/SP, one node with one rank (dp=1)."""
    par = replace(job.parallelism, name="reference", tp=1, pp=1, vpp=None, cp=1, ep=1, sequence_parallel=False)
    return replace(job, parallelism=par, cluster=replace(job.cluster, nodes=1, gpus_per_node=1))


class TimedSource:
    """Wraps a sample source and adds up the time spent fetching samples (the data-loader wait)."""

    def __init__(self, inner: Any, clock: Callable[[], float] = time.perf_counter) -> None:
        self.inner, self.clock, self.waited = inner, clock, 0.0

    def __getitem__(self, idx: int) -> Any:
        t0 = self.clock()
        try:
            return self.inner[idx]
        finally:
            self.waited += self.clock() - t0


def _log(rank: int, msg: str) -> None:
    if rank == 0:
        print(f"preflight: {msg}", flush=True)


# ---- model pieces shared by the target and the reference ----------------------------------

def _build(job: Any, cuda: bool, device: Any) -> tuple[list, Any, Any]:
    """Model chunks (DDP), optimizer and scheduler, built exactly as train.worker builds them."""
    from train import train_loop

    iters = train_loop.train_iters(job)
    return train_loop.build_training(job, iters, cuda=cuda, device=device)


def _named_params(chunks: list, model: Any):
    """(global name, parameter) over this rank's chunks (layer/expert indices made global)."""
    from train.megatron_model import _global_names

    for chunk in chunks:
        yield from _global_names(getattr(chunk, "module", chunk), model)


def _first_layers(chunks: list) -> list:
    layers = []
    for chunk in chunks:
        decoder = getattr(getattr(chunk, "module", chunk), "decoder", None)
        if decoder is not None and len(decoder.layers):
            layers.append(decoder.layers[0])
    return layers


def apply_breakage(kind: str, chunks: list) -> str:
    """Test-only: break the target model on purpose (see the module docstring); returns what was done."""
    if not kind:
        return ""
    layers = _first_layers(chunks)
    if kind == "detach":
        def detach(_module, _inputs, output):
            if isinstance(output, tuple):
                return (output[0].detach(),) + tuple(output[1:])
            return output.detach()

        for layer in layers:
            layer.mlp.register_forward_hook(detach)
        return f"detached the MLP output of {len(layers)} decoder layer(s)"
    if kind == "tp_split":
        for layer in layers:
            # Megatron's RowParallelLinear returns its partial sum unreduced when this is set
            # (the expert path, which reduces elsewhere): exactly a forgotten TP all-reduce.
            layer.self_attention.linear_proj.explicit_expert_comm = True
        return f"skipped the TP all-reduce of {len(layers)} attention output projection(s)"
    raise ValueError(f"preflight.break={kind!r}; expected one of detach | tp_split (test-only)")


def train_steps(job: Any, chunks: list, optimizer: Any, scheduler: Any, source: TimedSource, steps: int,
                device: Any, after_first: Optional[Callable[[], None]] = None,
                clock: Callable[[], float] = time.perf_counter) -> dict:
    """``steps`` optimizer steps from step 0; losses, grad norms, step and data-wait seconds.

    The timing skips step 1 (warm-up) when there is more than one step.
    """
    from train import train_loop

    t = job.training
    nmb = train_loop.num_microbatches(job)
    state = train_loop.TrainState()
    out = {"loss": [], "grad_norm": [], "step_s": 0.0, "wait_s": 0.0}
    for i in range(steps):
        w0, t0 = source.waited, clock()
        loss, grad_norm, _skipped, _guard = train_loop.train_step(job, chunks, optimizer, scheduler, source, state, nmb,
                                                          device)
        dt = clock() - t0
        state.step += 1
        state.consumed_samples += t.global_batch_size
        out["loss"].append(loss)
        out["grad_norm"].append(grad_norm)
        if i > 0 or steps == 1:
            out["step_s"] += dt
            out["wait_s"] += source.waited - w0
        if i == 0 and after_first is not None:
            after_first()
    out["state"] = state
    return out


def grad_sums(chunks: list, model: Any) -> dict[str, float]:
    """Sum of |grad| per trainable parameter on this rank (Megatron DDP keeps it in ``main_grad``)."""
    sums: dict[str, float] = {}
    for gname, p in _named_params(chunks, model):
        if not p.requires_grad:
            continue
        g = getattr(p, "main_grad", None)
        if g is None:
            g = p.grad
        sums[gname] = sums.get(gname, 0.0) + (0.0 if g is None else float(g.detach().float().abs().sum()))
    return sums


def unshard(parts: list, dim: int, stride: int) -> Any:
    """The full tensor from TP shards, inverting the interleaving of ``init_layout_independent``."""
    import torch

    if stride <= 1:
        return torch.cat(parts, dim=dim)
    world = len(parts)
    split = [p.split(p.shape[dim] // stride, dim=dim) for p in parts]
    return torch.cat([split[k % world][k // world] for k in range(stride * world)], dim=dim)


def _digest(t: Any) -> str:
    import torch

    raw = t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
    return f"{t.dtype}:{tuple(t.shape)}:" + hashlib.blake2b(raw, digest_size=16).hexdigest()


def full_hashes(chunks: list, model: Any) -> dict[str, str]:
    """Hash of every full parameter (TP shards gathered), merged over all ranks; collective.

    Tied copies (embedding and output layer on different pipeline stages) must agree; if not,
    the entry says so and cannot match the reference.
    """
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    tp_world = ps.get_tensor_model_parallel_world_size()
    keep = ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
    mine: dict[str, str] = {}
    for gname, p in _named_params(chunks, model):
        t = p.detach()
        if tp_world > 1 and getattr(p, "tensor_model_parallel", False) and getattr(p, "allreduce", True):
            parts = [torch.empty_like(t) for _ in range(tp_world)]
            dist.all_gather(parts, t.contiguous(), group=ps.get_tensor_model_parallel_group())
            t = unshard(parts, p.partition_dim, getattr(p, "partition_stride", 1))
        if keep:
            mine[gname] = _digest(t)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    merged: dict[str, str] = {}
    for d in everyone:
        for k, v in (d or {}).items():
            if k in merged and merged[k] != v:
                merged[k] = f"tied copies differ: {merged[k]} | {v}"
            else:
                merged.setdefault(k, v)
    return merged


def allreduce_busbw(device: Any, cuda: bool, clock: Callable[[], float] = time.perf_counter) -> tuple[Optional[float], int]:
    """nccl-tests' bus bandwidth (GB/s) of a float32 all-reduce over the world; (None, 0) on one rank."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    if world < 2:
        return None, 0
    nbytes = (256 if cuda else 4) * 2**20
    iters = 20 if cuda else 5
    x = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    dist.all_reduce(x)
    sync()
    dist.barrier()
    t0 = clock()
    for _ in range(iters):
        dist.all_reduce(x)
    sync()
    dt = torch.tensor([(clock() - t0) / iters], dtype=torch.float64, device=device)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # the slowest rank sets the job's pace
    return nbytes / float(dt.item()) * 2 * (world - 1) / world / 1e9, nbytes


def _ckpt_meta(job: Any, step: int) -> dict:
    return {"step": step, "consumed_samples": step * job.training.global_batch_size, "layout": layout_of(job),
            "distributed_optimizer": bool(job.parallelism.distributed_optimizer), "model": model_shape(job),
            "seed": job.training.seed, "preflight": True}


# ---- the reference process -----------------------------------------------------------------

def start_reference(pf_dir: Path, env: Mapping[str, str], local_rank: int,
                    popen: Callable[..., Any] = subprocess.Popen) -> Any:
    """Rank 0: start ``--reference`` as a one-rank world of its own (a fresh port, no Slurm task vars)."""
    child = {k: v for k, v in env.items() if not k.startswith("SLURM_")}
    child.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK=str(local_rank), MASTER_ADDR="127.0.0.1",
                 MASTER_PORT=str(free_port()))
    logs = RunPaths.of(pf_dir).logs
    logs.mkdir(parents=True, exist_ok=True)
    with open(logs / "reference.out", "ab") as out:
        return popen([sys.executable, "-m", "train.preflight_worker", str(pf_dir), "--reference"],
                     env=child, stdout=out, stderr=subprocess.STDOUT)


def run_reference(job: Any, pf_dir: Path, opts: dict, denv: Any) -> int:
    """The single-process reference: train the same steps, then load the target's checkpoint."""
    from train import megatron_ckpt
    from train.data import build_source

    ref = reference_job(job)
    cuda, device, _ = init_distributed(ref, denv, timeout_s=opts["timeout_s"])
    try:
        chunks, optimizer, scheduler = _build(ref, cuda, device)
        source = TimedSource(build_source(ref.data, ref.model, opts["steps"] * ref.training.global_batch_size,
                                          RunPaths.of(pf_dir).data_cache, ref.cluster.data_root))
        res = train_steps(ref, chunks, optimizer, scheduler, source, opts["steps"], device)
        atomic_write_json(pf_dir / REFERENCE_FILE, {"loss": res["loss"], "grad_norm": res["grad_norm"]})
        deadline = time.monotonic() + float(opts["timeout_s"])
        ready = pf_dir / CKPT_READY
        while not ready.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"no target checkpoint ({ready}) within {opts['timeout_s']} s")
            time.sleep(0.2)
        megatron_ckpt.load(Path(ready.read_text().strip()), chunks, optimizer, scheduler,
                           distributed_optimizer=ref.parallelism.distributed_optimizer)
        atomic_write_json(pf_dir / RESHARD_FILE, {"hashes": full_hashes(chunks, ref.model)})
        return 0
    finally:
        shutdown_distributed()


# ---- the target layout ---------------------------------------------------------------------

def run_target(job: Any, pf_dir: Path, opts: dict, denv: Any, env: Mapping[str, str]) -> int:
    """Every rank of the target layout; rank 0 also owns the reference and the verdict."""
    import torch
    import torch.distributed as dist

    from train import megatron_ckpt
    from train.data import build_source

    rank = denv.rank
    for stale in (REFERENCE_FILE, RESHARD_FILE, CKPT_READY):
        if rank == 0 and (pf_dir / stale).exists():
            (pf_dir / stale).unlink()
    ref_proc = start_reference(pf_dir, env, denv.local_rank) if rank == 0 else None
    cuda, device, _ = init_distributed(job, denv, timeout_s=opts["timeout_s"])
    try:
        chunks, optimizer, scheduler = _build(job, cuda, device)
        broke = apply_breakage(opts.get("break") or "", chunks)
        if broke:
            _log(rank, f"TEST-ONLY breakage: {broke}")
        source = TimedSource(build_source(job.data, job.model, opts["steps"] * job.training.global_batch_size,
                                          RunPaths.of(pf_dir).data_cache, job.cluster.data_root))
        sums: dict[str, float] = {}
        res = train_steps(job, chunks, optimizer, scheduler, source, opts["steps"], device,
                          after_first=lambda: sums.update(grad_sums(chunks, job.model)))
        _log(rank, f"trained {opts['steps']} step(s): loss {res['loss']}, grad norm {res['grad_norm']}")
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, sums)
        total: dict[str, float] = {}
        for d in every:
            for k, v in d.items():
                total[k] = total.get(k, 0.0) + v
        wait_step: list = [None] * dist.get_world_size()
        dist.all_gather_object(wait_step, (res["wait_s"], res["step_s"]))
        worst = max(wait_step, key=lambda ws: ws[0] / ws[1] if ws[1] > 0 else 0.0)
        busbw, nbytes = allreduce_busbw(device, cuda)
        _log(rank, f"all-reduce bus bandwidth {busbw} GB/s")

        ckpt = pf_dir / "ckpt" / checkpoint_name(opts["steps"])
        if rank == 0:
            shutil.rmtree(pf_dir / "ckpt", ignore_errors=True)
            ckpt.mkdir(parents=True)
        dist.barrier()
        dopt = job.parallelism.distributed_optimizer
        sd = megatron_ckpt.sharded_state(chunks, optimizer, scheduler, _ckpt_meta(job, opts["steps"]),
                                         distributed_optimizer=dopt, is_loading=False)
        megatron_ckpt.save_shards(ckpt, sd, distributed_optimizer=dopt)
        dist.barrier()
        saved = full_hashes(chunks, job.model)
        if rank == 0:
            (pf_dir / CKPT_READY).write_text(str(ckpt))
        with torch.no_grad():  # overwrite every parameter, so a load that restores nothing is caught
            for _name, p in _named_params(chunks, job.model):
                p.add_(1.0)
        megatron_ckpt.load(ckpt, chunks, optimizer, scheduler, distributed_optimizer=dopt)
        loaded = full_hashes(chunks, job.model)
        _log(rank, f"checkpoint round trip over {len(saved)} parameters done")
        if rank == 0:
            measured = {"losses": res["loss"], "grad_norms": res["grad_norm"], "grad_sums": total,
                        "wait": worst, "busbw": (busbw, nbytes), "saved": saved, "loaded": loaded, "cuda": cuda,
                        "broke": broke}
            report = judge(job, pf_dir, opts, measured, _wait_reference(ref_proc, opts["timeout_s"]))

            path = write_report(opts["run_dir"], report, atomic_write_json)
            print(format_table(report), flush=True)
            print(f"preflight: wrote {path}", flush=True)
            if not opts.get("keep_checkpoint"):
                shutil.rmtree(pf_dir / "ckpt", ignore_errors=True)
        dist.barrier()
        return 0
    finally:
        if ref_proc is not None and ref_proc.poll() is None:
            ref_proc.kill()
            ref_proc.wait()
        shutdown_distributed()


def _wait_reference(proc: Any, timeout_s: float) -> str:
    """Wait for the reference process; '' when it finished cleanly, else why not."""
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return f"the reference process did not finish within {timeout_s:g} s"
    return "" if rc == 0 else f"the reference process exited {rc} (see preflight/logs/reference.out)"


def _read(path: Path) -> Optional[dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def judge(job: Any, pf_dir: Path, opts: dict, m: dict, ref_error: str) -> Any:
    """Rank 0: the verdict rows from the target's measurements and the reference's files."""
    ref = _read(pf_dir / REFERENCE_FILE)
    reshard = _read(pf_dir / RESHARD_FILE)
    zero = sorted(k for k, v in m["grad_sums"].items() if v == 0.0)
    precision = job.training.precision
    rated, rated_field = pc.rated_bandwidth(job.cluster.nodes, job.cluster.nvlink_bandwidth_gbs,
                                            job.cluster.ib_bandwidth_gbs)
    busbw, nbytes = m["busbw"]
    checks = [
        pc.judge_grad_flow(zero, len(m["grad_sums"])),
        pc.judge_parity("loss_parity", m["losses"], ref and ref.get("loss"), precision, ref_error),
        pc.judge_parity("grad_norm_parity", m["grad_norms"], ref and ref.get("grad_norm"), precision, ref_error),
        pc.compare_hashes("checkpoint_roundtrip", m["saved"], m["loaded"], "save + load in the target layout"),
        pc.compare_hashes("checkpoint_reshard", m["saved"], reshard and reshard.get("hashes"),
                          "load on one process (tp=pp=1)", ref_error),
        pc.judge_bandwidth(busbw, rated, rated_field, gpu=bool(m["cuda"]), world_size=job.world_size,
                           nbytes=nbytes),
        pc.judge_data_wait(*m["wait"]),
    ]
    layout = layout_of(job)
    if m["broke"]:
        layout["test_only_break"] = opts.get("break")
    return pc.Report(checks=checks, layout=layout, world_size=job.world_size,
                     backend="nccl" if m["cuda"] else "gloo", time=time.time())


def main(argv: Optional[list[str]] = None, env: Optional[Mapping[str, str]] = None) -> int:
    """Run this rank (or the reference); returns its exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    env = dict(os.environ if env is None else env)
    reference = "--reference" in argv
    args = [a for a in argv if a != "--reference"]
    if len(args) != 1:
        print("usage: python -m train.preflight_worker PREFLIGHT_DIR [--reference]", file=sys.stderr)
        return 2
    pf_dir = Path(args[0]).absolute()
    from launch.compose import load_job  # Hydra: here, not in the checkpoint helpers that re-import this module

    job = load_job(RunPaths.of(pf_dir).config)
    opts = read_options(pf_dir)
    denv = dist_env.from_env(env)
    try:
        if reference:
            return run_reference(job, pf_dir, opts, denv)
        return run_target(job, pf_dir, opts, denv, env)
    except BaseException:  # report, then let the code say crash
        import traceback

        traceback.print_exc()
        return 1


if __name__ == "__main__":
    sys.exit(main())
