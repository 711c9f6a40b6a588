"""The login-node job check: one pure function that returns *every* problem of a job.

Why one function returning a list: a user who waits a day in the queue to learn that
``global_batch_size`` does not divide, and then another day to learn that ``num_query_groups``
does not divide either, loses two days. ``check(job)`` reports all of them at once, each with
the dotted field, the arithmetic that fails and an override that fixes it. Nothing is submitted
while the list is non-empty (see ``launch/pretrain.py``).

The layout rules (sizes, mesh, model split, batch, features) live in :mod:`launch.layout_rules`,
which the planner imports too. The check also asks ``analysis.flops`` (peak table, unknown GPU
types) and ``launch.planner`` (memory fit, the lead-time guard and the cost estimate used by the
budget guard); all of them are torch-free, so this module stays importable on a login node.
"""
from __future__ import annotations

import difflib
import math
import os
import re
from typing import Any, Callable, Optional

from analysis import flops
from launch import check_data, check_local_ckpt, check_watch, hf_config, planner, spares, vocab
from launch.config import CHOICES, Job
from launch.layout_rules import batch, features, has_size_errors, layout_problems, mesh, model_split, positive_sizes
from launch.paths import NAME_MAX, run_dir_issue, run_name_issue, run_root_issue  # noqa: F401
from launch.problems import Problem
from launch.slice_fit import slice_warning
from launch.tokenizer import get_tokenizer

__all__ = ["check", "layout_problems", "notes", "padded_vocab_size"]

SLURM_MAX_SIGNAL_S = 65535  # --signal=<sig>@<time>: Slurm accepts 0..65535 seconds

_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SBATCH_KEY = re.compile(r"^[a-z][a-z0-9-]*$")


def padded_vocab_size(job: Job) -> int:
    """The vocabulary the worker builds (:attr:`launch.config.Job.padded_vocab_size`)."""
    return job.padded_vocab_size


def notes(job: Job, read_index: Callable[[str], check_data.IndexFacts] = check_data.read_index) -> list[str]:
    """Facts worth printing that are not problems (vocab padding, derived dp, microbatches, data epochs)."""
    out = []
    padded = padded_vocab_size(job)
    if padded != job.model.vocab_size:
        multiple = vocab.padding_multiple(job.model.make_vocab_size_divisible_by, job.parallelism.tp)
        out.append(
            f"model.vocab_size {job.model.vocab_size} is padded to {padded} "
            f"(ceil({job.model.vocab_size} / lcm(make_vocab_size_divisible_by {job.model.make_vocab_size_divisible_by}"
            f", tp {job.parallelism.tp}) = {multiple}) * {multiple}; {padded - job.model.vocab_size} unused rows)"
        )
    if mock_data_at_scale(job):
        out.append(mock_data_warning(job))
    if job.dp >= 1 and job.training.micro_batch_size >= 1:
        out.append(
            f"dp {job.dp} = world {job.world_size} / (tp {job.parallelism.tp} * pp {job.parallelism.pp}"
            f" * cp {job.parallelism.cp}); microbatches per step = {job.num_microbatches}"
        )
    if job.parallelism.name != "auto":
        out.extend(planner.memory_warnings(job))  # inside the planner's error band: may or may not fit
    out.extend(check_data.notes(job, read_index))
    if job.cluster.launcher == "slurm":
        fit = slice_warning(job.run.time_limit_min, job.training.signal_lead_time_s,
                            job.paths_at(job.run_dir).events)
        if fit:
            out.append(fit)
    return out


def check(job: Job, *, path_exists: Callable[[str], bool] = os.path.exists,
          read_index: Callable[[str], check_data.IndexFacts] = check_data.read_index,
          load_tokenizer: Callable[[str], Any] = get_tokenizer,
          free_bytes: Callable[[str], Optional[int]] = check_local_ckpt.probe_free_bytes) -> list[Problem]:
    """Every reason ``job`` cannot run as configured (empty list: it can).

    The filesystem facts (``path_exists``, an index's ``read_index``, ``load_tokenizer``, the free space of the
    local checkpoint directory ``free_bytes``) are injected so tests can describe them without creating files.
    """
    problems: list[Problem] = []
    for rule in (positive_sizes, mesh, model_split, batch, features, _recipe_support, _overlap, _enums, _lifecycle,
                 _time, _cluster, _numbers, _strings, check_watch.problems, spares.problems):
        problems.extend(rule(job))
    problems.extend(check_data.problems(job, path_exists, read_index, load_tokenizer))
    problems.extend(hf_config.init_from_problems(job, path_exists))
    problems.extend(check_local_ckpt.problems(job, free_bytes))
    if not has_size_errors(problems) and not any(p.field in _PLANNER_DIVISORS for p in problems):
        problems.extend(_collaborators(job))  # the planner's guards divide by the rates: not with a 0 or nan one
    return problems


def _recipe_support(job: Job) -> list[Problem]:
    """Settings the planner models but the training recipe cannot run. ``launch/plan.py`` still
    estimates them; a job that would train with them is refused rather than silently run without.

    ``sharding=full`` (ZeRO-3/FSDP): Megatron-Core 0.16's torch FSDP2 wrapper builds its device mesh
    as "cuda" (``distributed/torch_fully_sharded_data_parallel.py``), so torch's ``fully_shard`` refuses
    CPU parameters; Megatron's own FSDP (``use_megatron_fsdp``) trains on gloo, but saves only in its
    ``fsdp_dtensor`` format, which is not the ``torch_dist`` format every other layout saves and reshards
    from: a run that cannot write our checkpoints cannot be requeued or resumed in another layout."""
    p = job.parallelism
    out = []
    if p.sharding == "full":
        out.append(Problem(
            "parallelism.sharding", "the training recipe does not shard weights and gradients (ZeRO-3/FSDP)",
            "sharding=full: Megatron-Core FSDP checkpoints only in its fsdp_dtensor format, not the torch_dist "
            "checkpoints train/megatron_ckpt.py writes, resumes and reshards (torch FSDP2 in Megatron-Core needs CUDA)",
            "set parallelism.sharding=optimizer with parallelism.distributed_optimizer=true "
            "(launch/plan.py estimates sharding=full for planning)"))
    return out


def _overlap(job: Job) -> list[Problem]:
    """Communication overlap (Megatron-Core DDP and TransformerEngine): each option's prerequisites,
    as Megatron-LM's ``validate_args`` states them."""
    p = job.parallelism
    out = []
    if p.overlap_param_gather and not p.distributed_optimizer:
        out.append(Problem(
            "parallelism.overlap_param_gather", "overlapping the weight all-gather needs the distributed optimizer",
            "overlap_param_gather=true with distributed_optimizer=false (no sharded weights to all-gather)",
            "set parallelism.distributed_optimizer=true or parallelism.overlap_param_gather=false"))
    if p.overlap_param_gather and not p.overlap_grad_reduce:
        out.append(Problem(
            "parallelism.overlap_param_gather", "the weight all-gather overlap comes with the gradient reduce overlap",
            "overlap_param_gather=true with overlap_grad_reduce=false (Megatron-LM requires both)",
            "set parallelism.overlap_grad_reduce=true"))
    if p.bucket_size is not None and p.bucket_size < 1:
        out.append(Problem("parallelism.bucket_size", "a gradient bucket holds at least one parameter",
                           f"bucket_size = {p.bucket_size}", "set parallelism.bucket_size=40000000 or null"))
    elif p.bucket_size is not None and not p.overlap_grad_reduce:
        out.append(Problem(
            "parallelism.bucket_size", "buckets only exist with overlap_grad_reduce (Megatron-Core ignores the size "
            "otherwise and reduces all gradients at once)", f"bucket_size = {p.bucket_size} with overlap_grad_reduce=false",
            "set parallelism.overlap_grad_reduce=true or parallelism.bucket_size=null"))
    if p.tp_comm_overlap:
        if p.tp < 2 or not p.sequence_parallel:
            out.append(Problem(
                "parallelism.tp_comm_overlap", "TP communication overlap splits the sequence-parallel all-gather and "
                "reduce-scatter around the GEMMs", f"tp_comm_overlap=true with tp {p.tp} and sequence_parallel="
                f"{str(p.sequence_parallel).lower()} (needs tp > 1 and sequence_parallel=true)",
                "set parallelism.sequence_parallel=true with parallelism.tp>1, or parallelism.tp_comm_overlap=false"))
        if job.cluster.gpu == "cpu":
            out.append(Problem(
                "parallelism.tp_comm_overlap", "TP communication overlap needs TransformerEngine's userbuffers (GPUs)",
                "tp_comm_overlap=true on cluster.gpu=cpu", "set parallelism.tp_comm_overlap=false on a CPU cluster"))
    return out


def _enum(field: str, value: Any, allowed: tuple[str, ...]) -> Optional[Problem]:
    if value in allowed:
        return None
    close = difflib.get_close_matches(str(value), list(allowed), n=1, cutoff=0.5) or \
        [a for a in allowed if str(value).lower() == a.lower()]
    fix = f"did you mean {field}={close[0]}? (one of {', '.join(allowed)})" if close else \
        f"set {field}= one of {', '.join(allowed)}"
    return Problem(field, f"unknown value {value!r}", f"{value!r} not in {list(allowed)}", fix)


def _enums(job: Job) -> list[Problem]:
    """Every choice field against its one list (:data:`launch.config.CHOICES`, read from the annotations)."""
    out = []
    for dotted, allowed in CHOICES.items():
        value: Any = job
        for part in dotted.split("."):
            value = getattr(value, part)
        problem = _enum(dotted, value, allowed)
        if problem is not None:
            out.append(problem)
    return out


def _lifecycle(job: Job) -> list[Problem]:
    t = job.training
    out = []
    ci = t.checkpoint_interval
    if not (t.checkpoint_interval_is_auto or t.fixed_checkpoint_interval is not None):
        out.append(Problem(
            "training.checkpoint_interval", "must be a positive step count or 'auto' (Young/Daly)",
            f"checkpoint_interval = {ci!r}", "set training.checkpoint_interval=auto or e.g. =500"))
    if t.eval_interval < 0 or (t.eval_interval > 0 and t.eval_iters < 1):
        field, value = ("training.eval_interval", t.eval_interval) if t.eval_interval < 0 else \
            ("training.eval_iters", t.eval_iters)
        out.append(Problem(field, "validation needs eval_interval >= 0 (0 = none) and eval_iters >= 1",
                           f"{field} = {value}", f"set {field}=1 or more (or training.eval_interval=0)"))
    if t.train_iters is None and t.train_tokens is None:
        out.append(Problem(
            "training.train_iters", "the run needs a length: train_iters or train_tokens",
            "train_iters = null and train_tokens = null", "set training.train_iters=N or training.train_tokens=T"))
    if t.train_iters is not None and t.train_iters < 1:
        out.append(Problem("training.train_iters", "must be >= 1", f"train_iters = {t.train_iters}",
                           "set training.train_iters=1 or more"))
    if t.train_tokens is not None and t.train_tokens < 1:
        out.append(Problem("training.train_tokens", "must be >= 1", f"train_tokens = {t.train_tokens}",
                           "set training.train_tokens to a positive count or null"))
    for name, value in (("training.max_restarts", t.max_restarts),
                        ("training.zero_progress_restarts", t.zero_progress_restarts),
                        ("run.dependency_chain", job.run.dependency_chain)):
        if value < 0:
            out.append(Problem(name, "must be >= 0", f"{name} = {value}", f"set {name}=0 or more"))
    for name, value, least in (("training.replay.check_steps", t.replay.check_steps, 0),
                               ("training.max_skipped_saves", t.max_skipped_saves, 1)):
        if value < least:
            out.append(Problem(name, f"must be >= {least}", f"{name} = {value}", f"set {name}={least} or more"))
    if not t.replay.rtol > 0:
        out.append(Problem("training.replay.rtol", "the replay tolerance must be a positive fraction",
                           f"rtol = {t.replay.rtol}", "set training.replay.rtol=1e-3"))
    if t.keep_checkpoints < 1:
        out.append(Problem("training.keep_checkpoints", "must keep at least one checkpoint",
                           f"keep_checkpoints = {t.keep_checkpoints}", "set training.keep_checkpoints=1 or more"))
    pf = job.preflight
    if pf.steps < 1:
        out.append(Problem("preflight.steps", "the preflight needs at least one optimizer step",
                           f"steps = {pf.steps}", "set preflight.steps=3"))
    if not pf.timeout_s > 0:
        out.append(Problem("preflight.timeout_s", "must be > 0 seconds", f"timeout_s = {pf.timeout_s}",
                           "set preflight.timeout_s=600"))
    return out


def _time(job: Job) -> list[Problem]:
    if job.cluster.launcher != "slurm":
        return []
    r, c, t = job.run, job.cluster, job.training
    out = []
    if r.time_limit_min < 1:
        out.append(Problem("run.time_limit_min", "must be >= 1 minute", f"time_limit_min = {r.time_limit_min}",
                           "set run.time_limit_min=60 (or more)"))
        return out
    if r.time_limit_min > c.max_time_min:
        out.append(Problem(
            "run.time_limit_min", "longer than the partition allows (the run continues over requeued slices)",
            f"time_limit_min {r.time_limit_min} > cluster.max_time_min {c.max_time_min}",
            f"set run.time_limit_min<={c.max_time_min}; long runs continue by requeue or run.dependency_chain"))
    limit_s = r.time_limit_min * 60
    lead = t.signal_lead_time_s
    if lead < 1 or lead > SLURM_MAX_SIGNAL_S:
        out.append(Problem(
            "training.signal_lead_time_s", "Slurm's --signal lead must be between 1 and 65535 seconds",
            f"signal_lead_time_s = {lead}", "set training.signal_lead_time_s=300"))
    elif lead >= limit_s:
        out.append(Problem(
            "training.signal_lead_time_s", "the warning would arrive before the job even starts training",
            f"signal_lead_time_s {lead} >= run.time_limit_min {r.time_limit_min} * 60 = {limit_s}",
            f"set training.signal_lead_time_s well below {limit_s} or raise run.time_limit_min"))
    elif lead > limit_s // 2:
        out.append(Problem(
            "training.signal_lead_time_s", "the lead time leaves less than half of each slice for training",
            f"signal_lead_time_s {lead} > run.time_limit_min {r.time_limit_min} * 60 / 2 = {limit_s // 2}",
            f"set training.signal_lead_time_s<={limit_s // 2} or raise run.time_limit_min"))
    return out


def _cluster(job: Job) -> list[Problem]:
    c = job.cluster
    out = []
    # cluster.launcher=local with nodes > 1: nodes x gpus_per_node ranks on this machine, grouped into simulated
    # nodes (launch/local.py), each with its own node-local checkpoint directory
    if c.launcher == "slurm" and c.gpus_per_node >= 1 and c.cpus_per_node < c.gpus_per_node:
        out.append(Problem(
            "cluster.cpus_per_node", "every task (one per GPU) needs at least one CPU",
            f"cpus_per_task = cpus_per_node {c.cpus_per_node} // gpus_per_node {c.gpus_per_node} = "
            f"{c.cpus_per_node // c.gpus_per_node}", f"set cluster.cpus_per_node>={c.gpus_per_node}"))
    if c.lustre_stripe_count < 0:
        out.append(Problem("cluster.lustre_stripe_count", "must be 0 (no striping) or a positive OST count",
                           f"lustre_stripe_count = {c.lustre_stripe_count}", "set cluster.lustre_stripe_count=0 or 8"))
    if c.mem_per_node_gb < 0:
        out.append(Problem("cluster.mem_per_node_gb", "must be >= 0 (0 = Slurm default)",
                           f"mem_per_node_gb = {c.mem_per_node_gb}", "set cluster.mem_per_node_gb=0"))
    for key in c.env:
        if not _ENV_KEY.match(str(key)):
            out.append(Problem(f"cluster.env.{key}", "not a valid environment variable name",
                               f"{key!r} does not match [A-Za-z_][A-Za-z0-9_]*", "rename the variable"))
    for key in c.sbatch_extra:
        if not _SBATCH_KEY.match(str(key)):
            out.append(Problem(f"cluster.sbatch_extra.{key}", "not a valid sbatch option name",
                               f"{key!r} does not match [a-z][a-z0-9-]*", "use the long option name, e.g. constraint"))
    if job.run.budget_gpu_hours is not None and not 0 < job.run.budget_gpu_hours < math.inf:  # nan: never reached
        out.append(Problem("run.budget_gpu_hours", "a budget must be a positive, finite number (or null for none)",
                           f"budget_gpu_hours = {job.run.budget_gpu_hours}", "set run.budget_gpu_hours=null"))
    if job.run.sweep_budget_gpu_hours is not None and not 0 < job.run.sweep_budget_gpu_hours < math.inf:
        out.append(Problem("run.sweep_budget_gpu_hours", "a sweep's budget must be a positive, finite number (or null for none)",
                           f"sweep_budget_gpu_hours = {job.run.sweep_budget_gpu_hours}",
                           "set run.sweep_budget_gpu_hours=null"))
    if c.gpu_hour_price is not None and not c.gpu_hour_price >= 0:
        out.append(Problem("cluster.gpu_hour_price", "a price must be >= 0 (or null for no cost line)",
                           f"gpu_hour_price = {c.gpu_hour_price}", "set cluster.gpu_hour_price=null"))
    return out


_PLANNER_DIVISORS = ("cluster.nvlink_bandwidth_gbs", "cluster.ib_bandwidth_gbs", "cluster.fs_write_bandwidth_gbs",
                     "cluster.node_mtbf_hours", "cluster.gpu_memory_gb", "cluster.planner.achievable_fraction",
                     "cluster.planner.nvlink_latency_us", "cluster.planner.ib_latency_us",
                     "cluster.planner.kernel_launch_us", "cluster.planner.step_overhead_s",
                     "cluster.planner.step_jitter")


def _numbers(job: Job) -> list[Problem]:
    """Rates, fractions and learning rates the planner and the optimizer divide by or multiply with."""
    c, t = job.cluster, job.training
    out = []
    positive = {
        "cluster.nvlink_bandwidth_gbs": c.nvlink_bandwidth_gbs,
        "cluster.ib_bandwidth_gbs": c.ib_bandwidth_gbs,
        "cluster.fs_write_bandwidth_gbs": c.fs_write_bandwidth_gbs,
        "cluster.node_mtbf_hours": c.node_mtbf_hours,
        "cluster.gpu_memory_gb": c.gpu_memory_gb,
    }
    for name, value in positive.items():
        if not _finite(value) or value <= 0:
            out.append(Problem(name, "must be a positive, finite number (the planner divides by it)",
                               f"{name} = {value!r}, not > 0", f"set {name} to the measured value"))
    cal = c.planner
    calibration = {  # the planner's per-site constants (launch/planner/steptime.py): 0 turns a term off
        f"cluster.planner.{name}": getattr(cal, name)
        for name in ("nvlink_latency_us", "ib_latency_us", "kernel_launch_us", "step_overhead_s", "step_jitter")
    }
    for name, value in calibration.items():
        if not _finite(value) or value < 0:
            out.append(Problem(name, "a planner calibration constant must be a finite number >= 0",
                               f"{name} = {value!r}, not >= 0",
                               f"set {name} to the schema default or a value fitted with launch.planner.compare"))
    frac = cal.achievable_fraction
    if not _finite(frac) or not 0 < frac <= 1:
        out.append(Problem("cluster.planner.achievable_fraction", "the fraction of peak a GEMM reaches lies in (0, 1]",
                           f"achievable_fraction = {frac!r}, not in (0, 1]",
                           "set cluster.planner.achievable_fraction=0.7 (or a measured value)"))
    for name, value in (("training.lr", t.lr), ("training.min_lr", t.min_lr)):
        if not _finite(value) or value < 0:
            out.append(Problem(name, "a learning rate must be a finite number >= 0",
                               f"{name} = {value!r}", f"set {name}=3e-4 (or your schedule's value)"))
    if _finite(t.lr) and _finite(t.min_lr) and 0 <= t.lr < t.min_lr:
        out.append(Problem("training.min_lr", "the decay floor is above the peak learning rate",
                           f"min_lr {t.min_lr} > lr {t.lr}", f"set training.min_lr<={t.lr}"))
    return out


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def run_dir_problems(job: Job) -> list[Problem]:
    """Each part of the run directory the one rule (:mod:`launch.paths`) refuses: run.name, then run.dir or
    cluster.run_root. ``f'{p.arithmetic}; fix: {p.fix}'`` is the one line the CLIs print."""
    out = []
    name = run_name_issue(job.run.name)
    if name:
        out.append(Problem("run.name", "not a usable run directory name", name[0], name[1]))
    where = run_dir_issue(job.run.dir) if job.run.dir else run_root_issue(job.cluster.run_root)
    if where:
        out.append(Problem("run.dir" if job.run.dir else "cluster.run_root", "not a usable run directory", where[0],
                           where[1]))
    return out


def checkpoint_path_problems(job: Job) -> list[Problem]:
    """A file (or anything but a directory) where the run's checkpoint directory belongs: refused before any rank
    starts, instead of each rank reporting the checkpoints as missing."""
    ckpts = job.paths.checkpoints
    if not os.path.lexists(ckpts) or os.path.isdir(ckpts):
        return []
    field = "cluster.checkpoint_root" if job.cluster.checkpoint_root else "run.dir" if job.run.dir else "run.name"
    return [Problem(field, "the checkpoint directory's path holds something that is not a directory",
                    f"{ckpts} is {'a broken symlink' if os.path.islink(ckpts) else 'a file'}",
                    f"move it away (mv {ckpts} {ckpts}.file), then launch again")]


def _strings(job: Job) -> list[Problem]:
    """Values rendered into ``#SBATCH`` lines or paths cannot hold newlines: a newline would end
    the directive and start a shell line. Refuse them here instead of rendering garbage."""
    c, r = job.cluster, job.run
    single_line = {
        "cluster.partition": c.partition,
        "cluster.account": c.account, "cluster.qos": c.qos, "cluster.exclude": c.exclude,
        "cluster.python": c.python, "cluster.checkpoint_root": c.checkpoint_root,
        "cluster.container.image": c.container.image, "cluster.container.workdir": c.container.workdir,
        "cluster.lustre_stripe_size": c.lustre_stripe_size, "data.path": job.data.path,
        "data.tokenizer": job.data.tokenizer,
    }
    single_line.update({f"cluster.modules[{i}]": m for i, m in enumerate(c.modules)})
    single_line.update({f"cluster.container.mounts[{i}]": m for i, m in enumerate(c.container.mounts)})
    single_line.update({f"cluster.sbatch_extra.{k}": str(v) for k, v in c.sbatch_extra.items()})
    out = []
    for name, value in single_line.items():
        if "\n" in value or "\r" in value or "\0" in value:
            out.append(Problem(name, "must be a single line (it is rendered into an #SBATCH line or a path)",
                               f"{name} = {value!r} contains a newline or NUL", f"remove the newline from {name}"))
    out.extend(run_dir_problems(job) or checkpoint_path_problems(job))
    if not c.python.strip():
        out.append(Problem("cluster.python", "the compute-node interpreter is empty", "cluster.python = ''",
                           "set cluster.python=python3"))
    for i, mount in enumerate(c.container.mounts):
        if "," in mount:
            out.append(Problem(f"cluster.container.mounts[{i}]", "one mount per list item (pyxis joins them by ',')",
                               f"{mount!r} contains ','", "split it into two list items"))
    return out


def mock_data_at_scale(job: Job) -> bool:
    """A multi-node GPU Slurm job on synthetic tokens: almost certainly a forgotten ``data=``."""
    c = job.cluster
    return job.data.kind == "mock" and c.launcher == "slurm" and c.nodes > 1 and c.gpu != "cpu"


def mock_data_warning(job: Job) -> str:
    """The WARNING of a multi-node GPU job on synthetic tokens: allowed (Megatron's own examples benchmark a
    cluster on mock data), said loudly in the check and the submission's summary."""
    c = job.cluster
    loud = "" if job.force else "WARNING: "  # force=true: the user said it is on purpose; a note then
    return (f"{loud}data=mock: {c.nodes} nodes x {c.gpus_per_node} {c.gpu} will train on synthetic tokens "
            f"(a benchmark, not a model); for real text set data=indexed data.path=<prefix> "
            f"(python -m launch.preprocess)")


def submission_problems(job: Job) -> list[Problem]:
    """What only a real submission refuses (``plan.py`` and dry runs just note it): nothing today; mock data
    on a multi-node job is a WARNING (:func:`mock_data_warning`), not a refusal."""
    return []


def _collaborators(job: Job) -> list[Problem]:
    """The GPU's peak table (analysis.flops) and the planner's memory, lead-time and budget guards."""
    out: list[Problem] = []
    if job.cluster.launcher == "slurm" and job.cluster.gpu != "cpu":
        try:
            flops.peak_flops(job.cluster.gpu, job.training.precision)
        except flops.UnknownDtype as exc:
            out.append(Problem(
                "training.precision", "the GPU has no dense peak for this precision (no MFU, likely a mistake)",
                f"{job.training.precision!r} on cluster.gpu {job.cluster.gpu!r}: {exc}",
                "set training.precision=bf16"))
        except flops.UnknownDevice as exc:
            out.append(Problem(
                "cluster.gpu", "unknown GPU type (no peak FLOP/s to plan or report MFU against)",
                f"{job.cluster.gpu!r}: {exc}", f"set cluster.gpu to one of {sorted(flops.PEAK_FLOPS)}"))
    if job.dp < 1:
        return out
    if job.parallelism.name != "auto":
        out.extend(planner.memory_problems(job))
    est = planner.estimate(job)
    if job.cluster.launcher == "slurm":
        out.extend(planner.lead_time_problems(job, est))
    budget = job.run.budget_gpu_hours
    if budget is not None and budget > 0:
        out.extend(planner.budget_problems(job, est))
    return out
