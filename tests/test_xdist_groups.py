"""Tests that share a fixture wider than one test run on one pytest-xdist worker (tests/xdist_groups.py)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from xdist_groups import SLURM_GROUP, groups, shared_keys

pytest_plugins = ["pytester"]

TESTS = Path(__file__).resolve().parent

SET_UP = """
import os
import pytest

def set_up(name):  # one line per set-up, in a file all workers append to
    with open(os.environ["SETUPS_FILE"], "a") as f:
        f.write(f"{name} {os.environ.get('PYTEST_XDIST_WORKER')}\\n")
"""

CONFTEST = SET_UP + """
from xdist_groups import mark_groups

def pytest_configure(config):
    config.addinivalue_line("markers", "slurm: the real cluster")

@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    mark_groups(items)

@pytest.fixture(scope="session")
def cluster():
    set_up("cluster")
"""

MODULE_A = SET_UP + """
@pytest.fixture(scope="module")
def ref():
    set_up("ref")

def test_ref_1(ref): pass
def test_ref_2(ref): pass
def test_ref_and_cluster(ref, cluster): pass
def test_cluster(cluster): pass
def test_plain(tmp_path): pass
@pytest.mark.slurm
def test_marked(): pass
"""

MODULE_B = """
def test_cluster_elsewhere(cluster): pass
""" + "".join(f"def test_filler_{i}(): pass\n" for i in range(12))


def test_groups_join_tests_linked_through_any_shared_key() -> None:
    keys = [["mod_a"], ["mod_a", "cluster"], ["cluster"], [], ["mod_b"], ["cluster", "mod_c"], ["mod_c"]]
    assert groups(keys) == ["cluster", "cluster", "cluster", "", "mod_b", "cluster", "cluster"]


def test_keys_name_module_and_session_fixtures_of_the_suite_but_not_pytests_own(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_a=MODULE_A, test_b=MODULE_B)
    items, _ = pytester.inline_genitems("test_a.py")
    keys = {item.name: sorted(shared_keys(item)) for item in items}
    assert keys == {"test_ref_1": ["test_a.py"], "test_ref_2": ["test_a.py"],
                    "test_ref_and_cluster": ["cluster", "test_a.py"], "test_cluster": ["cluster"],
                    "test_plain": [], "test_marked": [SLURM_GROUP]}


def test_each_shared_fixture_is_set_up_once_over_two_workers(pytester: pytest.Pytester,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("xdist")
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_a=MODULE_A, test_b=MODULE_B)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    setups = pytester.path / "setups.txt"
    monkeypatch.setenv("SETUPS_FILE", str(setups))
    res = pytester.runpytest_subprocess("-n", "2", "--dist", "loadgroup", "-p", "no:cacheprovider", "-v")
    res.assert_outcomes(passed=6 + 13)
    workers = {line.split()[0] for line in res.outlines if line.startswith("[gw")}
    assert workers == {"[gw0]", "[gw1]"}, res.outlines  # both workers ran tests
    # split over two workers, each fixture would have been set up twice
    assert sorted(line.split()[0] for line in setups.read_text().splitlines()) == ["cluster", "ref"], setups.read_text()
