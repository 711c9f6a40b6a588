"""``pip install -e '.[train]'`` installs every third-party module a training rank imports.

The README's first command installs the base dependencies and the ``[train]`` extra, then trains. A module a
rank imports that neither declares is only there by luck (another extra, a transitive dependency, the machine):
on a fresh machine the rank dies at its first import. So the imports are read from the source with ``ast``,
starting at ``train/worker.py`` (what every Slurm task runs) and following every import of the project's own
packages, including the ones inside functions: a lazy import counts, since the rank may call it on any run.

An import the rank needs only for an option it may never use is listed in :data:`OPTIONAL`, each with the
extra that installs it and why: those must stay guarded (inside a function or a ``try``), since at module level
they would fail every rank without them. Any other third-party import must come from a distribution named in
pyproject's base dependencies or ``[train]``.
"""
from __future__ import annotations

import ast
import functools
import importlib.metadata
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Set, Tuple

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parent.parent
PRODUCT = ("launch", "train", "recovery", "analysis")
ENTRY = "train.worker"  # python -m train.worker RUN_DIR: every rank

# Imports of a submodule that need a distribution of their own (the top-level package does not bring it).
SUBMODULE_DISTS = {"torch.utils.tensorboard": "tensorboard"}
# Calls that import a module named by a string literal: function name -> index of that argument.
DYNAMIC_IMPORTS = {"import_module": 0,  # importlib.import_module("x")
                   "_import": 1}        # launch/tokenizer.py: _import(spec, "module", fix)

# (importing module, imported name) -> (the extra that installs it, or None: not pip-installed by us; why optional)
OPTIONAL: Dict[Tuple[str, str], Tuple[Optional[str], str]] = {
    ("train.tracking", "tensorboard"): ("tracking", "tracking.tensorboard=true only; without it one WARNING line "
                                                    "and training goes on (docs/monitoring.md)"),
    ("train.tracking", "wandb"): ("tracking", "tracking.wandb=true only; without it one WARNING line and training "
                                              "goes on"),
    ("launch.tokenizer", "sentencepiece"): ("data", "data.tokenizer=sentencepiece:<model> only; refused with one "
                                                    "line naming the package when missing"),
    ("launch.tokenizer", "tiktoken"): ("data", "data.tokenizer=tiktoken:<file> only; refused with one line naming "
                                               "the package when missing"),
    ("train.megatron_model", "transformer_engine"): (None, "the TE layer spec and tp_comm_overlap when the image "
                                                           "ships TransformerEngine; probed in a try, the local "
                                                           "spec otherwise (never pip-installed by slurmtron)"),
    ("train.versions", "transformer_engine"): (None, "the probe that refuses fp8 and tp_comm_overlap without "
                                                     "TransformerEngine (a try; a missing TE is the answer)"),
}


@dataclass(frozen=True)
class Use:
    """One third-party import: where, what (the top-level module, or a :data:`SUBMODULE_DISTS` key) and whether
    it is guarded (inside a function or the body of a ``try``), i.e. not run by merely importing the module."""
    module: str
    name: str
    line: int
    guarded: bool


def _path(module: str) -> Optional[Path]:
    base = REPO.joinpath(*module.split("."))
    for p in (base.with_suffix(".py"), base / "__init__.py"):
        if p.is_file():
            return p
    return None


def _type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and isinstance(test, (ast.Name, ast.Attribute)) and \
        (getattr(test, "id", None) or getattr(test, "attr", None)) == "TYPE_CHECKING"


def _imports(path: Path, module: str) -> Iterable[Tuple[str, int, bool]]:
    """(absolute module name, line, guarded) for every import statement and literal dynamic import of ``path``;
    ``from a import b`` also yields ``a.b`` (b may be a module). ``if TYPE_CHECKING:`` blocks never run."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]

    def visit(node: ast.AST, guarded: bool) -> Iterable[Tuple[str, int, bool]]:
        if _type_checking(node):
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno, guarded
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package[:len(package) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            yield base, node.lineno, guarded
            for alias in node.names:
                yield f"{base}.{alias.name}", node.lineno, guarded
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            at = DYNAMIC_IMPORTS.get(name)
            if at is not None and len(node.args) > at and isinstance(node.args[at], ast.Constant) \
                    and isinstance(node.args[at].value, str):
                yield node.args[at].value, node.lineno, guarded
        inner = guarded or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        if isinstance(node, ast.Try):
            for child in node.body:
                yield from visit(child, True)
            for child in [*node.handlers, *node.orelse, *node.finalbody]:
                yield from visit(child, inner)
            return
        for child in ast.iter_child_nodes(node):
            yield from visit(child, inner)

    yield from visit(ast.parse(path.read_text(), str(path)), False)


def rank_imports(entry: str = ENTRY) -> Tuple[Set[str], List[Use]]:
    """(the project's modules reachable from ``entry``, the third-party imports among them)."""
    seen: Set[str] = set()
    todo = [entry]
    uses: List[Use] = []
    while todo:
        module = todo.pop()
        path = _path(module)
        if module in seen or path is None:
            continue
        seen.add(module)
        for name, line, guarded in _imports(path, module):
            top = name.split(".")[0]
            if top in PRODUCT:
                parts = name.split(".")
                todo.extend(".".join(parts[:i]) for i in range(1, len(parts) + 1))
            elif top not in sys.stdlib_module_names and top != "__future__":
                sub = next((s for s in SUBMODULE_DISTS if name == s or name.startswith(s + ".")), None)
                uses.append(Use(module, sub and SUBMODULE_DISTS[sub] or top, line, guarded))
    return seen, sorted(set(uses), key=lambda u: (u.module, u.line, u.name))


def declared() -> Tuple[Set[str], Dict[str, Set[str]]]:
    """(canonical names of the base dependencies and [train], {extra: canonical names})."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    names = lambda reqs: {canonicalize_name(Requirement(r).name) for r in reqs}  # noqa: E731
    extras = {e: names(reqs) for e, reqs in project["optional-dependencies"].items()}
    return names(project["dependencies"]) | extras["train"], extras


@functools.lru_cache(maxsize=1)
def _providers() -> Dict[str, List[str]]:
    return importlib.metadata.packages_distributions()  # reads every installed distribution's files: once


def distribution(name: str) -> Optional[str]:
    """The installed distribution providing the import ``name`` (a :data:`SUBMODULE_DISTS` value is one)."""
    if name in SUBMODULE_DISTS.values():
        return canonicalize_name(name)
    dists = _providers().get(name)
    return canonicalize_name(dists[0]) if dists else None


def uncovered(uses: Iterable[Use], covered: Set[str]) -> List[str]:
    """Each import that neither the base dependencies nor [train] install and :data:`OPTIONAL` does not excuse."""
    out = []
    for use in uses:
        if (use.module, use.name) in OPTIONAL:
            continue
        dist = distribution(use.name)
        if dist not in covered:
            out.append(f"{use.module}:{use.line} imports {use.name} "
                       f"({dist or 'no installed distribution provides it'}): add it to [train], or to OPTIONAL "
                       f"with its reason if only an option needs it")
    return out


def test_the_walk_reaches_the_ranks_modules_and_their_imports() -> None:
    seen, uses = rank_imports()
    assert {"train.worker", "train.local_ckpt", "train.local_shard", "train.tracking", "launch.tokenizer",
            "recovery.resume", "train.versions"} <= seen
    names = {u.name for u in uses}
    assert {"torch", "megatron", "safetensors", "psutil", "omegaconf", "tokenizers", "wandb"} <= names, names


def test_base_and_the_train_extra_install_every_module_a_rank_imports() -> None:
    covered, _ = declared()
    _, uses = rank_imports()
    assert uncovered(uses, covered) == []


def test_the_check_names_a_rank_import_the_train_extra_lacks() -> None:
    covered, _ = declared()
    _, uses = rank_imports()
    missing = uncovered(uses, covered - {"safetensors"})
    assert missing and all("imports safetensors (safetensors)" in m for m in missing), missing
    assert any(m.startswith("train.local_ckpt:") for m in missing), missing


def test_each_optional_import_is_guarded_current_and_in_its_extra() -> None:
    _, extras = declared()
    _, uses = rank_imports()
    found = {(u.module, u.name) for u in uses}
    assert sorted(set(OPTIONAL) - found) == [], "OPTIONAL lists imports the rank no longer has"
    unguarded = [f"{u.module}:{u.line} {u.name}" for u in uses if (u.module, u.name) in OPTIONAL and not u.guarded]
    assert unguarded == [], "an optional import at module level fails every rank without it"
    for (module, name), (extra, why) in OPTIONAL.items():
        assert why and (extra is None or canonicalize_name(name) in extras[extra] or
                        distribution(name) in extras[extra]), (module, name, extra)
