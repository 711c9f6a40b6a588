"""A chain of slices never ends without a word, on the real local Slurm cluster: the first slice's start-up is
made (test hook) to outlast its 3-minute slice, so the time-limit warning arrives before any step; rank 0
requeues at once without saving, and the next slice trains the run to the end. Without that, the slice would
end TIMEOUT, which ``--requeue`` does not requeue: the run would stop silently."""
from __future__ import annotations

from pathlib import Path

import pytest

from slurm_cluster import Cluster
from test_slurm_e2e import ITERS, finish, states, submit

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(900)]


def test_a_slice_whose_start_up_outlasts_the_slice_requeues_and_the_chain_continues(slurm_cluster: Cluster,
                                                                                  tmp_path: Path) -> None:
    slow_first = ("cluster.setup=['[ -n \"$SLURM_RESTART_COUNT\" ] || "
                  "export SLURMTRON_TEST_STARTUP_SLEEP_S=400']")  # longer than the 180 s slice
    run = finish(slurm_cluster, submit(slurm_cluster, tmp_path / "slowstart", "parallelism=tp2",
                                       "run.time_limit_min=3", "training.signal_lead_time_s=30", slow_first),
                 timeout=600)
    assert states(run) == ["REQUEUED", "COMPLETED"], run.logs()
    first = [e for e in run.events() if e.get("restart_count") == 0]
    assert not [e for e in first if e["event"] == "iteration"], "the slow slice must not have trained"
    [stop] = [e for e in first if e["event"] == "stop"]
    assert stop["reason"] == "time_limit" and stop["saved"] is False, stop
    assert "during start-up, before the first step" in stop["evidence"]
    assert [e["method"] for e in first if e["event"] == "requeue"][:1] == ["scontrol"]
    assert run.step_reached() == ITERS and [e["reason"] for e in run.of("exit")][-1] == "completed", run.logs()
