"""The NaN/Inf guard: a non-finite loss or gradient norm never reaches the weights.

Megatron-LM checks with ``--check-for-nan-in-loss-and-grad`` (the loss in the loss function,
the gradients during the data-parallel reduce) and *raises*: the job dies, and whatever the
last periodic save committed is what the next attempt loads. Here the check sits where
Megatron-Core's optimizer itself splits its step (``ChainedOptimizer.step``:
``prepare_grads`` -> ``get_grad_norm`` -> clip -> ``step_with_ready_grads``): after the grad
norm is known and before the update is applied, so either all ranks apply the update or none
does, and the policy (``training.nan_guard.on_nan``) decides what happens next.

All ranks agree without a collective of their own: the loss is broadcast from the last
pipeline stage to every rank (``train_loop._reduce_loss``), and the grad norm is the result
of Megatron's all-reduce over the grad-stats group of gradients that the data-parallel
reduce made identical; a NaN or Inf anywhere in either sum is non-finite on every rank.
(A per-step all-reduce of a flag cost 1-2% of the tiny model's step on CPU.)

An fp16 loss-scale overflow is *not* an incident: ``prepare_grads`` reports it, Megatron
skips the update and lowers the scale, exactly as before.

``training.nan_guard.hooks=true`` installs forward hooks on every module and gradient hooks on
every parameter that name the first place a non-finite value appeared (costly: one
``isfinite`` reduction per module output and gradient).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, List, Optional

import torch


@dataclass
class StepOutcome:
    applied: bool  # the optimizer update was kept
    grad_norm: float
    overflow: bool  # fp16 loss-scale overflow (Megatron's skipped iteration)
    nonfinite: bool  # the loss or the grad norm was non-finite on some rank: nothing applied
    agree_s: float = 0.0  # time spent agreeing (the guard's own cost)


def _chained(optimizer: Any) -> list:
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def guarded_step(optimizer: Any, loss: float, device: torch.device) -> StepOutcome:
    """Megatron-Core's optimizer step with the agreement on finiteness before the update."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    if optimizer.prepare_grads():
        return StepOutcome(False, float("nan"), True, False)
    grad_norm = optimizer.get_grad_norm()
    norm = float(grad_norm) if grad_norm is not None else 0.0
    t0 = time.perf_counter()
    bad = not (math.isfinite(loss) and math.isfinite(norm))
    agree_s = time.perf_counter() - t0
    if bad:
        return StepOutcome(False, norm, False, True, agree_s)
    for opt in _chained(optimizer):
        if getattr(opt, "is_stub_optimizer", False):
            continue
        params = opt.get_parameters()
        if params and opt.config.clip_grad > 0.0:
            clip_grad_by_total_norm_fp32(params, max_norm=opt.config.clip_grad, total_norm=grad_norm,
                                         use_decoupled_grad=opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
    applied = bool(optimizer.step_with_ready_grads())
    return StepOutcome(applied, norm, False, False, agree_s)


def nonfinite_params(chunks: List[Any]) -> Optional[str]:
    """The first parameter with a non-finite value (a last line of defence before a commit), or None."""
    for chunk in chunks:
        for name, p in getattr(chunk, "module", chunk).named_parameters():
            if not bool(torch.isfinite(p.detach()).all()):
                return name
    return None


class NanHooks:
    """Debug hooks: the first module output and the first parameter gradient that is non-finite."""

    def __init__(self, chunks: List[Any], report: Callable[[str], None]) -> None:
        self.report = report
        self.first: Optional[str] = None
        self.handles: list = []
        for chunk in chunks:
            for name, mod in getattr(chunk, "module", chunk).named_modules():
                self.handles.append(mod.register_forward_hook(self._forward(name or type(mod).__name__)))
            for name, p in getattr(chunk, "module", chunk).named_parameters():
                if p.requires_grad:
                    self.handles.append(p.register_hook(self._grad(name)))

    def reset(self) -> None:
        self.first = None

    def _note(self, where: str) -> None:
        if self.first is None:
            self.first = where
            self.report(where)

    def _forward(self, name: str):
        def hook(_mod, _inp, out):
            if self.first is None:
                for t in (out if isinstance(out, (tuple, list)) else (out,)):
                    if isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all()):
                        self._note(f"forward output of module {name}")
                        break
        return hook

    def _grad(self, name: str):
        def hook(g):
            if self.first is None and g is not None and not bool(torch.isfinite(g).all()):
                self._note(f"gradient of parameter {name}")
            return None
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
