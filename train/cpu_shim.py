"""Run Megatron-Core on a CPU-only machine (gloo), for tests and the embedded local default.

Megatron-Core calls CUDA unconditionally in four families of places; each part below
redirects one of them (see ``../shared/notes/megatron-core-on-cpu.md``; with any part
removed a TP2xPP2 distributed-optimizer run fails):

1. RNG: the CUDA RNG states tracker (``model_parallel_cuda_manual_seed``) -> the CPU
   default generator.
2. Device ordinal: ``torch.cuda.current_device()`` -> the CPU.
3. Sync, streams, events: no-op stand-ins.
4. Literal ``device="cuda"``, ``Tensor.cuda()``, ``pin_memory=True`` and ``Tensor.type()``
   strings: a :class:`torch.overrides.TorchFunctionMode` rewrites them.

Plus feature patches: sequence parallelism with the torch norm fallback, and the MoE router's
missing TE symbol (:func:`patch_missing_te_symbols`, also used on a GPU without TE).

:func:`apply` is called by the worker only when ``torch.cuda.is_available()`` is false,
before any model or optimizer is built. It returns the active function mode so the caller
owns its lifetime (no hidden global besides the patched attributes themselves).
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.overrides import TorchFunctionMode


def _is_cuda_device(dev: Any) -> bool:
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    if isinstance(dev, str):
        return dev.startswith("cuda")
    return isinstance(dev, int) and not isinstance(dev, bool)


def _cpu_type_string(name: str) -> str:
    return name.replace("torch.cuda.", "torch.")


class CpuDeviceMode(TorchFunctionMode):
    """Rewrite CUDA device arguments to the CPU inside torch calls (part 4 of the shim)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type:
            if len(args) == 1 and not kwargs:
                # grad clipping and the distributed optimizer assert on this string
                return func(*args).replace("torch.", "torch.cuda.", 1)
            args = tuple(_cpu_type_string(a) if isinstance(a, str) else a for a in args)
            if isinstance(kwargs.get("dtype"), str):
                kwargs["dtype"] = _cpu_type_string(kwargs["dtype"])
            return func(*args, **kwargs)
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func in (torch.Tensor.to, torch.Tensor.pin_memory):
            if func is torch.Tensor.pin_memory:
                return args[0]
            args = tuple(
                "cpu" if (i > 0 and _is_cuda_device(a) and not isinstance(a, int)) else a
                for i, a in enumerate(args)
            )
        return func(*args, **kwargs)


class _NullStream:
    """Stands in for torch.cuda.Stream / Event (part 3)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, *args: Any) -> None:
        pass

    def wait_event(self, *args: Any) -> None:
        pass

    def record_event(self, *args: Any) -> "_NullStream":
        return _NullStream()

    def record(self, *args: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, *args: Any) -> float:
        return 0.0

    def wait(self, *args: Any) -> None:
        pass


def _patch_rng() -> None:
    """Part 1: the CUDA RNG tracker uses the CPU default generator."""
    from megatron.core.tensor_parallel import random as mrandom

    def get_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
        return torch.get_rng_state()

    def set_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
        torch.set_rng_state(new_state)

    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.random.get_rng_state = torch.cuda.get_rng_state
    torch.cuda.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)
    # the CPU generator directly: torch.manual_seed itself calls torch.cuda.manual_seed_all
    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    mrandom._get_cuda_rng_state = get_state
    mrandom._set_cuda_rng_state = set_state


def _patch_device_and_streams() -> None:
    """Parts 2 and 3."""
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.Stream = _NullStream
    torch.cuda.Event = _NullStream
    torch.cuda.current_stream = lambda *a, **k: _NullStream()
    torch.cuda.default_stream = lambda *a, **k: _NullStream()
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    torch.cuda.set_device = lambda *a, **k: None
    torch.cuda.empty_cache = lambda: None


def _patch_sequence_parallel_norm() -> None:
    """Let the torch norm fallback run with sequence_parallel.

    ``WrappedTorchNorm`` refuses ``sequence_parallel``; TE and Apex norms instead tag their
    parameters ``sequence_parallel=True`` so ``finalize_model_grads`` all-reduces their
    grads across TP. Do the same.
    """
    from megatron.core.transformer import torch_norm

    original_new = torch_norm.WrappedTorchNorm.__new__

    def new(cls, config, hidden_size, eps=1e-5, *args, **kwargs):
        if not config.sequence_parallel:
            return original_new(cls, config, hidden_size, eps, *args, **kwargs)
        config.sequence_parallel = False  # only for the constructor's check
        try:
            norm = original_new(cls, config, hidden_size, eps, *args, **kwargs)
        finally:
            config.sequence_parallel = True
        for p in norm.parameters():
            setattr(p, "sequence_parallel", True)
        return norm

    if not getattr(torch_norm.WrappedTorchNorm, "_slurmtron_sp", False):
        torch_norm.WrappedTorchNorm.__new__ = staticmethod(new)
        torch_norm.WrappedTorchNorm._slurmtron_sp = True


def patch_missing_te_symbols() -> None:
    """Without TransformerEngine, Megatron-Core 0.16's MoE router reads an undefined name.

    ``moe_utils.router_gating_linear`` tests ``te_general_gemm is not None``, but the name is
    only bound when the TE import succeeds, so every MoE forward raises ``NameError``. Bind it
    to None, the value the code expects for "no TE". Needed on CPU and on a GPU without TE.
    """
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def apply() -> CpuDeviceMode:
    """Install parts 1-3 and the norm patch; enter and return the device mode (part 4)."""
    if torch.cuda.is_available():
        raise RuntimeError("cpu_shim.apply() called on a machine with CUDA; use the real device")
    _patch_rng()
    _patch_device_and_streams()
    _patch_sequence_parallel_norm()
    mode = CpuDeviceMode()
    mode.__enter__()
    return mode
