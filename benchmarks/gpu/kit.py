"""The GPU device check, run by ``benchmarks/gpu/run.sh`` (``--cpu``: the same steps without CUDA).

Every step goes through the product's own code: the run directory is composed by
:func:`launch.compose.compose_job` and checked by :func:`launch.check.check`, the rank is
``python -m train.worker RUN_DIR`` started with :func:`launch.local.rank_env`'s variables, the
preflight is ``python launch/preflight.py``. The steps:

1. **train**: a one-rank job (NCCL on a GPU, gloo on the CPU) of the 1.3B GPT-3 XL
   (seq 2048, bf16 with fp32 main weights; ``--cpu``: the tiny model in fp32) for ``K + 1``
   steps, an asynchronous save at step ``K`` and the final, synchronous one at ``K + 1``; the
   Megatron-format lines carry TFLOP/s/GPU and MFU against the dense peak of ``cluster.gpu``
   from ``analysis/flops.py::PEAK_FLOPS`` (none on the CPU: no peak, no MFU);
2. **save/resume**: the same model's full checkpoint saved both ways (``checkpoint_saved``,
   ``checkpoint_wait`` events): the asynchronous save's blocking time, write time and GB/s, the
   step time while its write is in flight, the synchronous save's seconds and GB/s, and the
   disk's own fsynced write rate for comparison; then the checkpoint after K is removed and a
   second attempt resumes from the asynchronously written K; its loss at K+1 must equal the
   first attempt's bit for bit (the worker logs ``repr(float)``);
3. **preflight**: ``launch/preflight.py`` on the same device (grad flow, checkpoint round trip,
   parity against the one-process reference);
4. **memory**: the train step's measured peak allocated (``torch.cuda.memory_stats()`` in its iteration events),
   reserved, gap and ``num_alloc_retries`` against the planner's per-GPU estimate of the same layout
   (``memory_plan.json``, as ``pretrain.py`` writes it); ``--cpu``: the RSS, no peak;
5. **oom**: one deliberate out-of-memory through the real worker: on the GPU the 1.3B at a micro-batch no GPU holds
   (a real ``torch.cuda.OutOfMemoryError`` in the first forward), with ``training.oom_snapshot=true``; ``--cpu``:
   the tiny model with the injected one (``SLURMTRON_TEST_OOM_AT_ITER``). Its exit code (18), the ``oom`` stop's
   line (the planner's estimate and fixes) and the forensics files under ``oom/``;
6. **local**: the node-local checkpoint tier's overhead on one GPU (replication 1: no peer): the same job run twice
   for :data:`LOCAL_ITERS` steps, without the tier and with a local save every :data:`LOCAL_EVERY` steps into
   ``/dev/shm`` (the scratch disk when ``/dev/shm`` lacks room); the wall time of steps 2-13 (saves at 5 and 10) of
   both, each save's stall (the copy into pinned host memory) and its background seconds; the goal is <= 3% at every
   5 steps. The GPU profile is the 125M model at a global batch of 256 (a few seconds a step): its 1.5 GB shard per
   step-second is of the order of a 70B model's per-GPU shard at scale (tp 8, pp 4, dp 32: 0.8 GB per ~10 s step),
   which the 1.3B on one GPU (15.6 GB per ~1 s step) is not;
7. **versions**: ``nvidia-smi``, torch, CUDA, NCCL, Megatron-Core, TransformerEngine.

Results: ``<out>/results.json`` plus the logs, at most 8 files directly in ``<out>``. The run
directories (1.3B: about 18 GB per checkpoint, two at a time) live in a temporary directory on
local disk (``KIT_SCRATCH``, default: the system temporary directory) and are removed; its free space is recorded.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.bench_recovery import fsynced_write_bandwidth  # noqa: E402
from launch.check import check  # noqa: E402
from launch.compose import compose_job, job_to_yaml  # noqa: E402
from launch.dist_env import free_port  # noqa: E402
from launch.local import rank_env  # noqa: E402
from recovery.events import read_events  # noqa: E402

# mode -> (model overrides, steps before the measured save K). GPU: GPT-3 XL (1.3B), micro-batch 4
# of 2048 tokens (unfused attention without TE keeps 16 x 2048^2 scores per layer and sample).
PROFILES = {
    "gpu": dict(model=["model=1.3b", "cluster.gpu=h200", "cluster.gpu_memory_gb=141", "training.precision=bf16",
                       "training.micro_batch_size=4", "training.global_batch_size=16"],
                preflight=["model=125m", "cluster.gpu=h200", "cluster.gpu_memory_gb=141", "training.precision=bf16",
                           "training.micro_batch_size=4", "training.global_batch_size=8"],
                k=20,
                local=["model=125m", "cluster.gpu=h200", "cluster.gpu_memory_gb=141", "training.precision=bf16",
                       "training.micro_batch_size=4", "training.global_batch_size=256"],
                oom=["training.micro_batch_size=256", "training.global_batch_size=256", "parallelism.recompute=none",
                     "training.oom_snapshot=true"], oom_env={}),
    "cpu": dict(model=["model=tiny", "cluster.gpu=cpu", "training.precision=fp32",
                       "training.micro_batch_size=2", "training.global_batch_size=4"],
                preflight=["model=tiny", "cluster.gpu=cpu", "training.precision=fp32",
                           "training.micro_batch_size=2", "training.global_batch_size=4"],
                k=3, local=["model=tiny", "cluster.gpu=cpu", "training.precision=fp32",
                            "training.micro_batch_size=2", "training.global_batch_size=4"],
                oom=["training.oom_snapshot=true"], oom_env={"SLURMTRON_TEST_OOM_AT_ITER": "1"}),
}
COMMON = ["cluster=local", "cluster.gpus_per_node=1", "parallelism=tp1", "data=mock", "training.train_tokens=null",
          "training.log_interval=1", "training.lr_warmup_iters=2", "training.keep_checkpoints=3",
          "training.signal_lead_time_s=3600", "training.zero_progress_restarts=0"]
LINE = re.compile(r"\] iteration\s+(\d+)/[^\n]*")
TFLOPS = re.compile(r"TFLOP/s/GPU\): ([\d.]+) \|")  # absent on CPU (no peak, no throughput field)
MFU = re.compile(r"MFU: ([\d.]+)% \|")


def say(msg: str) -> None:
    print(f"[gpu-kit {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def overrides(mode: str, run_root: Path, k: int) -> list[str]:
    return PROFILES[mode]["model"] + COMMON + [
        f"cluster.run_root={run_root}", "run.name=kit", f"training.train_iters={k + 1}",
        f"training.checkpoint_interval={k}", "training.async_save=true"]  # step k async, the final k + 1 sync


def start_rank(run_dir: Path, attempt: int, log: Path, timeout_s: float, extra_env: dict | None = None) -> int:
    """``python -m train.worker RUN_DIR`` as rank 0 of 1, with the local launcher's variables."""
    env = rank_env({**os.environ, **(extra_env or {})}, 0, 1, free_port(), attempt, str(REPO))
    env.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    with open(log, "ab") as out:
        proc = subprocess.run([sys.executable, "-u", "-m", "train.worker", str(run_dir)], cwd=REPO, env=env,
                              stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s)
    return proc.returncode


def throughput(log_text: str, first: int) -> dict:
    """Median TFLOP/s/GPU and MFU of the logged iterations >= ``first`` (warm-up excluded)."""
    rows = []
    for m in LINE.finditer(log_text):
        t, u = TFLOPS.search(m[0]), MFU.search(m[0])
        rows.append((int(m[1]), float(t[1]) if t else None, float(u[1]) if u else None))
    rows = [r for r in rows if r[0] >= first]
    tflops = [r[1] for r in rows if r[1] is not None]
    mfu = [r[2] for r in rows if r[2] is not None]
    return {"steps_measured": len(rows), "tflops_per_gpu_median": statistics.median(tflops) if tflops else None,
            "mfu_median": statistics.median(mfu) / 100 if mfu else None}


def step_losses(events: list[dict], restart: int) -> dict:
    return {e["step"]: e["loss"] for e in events if e["event"] == "iteration" and e.get("restart_count") == restart}


def versions() -> dict:
    code = r"""
import json, importlib.metadata as md
import torch
def v(d):
    try: return md.version(d)
    except md.PackageNotFoundError: return None
out = {"torch": torch.__version__, "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
       "megatron_core": v("megatron-core"), "transformer_engine": v("transformer-engine") or v("transformer_engine"),
       "python": __import__("sys").version.split()[0]}
try: out["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None
except Exception as e: out["nccl"] = f"unknown ({e})"
if torch.cuda.is_available(): out["device"] = torch.cuda.get_device_name(0)
print(json.dumps(out))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    return json.loads(proc.stdout) if proc.returncode == 0 else {"error": proc.stderr[-500:]}


def nvidia_smi(out: Path) -> str:
    try:
        proc = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=60)
        text = proc.stdout + proc.stderr
    except (OSError, subprocess.SubprocessError) as e:
        text = f"nvidia-smi not available: {e}"
    (out / "nvidia-smi.txt").write_text(text)
    return text.splitlines()[0] if text else ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=sorted(PROFILES), default="gpu")
    ap.add_argument("--out", type=Path, default=Path("gpu-results"))
    ap.add_argument("--budget-s", type=float, default=450.0, help="stop starting new steps after this")
    args = ap.parse_args(argv)
    t_start = time.monotonic()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    prof, mode = PROFILES[args.mode], args.mode
    k = prof["k"]
    results: dict = {"mode": mode, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "commit": _commit(), "ok": False}

    def left() -> float:
        return args.budget_s - (time.monotonic() - t_start)

    def write() -> None:
        results["wall_s"] = round(time.monotonic() - t_start, 1)
        (out / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")

    say(f"mode {mode}; versions and nvidia-smi")
    results["versions"] = versions()
    results["nvidia_smi"] = nvidia_smi(out)
    from train.versions import refusal
    results["version_check"] = refusal() or "ok"
    write()

    scratch = Path(tempfile.mkdtemp(prefix="slurmtron-gpu-kit-", dir=os.environ.get("KIT_SCRATCH") or None))
    results["scratch"] = {"path": str(scratch), "free_gb": shutil.disk_usage(scratch).free / 1e9}
    try:
        # ---- 1. train through the real worker --------------------------------------------
        job = compose_job(overrides(mode, scratch, k))
        problems = check(job)
        results["job_check"] = [f"{p.field}: {p.message}" for p in problems] or "ok"
        run_dir = scratch / "kit"  # <cluster.run_root>/<run.name>
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(job_to_yaml(job))
        plan = write_plan(job, run_dir)
        results["model"] = {"name": job.model.name, "layers": job.model.num_layers, "hidden": job.model.hidden_size,
                            "seq": job.model.seq_length, "precision": job.training.precision,
                            "micro_batch": job.training.micro_batch_size, "global_batch": job.training.global_batch_size}
        say(f"train: {job.model.name}, {k + 1} steps, save at {k}; run dir {run_dir}")
        t0 = time.monotonic()
        code = start_rank(run_dir, 0, out / "train.log", max(60.0, left()))
        train_text = (out / "train.log").read_text(errors="replace")
        results["train"] = {"exit_code": code, "seconds": round(time.monotonic() - t0, 1),
                            **throughput(train_text, first=3)}
        events = read_events(job.paths_at(run_dir).events)
        first = step_losses(events, 0)
        secs = [e["seconds"] for e in events if e["event"] == "iteration" and e["step"] >= 3]
        results["train"]["step_s_median"] = statistics.median(secs) if secs else None
        results["memory"] = memory_vs_plan(events, plan)
        write()
        if code != 0:
            say(f"train: the worker exited {code}; see train.log")
            return 1

        # ---- 2. save / resume -------------------------------------------------------------
        saves = {e["step"]: e for e in events if e["event"] == "checkpoint_saved"}
        at_k, final = saves[k], saves[k + 1]  # the interval save (asynchronous) and the final one (synchronous)
        waited = sum(e["seconds"] for e in events if e["event"] == "checkpoint_wait" and e["step"] == k)
        ckpts = Path(at_k["path"]).parent
        for later in sorted(ckpts.glob("iter_*")):
            if later.is_dir() and int(later.name.split("_")[1].split(".")[0]) > k:
                shutil.rmtree(later)
        probe = min(int(at_k["bytes"]), 4 << 30)
        disk_s, disk_bps = fsynced_write_bandwidth(run_dir, probe)
        sync_s = final["seconds"] - waited  # its t0 is before the wait for the step-k write
        step_in_flight = next((e["seconds"] for e in events if e["event"] == "iteration" and e["step"] == k + 1), None)
        results["save"] = {
            "bytes": at_k["bytes"], "disk_fsynced_write_gb_per_s": disk_bps / 1e9, "disk_probe_bytes": probe,
            "sync": {"step": k + 1, "seconds": sync_s, "gb_per_s": final["bytes"] / sync_s / 1e9},
            "async": {"step": k, "mode": at_k.get("mode"), "blocking_s": at_k.get("blocking_s"),
                      "written_s": at_k.get("written_s"), "durable_s": at_k["seconds"],
                      "gb_per_s": at_k["bytes"] / at_k["written_s"] / 1e9 if at_k.get("written_s") else None,
                      "final_save_waited_s": waited},
            "blocking_fraction_of_sync": (at_k["blocking_s"] / sync_s) if at_k.get("blocking_s") else None,
            "step_s_with_write_in_flight": step_in_flight,
            "step_s_median": results["train"]["step_s_median"],
        }
        say(f"resume from step {k} (checkpoints after it removed)")
        code = start_rank(run_dir, 1, out / "resume.log", max(60.0, left()))
        events = read_events(job.paths_at(run_dir).events)
        second = step_losses(events, 1)
        resumed = [e for e in events if e["event"] == "resume" and e.get("restart_count") == 1]
        compare = {s: (first.get(s), second.get(s)) for s in (k + 1,)}
        results["resume"] = {
            "exit_code": code, "from_step": resumed[0]["step"] if resumed else None,
            "load_seconds": resumed[0]["seconds"] if resumed else None,
            "load_gb_per_s": at_k["bytes"] / resumed[0]["seconds"] / 1e9 if resumed and resumed[0]["seconds"] else None,
            "losses": {str(s): {"uninterrupted": a, "resumed": b} for s, (a, b) in compare.items()},
            "bitwise_equal": code == 0 and all(a is not None and a == b for a, b in compare.values()),
        }
        write()
        shutil.rmtree(ckpts, ignore_errors=True)

        # ---- 3. preflight on the same device ----------------------------------------------
        if left() < 30:
            results["preflight"] = {"skipped": f"time budget ({args.budget_s:g} s) spent"}
        else:
            say("preflight")
            pf = prof["preflight"] + COMMON + [f"cluster.run_root={scratch}", "run.name=preflight",
                                               "training.train_iters=3", "preflight.steps=3",
                                               f"preflight.timeout_s={int(max(30, left()))}"]
            with open(out / "preflight.log", "wb") as log:
                proc = subprocess.run([sys.executable, str(REPO / "launch" / "preflight.py"), *pf], cwd=REPO,
                                      stdout=log, stderr=subprocess.STDOUT, timeout=max(60.0, left() + 30))
            report = scratch / "preflight" / "preflight.json"
            doc = json.loads(report.read_text()) if report.exists() else {}
            results["preflight"] = {"exit_code": proc.returncode, "verdict": doc.get("verdict"),
                                    "checks": {c["check"]: c["verdict"] for c in doc.get("checks", [])}}
        # ---- 5. one deliberate out-of-memory and its forensics ------------------------------
        if left() < 30:
            results["oom"] = {"skipped": f"time budget ({args.budget_s:g} s) spent"}
        else:
            say("oom: a deliberate out-of-memory through the worker")
            results["oom"] = deliberate_oom(mode, scratch, out, max(60.0, left()))
            write()
        # ---- 6. the node-local tier's overhead ----------------------------------------------
        if left() < 60:
            results["local"] = {"skipped": f"time budget ({args.budget_s:g} s) spent"}
        else:
            say(f"local: {LOCAL_ITERS} steps without and with a local save every {LOCAL_EVERY} steps")
            results["local"] = local_tier_overhead(mode, scratch, out, left)
            write()
        results["ok"] = bool(results["train"]["exit_code"] == 0 and results["resume"]["bitwise_equal"]
                             and results.get("preflight", {}).get("exit_code") == 0
                             and results.get("oom", {}).get("exit_code") in (None, 18)
                             and results.get("local", {}).get("exit_codes") in (None, [0, 0]))
        write()
        say(f"done: ok={results['ok']}; {out / 'results.json'}")
        return 0 if results["ok"] else 1
    finally:
        write()
        shutil.rmtree(scratch, ignore_errors=True)


def write_plan(job, run_dir: Path) -> dict:
    """``memory_plan.json`` as ``launch/pretrain.py`` writes it at submit (the ranks read it)."""
    from launch.planner.memory import memory_plan

    plan = memory_plan(job)
    (run_dir / "memory_plan.json").write_text(json.dumps(plan))
    return plan


def memory_vs_plan(events: list[dict], plan: dict) -> dict:
    """The measured memory of the train step (its iteration events) beside the planner's estimate, in GiB."""
    its = [e for e in events if e["event"] == "iteration"]
    gib = 2 ** 30

    def top(key: str):
        vals = [e[key] for e in its if isinstance(e.get(key), (int, float))]
        return max(vals) / gib if vals else None

    peak = top("mem_peak")
    retries = [e["mem_alloc_retries"] for e in its if "mem_alloc_retries" in e]
    return {"planner_gib": plan["total_gib"], "planner_terms_gib": plan["terms"], "planner_breakdown": plan["breakdown"],
            "measured_peak_allocated_gib": peak, "measured_reserved_gib": top("mem_reserved"),
            "measured_gap_gib": top("mem_gap"), "alloc_retries": max(retries) if retries else None,
            "rss_gib": top("mem_rss"),
            "planner_over_measured": plan["total_gib"] / peak if peak else None,
            "fragmentation_events": sum(e["event"] == "memory_fragmentation" for e in events)}


def deliberate_oom(mode: str, scratch: Path, out: Path, timeout_s: float) -> dict:
    """One out-of-memory through the real worker (PROFILES[mode]["oom"]): the stop, its line and its files."""
    prof = PROFILES[mode]
    job = compose_job(prof["model"] + COMMON + [f"cluster.run_root={scratch}", "run.name=oom", "training.train_iters=2",
                                                "training.checkpoint_interval=100", *prof["oom"]])
    run_dir = scratch / "oom"
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(job_to_yaml(job))
    plan = write_plan(job, run_dir)
    t0 = time.monotonic()
    code = start_rank(run_dir, 0, out / "oom.log", timeout_s, prof["oom_env"])
    events = read_events(job.paths_at(run_dir).events)
    stop = next((e for e in events if e["event"] == "stop"), {})
    files = sorted(p.name for p in (run_dir / "oom").glob("*")) if (run_dir / "oom").exists() else []
    return {"exit_code": code, "seconds": round(time.monotonic() - t0, 1), "reason": stop.get("reason"),
            "detail": stop.get("detail"), "files": files, "planner_gib": plan["total_gib"],
            "planner_says": [f"{p.field}: {p.message}" for p in check(job)] or "fits",
            "measured_peak_allocated_gib": stop["mem_peak"] / 2 ** 30 if isinstance(stop.get("mem_peak"), (int, float))
            else None}


LOCAL_ITERS, LOCAL_EVERY, LOCAL_WINDOW = 14, 5, range(2, 14)  # saves at 5 and 10 inside the window, none at 14


def _step_walls(events: list[dict]) -> dict:
    """step -> seconds since the previous step's iteration event (so a save's stall counts)."""
    t = {e["step"]: e["time"] for e in events if e["event"] == "iteration"}
    return {s: t[s] - t[s - 1] for s in t if s - 1 in t}


def local_tier_overhead(mode: str, scratch: Path, out: Path, left) -> dict:
    """The local tier's overhead at every :data:`LOCAL_EVERY` steps: the same job without and with the tier."""
    from launch.planner.tiers import node_shard_bytes

    base = PROFILES[mode]["local"] + COMMON + [f"cluster.run_root={scratch}", f"training.train_iters={LOCAL_ITERS}",
                                               "training.checkpoint_interval=100", "training.async_save=false"]
    shard = node_shard_bytes(compose_job(base + ["run.name=local_base"]))
    shm = Path("/dev/shm")
    room = shutil.disk_usage(shm).free if shm.is_dir() else 0
    local_dir = (shm if room > 3 * shard else scratch) / f"slurmtron-kit-local-{os.getpid()}"
    res: dict = {"local_dir": str(local_dir.parent), "local_dir_free_gb": (room if local_dir.parent == shm else
                 shutil.disk_usage(scratch).free) / 1e9, "planner_shard_bytes": shard, "exit_codes": [], "window":
                 f"steps {LOCAL_WINDOW[0]}-{LOCAL_WINDOW[-1]}"}
    walls = {}
    try:
        for name, extra in (("local_base", ["training.local_checkpoint.interval=0"]),
                            ("local_tier", [f"training.local_checkpoint.interval={LOCAL_EVERY}",
                                            "training.local_checkpoint.replication=1",
                                            f"cluster.local_checkpoint_dir={local_dir}"])):
            job = compose_job(base + [f"run.name={name}", *extra])
            problems = check(job)
            if problems:
                res[name] = {"check": [f"{p.field}: {p.message}" for p in problems]}
                return res
            run_dir = scratch / name
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "config.yaml").write_text(job_to_yaml(job))
            write_plan(job, run_dir)
            t0 = time.monotonic()
            res["exit_codes"].append(start_rank(run_dir, 0, out / "local.log", max(60.0, left())))
            events = read_events(job.paths_at(run_dir).events)
            w = _step_walls(events)
            walls[name] = sum(w.get(s, float("nan")) for s in LOCAL_WINDOW)
            saves = [e for e in events if e["event"] == "local_checkpoint_saved"]
            res[name] = {"seconds": round(time.monotonic() - t0, 1), "window_s": walls[name],
                         "step_s_median": statistics.median(w[s] for s in LOCAL_WINDOW if s in w) if w else None}
            if saves:
                res[name].update(saves_at=[e["step"] for e in saves], shard_bytes=saves[0]["bytes"],
                                 stall_s=[e["stall_s"] for e in saves], background_s=[e["seconds"] for e in saves],
                                 host_gb_per_s=[e["bytes"] / e["seconds"] / 1e9 for e in saves if e["seconds"]])
            shutil.rmtree(run_dir, ignore_errors=True)
        res["overhead_every_5"] = walls["local_tier"] / walls["local_base"] - 1
        res["goal"] = 0.03
        return res
    finally:
        shutil.rmtree(local_dir, ignore_errors=True)


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
