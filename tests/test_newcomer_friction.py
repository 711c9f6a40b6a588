"""Small frictions a newcomer meets on the way: a sweep's dry run that buries its table, a memory verdict worded two
ways, the ``auto`` table's reasons, the preprocess progress line (the export's are in tests/test_hf_training.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from launch import plan, pretrain
from launch.compose import compose_job
from launch.planner import estimate, memory_problems, memory_warnings
from launch.planner.layouts import choose_layout
from launch.planner.memory import memory_verdict
from launch.summary import summary

REPO = Path(__file__).resolve().parent.parent
PRETRAIN = REPO / "launch" / "pretrain.py"
EDGE = ["cluster=lustre", "model=70b", "parallelism.tp=4", "parallelism.pp=2"]  # 79.7 of 80 GiB per GPU


def test_one_memory_rule_words_every_table_alike():
    assert memory_verdict(68.0, 80) == "fits" and memory_verdict(68.1, 80) == "inside the error band"
    assert memory_verdict(79.7, 80) == "inside the error band" and memory_verdict(112.0, 80) == "inside the error band"
    assert memory_verdict(112.1, 80) == "does not fit"
    job = compose_job(EDGE)
    est = estimate(job)
    assert 79 < est.memory_gb_per_gpu < 80 and est.memory_verdict == "inside the error band"
    assert pretrain.fit_status(job, "ok (dry run)") == "may not fit (dry run)"  # the sweep's table
    assert "MAY NOT FIT" in summary(job, Path("/nonexistent"))  # the single run's summary
    assert "MAY NOT FIT" in plan.format_estimate(job, est)  # plan.py
    assert memory_warnings(job) and not memory_problems(job)  # the check warns, does not refuse
    roomy = compose_job(["cluster=lustre", "model=70b", "parallelism.tp=8", "parallelism.pp=2"])
    assert estimate(roomy).memory_gb_per_gpu < 68 and pretrain.fit_status(roomy, "ok (dry run)") == "ok (dry run)"
    assert not memory_warnings(roomy) and "(fits; estimate)" in summary(roomy, Path("/nonexistent"))


def test_a_dry_run_sweep_prints_a_line_per_member_then_the_table(tmp_path):
    proc = subprocess.run([sys.executable, str(PRETRAIN), "-m", "cluster=lustre", "model=70b", "parallelism.tp=2,4,8",
                           "parallelism.pp=1,2", "dry_run=true", f"cluster.run_root={tmp_path / 'runs'}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout == ""  # no batch script per member
    before, table = proc.stderr.split(" 6 member(s)\n", 1)
    assert len(before.splitlines()) < 6 * 6, before  # a few lines per member
    lines = {ln.split()[2]: ln for ln in before.splitlines() if ln.startswith("sweep member ") and "script:" in ln}
    assert sorted(lines) == ["70b_tp4-pp2", "70b_tp8-pp1", "70b_tp8-pp2"], before
    edge = lines["70b_tp4-pp2"]
    assert ": may not fit (dry run), 79.7 GiB/GPU" in edge, edge
    command = edge.split("script: ", 1)[1]
    assert command.startswith("python launch/pretrain.py ") and "parallelism.tp=4 parallelism.pp=2" in command
    row = next(ln for ln in table.splitlines() if ln.startswith("70b_tp4-pp2 "))
    assert " may not fit (dry run) " in row, row
    # the member's command prints its whole script
    alone = subprocess.run([sys.executable, str(PRETRAIN), *command.split()[2:], f"cluster.run_root={tmp_path / 'r'}"],
                           cwd=tmp_path, capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert alone.returncode == 0 and alone.stdout.startswith("#!/bin/bash"), alone.stderr[-2000:]
    assert "MAY NOT FIT" in alone.stderr


def _rows(table: str) -> list[list[str]]:
    """The ranked rows of the auto table: rank, layout, dp, mem, step, MFU, then the reason's words."""
    return [ln.split() for ln in table.splitlines()[2:] if ln[:4].strip().isdigit()]


def test_the_auto_table_explains_a_tie_in_step_time_by_what_broke_it():
    ties = 0
    for model in (["model=7b"], ["model=405b", "cluster.nodes=2048"], ["model=tiny"]):
        job = compose_job(["cluster=lustre", "parallelism=auto", "plan.top=8", *model])
        _, table = choose_layout(job)
        rows = _rows(table)
        best = rows[0]
        assert best[6:] == ["best"], table
        for row in rows[1:]:
            why = " ".join(row[6:])
            if row[4] == best[4]:  # equal step time as shown
                ties += 1
                assert "s/step" not in why, (row, table)
                assert why.startswith(("same MFU, more memory per GPU", "same step time to the ms, MFU",
                                       "ties the winner")), why
                if why.startswith("same MFU"):  # the claim is true: more memory than the winner
                    mine, theirs = why.split("(", 1)[1].split(" GiB")[0].split(" vs ")
                    assert float(mine) > float(theirs) and float(row[3]) >= float(best[3]), why
            else:  # a real difference: the net one is the one quoted first
                net = float(why.split(" s/step")[0].lstrip("+"))
                assert abs(net - (float(row[4]) - float(best[4]))) <= 0.0011 or "less elsewhere" not in why, why
    assert ties >= 3  # the tables above do have ties (7b: tp1-pp1 vs tp1-pp1-cp2)


EXPORT_CHECK = """
import json, os, sys, torch
from pathlib import Path
from launch.compose import compose_job
from launch.tokenizer import ByteTokenizer
from train import export, hf_bridge, megatron_model
out = Path(sys.argv[1])
with hf_bridge.one_process():
    job = hf_bridge.single_rank_job(compose_job(sys.argv[2:]))
    config = megatron_model.to_transformer_config(job.model, job.parallelism, job.training)
    padded = export.job_padded_vocab(job)
    chunk = megatron_model.build_model_chunks(job.model, config, 1, use_te=False, device=torch.device("cpu"))[0]
    megatron_model.init_layout_independent([chunk], job.model, 1234)
    with torch.no_grad():  # make the padded rows win every argmax, as a run's could: the export must not offer them
        chunk.embedding.word_embeddings.weight[job.model.vocab_size:] *= 50
    tokens = export.probe_tokens(job.model)
    reference = hf_bridge.megatron_logits(chunk.eval(), tokens)
    state = hf_bridge.full_state(chunk, job.model)
full, padding = hf_bridge.trim_vocab(state, job.model.vocab_size)
hf = export.hf_model(job, hf_bridge.to_hf_for(full, job.model), "float32")
hf.save_pretrained(str(out))
line = export.save_vocab_padding(padding, out, job.model.vocab_size, padded, torch.float32)
export.readable_by_group(out, 0o022)
from transformers import AutoModelForCausalLM
hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()  # as the export checks it
with torch.no_grad():
    got = hf(tokens).logits.float()
gen = hf.generate(tokens[:1, :4], max_new_tokens=16, do_sample=False, pad_token_id=ByteTokenizer().eod)[0].tolist()
back = hf_bridge.read_full(out, job.model, padded)  # what training.init_from gives the ranks
print(json.dumps({"line": line, "padded": padded, "config_vocab": json.loads((out / "config.json").read_text())["vocab_size"],
                  "modes": {p.name: oct(p.stat().st_mode & 0o777) for p in out.iterdir()}, "generated": gen,
                  "megatron_argmax_max": int(reference.argmax(-1).max()),
                  "round_trip": sorted(back) == sorted(state) and all(torch.equal(back[k], state[k]) for k in back),
                  **export.compare_logits(reference, got)}))
"""


def test_the_export_trims_the_padded_vocabulary_and_an_import_pads_it_back(tmp_path):
    """One process, the tiny model's freshly drawn weights (training is in tests/test_hf_training.py): the HF model
    has the tokenizer's 257 ids even when a padded row would win the argmax, its logits equal Megatron's over those
    ids, its files are 0644 under umask 022, and reading it back restores every padded row exactly."""
    from launch.tokenizer import ByteTokenizer

    out = tmp_path / "hf"
    out.mkdir()
    tiny = ["cluster=local", "model=tiny", "parallelism=tp1", "cluster.gpus_per_node=1"]
    proc = subprocess.run([sys.executable, "-c", EXPORT_CHECK, str(out), *tiny], cwd=REPO, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    tok = ByteTokenizer()
    assert got["config_vocab"] == tok.vocab_size == 257 and got["padded"] == 320
    assert got["line"].startswith("vocabulary: trimmed to the tokenizer's 257 ids") and "the 63 padding rows" in got["line"]
    assert got["megatron_argmax_max"] >= 257  # Megatron's own model would pick a padded id here
    assert got["generated"] and all(i in tok.inv_vocab for i in got["generated"]), got["generated"]
    assert got["greedy_equal"] and got["max_abs_diff"] <= 1e-4, got
    assert got["round_trip"]
    assert set(got["modes"].values()) == {"0o644"} and "slurmtron_vocab_padding.safetensors" in got["modes"], got


def test_the_export_files_take_the_mode_open_gives(tmp_path):
    from train.export import readable_by_group

    for umask, mode in ((0o022, 0o644), (0o002, 0o664), (0o027, 0o640), (0o077, 0o600)):
        f = tmp_path / "model.safetensors"
        f.write_bytes(b"x")
        f.chmod(0o600)  # as the safetensors writer leaves it
        readable_by_group(tmp_path, umask)
        assert f.stat().st_mode & 0o777 == mode, (oct(umask), oct(f.stat().st_mode))


def test_an_init_from_config_with_the_tokenizers_vocabulary_is_accepted():
    from launch.hf_config import llama_fields, shape_problems

    model = compose_job(["model=tiny"]).model
    cfg = {**llama_fields(model, 257), "model_type": "llama"}
    assert shape_problems(model, 320, cfg) == []  # an export's: padded back at the ranks
    assert shape_problems(model, 320, {**cfg, "vocab_size": 320}) == []  # an older, padded export
    (bad,) = shape_problems(model, 320, {**cfg, "vocab_size": 300})
    assert "neither model.vocab_size 257 nor the padded vocabulary 320" in bad.arithmetic


def test_the_preprocess_progress_counts_what_was_written(tmp_path):
    """With a pool the input is read far ahead of the writing: each progress line's documents, tokens and percent
    are those written so far (the old line said '1 documents (100%)' before writing 300)."""
    import re

    from launch.preprocess import preprocess

    src = tmp_path / "c.jsonl"
    docs = [f"document {i} " + "word " * (i % 40) for i in range(300)]
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    ends, pos = [], 0
    for raw in src.read_bytes().splitlines(keepends=True):
        pos += len(raw)
        ends.append(pos)
    lines: list = []
    ticks = iter(range(0, 100_000, 3))  # 3 s per reading: a line for about every other document
    assert preprocess(src, str(tmp_path / "out"), "byte", workers=2, progress=lines.append,
                      clock=lambda: float(next(ticks)))[0] == 300
    counted = [ln for ln in lines if " wrote " in ln]
    assert len(counted) > 100, lines[:3]
    tokens = 0
    written = [len(d.encode()) + 1 for d in docs]
    for ln in counted:
        m = re.search(r"wrote ([\d,]+) documents?, ([\d,]+) tokens, .* \((\d+)%\)", ln)
        assert m, ln
        n, toks, pct = int(m[1].replace(",", "")), int(m[2].replace(",", "")), int(m[3])
        assert toks == sum(written[:n]) >= tokens, ln
        assert pct == 100 * ends[n - 1] // ends[-1], (ln, ends[n - 1], ends[-1])
        assert (" 1 document," in ln) == (n == 1), ln
        assert (pct == 100) == (n == 300), ln
        tokens = toks
