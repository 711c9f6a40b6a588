"""Every command the README and docs/ show runs as written, and every output line they quote is still printed.

The extraction rules, which the docs follow (docs/README.md says them too):

- every line of a fenced ```bash block is a command (a trailing ``\\`` joins the next line); lines that start with
  ``#`` are comments, and so is a trailing ``  # ...`` after a command;
- a command whose trailing comment says ``not run by tests: <why>`` is not run; a comment line
  ``# not run by tests: <why>`` at the top of a block marks the whole block; the few rules in ``NOT_RUN`` below
  (installing, running the tests themselves, placeholders such as ``<jobid>``) do the same, each with its reason;
- a command must exit 0, unless its trailing comment says ``exit N`` (e.g. ``# refused: exit 2``);
- a ```text block that follows a ```bash block (nothing but blank lines between) quotes output of the block's last
  command: each of its non-empty lines must appear in that command's stdout or stderr (a line ``...`` stands for
  lines left out).

The runnable commands of one page run in order (a later one may read what an earlier one wrote, as for a user who
follows the page), each with ``bash -c``, in a fresh copy of the repository: the files a clone holds (git's tracked
files as they are in the working tree, and new files git does not ignore), nothing planted, with ``PYTHONPATH`` at
that copy. What the commands read is in the repository: ``tests/fixtures/slurm_run`` (a real run recorded on the
local Slurm cluster, complete) and the data files of ``examples/`` (two small JSONL corpora and a BPE
``tokenizer.json``; ``tests/datafiles.py`` writes them, and a test below checks they are still what it writes). The
copy holds no ``runs/``: the test does not train, so a command that reads the quickstart's ``runs/tiny`` carries the
marker. No command may change a tracked file of the copy.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional, Sequence, Tuple

import pytest

from datafiles import write_examples

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
MARK = "not run by tests:"
# (a regular expression searched in the command, the reason it is not run)
NOT_RUN: Sequence[Tuple[str, str]] = (
    (r"\bpip install\b", "installs packages"),
    (r"\bpython -m pytest\b|^pytest\b|\bSLURMTRON_UPDATE_GOLDEN=1 pytest\b", "runs the test suite itself"),
    (r"<[A-Za-z_. |-]+>", "has a placeholder to fill in (<...>)"),
)
SKIP_COPY = {".git", "runs", "__pycache__", ".pytest_cache", "test-artifacts", "wheels", ".hypothesis", "report",
             "gpu-results"}
TIMEOUT_S = 180  # a login-side command takes 1-3 s; a command that trains would pass this and needs its marker


@dataclass
class Command:
    doc: str  # path relative to the repository
    line: int  # 1-based line of the command's first line
    text: str  # the command, continuation lines joined
    comment: str = ""  # its trailing comment
    skip: Optional[str] = None  # why it is not run
    block: int = 0  # 1-based line of its block's opening fence
    expect_rc: int = 0
    expect_lines: List[str] = field(default_factory=list)

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"


def _split_comment(line: str) -> Tuple[str, str]:
    """``cmd  # comment`` -> (cmd, comment); a ``#`` inside quotes or ``$(...)`` does not start a comment."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1] in " \t"):
            return line[:i].rstrip(), line[i + 1:].strip()
    return line.rstrip(), ""


def extract(markdown: str, doc: str) -> List[Command]:
    """Every command of the ```bash blocks of one markdown text, with what the docs say it must do."""
    lines = markdown.splitlines()
    commands: List[Command] = []
    i = 0
    while i < len(lines):
        if lines[i].strip() != "```bash":
            i += 1
            continue
        start, i = i + 1, i + 1
        block: List[Command] = []
        block_skip: Optional[str] = None
        pending: Optional[Command] = None
        while i < len(lines) and lines[i].strip() != "```":
            raw = lines[i]
            if pending is None and raw.lstrip().startswith("#"):
                if MARK in raw and not block and block_skip is None and i == start:
                    block_skip = raw.split(MARK, 1)[1].strip() or "(no reason given)"
                i += 1
                continue
            if not raw.strip():
                i += 1
                continue
            cmd, comment = _split_comment(raw)
            if pending is None:
                pending = Command(doc, i + 1, "", block=start)
            cmd = cmd.strip()
            if cmd.endswith("\\"):
                pending.text += cmd[:-1].rstrip() + " "
                pending.comment = " ".join(x for x in (pending.comment, comment) if x)
                i += 1
                continue
            pending.text = (pending.text + cmd).strip()
            pending.comment = " ".join(x for x in (pending.comment, comment) if x)
            block.append(pending)
            pending = None
            i += 1
        i += 1  # the closing fence
        for c in block:
            if MARK in c.comment:
                c.skip = c.comment.split(MARK, 1)[1].strip() or "(no reason given)"
            elif block_skip is not None:
                c.skip = block_skip
            else:
                c.skip = next((why for pattern, why in NOT_RUN if re.search(pattern, c.text)), None)
            m = re.search(r"\bexits? (\d+)\b", c.comment)
            c.expect_rc = int(m.group(1)) if m else 0
        # a ```text block right after: output of the block's last command
        j = i
        while j < len(lines) and not lines[j].strip():
            j += 1
        if block and j < len(lines) and lines[j].strip() == "```text":
            j += 1
            while j < len(lines) and lines[j].strip() != "```":
                quoted = lines[j].strip()
                if quoted and quoted != "...":
                    block[-1].expect_lines.append(quoted)
                j += 1
            i = j + 1
        commands.extend(block)
    return commands


def all_commands() -> List[Command]:
    return [c for path in DOCS for c in extract(path.read_text(encoding="utf-8"), str(path.relative_to(REPO)))]


def clone_files(new: bool = True) -> List[str]:
    """The files a clone of the repository holds, with the changes not committed yet: git's tracked files and, with
    ``new``, the new files git does not ignore (a module not added yet); without git, every file but ``SKIP_COPY``'s."""
    try:
        others = ["--others", "--exclude-standard"] if new else []
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", *others], cwd=REPO, capture_output=True,
                                check=True).stdout.decode().split("\0")
    except (OSError, subprocess.CalledProcessError):
        return [str(p.relative_to(REPO)) for p in REPO.rglob("*")
                if not p.is_dir() and not SKIP_COPY.intersection(p.relative_to(REPO).parts) and p.suffix != ".pyc"]
    return [f for f in listed if f and os.path.lexists(REPO / f)]


def prepare(root: Path) -> Path:
    """A fresh copy of the repository, nothing added; returns its root."""
    for name in clone_files():
        dest = root / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, dest, follow_symlinks=False)
    return root


def snapshot(root: Path) -> dict:
    """Size and modification time of every file of the repository (tracked by git) in the copy at ``root``."""
    return {name: ((root / name).lstat().st_size, (root / name).lstat().st_mtime_ns) if os.path.lexists(root / name)
            else None for name in clone_files(new=False)}


def run(command: Command, root: Path) -> List[str]:
    """Run one command in ``root``; returns the problems (empty: it does what the docs say)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SLURMTRON_TEST_"))}
    env["PYTHONPATH"] = str(root)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    try:
        proc = subprocess.run(["bash", "-c", command.text], cwd=root, env=env, capture_output=True, text=True,
                              timeout=TIMEOUT_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return [f"still running after {TIMEOUT_S} s: does it train or submit? Then mark it "
                f"`# {MARK} <why>`"]
    out = proc.stdout + proc.stderr
    problems = []
    if proc.returncode != command.expect_rc:
        problems.append(f"exit {proc.returncode}, the docs say {command.expect_rc}")
    problems += [f"quoted output line not printed: {line!r}" for line in command.expect_lines if line not in out]
    if problems:
        problems.append("output (last 3000 characters):\n" + out[-3000:])
    return problems


COMMANDS = all_commands()
RUNNABLE = [c for c in COMMANDS if c.skip is None]
# the runnable commands of one page run one after another in one copy (a later one may read what an earlier one
# wrote, as for a user who follows the page); the test is named by the page
PAGES: List[List[Command]] = []
for _c in RUNNABLE:
    if PAGES and PAGES[-1][-1].doc == _c.doc:
        PAGES[-1].append(_c)
    else:
        PAGES.append([_c])


# Documented behaviour the product does not have yet, each with the change that brings it (an entry is removed
# when that change lands; non-strict, so the change's own merge is not blocked by this list)
KNOWN_GAPS = {
}


def _param(page: List[Command]) -> Any:
    gap = next((why for key, why in KNOWN_GAPS.items() for c in page if key in c.text), None)
    marks = [pytest.mark.xfail(reason=gap, strict=False)] if gap else []
    return pytest.param(page, id=page[0].doc, marks=marks)


@pytest.mark.parametrize("page", [_param(p) for p in PAGES])
def test_documented_commands_do_what_the_docs_say(page: List[Command], tmp_path: Path) -> None:
    root = prepare(tmp_path / "repo")
    before = snapshot(root)
    for command in page:
        problems = run(command, root)
        assert not problems, f"{command.id}: {command.text}\n" + "\n".join(problems)
    after = snapshot(root)
    changed = sorted(name for name, stat in before.items() if after[name] != stat)
    assert not changed, f"{page[0].doc}: its commands changed or removed files of the repository: {changed}"


def test_the_example_files_are_what_datafiles_writes(tmp_path: Path) -> None:
    """``examples/`` ships the data files the docs read; ``tests/datafiles.py`` is their one recipe."""
    written = write_examples(tmp_path)
    shipped = sorted(p.name for p in (REPO / "examples").iterdir() if p.suffix in (".jsonl", ".json"))
    assert shipped == sorted(p.name for p in written)
    for path in written:
        assert (REPO / "examples" / path.name).read_bytes() == path.read_bytes(), (
            f"examples/{path.name} is not what tests/datafiles.py writes: python tests/datafiles.py examples")


def test_every_command_not_run_says_why() -> None:
    assert COMMANDS and RUNNABLE, "no command found in the docs"
    for c in COMMANDS:
        if c.skip is not None:
            assert len(c.skip) >= 5, f"{c.id}: {c.text}: say why it is not run"


def test_the_quickstart_commands_agree_with_ci_everywhere() -> None:
    """The README's two commands are the quickstart page's, and the second is exactly what .ci/run runs."""
    ci = (REPO / ".ci" / "run").read_text().strip().splitlines()[-1]
    readme = [c.text for c in COMMANDS if c.doc == "README.md" and "pip install -e '.[" in c.text]
    quick = [c.text for c in COMMANDS if c.doc == "docs/quickstart.md" and "pip install -e '.[" in c.text]
    assert len(readme) == 2 and readme[1] == ci, (readme, ci)
    assert quick == readme, (quick, readme)


# ---- the checker itself must fail on a broken example ---------------------------------------------

BROKEN = '''
Some prose.

```bash
python launch/pretrain.py cluster=lustre model=30b parallelism.tp=8 dry_run=true   # refused: exit 2
```

```text
refused: 7 problem(s); nothing was submitted
```

```bash
python launch/plan.py model=70b cluster=lustre plan.fromat=json
python launch/status.py runs/llama70b   # not run by tests: shown for the marker
```
'''


def test_extraction_reads_markers_exit_codes_and_quoted_lines() -> None:
    cmds = extract(BROKEN, "broken.md")
    assert [c.line for c in cmds] == [5, 13, 14]
    assert cmds[0].expect_rc == 2 and cmds[0].expect_lines == ["refused: 7 problem(s); nothing was submitted"]
    assert cmds[1].expect_rc == 0 and cmds[1].skip is None and cmds[1].text.endswith("plan.fromat=json")
    assert cmds[2].skip == "shown for the marker"
    joined = extract("```bash\n# not run by tests: a whole block\npython a.py \\\n    --x 1   # exit 3\n"
                     "python b.py\n```\n", "b.md")
    assert [(c.text, c.expect_rc, c.skip) for c in joined] == [("python a.py --x 1", 3, "a whole block"),
                                                                ("python b.py", 0, "a whole block")]


def test_a_wrong_quoted_line_or_a_misspelled_option_fails(tmp_path: Path) -> None:
    root = prepare(tmp_path / "repo")
    wrong_count, misspelled, _ = extract(BROKEN, "broken.md")
    problems = run(wrong_count, root)
    assert any("quoted output line not printed: 'refused: 7 problem(s)" in p for p in problems), problems
    assert not any(p.startswith("exit ") for p in problems), problems  # the refusal itself still exits 2
    problems = run(misspelled, root)
    assert problems and problems[0].startswith("exit ") and "the docs say 0" in problems[0], problems


# ---- links between the pages ---------------------------------------------------------------------

def _anchors(markdown: str) -> set:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    out, fenced = set(), False
    for line in markdown.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            out.add(re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-"))
    return out


def test_every_relative_link_and_anchor_resolves() -> None:
    broken = []
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                broken.append(f"{path.relative_to(REPO)}: {target}: no such file")
            elif anchor and (dest.suffix != ".md" or anchor not in _anchors(dest.read_text(encoding="utf-8"))):
                broken.append(f"{path.relative_to(REPO)}: {target}: no such heading")
    assert not broken, "\n".join(broken)
