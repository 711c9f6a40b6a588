"""Hostile input through every entry point: one table, one line, the documented exit code, nothing touched.

Each row of ``CASES`` is (entry point, arguments, exit code, a fragment of the one line). The entry points are
the login tools' importable ``main`` functions with their input injected (``argv``, a composed config, ``out``/
``err`` streams, a Slurm runner that fails the test if it is ever called), the same way the other CLI tests
drive them. For every row: exactly one line on stderr, no traceback, the exit code, and every file under the
run root byte-identical before and after (a refused command writes nothing). Add a row for each new entry
point or input. Login side only: no torch is imported here.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from launch.compose import CONFIG_DIR, compose_job, job_to_yaml
from launch.config import register_configs

REPO = Path(__file__).resolve().parent.parent
FIXTURE = REPO / "tests" / "fixtures" / "slurm_run"
LONG = "r" * 300  # 300 bytes: over NAME_MAX
WIDE = "\u00e9" * 130  # 130 characters, 260 bytes in UTF-8: over NAME_MAX by bytes only
XSS = "<img src=x onerror=alert(1)>"


def no_slurm(argv, **_kw):
    raise AssertionError(f"a refused command may not call Slurm: {argv}")


def _cfg(overrides):
    register_configs()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def _captured(fn) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = fn(out, err)
    return rc, out.getvalue(), err.getvalue()


def run_pretrain(args):
    from launch import pretrain

    return _captured(lambda out, err: pretrain.main(_cfg(args), runner=no_slurm, out=out, err=err))


def run_plan(args):
    from launch import plan

    return _captured(lambda out, err: plan.main(_cfg(args), out=lambda text: print(text, file=out)))


def run_preflight(args):
    from launch import preflight

    def no_ranks(*a, **_kw):
        raise AssertionError(f"a refused preflight may not start ranks: {a}")

    return _captured(lambda out, err: preflight.main(args, runner=no_slurm, popen=no_ranks, out=out, err=err,
                                                     env={}))


def run_status(args):
    from launch import status

    return _captured(lambda out, err: status.main(args, runner=no_slurm, out=out, err=err))


def run_stop(args):
    from launch import stop

    return _captured(lambda out, err: stop.main(args, out=out, err=err))


def run_report(args):
    from analysis import report

    return _captured(lambda out, err: report.main(args))


def run_resume(args):
    from recovery import resume

    return _captured(lambda out, err: resume.main(args))


ENTRY = {"pretrain": run_pretrain, "plan": run_plan, "preflight": run_preflight, "status": run_status,
         "stop": run_stop, "report": run_report, "resume": run_resume}
HYDRA = ("pretrain", "plan", "preflight", "status", "stop")  # the entry points that name a run by overrides
BASE = ["cluster=local", "model=tiny"]


def _named(name: str, frag: str) -> list[tuple]:
    """A run name every entry point that takes run.name refuses with the same line and exit code 2."""
    return [(e, ["run.name=" + name], 2, frag) for e in HYDRA]


CASES = (
    _named("../other", "contains '/'")
    + _named("..", "contains '..'")
    + _named(LONG, "300 bytes (300 characters) > NAME_MAX 255")
    + _named(f"'{WIDE}'", "260 bytes (130 characters) > NAME_MAX 255")
    + _named("a%j", "contains '%'")
    + _named("'a\x1bb'", "control character '\\x1b'")
    + [(e, ["cluster.run_root="], 2, "cluster.run_root = '' is empty") for e in HYDRA]
    + [(e, ["cluster.run_root=/"], 2, "is the filesystem root") for e in HYDRA]
    + [
        ("status", ["{root}/binary"], 3, "cannot be read as a run's config.yaml (UnicodeDecodeError"),
        ("status", ["{root}/empty"], 3, "cannot be read as a run's config.yaml (MissingMandatoryValue"),
        ("status", ["{root}/malformed"], 3, "cannot be read as a run's config.yaml (ParserError"),
        ("status", ["{root}/a_list"], 3, "cannot be read as a run's config.yaml (ConfigTypeError"),
        ("status", ["cluster.run_root={root}", "binary_sweep"], 3, "is not text (byte"),
        ("status", ["cluster.run_root={root}", "odd_sweep"], 3, "holds no member record (3 line(s)"),
        ("status", ["cluster.run_root={root}", "..sweep"], 2, "sweep id: the name = '..sweep' contains '..'"),
        ("status", ["cluster.run_root={root}", "../good"], 2, "no run at"),
        ("stop", ["{root}/stopdir"], 4, "stop.json is a directory, not a stop request; nothing was written"),
        ("stop", ["{root}/nothing_here"], 2, "has no config.yaml"),
        ("stop", ["{root}/good", "at_step=0"], 2, "at_step: '0' is not a step number"),
        ("stop", ["{root}/a%j"], 2, "contains '%'"),
        ("report", ["{root}/good", "--out", "{out}", "--window", "0"], 2, "--window 0: the rolling window"),
        ("report", ["{root}/good", "--out", "{out}", "--window", "-3"], 2, "--window -3"),
        ("report", ["{root}/good", "--out", "{out}", "--threshold", "0"], 2, "--threshold 0.0"),
        ("report", ["{root}/good", "--out", "{out}", "--num-gpus", "0"], 2, "--num-gpus 0"),
        ("report", ["{root}/a\x1bb", "--out", "{out}"], 2, "control character '\\x1b'"),
        ("resume", ["{root}/a%j/checkpoints"], 2, "contains '%'"),
        ("resume", ["{root}/good/../nothing_here"], 2, "nothing_here does not exist"),
    ]
)


def _id(case) -> str:
    entry, args, _rc, _frag = case
    text = " ".join(a.replace("\x1b", "ESC") for a in args)
    return f"{entry}:{text[:40]}{'...' if len(text) > 40 else ''}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """A run root with a good run, a broken one for each kind of bad file, and two odd sweep registries."""
    root = tmp_path_factory.mktemp("hostile") / "runs"
    good = root / "good"
    (good / "logs").mkdir(parents=True)
    (good / "config.yaml").write_text(job_to_yaml(compose_job(BASE + ["run.name=good", f"cluster.run_root={root}"])))
    (good / "events.jsonl").write_text(json.dumps({"event": "job_start", "rank": 0, "time": 1.0}) + "\n")
    (good / "logs" / "local_0_rank0.out").write_text("iteration 1 of the good run\n")
    for name, data in (("binary", bytes(range(256)) * 4), ("empty", b""), ("malformed", b"model: [\n"),
                       ("a_list", b"- 1\n- 2\n")):
        (root / name).mkdir()
        (root / name / "config.yaml").write_bytes(data)
    shutil.copytree(good, root / "stopdir")
    (root / "stopdir" / "stop.json").mkdir()
    (root / "sweeps").mkdir()
    (root / "sweeps" / "binary_sweep.jsonl").write_bytes(b"\xff\xfe" + bytes(range(200)))
    (root / "sweeps" / "odd_sweep.jsonl").write_text('[1]\n"x"\n{"run_name": 5, "status": "submitted"}\n')
    return root


def _tree(d: Path) -> dict:
    return {str(p.relative_to(d)): (p.read_bytes() if p.is_file() else "dir") for p in sorted(d.rglob("*"))}


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_hostile_input_is_one_line_its_exit_code_and_touches_nothing(case, runs, tmp_path):
    entry, args, code, fragment = case
    out_dir = tmp_path / "report"
    args = [a.replace("{root}", str(runs)).replace("{out}", str(out_dir)) for a in args]
    if entry in HYDRA and any("=" in a for a in args):  # overrides: composed like pretrain.py composes them
        own_root = any(a.startswith("cluster.run_root=") for a in args)
        args = BASE + ([] if own_root else [f"cluster.run_root={runs}"]) + args
    before = _tree(runs)
    rc, _out, err = ENTRY[entry](args)
    lines = err.splitlines()
    assert "Traceback" not in err, err
    assert rc == code and len(lines) == 1, (rc, err)
    assert fragment in lines[0], lines[0]
    assert _tree(runs) == before, "a refused command changed the run root"
    assert not out_dir.exists(), "a refused report wrote its output directory"


def test_every_entry_point_is_in_the_table():
    assert {c[0] for c in CASES} == set(ENTRY)
    for entry in HYDRA:  # the run-directory rule, the same on every entry point that names a run
        assert {c[3] for c in CASES if c[0] == entry} >= {"contains '/'", "contains '%'", "contains '..'"}


def test_one_rule_one_line_everywhere(runs):
    """The same bad name gives the same sentence on every entry point that takes run.name."""
    said = set()
    for entry in HYDRA:
        _rc, _out, err = ENTRY[entry](BASE + [f"cluster.run_root={runs}", "run.name=../good"])
        said.add(err.split("run.name = ", 1)[1].split(";")[0])
    assert said == {"'../good' contains '/' (a run is one directory under cluster.run_root)"}


def test_explicit_run_directories_are_resolved_and_shown(runs):
    rc, out, err = run_stop([f"{runs}/stopdir/../good"])
    try:
        assert rc == 0, err
        assert f"stop requested for {runs / 'good'} " in out  # resolved: no '..' in what the user reads
    finally:
        (runs / "good" / "stop.json").unlink()
    rc, out, err = run_resume([f"{runs}/good/../good/checkpoints"])
    assert str(runs / "good" / "checkpoints") in out + err and "/../" not in out + err, (rc, out, err)
    rc, out, _err = run_status([f"{runs}/stopdir/../good"])
    assert rc == 0 and f"({runs / 'good'})" in out.splitlines()[0]


def test_status_survives_an_event_with_an_infinite_step(runs, tmp_path):
    run = tmp_path / "inf"
    shutil.copytree(runs / "good", run)
    with open(run / "events.jsonl", "a") as fh:
        fh.write('{"event": "iteration", "step": 1e400, "time": 2.0}\n{"event": "iteration", "step": 3, "time": 3}\n')
    rc, out, err = run_status([str(run)])
    assert rc == 0 and err == "", err
    assert "step 3 / " in out
    assert "WARNING: 1 iteration event(s) in the event log skipped: a step that is not a whole number (e.g. 'inf')" \
        in out
    assert "log analysis failed" not in out


@pytest.mark.parametrize("args, fragment", [
    (["run.name=../escaped"], "run.name = '../escaped' contains '/'"),
    (["-m", "cluster.run_root=", "run.name=a,b"], "cluster.run_root = '' is empty"),  # before Hydra's sweep dir
])
def test_pretrain_cli_refuses_in_one_line(tmp_path, args, fragment):
    """The real command line too (Hydra's own entry glue): one line, exit 2, nothing created."""
    proc = subprocess.run([sys.executable, str(REPO / "launch" / "pretrain.py"), "cluster=local", "model=tiny",
                           f"cluster.run_root={tmp_path / 'runs'}", *args],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1 and "Traceback" not in proc.stderr
    assert fragment in proc.stderr, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []


# ---- report.md / report.html / CSV: what a run or a log says is shown, never run ----------------------------

def _hostile_run(root: Path, name: str) -> Path:
    run = root / name
    shutil.copytree(FIXTURE, run)
    ev = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines() if line.strip()]
    job = next(e for e in ev if e.get("job_id"))
    ev.append({**{k: job[k] for k in ("job_id", "restart_count") if k in job}, "event": "hang", "time": 2e9,
               "step": 3, "deadline": "<script>alert('deadline')</script>", "arithmetic": "[x](javascript:alert(1))",
               "suspects": [{"rank": 1, "host": "<img src=x onerror=alert('host')>"}],
               "stacks": "<script>alert('stacks')</script>"})
    ev.append({**{k: job[k] for k in ("job_id", "restart_count") if k in job}, "event": "nan", "time": 2e9 + 1,
               "step": 4, "loss": "<b>nan</b>", "grad_norm": "=1+1", "policy": "<script>x</script>"})
    ev.append({"event": "iteration", "time": 2e9 + 2, "step": 1e400, "restart_count": 1e400})  # json: inf
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in ev))
    return run


def test_report_md_escapes_run_names_and_event_fields(tmp_path, capsys):
    from analysis import report

    runs = tmp_path / "runs"
    _hostile_run(runs, XSS)
    _hostile_run(runs, "=HYPERLINK(1)")
    _hostile_run(runs, "a$\\frac{$b")  # matplotlib's math mode in a plot title: shown as text, not parsed
    out = tmp_path / "out"
    assert report.main([str(runs), "--out", str(out)]) == 0, capsys.readouterr().err
    md = (out / "report.md").read_text()
    for raw in ("<img", "<script", "<b>", "](javascript:"):
        assert raw not in md, raw
    assert "&lt;img src=x onerror=alert\\(1\\)&gt;" in md  # shown, as text
    assert "&lt;script&gt;alert\\('deadline'\\)&lt;/script&gt;" in md
    assert "onerror=alert\\('host'\\)" in md
    page = (out / "report.html").read_text()
    for raw in ("<img src=x", "<script>", "<b>nan"):
        assert raw not in page, raw
    assert "&lt;img src=x onerror=alert(1)&gt;" in page
    import pandas as pd

    its = pd.read_csv(out / "iterations.csv")
    assert set(its["run"]) == {XSS, "'=HYPERLINK(1)", "a$\\frac{$b"}  # the formula is text; the other name needs nothing
    assert its["iteration"].dtype.kind == "i" and its["lm_loss"].dtype.kind == "f"  # numbers stay numbers
    intr = pd.read_csv(out / "interruptions.csv")
    assert not any(str(v).startswith(("=", "+", "@")) for v in intr.astype(str).to_numpy().ravel())


def test_markdown_and_csv_cells():
    from analysis.document import csv_cell, md

    assert md("a | b\n# c") == "a \\| b \\# c"  # a cell cannot split the table or start a heading
    assert md("x & <y>") == "x &amp; &lt;y&gt;"
    assert [csv_cell(v) for v in ("=SUM(A1)", "+cmd", "-2+3", "@x", "\tx", "\rx", "-1.5", "+3", "ok", 7, -2.0)] \
        == ["'=SUM(A1)", "'+cmd", "'-2+3", "'@x", "'\tx", "'\rx", "-1.5", "+3", "ok", 7, -2.0]


# ---- preprocess and the planner's rates ---------------------------------------------------------------------

def _preprocess(args) -> tuple[int, str]:
    from launch import preprocess

    rc, _out, err = _captured(lambda out, err: preprocess.main(args))
    assert "Traceback" not in err
    return rc, err


def test_preprocess_refuses_an_occupied_or_impossible_output_before_any_work(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("hello\n")
    (tmp_path / "occupied.bin").mkdir()
    (tmp_path / "afile").write_text("x")
    for prefix, fragment in ((tmp_path / "occupied", "occupied.bin is occupied by a directory"),
                             (tmp_path / "afile" / "c", "afile is not a directory")):
        before = sorted(p.name for p in tmp_path.iterdir())
        rc, err = _preprocess(["--input", str(corpus), "--output-prefix", str(prefix), "--workers", "1"])
        assert rc == 2 and len(err.splitlines()) == 1 and fragment in err and err.rstrip().endswith("nothing written")
        assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes into read-only directories")
def test_preprocess_refuses_a_read_only_output_directory(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("hello\n")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        rc, err = _preprocess(["--input", str(corpus), "--output-prefix", str(ro / "c"), "--workers", "1"])
    finally:
        ro.chmod(0o755)
    assert rc == 2 and len(err.splitlines()) == 1 and "is not writable" in err
    assert list(ro.iterdir()) == []


def test_a_line_that_is_not_utf8_is_named_by_file_and_line(tmp_path):
    from launch.preprocess import iter_documents

    bad = tmp_path / "corpus.txt"
    bad.write_bytes(b"fine\nalso fine\ncaf\xe9 au lait\n")
    with pytest.raises(ValueError) as exc:
        list(iter_documents(bad))
    assert str(exc.value).startswith(f"{bad}:3: byte 4 of the line (b'\\xe9') is not UTF-8; fix: convert")


@pytest.mark.parametrize("field", ["fs_write_bandwidth_gbs", "ib_bandwidth_gbs", "nvlink_bandwidth_gbs",
                                   "node_mtbf_hours"])
@pytest.mark.parametrize("value", [0.0, -1.0])
def test_a_zero_or_negative_rate_is_its_field_not_an_absurd_lead_time(field, value):
    from dataclasses import replace

    from launch.check import check

    job = compose_job(["cluster=lustre", "model=7b", "run.dir=/nonexistent/runs/t"])
    problems = check(replace(job, cluster=replace(job.cluster, **{field: value})))
    assert [p.field for p in problems] == [f"cluster.{field}"]
    assert "set cluster." in problems[0].fix and "signal_lead_time_s" not in str(problems[0])
