"""The Hugging Face bridge without training: the submit-time check of ``training.init_from``, the weight
mapping's fused layouts, and the export's refusals (the end-to-end runs are in test_hf_training.py)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from launch.check import check
from launch.compose import compose_job, job_to_yaml
from launch.hf_config import architecture, llama_fields, shape_problems, unsupported

REPO = Path(__file__).resolve().parent.parent
TINY = ["cluster=local", "model=tiny", "parallelism=tp1", "cluster.gpus_per_node=1"]


def hf_dir(tmp_path: Path, **changes) -> Path:
    """An HF model directory for the tiny model (config.json as save_pretrained writes it, transformers 5)."""
    job = compose_job(TINY)
    cfg = llama_fields(job.model, job.padded_vocab_size)
    theta = cfg.pop("rope_theta")
    cfg.update(model_type="llama", architectures=["LlamaForCausalLM"],
               rope_parameters={"rope_type": "default", "rope_theta": theta})
    cfg.update(changes)
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "model.safetensors").write_bytes(b"")  # the check reads config.json only
    return d


def init_problems(tmp_path: Path, *overrides: str, **changes) -> list:
    d = hf_dir(tmp_path, **changes)
    job = compose_job([*TINY, f"run.dir={tmp_path / 'run'}", f"training.init_from=hf:{d}", *overrides])
    return [p for p in check(job) if p.field == "training.init_from"]


def test_a_matching_hf_model_is_accepted(tmp_path):
    assert init_problems(tmp_path) == []


@pytest.mark.parametrize("changes, arithmetic", [
    ({"hidden_size": 128}, "config.json hidden_size 128 != model.hidden_size 64"),
    ({"num_hidden_layers": 2}, "config.json num_hidden_layers 2 != model.num_layers 4"),
    ({"num_attention_heads": 8}, "config.json num_attention_heads 8 != model.num_attention_heads 4"),
    ({"num_key_value_heads": 4}, "config.json num_key_value_heads 4 != model.num_query_groups 2"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}},
     "config.json rope_theta 500000.0 != model.rotary_base 10000.0"),
    ({"vocab_size": 32000}, "config.json vocab_size 32000 is neither model.vocab_size 257 nor the padded vocabulary "
                            "320"),
])
def test_a_shape_mismatch_is_refused_with_the_arithmetic(tmp_path, changes, arithmetic):
    problems = init_problems(tmp_path, **changes)
    assert len(problems) == 1 and problems[0].arithmetic.startswith(arithmetic), problems
    assert problems[0].fix.startswith("set ")


def test_the_refusal_at_submit_is_lines_not_a_traceback(tmp_path):
    d = hf_dir(tmp_path, hidden_size=128)
    proc = subprocess.run([sys.executable, str(REPO / "launch" / "pretrain.py"), *TINY, f"run.dir={tmp_path / 'run'}",
                           f"training.init_from=hf:{d}", "dry_run=true"], capture_output=True, text=True, cwd=REPO,
                          timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    out = proc.stdout + proc.stderr
    assert "config.json hidden_size 128 != model.hidden_size 64" in out and "Traceback" not in out
    assert not (tmp_path / "run").exists()  # nothing written


def test_init_from_names_a_form_files_and_an_architecture(tmp_path):
    job = compose_job([*TINY, "training.init_from=/some/dir"])
    assert [p.arithmetic for p in check(job) if p.field == "training.init_from"] == \
        ["training.init_from='/some/dir'"]
    job = compose_job([*TINY, f"training.init_from=hf:{tmp_path}"])
    assert any("config.json does not exist" in p.arithmetic for p in check(job) if p.field == "training.init_from")
    assert [p.arithmetic for p in shape_problems(job.model, 320, {"model_type": "gpt2"})] == \
        ["config.json: model_type 'gpt2', architectures []"]
    gpt3 = compose_job(["cluster=local", "model=125m"])
    assert unsupported(gpt3.model) is None and architecture(gpt3.model) == "GPT2LMHeadModel"
    assert architecture(job.model) == "LlamaForCausalLM"
    moe = compose_job(["cluster=local", "model=mixtral_8x7b"])
    assert "8 experts (model.num_experts)" in unsupported(moe.model)
    job = compose_job(["cluster=local", "model=125m", f"training.init_from=hf:{tmp_path}"])
    assert [p.message for p in check(job) if p.field == "training.init_from"] == \
        ["only Llama-style models initialise from Hugging Face weights"]


@pytest.mark.parametrize("weight_map,fragment", [
    ({"model.embed_tokens.weight": "pytorch_model-00001.bin"}, "not a .safetensors file of this directory"),
    ({"model.embed_tokens.weight": "../elsewhere.safetensors"}, "not a .safetensors file of this directory"),
    ({}, "no weight_map"),
    ({"model.embed_tokens.weight": "model-00001.safetensors"}, "model-00001.safetensors does not exist"),
])
def test_init_from_an_index_that_names_no_usable_safetensors_is_refused_at_submit(tmp_path, weight_map, fragment):
    """A bad HF directory is final (exit 14) where it can be checked: on the login side, before any rank starts."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    job = compose_job([*TINY, f"training.init_from=hf:{tmp_path}"])
    (p,) = [p for p in check(job) if p.field == "training.init_from"]
    assert fragment in p.arithmetic, p


def test_a_shard_that_is_not_safetensors_is_an_hf_weights_error_on_the_ranks(tmp_path):
    """What the ranks meet when the directory changes after the check: one HFWeightsError (a final exit 14 on every
    rank), never safetensors' own exception type escaping as a traceback."""
    pytest.importorskip("torch")
    from train.hf_bridge import HFWeightsError, read_full

    (tmp_path / "model-00001.safetensors").write_bytes(b"PK\x03\x04 a zip, not safetensors" * 10)
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.embed_tokens.weight": "model-00001.safetensors"}}))
    job = compose_job(TINY)
    with pytest.raises(HFWeightsError, match="cannot read the weights in"):
        read_full(tmp_path, job.model, job.padded_vocab_size)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "pytorch_model.bin"}}))
    with pytest.raises(HFWeightsError, match="not a .safetensors file"):
        read_full(tmp_path, job.model, job.padded_vocab_size)


def test_qkv_and_fc1_split_by_query_group_and_back():
    torch = pytest.importorskip("torch")
    from train.hf_bridge import from_hf, to_hf

    model = compose_job(TINY).model  # 4 heads in 2 groups of head dim 16; ffn 256
    h, d = model.hidden_size, 16
    sd = {"embedding.word_embeddings.weight": torch.randn(320, h), "decoder.final_layernorm.weight": torch.randn(h),
          "output_layer.weight": torch.randn(320, h)}
    for i in range(model.num_layers):
        p = f"decoder.layers.{i}."
        # row r of linear_qkv holds the value r: group 0 is rows 0-63 = q heads 0,1 (0-31), k (32-47), v (48-63)
        sd.update({p + "input_layernorm.weight": torch.randn(h), p + "pre_mlp_layernorm.weight": torch.randn(h),
                   p + "self_attention.linear_qkv.weight": torch.arange(128.0).unsqueeze(1).expand(128, h).clone(),
                   p + "self_attention.linear_proj.weight": torch.randn(h, 4 * d),
                   p + "mlp.linear_fc1.weight": torch.randn(512, h), p + "mlp.linear_fc2.weight": torch.randn(h, 256)})
    hf = to_hf(sd, model)
    q, k, v = (hf[f"model.layers.0.self_attn.{n}_proj.weight"][:, 0] for n in "qkv")
    assert q.tolist() == list(range(0, 32)) + list(range(64, 96))  # heads 0,1 of group 0, then 2,3 of group 1
    assert k.tolist() == list(range(32, 48)) + list(range(96, 112))
    assert v.tolist() == list(range(48, 64)) + list(range(112, 128))
    assert torch.equal(hf["model.layers.1.mlp.gate_proj.weight"], sd["decoder.layers.1.mlp.linear_fc1.weight"][:256])
    assert torch.equal(hf["model.layers.1.mlp.up_proj.weight"], sd["decoder.layers.1.mlp.linear_fc1.weight"][256:])
    back = from_hf(hf, model)
    assert sorted(back) == sorted(sd) and all(torch.equal(back[n], sd[n]) for n in sd)


def test_export_refuses_a_model_without_hf_equivalent_and_a_run_without_checkpoint(tmp_path, capsys):
    from train import export

    run = tmp_path / "moe"
    run.mkdir()
    (run / "config.yaml").write_text(job_to_yaml(compose_job(["cluster=local", "model=mixtral_8x7b",
                                                              f"run.dir={run}"])))
    assert export.main([str(run), "--out", str(tmp_path / "out")]) == 2
    assert "no Hugging Face architecture fits this model" in capsys.readouterr().err
    tiny = tmp_path / "tiny"
    tiny.mkdir()
    (tiny / "config.yaml").write_text(job_to_yaml(compose_job([*TINY, f"run.dir={tiny}"])))
    (tiny / "checkpoints").mkdir()
    assert export.main([str(tiny), "--out", str(tmp_path / "out")]) == 5
    assert "holds no verified checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep")
    assert export.main([str(tiny), "--out", str(tmp_path / "full")]) == 2
    assert "never overwrites" in capsys.readouterr().err and (tmp_path / "full" / "x").read_text() == "keep"


@pytest.mark.parametrize("size", ["0", "garbage", "0.0GB", "1.5 parsecs"])
def test_export_refuses_a_bad_shard_size_before_any_load(tmp_path, capsys, size):
    """No run, no checkpoint: a bad --max-shard-size is refused first (it used to be found after the whole load)."""
    from train import export

    assert export.main([str(tmp_path / "nowhere"), "--out", str(tmp_path / "out"), "--max-shard-size", size]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"error: --max-shard-size {size!r} is not a size > 0") and not (tmp_path / "out").exists()


def test_export_refuses_an_out_it_cannot_create_before_any_load(tmp_path, capsys, monkeypatch):
    from train import export

    tiny = tmp_path / "tiny"
    tiny.mkdir()
    (tiny / "config.yaml").write_text(job_to_yaml(compose_job([*TINY, f"run.dir={tiny}"])))
    (tmp_path / "afile").write_text("x")
    assert export.main([str(tiny), "--out", str(tmp_path / "afile" / "hf")]) == 7
    (line,) = capsys.readouterr().err.splitlines()
    assert line == f"error: --out {tmp_path / 'afile' / 'hf'}: {tmp_path / 'afile'} is not a directory; nothing was " \
                   "loaded or written"
    assert export.shard_bytes("5GB") == 5 * 10**9 and export.shard_bytes("2GiB") == 2**31
    assert export.shard_bytes("1000") == 1000
    real = export.os.statvfs

    class ReadOnly:  # what statvfs says of a read-only mount (root may write anywhere else)
        def __init__(self, path):
            self.f_flag = real(path).f_flag | export.os.ST_RDONLY

    monkeypatch.setattr(export.os, "statvfs", ReadOnly)
    assert export.main([str(tiny), "--out", str(tmp_path / "ro" / "hf")]) == 7
    assert "is on a read-only filesystem" in capsys.readouterr().err and not (tmp_path / "ro").exists()



def test_weights_a_rank_cannot_use_are_one_line_for_every_rank(tmp_path):
    torch = pytest.importorskip("torch")
    save_file = pytest.importorskip("safetensors.torch").save_file
    from train.hf_bridge import HFWeightsError, full_shapes, read_full, to_hf

    model = compose_job(TINY).model
    full = {n: torch.zeros(s) for n, s in full_shapes(model, 320).items()}
    hf = to_hf(full, model)
    d = tmp_path / "hf"
    d.mkdir()
    save_file(hf, str(d / "model.safetensors"))
    assert sorted(read_full(d, model, 320)) == sorted(full)  # complete: every tensor, every shape
    with pytest.raises(HFWeightsError, match=r"embedding.word_embeddings.weight has shape \(320, 64\), the model "
                                             r"needs \(384, 64\)"):
        read_full(d, model, 384)
    del hf["model.layers.3.mlp.up_proj.weight"]
    save_file(hf, str(d / "model.safetensors"))
    with pytest.raises(HFWeightsError, match="has no tensor model.layers.3.mlp.up_proj.weight"):
        read_full(d, model, 320)


GPT3_STYLE = ["model.swiglu=false", "model.normalization=LayerNorm", "model.position_embedding_type=learned_absolute",
              "model.num_query_groups=4", "model.untie_embeddings_and_output_weights=false"]
GPT2_CHECK = """
import json, sys, torch
from launch.compose import compose_job
from train import hf_bridge, megatron_model
from train.export import compare_logits, hf_model, probe_tokens
with hf_bridge.one_process():
    job = hf_bridge.single_rank_job(compose_job(sys.argv[1:]))
    config = megatron_model.to_transformer_config(job.model, job.parallelism, job.training)
    chunk = megatron_model.build_model_chunks(job.model, config, 1, use_te=False, device=torch.device("cpu"))[0]
    megatron_model.init_layout_independent([chunk], job.model, 1234)
    with torch.no_grad():  # norms and biases start at ones/zeros: draw them, so that a swapped one shows
        for name, p in chunk.named_parameters():
            if p.dim() == 1:
                p.normal_(0.0 if name.endswith("bias") else 1.0, 0.1)
    tokens = probe_tokens(job.model)
    reference = hf_bridge.megatron_logits(chunk.eval(), tokens)
    hf = hf_model(job, hf_bridge.to_hf_for(hf_bridge.full_state(chunk, job.model), job.model), "float32")
    with torch.no_grad():
        got = hf(tokens).logits.float()
print(json.dumps({"class": type(hf).__name__, **compare_logits(reference, got)}))
"""


def test_a_gpt3_style_model_maps_to_gpt2_with_the_same_logits():
    """Megatron's forward of a GPT-3-style model (LayerNorm with biases, exact GeLU, learned positions, tied, linear
    biases) equals transformers' GPT2LMHeadModel forward of the mapped weights (float32, max abs 1e-4; measured
    1.8e-7, and 2.4e-7 without linear biases, zero-filled)."""
    overrides = [*TINY, *GPT3_STYLE, "model.add_bias_linear=true"]
    proc = subprocess.run([sys.executable, "-c", GPT2_CHECK, *overrides], cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["class"] == "GPT2LMHeadModel" and got["greedy_equal"] and got["max_abs_diff"] <= 1e-4, got
