"""Shared fixtures. Keep this file small: session fixtures and generic helpers only."""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Iterator, List

import pytest

from slurm_cluster import Cluster, missing_binaries, start, stop
from xdist_groups import mark_groups


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[Cluster]:
    """A real local Slurm cluster (see tests/slurm_cluster.py), started once per session.

    Only tests that request it (the ``slurm``-marked ones) start it, so a plain unit-test run
    never touches Slurm. Its state lives in a short temporary directory (unix socket paths
    must stay under 108 characters); set SLURMTRON_KEEP_CLUSTER=1 to keep it for debugging.
    """
    if missing_binaries() and os.geteuid() != 0:
        pytest.skip(f"Slurm is not installed ({missing_binaries()}) and installing it needs root")
    root = Path(tempfile.mkdtemp(prefix="stc-"))
    cluster = start(root)
    try:
        yield cluster
    finally:
        stop(root)
        if not os.environ.get("SLURMTRON_KEEP_CLUSTER"):
            shutil.rmtree(root, ignore_errors=True)


@pytest.hookimpl(tryfirst=True)  # before xdist's worker reads the marks
def pytest_collection_modifyitems(items: List[pytest.Item]) -> None:
    """Tests that share a module or session fixture (or the Slurm cluster) run on one xdist worker."""
    mark_groups(items)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """On a failed test that used the cluster, attach the daemon logs so CI failures are diagnosable."""
    outcome = yield
    rep = outcome.get_result()
    cluster = getattr(item, "funcargs", {}).get("slurm_cluster")
    if rep.failed and isinstance(cluster, Cluster):
        rep.sections.append(("slurm daemon logs", cluster.diagnostics()))


@pytest.fixture
def small_disk(tmp_path):
    """A real tmpfs of a given size (root only); yields a mounter: ``small_disk(size_bytes) -> Path``."""
    mounts = []

    def mount(size_bytes: int) -> Path:
        where = tmp_path / f"disk{len(mounts)}"
        where.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(where)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
        mounts.append(where)
        return where

    yield mount
    for m in mounts:
        subprocess.run(["umount", "-l", str(m)], check=False)
