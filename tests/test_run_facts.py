"""Run-file names and checkpoint naming live only in launch/paths.py; small JSON files have one atomic writer."""
from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from launch import paths
from launch.paths import RunPaths
from recovery import commit
from recovery.storage import LocalStorage, atomic_write_json

REPO = Path(__file__).resolve().parent.parent
PRODUCT = ("launch", "train", "recovery", "analysis")
# Names of run files (with a dot: no ordinary word) and checkpoint states, defined once in launch/paths.py.
RUN_FILES = sorted({v for k, v in vars(paths).items() if k.isupper() and isinstance(v, str) and "." in v
                    and k not in ("HANG_SUMMARY", "STAGING_SUFFIX", "ASIDE_SUFFIX", "DELETE_SUFFIX")})
# Writers that rename by hand, each with its reason; any other is a second atomic writer.
OWN_RENAMES = {
    "recovery/storage.py": "the storage seam itself",
    "launch/preprocess.py": "the .bin/.idx data files, written in chunks",
    "recovery/lock.py": "moves a stale lock aside",
    "train/export.py": "renames the staged export directory into place",
}


def _strings(path: Path) -> list[tuple[int, str]]:
    """Every string constant of ``path`` that is not a docstring, with its line."""
    tree = ast.parse(path.read_text(), str(path))
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs]


def _product_files():
    for pkg in PRODUCT:
        yield from sorted((REPO / pkg).rglob("*.py"))


def test_the_run_files_are_named_once():
    assert {"config.yaml", "events.jsonl", "options.json", "progress.json", "stop.json"} <= set(RUN_FILES)
    bad = []
    for path in _product_files():
        if path == REPO / "launch" / "paths.py":
            continue
        rel = path.relative_to(REPO).as_posix()
        for line, text in _strings(path):
            if text in RUN_FILES or text in (paths.LATEST, paths.CHECKPOINT_PREFIX) or "07d" in text:
                bad.append(f"{rel}:{line} {text!r}")
    assert bad == [], "use launch.paths (RunPaths, checkpoint_name) instead of a literal"


def test_checkpoint_names_round_trip_through_the_one_format(tmp_path):
    rp = RunPaths.of(tmp_path)
    assert rp.checkpoint(10).name == commit.dir_name(10) == paths.checkpoint_name(10) == "iter_0000010"
    assert rp.staging(10) == commit.staging_path(rp.checkpoints, 10)
    assert rp.latest == rp.checkpoints / commit.LATEST
    for suffix in ("", paths.STAGING_SUFFIX, paths.ASIDE_SUFFIX, paths.DELETE_SUFFIX):
        assert commit.parse_dir_name(paths.checkpoint_name(1234567) + suffix) == (1234567, suffix)
    for name in ("iter_001", "iter_0000010.bak", "latest", paths.QUARANTINE, "xiter_0000010"):
        assert paths.parse_checkpoint_name(name) is None


class Recording(LocalStorage):
    def __init__(self, fail_on: str = "") -> None:
        self.ops: list[str] = []
        self.fail_on = fail_on

    def _op(self, name: str) -> None:
        self.ops.append(name)
        if name == self.fail_on:
            raise OSError(5, "injected")

    def write_text(self, path, text):
        super().write_text(path, text)  # writes and fsyncs the file
        self._op("write_text")

    def replace(self, src, dst):
        self._op("replace")
        super().replace(src, dst)

    def fsync_dir(self, path):
        self._op("fsync_dir")
        super().fsync_dir(path)


def test_atomic_write_json_fsyncs_the_file_then_the_directory(tmp_path):
    st = Recording()
    target = tmp_path / "sub" / "progress.json"
    atomic_write_json(target, {"a": [1, 2], "when": Path("x")}, storage=st)
    assert st.ops == ["write_text", "replace", "fsync_dir"]
    assert json.loads(target.read_text()) == {"a": [1, 2], "when": "x"}
    assert sorted(p.name for p in target.parent.iterdir()) == ["progress.json"]  # no temp file left


@pytest.mark.parametrize("fail_on", ["write_text", "replace"])
def test_a_failed_atomic_write_keeps_the_old_file_and_leaves_no_temp(tmp_path, fail_on):
    target = tmp_path / "stop.json"
    atomic_write_json(target, {"old": True})
    with pytest.raises(OSError):
        atomic_write_json(target, {"new": True}, storage=Recording(fail_on))
    assert json.loads(target.read_text()) == {"old": True}
    assert [p.name for p in tmp_path.iterdir()] == ["stop.json"]


def test_there_is_one_atomic_json_writer():
    bad = []
    for path in _product_files():
        rel = path.relative_to(REPO).as_posix()
        if rel in OWN_RENAMES:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    isinstance(node.func.value, ast.Name) and node.func.value.id == "os" and \
                    node.func.attr in ("replace", "rename"):
                bad.append(f"{rel}:{node.lineno} os.{node.func.attr}")
    assert bad == [], "write small JSON files with recovery.storage.atomic_write_json"
