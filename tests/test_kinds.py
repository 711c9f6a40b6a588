"""The one vocabulary (launch/kinds.py) and the one hardware-fault table (launch/hardware_faults.py): well formed,
and known to every consumer (a cause or an event kind one of them does not know fails here)."""
from __future__ import annotations

import json
import subprocess
import sys
from datetime import datetime, timedelta
from pathlib import Path

import pandas as pd
import pytest

from analysis import parse_slurm, plots
from launch import hardware_faults
from launch.kinds import Cause, EventKind, causes_table, events_table

REPO = Path(__file__).resolve().parent.parent


def test_the_causes_are_in_priority_order_with_a_colour_and_a_meaning():
    assert [c.priority for c in Cause] == list(range(len(Cause)))
    assert all(c.colour and c.meaning for c in Cause)
    assert Cause.NODE_FAILURE.priority == 0 and Cause.UNKNOWN.priority == len(Cause) - 1
    assert Cause.OOM == "oom" and f"{Cause.OOM}" == "oom" and Cause("node_exclusion") is Cause.NODE_EXCLUSION


def test_the_decided_causes_are_the_ones_the_stop_rules_return():
    assert {c.value for c in Cause.decided_ones()} == {"user_cancel", "user_stop", "user_requeue", "preemption",
                                                      "time_limit", "node_failure"}
    # final: the attempt it ends is not requeued (a user's cancel or stop, a NaN stop)
    assert {c.value for c in Cause if c.final} == {"user_cancel", "user_stop", "nan", "replay_mismatch", "budget",
                                                    "zero_progress"}
    # a final cause the ranks stop with (not Slurm's decision) is a final stop reason with its own exit code
    from recovery.exit_codes import FINAL_REASONS

    assert all(c.value in FINAL_REASONS for c in Cause if c.final and not c.decided)


def test_every_event_kind_says_what_it_adds():
    assert all(k.fields.strip() for k in EventKind)
    assert len({k.value for k in EventKind}) == len(EventKind)


@pytest.mark.parametrize("text, reason", [
    ("RuntimeError: CUDA error: uncorrectable ECC error encountered", "uncorrectable ECC error"),
    ("NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus", "GPU Xid error"),
    ("RuntimeError: GPU has fallen off the bus", "GPU fell off the bus"),
    ("RuntimeError: CUDA error: an uncorrectable NVLink error was detected during the execution", "CUDA device fault"),
    # a kernel bug on healthy hardware: a software crash, the node is not excluded
    ("RuntimeError: CUDA error: an illegal memory access was encountered", None),
    ("RuntimeError: CUDA error: unspecified launch failure", None),
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


# ---- every consumer knows every cause -----------------------------------------------------------------------

def _at(minutes: float) -> datetime:
    return datetime(2026, 11, 29, 10, 0, 0) + timedelta(minutes=minutes)


def _line(step: int) -> str:
    return (f" [{_at(step / 6):%Y-%m-%d %H:%M:%S}] iteration {step:>8}/      30 | consumed samples: {step * 8:>12} | "
            f"elapsed time per iteration (ms): 1000.0 | learning rate: 1.000000E-04 | global batch size: 8 | "
            f"lm loss: 5.000000E+00 | loss scale: 1.0 | grad norm: 1.000 | number of skipped iterations:   0 | "
            f"number of nan iterations:   0 |")


def _interruption(log: str = "", events: tuple = (), state: str | None = None) -> pd.DataFrame:
    """The report's interruption table of one attempt of job 100 that trained 5 steps, then left ``log`` lines,
    ``events`` and (with ``state``) a sacct record: the real parsers and attempt rules."""
    from analysis.interruptions import build_attempts, interruptions
    from analysis.parse_events import parse_events_text
    from analysis.parse_megatron import parse_iteration_text
    from analysis.parse_slurm import parse_sacct_text
    from analysis.signatures import parse_signature_text

    text = "\n".join([_line(s) for s in range(1, 6)] + ([log] if log else [])) + "\n"
    it, _ = parse_iteration_text(text, source="logs/100_0.out", job_id="100", offsets=True)
    sg, _ = parse_signature_text(text, source="logs/100_0.out", job_id="100")
    base = _at(0).timestamp()
    ev, _ = parse_events_text("\n".join(json.dumps({"time": base + 60 + i, "job_id": "100", "restart_count": 0, **e})
                                        for i, e in enumerate(events)))
    sacct = None
    if state:
        sacct, _ = parse_sacct_text(
            "JobID|JobName|State|ExitCode|Submit|Start|End|Elapsed|NNodes|AllocTRES\n"
            f"100|tron|{state}|0:15|{_at(0):%Y-%m-%dT%H:%M:%S}|{_at(0):%Y-%m-%dT%H:%M:%S}|"
            f"{_at(2):%Y-%m-%dT%H:%M:%S}|00:02:00|2|gres/gpu=4\n")
    att, _ = build_attempts(it, sg, None, ev, sacct, gpus=4, train_iters=30)
    return interruptions(att)


# One piece of evidence per cause, as the tools print or the ranks write it. A new cause needs its detector and
# an example here: the test of the missing one fails.
EVIDENCE = {
    Cause.TIME_LIMIT: dict(log="slurmstepd: error: *** JOB 100 ON n1 CANCELLED AT 2026-11-29T10:02:00 DUE TO TIME "
                               "LIMIT ***"),
    Cause.PREEMPTION: dict(state="PREEMPTED"),
    Cause.NODE_FAILURE: dict(log="srun: error: Node failure on n3"),
    Cause.NCCL_TIMEOUT: dict(log="[rank1]:[E1129 10:01:00.123] Watchdog caught collective operation timeout: "
                                 "WorkNCCL(SeqNum=9, OpType=ALLREDUCE) ran for 600000 milliseconds"),
    Cause.OOM: dict(log="torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"),
    Cause.NAN: dict(events=({"event": EventKind.STOP, "reason": "nan", "code": 11},)),
    Cause.REPLAY_MISMATCH: dict(events=({"event": EventKind.STOP, "reason": "replay_mismatch", "code": 16},)),
    Cause.BUDGET: dict(events=({"event": EventKind.STOP, "reason": "budget", "code": 17},)),
    Cause.XID: dict(log="NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus."),
    Cause.HANG: dict(events=({"event": EventKind.HANG, "deadline": "step"},)),
    Cause.ZERO_PROGRESS: dict(events=({"event": EventKind.STOP, "reason": "zero_progress", "code": 3},)),
    Cause.CRASH: dict(events=({"event": EventKind.EXIT, "reason": "error", "code": 1},)),
    # a rank that failed before its first step (recovery/startup_failures.py): a crash too
    "startup_failed": dict(events=({"event": EventKind.STARTUP_FAILED, "error": "ModuleNotFoundError: No module "
                                    "named 'megatron'", "host": "n1"},)),
    Cause.USER_CANCEL: dict(state="CANCELLED by 0"),
    Cause.USER_STOP: dict(events=({"event": EventKind.STOP, "reason": "user_stop", "requeue": False},)),
    Cause.USER_REQUEUE: dict(events=({"event": EventKind.STOP, "reason": "user_requeue", "requeue": True},)),
    Cause.NODE_EXCLUSION: dict(events=({"event": EventKind.EXCLUDE, "hosts": ["n1"], "bad_here": ["n1"],
                                        "ok": True, "detail": "requeued"},)),
    Cause.UNKNOWN: dict(state="FAILED"),
}


def test_a_start_up_failure_is_a_crash_in_the_report():
    intr = _interruption(**EVIDENCE["startup_failed"])
    assert intr["cause"].tolist() == [Cause.CRASH.value], intr["evidence"].tolist()
    assert "ModuleNotFoundError" in intr["evidence"].iloc[0]


@pytest.mark.parametrize("cause", list(Cause))
def test_every_cause_is_detected_and_reported(cause):
    assert cause in EVIDENCE, f"cause {cause}: add its detector and an example of its evidence to EVIDENCE"
    intr = _interruption(**EVIDENCE[cause])
    assert intr["cause"].tolist() == [cause.value], intr["evidence"].tolist()
    assert plots._colour(cause.value) == cause.colour and plots._colour("no_such_cause") == "black"


def test_every_sacct_state_names_a_cause_of_the_vocabulary():
    assert all(c is None or isinstance(c, Cause) for c in parse_slurm.SACCT_STATE_CAUSE.values())


def test_the_stop_rules_decide_exactly_the_decided_causes_and_requeue_unless_final():
    # every reason recovery/stop.py can return that is a cause of the vocabulary
    from recovery import stop as st

    decided = {st.USER_CANCEL, st.USER_STOP, st.USER_REQUEUE, st.PREEMPTION, st.TIME_LIMIT, st.NODE_FAILURE}
    assert decided == set(Cause.decided_ones())
    assert all(st.StopDecision.of(c, "e").requeue is (not c.final) for c in Cause.decided_ones())


def test_a_hardware_fault_a_rank_named_is_the_cause_and_counted_in_the_report():
    """The rank's crash named an ECC error: it wrote stop crash, then exclude with the reason; the report shows
    the hardware fault as the cause (over the crash), lists it among the live alerts and counts it by reason."""
    from analysis import report

    events = ({"event": EventKind.STOP, "reason": "crash", "code": 1, "detail": "RuntimeError: CUDA error: "
                                                                                 "uncorrectable ECC error"},
              {"event": EventKind.EXCLUDE, "hosts": ["n2"], "ok": True, "detail": "requeued",
               "reason": "uncorrectable ECC error"},
              {"event": EventKind.EXIT, "reason": "requeue", "code": 42})
    intr = _interruption(events=events)
    assert intr["cause"].tolist() == ["xid"]
    assert "event exclude: uncorrectable ECC error on n2" in intr["evidence"].iloc[0]
    from analysis.parse_events import parse_events_text

    carried = {"event": EventKind.EXCLUDE, "hosts": ["n2"], "ok": True, "detail": "x"}  # no reason: no new fault
    ev, _ = parse_events_text("\n".join(json.dumps({"time": 1.0 + i, "job_id": "100", "restart_count": 0, **e})
                                        for i, e in enumerate(events + (carried,))))
    live = report.live_alerts(ev)
    assert live["event"].tolist() == ["exclude"] and "uncorrectable ECC error on n2" in live["what"].iloc[0]
    assert report._hardware_counts(ev) == {"uncorrectable ECC error": 1}


# ---- the documentation tables are the code's ------------------------------------------------------------------

def test_the_reports_guide_holds_the_causes_table():
    assert causes_table() in (REPO / "docs" / "reports.md").read_text(), \
        "docs/reports.md: paste the output of `python -m launch.kinds causes`"


def test_the_event_log_module_documents_every_kind():
    from recovery import events

    assert events_table() in events.__doc__, "recovery/events.py: paste the output of `python -m launch.kinds events`"


# ---- every emitter names an EventKind -------------------------------------------------------------------------

def _product_trees():
    import ast

    for pkg in ("launch", "train", "recovery", "analysis"):
        for path in sorted((REPO / pkg).rglob("*.py")):
            yield path.relative_to(REPO), ast.parse(path.read_text())


def test_no_emitter_writes_an_event_kind_as_a_string_literal():
    """``emit("stop", ...)`` or a notice ``{"event": "quarantine", ...}`` would bypass the vocabulary."""
    import ast

    literal = []
    for rel, tree in _product_trees():
        for n in ast.walk(tree):
            if isinstance(n, ast.Call):
                name = n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
                if "emit" in name and n.args and isinstance(n.args[0], ast.Constant):
                    literal.append(f"{rel}:{n.lineno} {name}({n.args[0].value!r})")
            if isinstance(n, ast.Dict):
                literal += [f"{rel}:{n.lineno} {{'event': {v.value!r}}}" for k, v in zip(n.keys, n.values)
                            if isinstance(k, ast.Constant) and k.value == "event" and isinstance(v, ast.Constant)]
    assert literal == []


def _reads_the_kind(n) -> bool:
    """``e.get("event")``, ``e["event"]``, ``r.event`` or ``df["event"].isin(...)``."""
    import ast

    if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute):
        return (n.func.attr == "get" and bool(n.args) and isinstance(n.args[0], ast.Constant)
                and n.args[0].value == "event") or (n.func.attr == "isin" and _reads_the_kind(n.func.value))
    return (isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant) and n.slice.value == "event") \
        or (isinstance(n, ast.Attribute) and n.attr == "event")


def test_no_reader_compares_an_event_kind_with_a_string_literal():
    import ast

    kinds = {k.value for k in EventKind}
    literal = []
    for rel, tree in _product_trees():
        for n in ast.walk(tree):
            reads = (isinstance(n, ast.Compare) and any(_reads_the_kind(x) for x in [n.left, *n.comparators])) \
                or (isinstance(n, ast.Call) and _reads_the_kind(n))
            if reads:
                literal += [f"{rel}:{c.lineno} {c.value!r}" for c in ast.walk(n)
                            if isinstance(c, ast.Constant) and c.value in kinds]
    assert literal == []


def test_every_event_kind_is_emitted_somewhere():
    """A kind in the vocabulary that nothing names is a dead row of the documentation."""
    import ast

    named = {n.attr for rel, tree in _product_trees() if rel != Path("launch/kinds.py") for n in ast.walk(tree)
             if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "EventKind"}
    assert sorted(k.name for k in EventKind if k.name not in named) == []
