"""The training loop proper: model, DDP, optimizer, schedule, steps, the stop flag, logging.

The worker (:mod:`train.worker`) owns the process (distributed init, the run directory,
resume and the exit code); this module owns what happens between two checkpoints. Every
side effect it needs comes in with the rank's context (the clock, the printer, the event log,
the stop flag) and its checkpointer, so the loop is the same under Slurm, ``cluster=local``
and in tests.

Determinism: the model init is layout independent (:mod:`train.megatron_model`), data is
addressed by global sample index (:mod:`train.data`), dropout is 0 and every RNG is
re-seeded from (seed, step) at each step (:func:`seed_step`). Resume is therefore bitwise
equal to an uninterrupted run with the same layout.
"""
from __future__ import annotations

import datetime
import math
import random
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Dict, List, NamedTuple, Optional

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func

from analysis import flops as aflops
from analysis import throughput
from analysis.spend import stop_text
from launch.config import Job, ParallelismConfig, TrainingConfig
from launch.kinds import EventKind
from train import hf_bridge, megatron_model, memory, nan_guard
from train.checkpointer import Checkpointer
from train.context import RankContext
from train.cpu_shim import patch_missing_te_symbols
from train.data import SampleSource, step_batches
from train.megatron_model import to_ddp_config, to_optimizer_config


class InjectedFailure(RuntimeError):
    """``SLURMTRON_TEST_FAIL_AT_ITER``: a deterministic crash for the recovery tests."""


class TrainingParts(NamedTuple):
    """What :func:`build_training` builds and a checkpoint holds besides the position."""

    chunks: List[Any]  # model chunks (Megatron DDP), one per virtual pipeline stage
    optimizer: Any
    scheduler: OptimizerParamScheduler


@dataclass
class TrainState:
    """The position in the run; checkpointed, so a resume neither repeats nor skips."""

    step: int = 0  # optimizer steps done
    consumed_samples: int = 0  # data position: global samples consumed or skipped
    skips: List[List[int]] = field(default_factory=list)  # [first sample, count]: batches skipped after a NaN

    def skip_here(self) -> int:
        """Samples to skip at the current data position (a NaN rollback's skipped batches), 0 if none."""
        return sum(n for start, n in self.skips if start == self.consumed_samples)


@dataclass
class StepResult:
    iteration: int
    loss: float  # mean lm loss over the global batch
    grad_norm: float
    lr: float
    skipped: bool
    nan: bool
    seconds: float


@dataclass
class Counters:
    skipped: int = 0
    nan: int = 0
    history: List[StepResult] = field(default_factory=list)


def train_iters(job: Job) -> int:
    """:attr:`launch.config.Job.iterations`, refused on the rank when it is not a step count >= 1."""
    iters = job.iterations
    if not iters or iters < 1:
        raise ValueError("set training.train_iters (>= 1) or training.train_tokens")
    return int(iters)


def num_microbatches(job: Job) -> int:
    """:attr:`launch.config.Job.num_microbatches`, refused on the rank unless it divides the batch exactly."""
    t = job.training
    per_step = t.micro_batch_size * job.dp
    if per_step < 1 or t.global_batch_size % per_step:
        raise ValueError(
            f"training.global_batch_size={t.global_batch_size} is not a multiple of "
            f"micro_batch_size * dp = {t.micro_batch_size} * {job.dp} = {per_step}"
        )
    return job.num_microbatches


def seed_step(seed: int, step: int) -> None:
    """Re-seed python, numpy, torch and Megatron's model-parallel RNG tracker from (seed, step)."""
    s = (seed * 1_000_003 + step) % (2**31 - 1)
    random.seed(s)
    np.random.seed(s)
    torch.manual_seed(s)
    tensor_parallel.model_parallel_cuda_manual_seed(s)


def wrap_ddp(chunks: List[torch.nn.Module], config: Any, parallelism: ParallelismConfig) -> List[DistributedDataParallel]:
    """Megatron DDP around each chunk (:func:`train.megatron_model.to_ddp_config`); bucketing only on
    chunk 0, and the schedule's sync hooks set as Megatron-LM's ``training.py`` sets them."""
    ddp_config = to_ddp_config(parallelism)
    wrapped = [
        DistributedDataParallel(config=config, ddp_config=ddp_config, module=c, disable_bucketing=i > 0)
        for i, c in enumerate(chunks)
    ]
    for m in wrapped:
        m.broadcast_params()
    one = len(wrapped) == 1
    config.no_sync_func = wrapped[0].no_sync if one else [m.no_sync for m in wrapped]
    if ddp_config.overlap_grad_reduce:  # the pipeline schedules start each chunk's reduce after its last backward
        config.grad_sync_func = wrapped[0].start_grad_sync if one else [m.start_grad_sync for m in wrapped]
    config.finalize_model_grads_func = finalize_model_grads
    return wrapped


def build_optimizer(training: TrainingConfig, chunks: List[Any], parallelism: ParallelismConfig) -> Any:
    """Megatron's optimizer as :func:`train.megatron_model.to_optimizer_config` configures it."""
    return get_megatron_optimizer(to_optimizer_config(training, parallelism), chunks)


def build_scheduler(training: TrainingConfig, optimizer: Any, iters: int, gbs: int) -> OptimizerParamScheduler:
    """Megatron's LR schedule, counted in samples like Megatron-LM (warm-up, then decay to min_lr)."""
    if training.lr_decay_style not in ("cosine", "linear", "constant"):
        raise ValueError(f"training.lr_decay_style={training.lr_decay_style!r}; expected cosine | linear | constant")
    decay = max(iters * gbs, training.lr_warmup_iters * gbs + 1)
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=training.lr,
        min_lr=training.min_lr,
        lr_warmup_steps=training.lr_warmup_iters * gbs,
        lr_decay_steps=decay,
        lr_decay_style=training.lr_decay_style,
        start_wd=training.weight_decay,
        end_wd=training.weight_decay,
        wd_incr_steps=decay,
        wd_incr_style="constant",
    )


def build_training(job: Job, iters: int, *, cuda: bool, device: torch.device,
                   hf_weights: Optional[Path] = None) -> TrainingParts:
    """Model chunks (Megatron DDP), optimizer and LR schedule for ``job``, in one fixed order.

    The worker and the preflight both build through here, so the preflight checks exactly
    what the job will train: same translator, same seeding, same layout-independent init.
    """
    p, t = job.parallelism, job.training
    config = megatron_model.to_transformer_config(job.model, p, t, cuda=cuda)
    use_te = cuda and megatron_model.have_transformer_engine()
    if not megatron_model.have_transformer_engine():  # the MoE router without TE
        patch_missing_te_symbols()
    if p.tp_comm_overlap:
        if not use_te:  # train.versions refuses it without TE; the job check on cluster.gpu=cpu
            raise ValueError("parallelism.tp_comm_overlap=true needs TransformerEngine on a GPU")
        megatron_model.init_tp_comm_overlap(job.model, p, t)
    seed_step(t.seed, 0)
    chunks = megatron_model.build_model_chunks(job.model, config, p.tp, use_te=use_te, device=device)
    megatron_model.init_layout_independent(chunks, job.model, t.seed)
    if hf_weights is not None:  # training.init_from=hf:DIR at step 0: before DDP and the optimizer copy the weights
        hf_bridge.load_into(chunks, job.model, hf_weights, megatron_model.padded_vocab_size(job.model, p.tp))
    chunks = wrap_ddp(chunks, config, p)
    optimizer = build_optimizer(t, chunks, p)
    config.grad_scale_func = optimizer.scale_loss  # fp16: the schedules scale the loss by the dynamic loss scale
    scheduler = build_scheduler(t, optimizer, iters, t.global_batch_size)
    return TrainingParts(chunks, optimizer, scheduler)


def _loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    losses = output_tensor.float().view(-1)
    mask = loss_mask.float().view(-1)
    loss = torch.sum(losses * mask) / mask.sum().clamp(min=1.0)
    return loss, {"lm loss": loss.detach().clone()}  # clone: the schedule scales `loss` in place


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(
        batch["tokens"].to(_device_of(model)),
        batch["position_ids"].to(_device_of(model)),
        None,
        labels=batch["labels"].to(_device_of(model)),
    )
    return output, partial(_loss_func, batch["loss_mask"].to(_device_of(model)))


def _device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def agree_stop(flag_signum: Optional[int], device: torch.device, requested: bool = False,
               spend: tuple[int, int] = (0, 0)) -> tuple[int, bool, int, int]:
    """All ranks agree at a step boundary: the largest signal number any rank saw (0 = none), whether any
    rank (rank 0 polls the stop request file) saw a drain request, and rank 0's spend and projected spend
    (:mod:`train.budget`, nano-hours; 0 elsewhere). One all-reduce."""
    t = torch.tensor([int(flag_signum or 0), int(bool(requested)), int(spend[0]), int(spend[1])],
                     dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t[0].item()), bool(t[1].item()), int(t[2].item()), int(t[3].item())


def _reduce_loss(losses: List[Dict[str, torch.Tensor]], device: torch.device) -> torch.Tensor:
    """Mean lm loss over the global batch, on every rank (from the last pipeline stage)."""
    out = torch.zeros(1, dtype=torch.float64, device=device)
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True) and losses:
        local = torch.stack([d["lm loss"].double() for d in losses]).mean().reshape(1)
        dist.all_reduce(local, group=parallel_state.get_data_parallel_group())
        out = local / parallel_state.get_data_parallel_world_size()
    dist.broadcast(out, src=dist.get_world_size() - 1)
    return out


def train_step(
    job: Job,
    chunks: List[Any],
    optimizer: Any,
    scheduler: OptimizerParamScheduler,
    source: SampleSource,
    state: TrainState,
    nmb: int,
    device: torch.device,
    overflow: bool = False,
) -> tuple[float, float, bool, "nan_guard.StepOutcome"]:
    """One optimizer step over the global batch; returns (loss, grad norm, update skipped, the guard's outcome).

    The loss is reduced *before* the update so that the NaN guard (:mod:`train.nan_guard`) can
    keep a non-finite loss or grad norm from ever being applied. ``overflow`` (a test hook,
    ``SLURMTRON_TEST_OVERFLOW_AT_ITER``) sets every reduced gradient to inf before the optimizer sees it.
    """
    t = job.training
    seed_step(t.seed, state.step)
    batches = step_batches(
        source, state.consumed_samples, nmb, t.micro_batch_size,
        parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank(),
    )
    for c in chunks:
        c.zero_grad_buffer()
    optimizer.zero_grad()
    iterators = [iter(batches) for _ in chunks]
    losses = get_forward_backward_func()(
        forward_step_func=_forward_step,
        data_iterator=iterators if len(chunks) > 1 else iterators[0],
        model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=nmb,
        seq_length=job.model.seq_length,
        micro_batch_size=t.micro_batch_size,
        decoder_seq_length=job.model.seq_length,
        forward_only=False,
    )
    loss = float(_reduce_loss(losses, device).item())
    if overflow:
        for c in chunks:
            for p in c.parameters():
                if getattr(p, "main_grad", None) is not None:
                    p.main_grad.fill_(float("inf"))
    out = nan_guard.guarded_step(optimizer, loss, device)
    if out.applied:
        scheduler.step(increment=t.global_batch_size)
    return loss, out.grad_norm, out.overflow, out


def evaluate(job: Job, chunks: List[Any], source: SampleSource, nmb: int, device: torch.device) -> float:
    """Mean lm loss over ``training.eval_iters`` global batches of the validation split (forward only).

    The same batches every time (samples 0 .. eval_iters * gbs), so the curve compares like with like.
    """
    t = job.training
    total = 0.0
    for c in chunks:
        c.eval()
    try:
        with torch.no_grad():
            for i in range(t.eval_iters):
                batches = step_batches(
                    source, i * t.global_batch_size, nmb, t.micro_batch_size,
                    parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank(),
                )
                iterators = [iter(batches) for _ in chunks]
                losses = get_forward_backward_func()(
                    forward_step_func=_forward_step,
                    data_iterator=iterators if len(chunks) > 1 else iterators[0],
                    model=chunks if len(chunks) > 1 else chunks[0],
                    num_microbatches=nmb, seq_length=job.model.seq_length, micro_batch_size=t.micro_batch_size,
                    decoder_seq_length=job.model.seq_length, forward_only=True,
                )
                total += float(_reduce_loss(losses, device).item())
    finally:
        for c in chunks:
            c.train()
    return total / t.eval_iters


def format_validation(iteration: int, loss: float) -> str:
    """Megatron-LM's ``evaluate_and_print_results`` block, between two lines of dashes."""
    ppl = math.exp(min(20.0, loss))
    s = f" validation loss at iteration {iteration} | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} | "
    return "\n".join(["-" * (len(s) + 1), s, "-" * (len(s) + 1)])


def format_iteration(
    *,
    now: datetime.datetime,
    iteration: int,
    train_iters: int,
    consumed: int,
    elapsed_ms: float,
    lr: float,
    gbs: int,
    loss: float,
    loss_scale: float,
    grad_norm: float,
    skipped: int,
    nan: int,
    tflops: Optional[float] = None,
    mfu: Optional[float] = None,
) -> str:
    """Megatron-LM's ``training_log`` line, field for field (so its users' greps and parsers work)."""
    s = f"[{now.strftime('%Y-%m-%d %H:%M:%S.%f')}] iteration {iteration:8d}/{train_iters:8d} |"
    s += f" consumed samples: {consumed:12d} |"
    s += f" elapsed time per iteration (ms): {elapsed_ms:.1f} |"
    if tflops is not None:
        s += f" throughput per GPU (TFLOP/s/GPU): {tflops:.1f} |"
    if mfu is not None:
        s += f" MFU: {mfu * 100:.2f}% |"
    s += f" learning rate: {lr:.6E} |"
    s += f" global batch size: {gbs:5d} |"
    s += f" lm loss: {loss:.6E} |"
    s += f" loss scale: {loss_scale:.1f} |"
    s += f" grad norm: {grad_norm:.3f} |"
    s += f" number of skipped iterations: {skipped:3d} |"
    s += f" number of nan iterations: {nan:3d} |"
    return s


class Meter:
    """Counts skipped and NaN steps and reports each logged step: an ``iteration`` event and Megatron's line."""

    def __init__(self, ctx: RankContext, optimizer: Any, iters: int) -> None:
        self.ctx, self.optimizer, self.iters = ctx, optimizer, iters
        self.counters = Counters()
        self.flops_per_step, self.peak_flops = throughput_model(ctx)
        plan = memory.read_plan(ctx.paths.memory_plan)
        self.plan_bytes = plan["total_gib"] * memory.GIB if plan and ctx.cuda else None
        self.fragmentation = memory.FragmentationWatch(window=ctx.job.training.memory_window)

    def step_done(self, state: TrainState, loss: float, grad_norm: float, skipped: bool, elapsed: float) -> None:
        ctx, t, iteration = self.ctx, self.ctx.job.training, state.step
        self.counters.skipped += int(skipped)
        self.counters.nan += int(not math.isfinite(loss))
        if not (iteration % max(1, t.log_interval) == 0 or iteration == self.iters):  # the event log fsyncs
            return
        lr = self.optimizer.param_groups[0]["lr"]
        tflops = mfu = None
        if self.flops_per_step is not None and elapsed > 0 and self.peak_flops:  # CPU: no "TFLOP/s/GPU: 0.0"
            tflops = self.flops_per_step / (elapsed * ctx.world) / 1e12
            if self.peak_flops:
                mfu = tflops * 1e12 / self.peak_flops
        scale = loss_scale(self.optimizer)
        mem = memory.sample(bool(ctx.cuda))
        ctx.emit(EventKind.ITERATION, step=iteration, loss=repr(loss), grad_norm=repr(grad_norm), lr=repr(lr),
                 consumed_samples=state.consumed_samples, seconds=elapsed, **mem.fields())
        ctx.log(format_iteration(
            now=ctx.now(), iteration=iteration, train_iters=self.iters, consumed=state.consumed_samples,
            elapsed_ms=elapsed * 1000.0, lr=lr, gbs=t.global_batch_size, loss=loss,
            loss_scale=scale,
            grad_norm=grad_norm, skipped=self.counters.skipped, nan=self.counters.nan, tflops=tflops, mfu=mfu,
        ))
        ctx.log(memory.log_line(ctx.rank, iteration, mem))
        finding = self.fragmentation.add(iteration, mem)
        if finding is not None:  # this rank's own log says it; rank 0's event log records rank 0's
            print(f"WARNING: rank {ctx.rank}: memory fragmentation: {finding['detail']}", flush=True)
            ctx.emit(EventKind.MEMORY_FRAGMENTATION, rank=ctx.rank, **finding)
        if getattr(ctx, "tracker", None) is not None:  # TensorBoard/W&B under Megatron-LM's names (train/tracking.py)
            tokens = t.global_batch_size * ctx.job.model.seq_length
            ctx.tracker.scalars(iteration, {
                "loss": loss, "lr": lr, "grad_norm": grad_norm, "loss_scale": scale,
                "batch_size": t.global_batch_size, "iteration_time": elapsed, "throughput": tflops, "mfu": mfu,
                "tokens_per_s": tokens / elapsed if elapsed > 0 else None, **memory.scalars(mem, self.plan_bytes)})


    def run_summary(self, step: int) -> None:
        """End of the attempt, rank 0 (the event log's writer): the run's figures over every attempt's logged
        steps so far (:mod:`analysis.throughput`, what ``status.py`` and the report show), one log line, and on
        TensorBoard under ``run/`` when this rank also writes it."""
        ctx, job = self.ctx, self.ctx.job
        if not ctx.is_first:
            if getattr(ctx, "tracker", None) is not None:  # TensorBoard's rank is not the event log's writer
                ctx.tracker.text(step, "run throughput: not written here (this rank does not write the event log "
                                       "its figures come from): rank 0's log line, status.py and the report")
            return
        from recovery.events import read_events

        gbs = job.training.global_batch_size
        fig = throughput.of_events(
            read_events(ctx.paths.events), tokens_per_step=gbs * job.model.seq_length,
            tflop_per_gpu_step=throughput.tflop_per_gpu_step(job.model, gbs, ctx.world, job.parallelism.tp),
            peak=throughput.peak_or_none(job.cluster.gpu, job.training.precision))
        if fig.step_time_s is None:
            return
        text = (f"run throughput: {throughput.line(fig)} ({throughput.LABEL}; {fig.steps} step(s), from the "
                f"{fig.source})")
        print(text, flush=True)
        if getattr(ctx, "tracker", None) is not None:
            ctx.tracker.scalars(step, {"run_step_time": fig.step_time_s, "run_tokens_per_s": fig.tokens_per_s,
                                       "run_throughput": fig.tflops_per_gpu, "run_mfu": fig.mfu})
            ctx.tracker.text(step, text)


def loss_scale(optimizer: Any) -> float:
    """The optimizer's current loss scale (1.0 without fp16's dynamic scaler)."""
    return float(getattr(optimizer, "get_loss_scale", lambda: torch.tensor(1.0))().item())


def throughput_model(ctx: RankContext) -> tuple[Optional[float], Optional[float]]:
    """(FLOPs per global step, peak FLOP/s per device or None on CPU), for the log's TFLOP/s and MFU fields."""
    job = ctx.job
    try:
        flops = aflops.num_floating_point_operations(
            job.model, job.training.global_batch_size,
            padded_vocab_size=megatron_model.padded_vocab_size(job.model, job.parallelism.tp))
        peak = aflops.peak_flops(job.cluster.gpu, job.training.precision) if job.cluster.gpu != "cpu" else None
        return flops, peak
    except (ImportError, KeyError, ValueError) as e:
        ctx.log(f"WARNING: no throughput/MFU in the log: {e}")
        return None, None


@dataclass
class LoopResult:
    state: TrainState
    reason: str  # completed | signal (a stop signal or a drain request) | nan | replay_mismatch | budget
    signum: int = 0
    requested: bool = False  # a drain request (the stop file) was agreed
    detail: str = ""
    live_s: float = 0.0  # seconds spent in the live checks (heartbeats, straggler all-gathers)
    median_step_s: float = 0.0
    steps_run: int = 0  # steps this attempt trained (replayed ones included)


def run_loop(ctx: RankContext, parts: TrainingParts, ckpt: Checkpointer, source: SampleSource, state: TrainState,
             iters: int, valid: Optional[SampleSource] = None, judge: Any = None, live: Any = None,
             nan_hooks: Any = None, replay: Any = None, budget: Any = None) -> LoopResult:
    """Train from ``state`` to ``iters``; at every step boundary all ranks agree on a stop first.

    ``ctx`` is the rank's :class:`train.context.RankContext`, ``ckpt`` its
    :class:`train.checkpointer.Checkpointer` (periodic saves, ``auto`` interval, lead-time check,
    NaN rollback). ``valid``: the validation split, evaluated every ``training.eval_interval``
    steps and at the end. ``judge`` (rank 0 only, :class:`recovery.stop.Judge`) polls the drain
    request file and, on a stop, asks Slurm who stopped the job while the ranks save. After each
    step the rank sends its watcher a heartbeat and feeds ``live`` (:class:`train.stragglers.LiveChecks`);
    a step whose loss or grad norm is non-finite is not applied (:mod:`train.nan_guard`) and ends
    the loop (``training.nan_guard.on_nan=stop``) or rolls back. ``replay`` (:class:`train.replay_parity.ReplayParity`)
    compares the first replayed steps with the lost attempt's log; periodic saves wait until it vouched for them.
    ``budget`` (:class:`train.budget.BudgetGuard`, every rank) warns as the spend passes 50/80/95% of
    ``run.budget_gpu_hours`` and ends the loop (reason ``budget``, after a stop checkpoint) once it is spent.
    """
    t = ctx.job.training
    gbs = t.global_batch_size
    nmb = num_microbatches(ctx.job)
    meter = Meter(ctx, parts.optimizer, iters)
    rollbacks, live_s, step_times = 0, 0.0, []

    def result(reason: str, signum: int = 0, detail: str = "", requested: bool = False) -> LoopResult:
        med = float(np.median(step_times)) if step_times else 0.0
        meter.run_summary(state.step)
        return LoopResult(state, reason, signum, requested, detail, live_s, med, len(step_times))

    while state.step < iters:
        mine = budget.local(state.step) if budget is not None and ctx.is_first else (0, 0)
        signum, requested, spent, projected = agree_stop(
            ctx.flag.signum, ctx.device, judge is not None and judge.requested(state.step), mine)
        over = budget.review(ctx, state.step, spent, projected) if budget is not None else None
        if over is not None and not (signum or requested):
            ckpt.save(state, "budget")
            return result("budget", detail=stop_text(over, state.step, ctx.job.run.name))
        if signum or requested:
            if signum:
                ctx.emit(EventKind.SIGNAL, signal=_signame(signum), step=state.step)
            if judge is not None:
                judge.begin(signum, requested)
            ckpt.save(state, "signal")
            return result("signal", signum, requested=requested)
        skip = state.skip_here()  # a NaN rollback's skipped batches start here
        if skip:
            ctx.log(f"skipping {skip // gbs} batch(es) (samples {state.consumed_samples}.."
                    f"{state.consumed_samples + skip - 1}) after a non-finite step "
                    f"(training.nan_guard.skip_batches={t.nan_guard.skip_batches})")
            ctx.emit(EventKind.BATCHES_SKIPPED, step=state.step, first_sample=state.consumed_samples, samples=skip,
                     batches=skip // gbs)
            state.consumed_samples += skip
        inject_failure(ctx.hooks.fail_at_iter, state.step + 1)
        inject_oom(ctx.hooks.oom_at_iter, state.step + 1)
        if nan_hooks is not None:
            nan_hooks.reset()
        t0, c0 = ctx.clock(), time.thread_time()
        loss, grad_norm, skipped, guard = train_step(ctx.job, *parts, source, state, nmb, ctx.device,
                                                     overflow=ctx.hooks.overflows_at(state.step + 1))
        if ctx.hooks.step_sleep_s > 0:
            ctx.sleep(ctx.hooks.step_sleep_s)
        elapsed, compute = ctx.clock() - t0, time.thread_time() - c0
        if skipped:
            scale = loss_scale(parts.optimizer)
            ctx.log(f"WARNING: fp16 loss scale overflow at iteration {state.step + 1}: the update was skipped "
                    f"(loss scale now {scale:.1f}; training.hysteresis={t.hysteresis} overflows in a row halve it)")
            ctx.emit(EventKind.LOSS_SCALE_OVERFLOW, step=state.step + 1, loss_scale=scale)
        if guard.nonfinite:
            meter.counters.nan += 1
            where = nan_hooks.first if nan_hooks is not None else None
            detail = (f"non-finite {'lm loss' if not math.isfinite(loss) else 'grad norm'} at iteration "
                      f"{state.step + 1} (lm loss {loss!r}, grad norm {grad_norm!r}); the update was not applied"
                      + (f"; first non-finite value: {where}" if where else ""))
            ctx.log(f"WARNING: {detail}")
            ctx.emit(EventKind.NAN, step=state.step + 1, loss=repr(loss), grad_norm=repr(grad_norm),
                     first_sample=state.consumed_samples, policy=t.nan_guard.on_nan, where=where)
            if t.nan_guard.on_nan != "rollback":
                return result("nan", detail=detail + " (training.nan_guard.on_nan=stop)")
            if rollbacks >= t.nan_guard.max_rollbacks:
                return result("nan", detail=detail + f"; {rollbacks} rollback(s) already done "
                                                     f"(training.nan_guard.max_rollbacks={t.nan_guard.max_rollbacks})")
            back = ckpt.rollback(state, state.consumed_samples)
            if back is None:
                return result("nan", detail=detail + "; no verified checkpoint to roll back to")
            rollbacks += 1
            state = back
            continue
        state.step += 1
        state.consumed_samples += gbs
        step_times.append(elapsed)
        if budget is not None:
            budget.step_times.append(elapsed)
        t1 = ctx.clock()
        ctx.beat("step", state.step, elapsed)
        if live is not None:
            live.on_step(state.step, compute, elapsed)
        live_s += ctx.clock() - t1
        meter.step_done(state, loss, grad_norm, skipped, elapsed)
        if replay is not None:
            action = replay.after_step(state, loss, grad_norm)
            if action == "rollback":
                back = replay.rollback(ckpt, state)
                if back is not None:
                    state = back
                    continue
                action = "stop"
            if action == "stop":
                return result("replay_mismatch", detail=replay.detail)
            ckpt.hold_saves = replay.pending
        if valid is not None and (state.step % t.eval_interval == 0 or state.step == iters):
            validate(ctx, parts, valid, nmb, state.step)
        ckpt.after_step(state, elapsed, iters)
    return result("completed")


def validate(ctx: RankContext, parts: TrainingParts, valid: SampleSource, nmb: int, step: int) -> float:
    """Evaluate, then log the Megatron block, a ``validation`` event and the TensorBoard scalars."""
    loss = evaluate(ctx.job, parts.chunks, valid, nmb, ctx.device)
    ctx.log(format_validation(step, loss))
    ctx.emit(EventKind.VALIDATION, step=step, loss=repr(loss), iters=ctx.job.training.eval_iters)
    if getattr(ctx, "tracker", None) is not None:
        ctx.tracker.scalars(step, {"val_loss": loss, "val_ppl": math.exp(min(20.0, loss))})
    return loss


def inject_failure(fail_at_iter: Optional[int], iteration: int) -> None:
    """``SLURMTRON_TEST_FAIL_AT_ITER``: raise at that iteration on every rank (a deterministic crash)."""
    if fail_at_iter is not None and iteration == fail_at_iter:
        raise InjectedFailure(f"SLURMTRON_TEST_FAIL_AT_ITER={fail_at_iter}: injected failure at iteration {iteration}")


def inject_oom(oom_at_iter: int, iteration: int) -> None:
    """``SLURMTRON_TEST_OOM_AT_ITER``: raise ``torch.cuda.OutOfMemoryError`` at that iteration on every rank, as the
    caching allocator does when a cudaMalloc fails (the OOM path on a machine without a GPU)."""
    if oom_at_iter and iteration == oom_at_iter:
        raise torch.cuda.OutOfMemoryError(
            f"CUDA out of memory. Tried to allocate 2.00 GiB (SLURMTRON_TEST_OOM_AT_ITER={oom_at_iter}: injected at "
            f"iteration {iteration})")


def _signame(signum: int) -> str:
    import signal

    try:
        return signal.Signals(signum).name
    except ValueError:
        return str(signum)
