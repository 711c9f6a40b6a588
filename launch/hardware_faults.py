"""The one table of node hardware faults: errors that mean "this node's hardware", not "our code".

Read by the ranks (recovery/exclusion.py: a crash whose traceback names one records the node and requeues the job
without it; the ``exclude`` event carries the row's ``reason``) and by the report (analysis/signatures.py finds the
same errors in job output; analysis/report.py counts the ranks' ``exclude`` events by reason). Torch-free, stdlib
only.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from launch.kinds import Cause

__all__ = ["HardwareFault", "HARDWARE_FAULTS", "hardware_fault", "match"]


@dataclass(frozen=True)
class HardwareFault:
    """``pattern`` (case-insensitive) finds the fault in a traceback or a log line; every line it matches in a
    log holds one of ``literals`` (the report's fast pre-filter); ``reason`` is what is recorded with the host;
    ``kind`` the report's signature kind; ``cause`` the interruption's cause."""

    name: str
    pattern: str
    literals: tuple[str, ...]
    reason: str
    kind: str = "hardware"
    cause: Cause = Cause.XID

    @property
    def regex(self) -> re.Pattern:
        return re.compile(self.pattern, re.I)


HARDWARE_FAULTS: tuple[HardwareFault, ...] = (
    HardwareFault("ecc", r"uncorrectable ECC error", ("ECC error", "ecc error", "ECC Error"),
                  "uncorrectable ECC error"),
    # the kernel's ``NVRM: Xid (PCI:0000:3b:00): 79, ...`` and any error naming an Xid
    HardwareFault("xid", r"(?:NVRM: )?\bXid\b", ("Xid", "XID"), "GPU Xid error", kind="xid"),
    HardwareFault("off_bus", r"fallen off the bus", ("fallen off the bus",), "GPU fell off the bus"),
    # CUDA's own words for a device fault. Not "an illegal memory access" nor "unspecified launch failure": those
    # are what a kernel bug (an out-of-bounds index, a bad pointer) raises on healthy hardware, a software crash
    # that another node would meet too, so excluding the node would only shrink the pool.
    HardwareFault("cuda_device", r"CUDA error: (?:an uncorrectable NVLink error|ECC)",
                  ("CUDA error",), "CUDA device fault"),
    HardwareFault("nvlink", r"NVLink (?:error|fatal)", ("NVLink", "NVLINK", "nvlink"), "NVLink error"),
    HardwareFault("infiniband", r"ibv_\w+ failed|IBV? (?:link|port) (?:down|error)",
                  ("ibv_", "IB link", "IB port", "IBV link", "IBV port", "ib link", "ib port"), "InfiniBand error"),
)


def match(text: str) -> Optional[HardwareFault]:
    """The first row of :data:`HARDWARE_FAULTS` whose pattern ``text`` holds, or None."""
    return next((f for f in HARDWARE_FAULTS if f.regex.search(text or "")), None)


def hardware_fault(text: str) -> Optional[str]:
    """A short reason if ``text`` (an exception or its traceback) names a node hardware fault."""
    f = match(text)
    return f.reason if f else None
