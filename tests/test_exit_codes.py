"""The one exit-code table (recovery/exit_codes.py) and everything that reads it: the docs' table, the batch script,
the local launcher's verdict and the crash judgement."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from launch import local, render
from recovery import crash, exit_codes, policy
from recovery.exit_codes import EXIT_CODES

REPO = Path(__file__).resolve().parent.parent
PRODUCT = ("launch", "train", "recovery", "analysis")


def test_the_table_is_consistent_and_its_constants_are_its_rows():
    codes = [e.code for e in EXIT_CODES]
    assert len(set(codes)) == len(codes) and len({e.name for e in EXIT_CODES}) == len(codes)
    constants = {n: v for n, v in vars(exit_codes).items() if n.startswith("EXIT_") and isinstance(v, int)}
    assert constants == {e.name: e.code for e in EXIT_CODES}
    assert all(0 <= c < 256 for c in codes) and all(e.meaning for e in EXIT_CODES)
    reasons = [e.reason for e in EXIT_CODES if e.reason]
    assert len(set(reasons)) == len(reasons)
    assert all(e.final for e in EXIT_CODES if e.reason)  # a stop reason with its own code is a refusal: final


def test_the_policy_re_exports_the_same_values():
    for e in EXIT_CODES:
        assert getattr(policy, e.name) == e.code
    assert policy.FINAL_REASONS == exit_codes.FINAL_REASONS and policy.REFUSAL_CODES == exit_codes.REFUSAL_CODES
    assert exit_codes.EXIT_COMPLETED in exit_codes.FINAL_CODES and exit_codes.EXIT_REQUEUE not in exit_codes.FINAL_CODES
    assert exit_codes.EXIT_CRASH not in exit_codes.FINAL_CODES
    assert exit_codes.code_name(exit_codes.EXIT_RUN_LOCKED) == "run_locked" and exit_codes.code_name(77) == "exit 77"


def test_the_docs_table_is_the_code_table():
    text = (REPO / "docs" / "recovery.md").read_text()
    m = re.search(r"<!-- exit-codes: generated from recovery/exit_codes.py -->\n(.*?)\n<!-- /exit-codes -->", text, re.S)
    assert m, "docs/recovery.md lost its exit-code table markers"
    assert m.group(1) == exit_codes.markdown_table(), (
        "docs/recovery.md's exit-code table differs from recovery/exit_codes.py; paste exit_codes.markdown_table()")


def test_no_product_module_redefines_an_exit_code_or_restates_a_range():
    """Every EXIT_* of the worker is defined in recovery/exit_codes.py only; no docstring says "3-15 are final"."""
    worker_names = {e.name for e in EXIT_CODES}
    bad = []
    for pkg in PRODUCT:
        for path in sorted((REPO / pkg).rglob("*.py")):
            if path == REPO / "recovery" / "exit_codes.py":
                continue
            text = path.read_text()
            for name in re.findall(r"^(EXIT_\w+)\s*=", text, re.M):
                if name in worker_names:
                    bad.append(f"{path.relative_to(REPO)} defines {name}")
            if re.search(r"\b\d+\s*[-–]\s*\d+ are final", text):
                bad.append(f"{path.relative_to(REPO)} restates a range of final codes")
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        if re.search(r"\b\d+\s*[-–]\s*\d+ are final|final code \(\d+\s*[-–]\s*\d+\)", path.read_text()):
            bad.append(f"{path.relative_to(REPO)} restates a range of final codes")
    assert bad == []


def test_the_batch_script_tests_the_requeue_code_of_the_table():
    text = render.piece("srun", {"srun_args": "", "python": "python3", "exclusion_flags": "", "requeue_on_crash": "1",
                                 **exit_codes.shell_values()})
    assert f"[ $? -eq {exit_codes.EXIT_REQUEUE} ] && exit {exit_codes.EXIT_REQUEUE}" in text
    assert "{{" not in text
    for reason, code in exit_codes.FINAL_REASONS.items():
        assert f"{reason} {code}" in text


@pytest.mark.parametrize("entry", [e for e in EXIT_CODES if e.code not in (0, exit_codes.EXIT_REQUEUE)],
                         ids=lambda e: e.name)
def test_the_launcher_and_the_crash_judgement_read_finality_from_the_table(entry, tmp_path):
    """A final code ends the local chain and is never requeued by recovery.crash; a non-final one is relaunched."""
    assert (entry.code in local.TERMINAL) == entry.final
    if entry.final:  # a refusal of one rank outranks another rank's crash
        assert local.Attempt(attempt=0, codes=[exit_codes.EXIT_CRASH, entry.code]).code == entry.code
        (tmp_path / "events.jsonl").write_text("")
        code, why = crash.requeue_after_crash(tmp_path, {"SLURM_JOB_ID": "7"}, runner=_never, rc=entry.code)
        assert code == 0 and "final" in why
    if entry.reason:
        assert local.final_words(entry.code) == f"stopped: {entry.reason} (exit {entry.code})"


def _never(*args, **kwargs):
    raise AssertionError("a final code must not reach Slurm")


def test_the_worker_docstring_names_every_code_as_the_table_does():
    """train/worker.py's summary of the codes is copied from the table: every code once, each with its meaning."""
    import re

    import train.worker

    doc = train.worker.__doc__
    said = doc[doc.index("From it:"):doc.index("A hang")]
    codes = [int(c) for c in re.findall(r"(\d+) [a-zA-Z]", said)]
    assert codes == [e.code for e in exit_codes.EXIT_CODES]
    for e in exit_codes.EXIT_CODES:
        if e.reason:  # the reason's words follow its code: "17 the budget", "18 out of GPU memory" (oom)
            words = {"oom": "out of GPU memory", "nan": "NaN"}.get(e.reason, e.reason.split("_")[0])
            assert re.search(rf"\b{e.code} [^,]*{re.escape(words)}", said), (e.code, e.reason)
