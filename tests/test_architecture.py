"""docs/ARCHITECTURE.md lists every module of each package, and marks the contract test_imports.py enforces."""
from __future__ import annotations

import re
from pathlib import Path

from test_imports import CONTRACT, PRODUCT

REPO = Path(__file__).resolve().parent.parent
ROW = re.compile(r"^\| `((?:launch|train|recovery|analysis)/[\w/]+\.py)` \| ([^|]+) \|", re.M)


def listed() -> dict[str, str]:
    """``{module path: runs}`` of the section "Every module"."""
    text = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    section = text.split("## Every module", 1)[1].split("\n## ", 1)[0]
    return {m.group(1): m.group(2).strip() for m in ROW.finditer(section)}


def on_disk() -> set[str]:
    return {p.relative_to(REPO).as_posix() for pkg in PRODUCT for p in (REPO / pkg).rglob("*.py")
            if p.name != "__init__.py"}


def test_every_module_is_listed_and_every_listed_module_exists():
    doc, disk = set(listed()), on_disk()
    assert sorted(disk - doc) == [], "add these modules to docs/ARCHITECTURE.md (## Every module)"
    assert sorted(doc - disk) == [], "these modules are gone: remove them from docs/ARCHITECTURE.md"


def test_the_contract_is_marked_as_test_imports_enforces_it():
    marked = {path[:-3].replace("/", ".") for path, runs in listed().items() if runs == "contract"}
    assert marked == set(CONTRACT)


def test_the_list_parser_sees_a_missing_module(tmp_path):
    rows = "| `launch/paths.py` | contract | x |\n| `train/gone.py` | rank | y |\n"
    found = {m.group(1) for m in ROW.finditer(rows)}
    assert found == {"launch/paths.py", "train/gone.py"} and "train/gone.py" not in on_disk()
