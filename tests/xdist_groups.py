"""Which tests must run on the same pytest-xdist worker (``-n 2 --dist loadgroup``, set in pyproject.toml).

A fixture wider than one test (module, class, package or session scope) is set up once per worker process: two
tests that share one, sent to two workers, would set it up twice (a second reference training run, a second
Slurm cluster). So every set of tests that shares such a fixture of ours, and every ``slurm``-marked test (they
share the one cluster of the session), becomes one xdist group: it runs on one worker, in collection order.
Every other test goes to whichever worker is free. With ``-n 0`` (one process) the marks change nothing.
"""
from __future__ import annotations

import inspect
from pathlib import Path
from typing import Dict, Iterable, List, Sequence

import pytest

SLURM_GROUP = "slurm_cluster"  # the session fixture the slurm-marked tests share


def shared_keys(item: pytest.Item) -> List[str]:
    """What ``item`` shares with other tests: one key per instance of a non-function fixture of ours it uses.

    A session fixture has one instance (its name is the key); a module, class or package fixture has one per
    module here (the module's node id is the key, a little coarser than needed for class scope). Fixtures of
    pytest and its plugins (``tmp_path_factory``, ...) cost nothing to set up twice and are left out.
    """
    keys = [SLURM_GROUP] if item.get_closest_marker("slurm") else []
    infos = getattr(item, "_fixtureinfo", None)
    for name in item.fixturenames:
        defs = infos.name2fixturedefs.get(name) if infos is not None else None
        if not defs or defs[-1].scope == "function" or not ours(defs[-1], item.config.rootpath):
            continue
        keys.append(name if defs[-1].scope == "session" else item.nodeid.split("::")[0])
    return keys


def ours(fixturedef: pytest.FixtureDef, root: Path) -> bool:
    """Whether a fixture is the suite's own (a test module's or a conftest's), not pytest's or a plugin's."""
    if fixturedef.baseid:  # defined in a test module or in a conftest below the root directory
        return True
    try:  # a conftest in the root directory has no baseid either: tell it by its file
        path = Path(inspect.getfile(fixturedef.func)).resolve()
    except TypeError:
        return False
    return root.resolve() in path.parents and not {"site-packages", "dist-packages"} & set(path.parts)


def groups(keys_per_test: Sequence[Iterable[str]]) -> List[str]:
    """Each test's group name ('' for none): tests linked through a shared key, directly or not, get the same
    name (the smallest key of their set), so no shared instance is split over two workers."""
    parent: Dict[str, str] = {}

    def find(k: str) -> str:
        parent.setdefault(k, k)
        while parent[k] != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    def union(a: str, b: str) -> None:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)

    listed = [list(keys) for keys in keys_per_test]
    for keys in listed:
        for k in keys[1:]:
            union(keys[0], k)
    return [find(keys[0]) if keys else "" for keys in listed]


def mark_groups(items: Sequence[pytest.Item]) -> None:
    """Add the xdist_group mark that :func:`groups` gives each item (xdist reads it after collection).

    A test that carries its own xdist_group mark is left as its author grouped it.
    """
    free = [i for i in items if i.get_closest_marker("xdist_group") is None]
    for item, name in zip(free, groups([shared_keys(i) for i in free])):
        if name:
            item.add_marker(pytest.mark.xdist_group(name))
    if items and getattr(items[0].config.option, "loadgroup", False) and not _renames_take(items[0]):
        for item in items:
            _suffix_group(item)


def _group_name(item: pytest.Item) -> str:
    """The group pytest-xdist's loadgroup gives ``item`` (its xdist_group marks' names joined), '' for none."""
    names = {str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in item.iter_markers("xdist_group")}
    return "_".join(sorted(names))


def _renames_take(item: pytest.Item) -> bool:
    """Whether this pytest reads a node id from ``Node._nodeid``, where pytest-xdist (3.8) writes ``ID@group``.

    The loadgroup scheduler reads each test's group from that suffix of its node id. Since pytest 9.2 a node
    keeps its id as a structured ``Node._id`` and xdist's assignment reaches nothing: every group is dropped
    without a word, and a shared fixture is set up once per worker (tests/test_xdist_groups.py).
    """
    before = item.nodeid
    item._nodeid = before + "@probe"
    took = item.nodeid == before + "@probe"
    item._nodeid = before
    if not took:
        del item.__dict__["_nodeid"]
    return took


def _suffix_group(item: pytest.Item) -> None:
    """Give ``item`` the node id ``ID@group`` that xdist's loadgroup means to, where pytest ignores xdist's own
    renaming (pytest 9.2's ``Node._id``); constraints/cpu.txt still pins the pytest these groups were tested with."""
    name = _group_name(item)
    if name:
        item._id = type(item._id).parse(f"{item.nodeid}@{name}")
