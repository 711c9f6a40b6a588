"""Data blends, tokenizers and the job check's data rules (fast: no training).

The check reads facts of this machine's files (``.bin``/``.idx`` existence, the index's sequence
lengths, the tokenizer); the arithmetic it shows is Megatron-Core's (split rounding, the blending
surplus, the GPT dataset's ``samples * seq + 1`` tokens per pass).
"""
from __future__ import annotations

from pathlib import Path

import pytest
from datafiles import corpus, train_bpe, write_index

from launch import blend
from launch.check import check, notes
from launch.check_data import read_index
from launch.compose import compose_job, job_to_yaml, load_job
from launch.tokenizer import HFTokenizer, TokenizerError, get_tokenizer

TINY = ["cluster=local", "model=tiny", "run.dir=/nonexistent/runs/t", "data=indexed"]


def _two_sources(tmp_path: Path, web=(100,) * 50, code=(100,) * 50) -> tuple:
    return write_index(tmp_path / "web", web), write_index(tmp_path / "code", code, seed=1)


def test_the_list_and_megatron_flat_forms_are_the_same_blend(tmp_path):
    listed = compose_job(TINY + ["data.blend=[{path: web, weight: 0.3}, {path: code, weight: 0.7}]"])
    flat = compose_job(TINY + ["data.blend='0.3 web 0.7 code'"])
    a = blend.train_sources(listed.data, data_root="/data")
    assert a == blend.train_sources(flat.data, data_root="/data")
    assert [(s.path, s.weight, s.field) for s in a] == [("/data/web", 0.3, "data.blend[0]"),
                                                        ("/data/code", 0.7, "data.blend[1]")]
    assert blend.megatron_blend(a) == (["/data/web", "/data/code"], [0.3, 0.7])
    again = load_job_text(tmp_path, listed)  # the run's config.yaml round-trips the list
    assert blend.train_sources(again.data) == blend.train_sources(listed.data)


def load_job_text(tmp_path: Path, job):
    p = tmp_path / "config.yaml"
    p.write_text(job_to_yaml(job))
    return load_job(str(p))


@pytest.mark.parametrize("value, field, words", [
    ("'0.3 web 0.7'", "data.blend", "alternates weight and prefix"),
    ("'web 0.3 code 0.7'", "data.blend[0]", "not a number"),
    ("'0 web 1 code'", "data.blend[0]", "positive"),
    ("'-0.5 web 1 code'", "data.blend[0]", "positive"),
    ("[{path: web, weight: 1}, {prefix: code}]", "data.blend[1]", "{path, weight}"),
])
def test_a_bad_blend_is_one_problem_naming_the_entry(value, field, words):
    problems = check(compose_job(TINY + [f"data.blend={value}"]))
    assert len(problems) == 1 and problems[0].field == field and words in problems[0].message, problems


def test_path_and_blend_together_are_refused():
    (p,) = check(compose_job(TINY + ["data.path=x", "data.blend='1 y 1 z'"]))
    assert p.field == "data.path" and "both" in p.message


def test_every_missing_prefix_file_of_a_blend_is_named(tmp_path):
    web, code = _two_sources(tmp_path)
    Path(f"{code}.bin").unlink()
    job = compose_job(TINY + [f"data.blend='0.3 {web} 0.7 {code}'"])
    (p,) = check(job)
    assert p.field == "data.blend[1]" and p.arithmetic == f"not found: {code}.bin"
    assert check(compose_job(TINY + [f"data.blend='0.3 {web} 0.7 {code}'", "force=true"])) == []


def test_relative_prefixes_are_under_the_data_root(tmp_path):
    _two_sources(tmp_path)
    job = compose_job(TINY + ["data.blend='0.3 web 0.7 code'", f"cluster.data_root={tmp_path}"])
    assert check(job) == []


def test_the_epochs_each_source_repeats_are_shown_with_megatrons_arithmetic(tmp_path):
    # web: 50 sequences of 100 tokens; train split 99% -> round(0.99 * 50) = 50 sequences... use 90,10,0:
    # train = sequences 0..45 of 50 = 4,500 tokens. The run: 20 iters x gbs 8 = 160 samples;
    # web gets ceil(ceil(160 * 0.3) * 1.005) = ceil(48 * 1.005) = 49 samples x 64 + 1 = 3,137 tokens: one pass;
    # code gets ceil(ceil(160 * 0.7) * 1.005) = ceil(112.56) = 113 samples x 64 + 1 = 7,233 tokens: 2 epochs.
    web, code = _two_sources(tmp_path)
    job = compose_job(TINY + [f"data.blend='0.3 {web} 0.7 {code}'", "data.split='90,10,0'",
                              "training.train_iters=20", "training.global_batch_size=8"])
    assert check(job) == []
    lines = [n for n in notes(job) if n.startswith("data.blend")]
    assert lines == [
        "data.blend[0] web (train, weight 0.3): sequences 0..45 of 50 = 4,500 tokens; 49 samples x 64 + 1 = "
        "3,137 tokens: enough for one pass",
        "data.blend[1] code (train, weight 0.7): sequences 0..45 of 50 = 4,500 tokens; 113 samples x 64 + 1 = "
        "7,233 tokens: repeats 2 epochs",
    ]


def test_an_empty_train_or_validation_split_is_refused(tmp_path):
    web, code = _two_sources(tmp_path, code=(100,) * 3)
    # 3 sequences with split 90,10,0: validation = round(0.9 * 3)..round(1.0 * 3) = 3..3, empty
    job = compose_job(TINY + [f"data.blend='0.3 {web} 0.7 {code}'", "data.split='90,10,0'",
                              "training.eval_interval=5"])
    (p,) = check(job)
    assert p.field == "data.blend[1]" and "valid split of code is empty" in p.message
    assert "sequences 3..3 of 3" in p.arithmetic
    valid = write_index(tmp_path / "held_out", (100,) * 4, seed=2)  # a separate validation blend fixes it
    assert check(compose_job(TINY + [f"data.blend='0.3 {web} 0.7 {code}'", f"data.valid_blend='1 {valid}'",
                                     "training.eval_interval=5"])) == []


def test_an_unreadable_index_is_refused(tmp_path):
    prefix = tmp_path / "corpus"
    Path(f"{prefix}.bin").write_bytes(b"x")
    Path(f"{prefix}.idx").write_bytes(b"not an index")
    (p,) = check(compose_job(TINY + [f"data.path={prefix}"]))
    assert p.field == "data.path" and "not a Megatron indexed-dataset index" in p.arithmetic


def test_the_index_reader_reads_what_megatrons_builder_writes(tmp_path):
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(str(tmp_path / "m.bin"), dtype=np.uint16)
    for n in (5, 17, 3):
        builder.add_document(np.arange(n, dtype=np.uint16), [n])
    builder.finalize(str(tmp_path / "m.idx"))
    facts = read_index(str(tmp_path / "m"))
    assert facts.sequences == 3 and [facts.tokens_in(0, 3), facts.tokens_in(1, 2), facts.tokens_in(2, 3)] == [25, 17, 3]
    ours = write_index(tmp_path / "ours", (5, 17, 3))  # the test helper's files are Megatron's format too
    ds = IndexedDataset(str(ours))
    assert list(ds.sequence_lengths) == [5, 17, 3] and list(ds.document_indices) == [0, 1, 2, 3]


# ---- tokenizers ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("bpe")
    texts = [line for line in corpus(tmp / "c.jsonl", docs=200).read_text().splitlines()]
    return train_bpe(tmp / "tokenizer.json", texts, vocab_size=300)


def test_a_hf_tokenizer_gives_its_vocabulary_and_eod(bpe):
    tok = get_tokenizer(f"hf:{bpe}")
    assert isinstance(tok, HFTokenizer) and tok.vocab_size == 300 and tok.eod == 0  # the first special token
    ids = tok.tokenize("the cat sees a bird.")
    assert len(ids) < len("the cat sees a bird.") and tok.detokenize(ids) == "the cat sees a bird."


def test_the_vocab_mismatch_is_refused_before_submission(tmp_path, bpe):
    prefix = write_index(tmp_path / "c", (100,) * 20)
    (p,) = check(compose_job(TINY + [f"data.path={prefix}", f"data.tokenizer=hf:{bpe}"]))
    assert p.field == "model.vocab_size" and p.arithmetic == f"model.vocab_size 257 != hf:{bpe} vocabulary 300 (EOD id 0)"
    assert p.fix.startswith("set model.vocab_size=300")
    assert check(compose_job(TINY + [f"data.path={prefix}", f"data.tokenizer=hf:{bpe}", "model.vocab_size=300"])) == []


def test_a_relative_tokenizer_path_is_under_the_data_root_like_the_prefixes(tmp_path, bpe, monkeypatch):
    import shutil

    from launch.tokenizer import under_root
    from train.data import start_refusal

    root = tmp_path / "datasets"
    write_index(root / "c", (100,) * 20)
    (root / "tok").mkdir()
    shutil.copy(bpe, root / "tok" / "tokenizer.json")
    monkeypatch.chdir(tmp_path)  # not the root: a path relative to the working directory would not be found
    over = TINY + ["data.path=c", "data.tokenizer=hf:tok/tokenizer.json", "model.vocab_size=300"]
    assert check(compose_job(over + [f"cluster.data_root={root}"])) == []
    (p,) = [p for p in check(compose_job(over)) if p.field == "data.tokenizer"]  # no root: the working directory
    assert "does not exist" in p.message  # (where there is no tok/)
    job = compose_job(over + [f"cluster.data_root={root}"])
    assert start_refusal(job.data, job.cluster.data_root) is None  # the ranks read the same file
    assert under_root("byte", str(root)) == "byte"
    assert under_root(f"hf:{bpe}", str(root)) == f"hf:{bpe}"  # absolute: unchanged


@pytest.mark.parametrize("name, words", [
    ("hf:/nonexistent/tokenizer.json", "does not exist"),
    ("gpt2", "expected byte | hf:<tokenizer.json>"),
    ("sentencepiece:", "expected byte"),
])
def test_a_tokenizer_that_cannot_load_is_one_problem(tmp_path, name, words):
    prefix = write_index(tmp_path / "c", (100,) * 20)
    (p,) = check(compose_job(TINY + [f"data.path={prefix}", f"data.tokenizer={name}"]))
    assert p.field == "data.tokenizer" and words in p.message and "\n" not in p.message


def test_a_hf_file_that_is_not_a_tokenizer_is_one_line(tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{}")
    with pytest.raises(TokenizerError, match="could not be read as a hf tokenizer"):
        get_tokenizer(f"hf:{bad}")


def test_sentencepiece_and_tiktoken_files_load(tmp_path, bpe):
    spm = pytest.importorskip("sentencepiece")
    pytest.importorskip("tiktoken")
    texts = corpus(tmp_path / "c.jsonl", docs=200).read_text().splitlines()
    (tmp_path / "c.txt").write_text("\n".join(texts))
    spm.SentencePieceTrainer.train(input=str(tmp_path / "c.txt"), model_prefix=str(tmp_path / "sp"), vocab_size=200,
                                   model_type="bpe", minloglevel=2)
    sp = get_tokenizer(f"sentencepiece:{tmp_path / 'sp.model'}")
    assert sp.vocab_size == 200 and sp.eod == 2 and sp.detokenize(sp.tokenize("a dog likes the log.")) == \
        "a dog likes the log."
    # a tiktoken ranks file: the 256 single bytes, then two merges
    import base64
    ranks = [bytes([i]) for i in range(256)] + [b"th", b"the"]
    (tmp_path / "t.tiktoken").write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(ranks)))
    tt = get_tokenizer(f"tiktoken:{tmp_path / 't.tiktoken'}")
    assert (tt.vocab_size, tt.eod) == (259, 258)
    assert tt.tokenize("the") == [257] and tt.detokenize(tt.tokenize("the cat")) == "the cat"


# ---- preprocess -----------------------------------------------------------------------------------

def test_preprocess_in_several_processes_writes_the_same_files_as_one(tmp_path, bpe):
    """The pool keeps documents in input order: byte-identical files; Megatron reads them unchanged."""
    src = corpus(tmp_path / "c.jsonl", docs=1500, seed=3)
    from launch.preprocess import preprocess

    lines = []
    ticks = iter(range(0, 10_000, 3))  # a clock that advances 3 s per reading: a progress line every other document
    one = preprocess(src, str(tmp_path / "one"), f"hf:{bpe}", workers=1)
    three = preprocess(src, str(tmp_path / "three"), f"hf:{bpe}", workers=3, progress=lines.append,
                       clock=lambda: float(next(ticks)))
    assert one == three and one[0] == 1500
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"one{ext}").read_bytes() == (tmp_path / f"three{ext}").read_bytes()
    assert lines and "3 worker(s)" in lines[-1] and "documents" in lines[-1] and "%" in lines[-1]
    assert not list(tmp_path.glob("*.tmp"))

    from megatron.core.datasets.indexed_dataset import IndexedDataset

    tok = get_tokenizer(f"hf:{bpe}")
    ds = IndexedDataset(str(tmp_path / "three"))
    first = src.read_text().splitlines()[0]
    import json

    assert list(ds[0]) == tok.tokenize(json.loads(first)["text"]) + [tok.eod]
    assert int(sum(ds.sequence_lengths)) == one[1]


def test_preprocess_refuses_bad_input_in_one_line_and_writes_nothing(tmp_path, capsys):
    from launch.preprocess import main

    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"body": "no text"}\n')
    out = str(tmp_path / "out")
    assert main(["--input", str(tmp_path / "bad.jsonl"), "--output-prefix", out, "--workers", "2"]) == 2
    err = capsys.readouterr().err
    assert "bad.jsonl:2" in err and "nothing written" in err and len(err.strip().splitlines()) == 1
    assert not list(tmp_path.glob("out*"))
    assert main(["--input", str(tmp_path / "bad.jsonl"), "--output-prefix", out,
                 "--tokenizer", "hf:/nonexistent/tokenizer.json"]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and len(err.strip().splitlines()) == 1
    assert not list(tmp_path.glob("out*"))


def test_the_cli_refuses_a_vocab_mismatch_before_submission_and_writes_nothing(tmp_path, bpe):
    import subprocess
    import sys

    from trainutil import REPO

    prefix = write_index(tmp_path / "c", (100,) * 20)
    proc = subprocess.run([sys.executable, str(REPO / "launch" / "pretrain.py"), "data=indexed",
                           f"data.path={prefix}", f"data.tokenizer=hf:{bpe}", f"cluster.run_root={tmp_path / 'runs'}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert f"model.vocab_size 257 != hf:{bpe} vocabulary 300 (EOD id 0)" in proc.stderr
    assert "set model.vocab_size=300" in proc.stderr and not (tmp_path / "runs").exists()


def test_the_eod_of_a_hf_tokenizer_comes_from_its_config_beside_it(tmp_path, bpe):
    import json
    import shutil

    shutil.copy(bpe, tmp_path / "tokenizer.json")
    token = next(t for t, i in json.loads(bpe.read_text())["model"]["vocab"].items() if i == 42)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": token}}))
    assert get_tokenizer(f"hf:{tmp_path / 'tokenizer.json'}").eod == 42  # not <|endoftext|> (id 0)


def test_what_a_compute_node_lacks_is_a_final_stop_reason(tmp_path, bpe, monkeypatch):
    """train.data.start_refusal: a missing tokenizer package is unsupported software (exit 10), a missing
    prefix or tokenizer file a storage error (exit 7); both final, neither a crash loop."""
    import sys

    from recovery.policy import FINAL_REASONS
    from train.data import start_refusal

    prefix = write_index(tmp_path / "c", (100,) * 20)
    job = compose_job(TINY + [f"data.path={prefix}"])
    assert start_refusal(job.data) is None
    gone = compose_job(TINY + [f"data.path={tmp_path / 'gone'}"])
    assert start_refusal(gone.data)["reason"] == "storage_error"
    no_file = compose_job(TINY + [f"data.path={prefix}", f"data.tokenizer=hf:{tmp_path / 'x.json'}"])
    assert start_refusal(no_file.data)["reason"] == "storage_error"
    monkeypatch.setitem(sys.modules, "sentencepiece", None)  # the package is not installed on this node
    (tmp_path / "sp.model").write_bytes(b"x")
    sp = compose_job(TINY + [f"data.path={prefix}", f"data.tokenizer=sentencepiece:{tmp_path / 'sp.model'}"])
    refused = start_refusal(sp.data)
    assert refused["reason"] == "unsupported_software" and "'sentencepiece' package" in refused["detail"]
    assert {"storage_error", "unsupported_software"} <= set(FINAL_REASONS)


def test_a_resume_with_other_data_is_named_change_by_change():
    from train.data import data_changes

    before = {"kind": "indexed", "seed": 1234, "tokenizer": "byte", "num_samples": 96,
              "sources": [{"path": "web", "weight": 0.3}, {"path": "code", "weight": 0.7}]}
    assert data_changes(None, before) == [] and data_changes(before, dict(before)) == []
    now = {**before, "seed": 7, "sources": [{"path": "web", "weight": 0.5}, {"path": "code", "weight": 0.5}]}
    assert data_changes(before, now) == [
        "seed 1234 -> 7", "blend [('web', 0.3), ('code', 0.7)] -> [('web', 0.5), ('code', 0.5)]"]
