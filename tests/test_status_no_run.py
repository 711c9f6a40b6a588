"""``status.py`` answers "no such run" without the log analysis: pandas and matplotlib are imported only once there
is a run to read (a fresh interpreter each, so nothing another test imported counts)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PROBE = """
import json, sys
from launch import status
rc = status.main(sys.argv[1:])
print(json.dumps({"rc": rc, "loaded": sorted(m for m in ("pandas", "matplotlib") if m in sys.modules)}))
"""


def _status(*args: str) -> tuple[dict, str]:
    env = {**os.environ, "PATH": str(Path(sys.executable).parent)}  # no squeue/sacct: Slurm is never asked
    p = subprocess.run([sys.executable, "-c", PROBE, *args], cwd=REPO, capture_output=True, text=True, timeout=120,
                       env=env)
    return json.loads(p.stdout.strip().splitlines()[-1]), p.stderr


@pytest.mark.parametrize("how", ["dir", "name"])
def test_no_such_run_imports_no_pandas(tmp_path, how):
    args = [str(tmp_path / "nonesuch")] if how == "dir" else [f"cluster.run_root={tmp_path}", "run.name=nonesuch"]
    got, err = _status(*args)
    assert got == {"rc": 2, "loaded": []}, err
    assert err.startswith("status: no run") and "nonesuch" in err


def test_a_run_to_read_loads_the_analysis(tmp_path):
    """The probe can see an import: a real run directory brings pandas in."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(REPO / "tests" / "fixtures" / "slurm_run", run)
    got, err = _status(str(run))
    assert got["rc"] == 0 and "pandas" in got["loaded"], err


@pytest.mark.parametrize("args,fragment", [
    (["--watch", "abc"], "--watch 'abc' is not a refresh period in seconds"),
    (["--watch", "-1"], "--watch '-1' is not a refresh period in seconds"),
    (["--watch=nan"], "--watch 'nan' is not a refresh period in seconds"),
    (["--lines", "x"], "--lines 'x' is not a count of log lines"),
])
def test_a_bad_watch_or_lines_value_is_one_line_not_a_second_run(tmp_path, args, fragment):
    proc = subprocess.run([sys.executable, str(REPO / "launch" / "status.py"), str(tmp_path), *args],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [f"status: {fragment} (a number > 0, e.g. --watch 30)"
                                        if "watch" in fragment else f"status: {fragment} (0 or more)"]


def test_a_reader_that_leaves_early_is_no_traceback():
    """`status.py RUN | head`: the pipe closes before status writes; it ends quietly, exit 0."""
    proc = subprocess.Popen([sys.executable, str(REPO / "launch" / "status.py"), str(REPO / "tests" / "fixtures" /
                                                                                      "slurm_run")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # before it has imported anything: its first write meets a closed pipe
    _out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and b"Traceback" not in err and b"BrokenPipeError" not in err
