"""The arrows between the packages point one way (docs/ARCHITECTURE.md), read from the source.

Every ``import`` statement counts, including the ones inside functions (a lazy import is still a
dependency). The login path's runtime imports (no torch) are checked in test_pretrain_cli.py.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PRODUCT = ("launch", "train", "recovery", "analysis")
# The contract both machine sides read: schema, composition, run paths, vocabulary rule, rank environment,
# tokenizer, problem records and the preflight's verdict rules. Torch-free; imports only itself.
CONTRACT = ("launch.config", "launch.compose", "launch.paths", "launch.vocab", "launch.dist_env", "launch.blend",
            "launch.tokenizer", "launch.problems", "launch.preflight_checks", "launch.kinds", "launch.hardware_faults",
            "launch.hf_config", "launch.watchdog_config", "launch.nan_guard_config", "launch.stragglers_config",
            "launch.planner_config", "launch.local_ckpt_config", "launch.attempts")
# What recovery/ and analysis/ may read of the contract: the run's files, the vocabulary of causes and event
# kinds, the hardware-fault table (the ranks write what the report reads, in the same words), and what an
# attempt is (every reader counts them the same way).
RECORDS = ("launch.paths", "launch.kinds", "launch.hardware_faults", "launch.attempts")
TEST_MODULES = ("tests", "conftest", "faults", "fake_slurm", "slurm_cluster", "trainutil")
EXCEPTIONS: set = set()  # known exceptions, each with its reason; a new one must be added here on purpose


def module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    """Absolute module names ``path`` imports (``from a import b`` counts as ``a.b``: b may be a module)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def modules(package: str) -> dict[str, set[str]]:
    return {module_name(p): imports_of(p) for p in sorted((REPO / package).rglob("*.py"))}


def within(name: str, allowed: tuple[str, ...]) -> bool:
    return any(name == a or name.startswith(a + ".") for a in allowed)


def ours(name: str) -> bool:
    return name.split(".")[0] in PRODUCT + TEST_MODULES


def violations(package: str, allowed: tuple[str, ...]) -> list[str]:
    """Imports of our own modules from ``package`` outside ``package`` itself and ``allowed``."""
    out = []
    for mod, names in modules(package).items():
        for name in sorted(names):
            line = f"{mod} imports {name}"
            if ours(name) and name not in PRODUCT and not within(name, (package,) + allowed) \
                    and line not in EXCEPTIONS:
                out.append(line)
    return out


def test_the_compute_node_package_imports_only_the_contract_from_launch():
    assert violations("train", CONTRACT + ("recovery", "analysis")) == []


def test_recovery_imports_no_login_code():
    assert violations("recovery", RECORDS) == []


def test_analysis_depends_only_on_itself_the_run_paths_and_the_vocabulary():
    assert violations("analysis", RECORDS) == []


def test_the_contract_imports_only_the_contract():
    contract = {m: names for m, names in modules("launch").items() if within(m, CONTRACT)}
    assert sorted(contract) == sorted(CONTRACT)  # the list names real modules
    bad = [f"{m} imports {n}" for m, names in contract.items() for n in sorted(names)
           if ours(n) and n != "launch" and not within(n, CONTRACT)]
    assert bad == []


def test_the_login_tools_never_import_the_compute_node_package():
    assert violations("launch", ("recovery", "analysis")) == []


def test_nothing_in_the_product_imports_the_test_harnesses():
    bad = [f"{m} imports {n}" for pkg in PRODUCT for m, names in modules(pkg).items() for n in sorted(names)
           if n.split(".")[0] in TEST_MODULES]
    assert bad == []


def test_the_checker_sees_an_offending_import(tmp_path):
    bad = tmp_path / "x.py"
    bad.write_text("def f():\n    from launch.pretrain import main\n    import faults\n")
    names = imports_of(bad)
    assert "launch.pretrain.main" in names and not within("launch.pretrain.main", CONTRACT) and ours("faults")


@pytest.mark.parametrize("package", ["launch.config, launch.compose, launch.paths, launch.vocab, launch.dist_env, "
                                     "launch.tokenizer, launch.problems, launch.preflight_checks, launch.kinds, "
                                     "launch.hardware_faults",
                                     "launch.check, launch.planner, launch.render, launch.submit, launch.entry",
                                     "recovery.slurm, recovery.crash, recovery.exclusion, analysis.load"])
def test_the_contract_and_the_login_tools_load_without_torch(package):
    code = (f"import sys, {package}; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron', 'transformer_engine')]; "
            "print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
