"""The one vocabulary (launch/kinds.py) and the one hardware-fault table (launch/hardware_faults.py): well formed,
and known to every consumer (a cause or an event kind one of them does not know fails here)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from launch import hardware_faults
from launch.kinds import Cause, EventKind, causes_table, events_table

REPO = Path(__file__).resolve().parent.parent


def test_every_cause_has_its_own_priority_and_a_colour():
    assert sorted(c.priority for c in Cause) == list(range(len(Cause)))
    assert all(c.colour and c.meaning for c in Cause)
    assert Cause.by_priority()[0] == Cause.NODE_FAILURE and Cause.by_priority()[-1] == Cause.UNKNOWN
    assert Cause.OOM == "oom" and f"{Cause.OOM}" == "oom" and Cause("node_exclusion") is Cause.NODE_EXCLUSION


def test_the_decided_causes_are_the_ones_the_stop_rules_return():
    assert {c.value for c in Cause.decided_ones()} == {"user_cancel", "user_stop", "user_requeue", "preemption",
                                                      "time_limit", "node_failure"}
    # final: the attempt it ends is not requeued (a user's cancel or stop, a NaN stop)
    assert {c.value for c in Cause if c.final} == {"user_cancel", "user_stop", "nan"}


def test_every_event_kind_says_what_it_adds():
    assert all(k.fields.strip() for k in EventKind)
    assert len({k.value for k in EventKind}) == len(EventKind)


@pytest.mark.parametrize("text, reason", [
    ("RuntimeError: CUDA error: uncorrectable ECC error encountered", "uncorrectable ECC error"),
    ("NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus", "GPU Xid error"),
    ("RuntimeError: GPU has fallen off the bus", "GPU fell off the bus"),
    ("RuntimeError: CUDA error: an illegal memory access was encountered", "CUDA device fault"),
    ("NCCL WARN NVLink fatal error on link 3", "NVLink error"),
    ("NCCL WARN NET/IB : ibv_poll_cq failed", "InfiniBand error"),
    ("ValueError: global_batch_size is not a multiple", None),
])
def test_the_hardware_table_tells_node_faults_from_code_bugs(text, reason):
    assert hardware_faults.hardware_fault(text) == reason
    row = hardware_faults.match(text)
    # the report finds the same line in a log: it holds one of the row's pre-filter literals
    assert row is None or any(lit in text for lit in row.literals)


def test_every_hardware_fault_names_a_cause_of_the_vocabulary():
    assert all(isinstance(f.cause, Cause) and f.reason and f.literals for f in hardware_faults.HARDWARE_FAULTS)
    assert len({f.name for f in hardware_faults.HARDWARE_FAULTS}) == len(hardware_faults.HARDWARE_FAULTS)


def test_the_tables_print_from_the_command_line():
    out = subprocess.run([sys.executable, "-m", "launch.kinds", "causes"], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == causes_table()
    assert all(f"`{c}`" in out.stdout for c in Cause)
    bad = subprocess.run([sys.executable, "-m", "launch.kinds", "bogus"], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
    assert all(k.value in events_table() for k in EventKind)
