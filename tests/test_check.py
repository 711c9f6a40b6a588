"""The job check refuses each invalid configuration with a message that names the field.

Each case starts from a valid shipped job, changes one thing (as a user would on the command
line, or by editing the composed job where Hydra's grammar cannot express the value), and
asserts the dotted field appears among the problems and in the printed message.
"""
from __future__ import annotations

import io
from dataclasses import replace
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from datafiles import write_index
from fake_slurm import FakeSlurm

from launch import pretrain
from launch.check import check, notes, padded_vocab_size
from launch.compose import CONFIG_DIR, compose_job
from launch.config import register_configs
from launch.problems import format_problems

LUSTRE_7B = ["cluster=lustre", "model=7b", "run.dir=/nonexistent/runs/t"]
LUSTRE_30B = ["cluster=lustre", "model=30b", "run.dir=/nonexistent/runs/t"]
LUSTRE_70B = ["cluster=lustre", "model=70b", "run.dir=/nonexistent/runs/t"]
LUSTRE_MIX = ["cluster=lustre", "model=mixtral_8x7b", "run.dir=/nonexistent/runs/t"]
LOCAL_TINY = ["cluster=local", "model=tiny", "run.dir=/nonexistent/runs/t"]


def _cluster(**kw):
    return lambda j: replace(j, cluster=replace(j.cluster, **kw))


def _run(**kw):
    return lambda j: replace(j, run=replace(j.run, **kw))


def _container(**kw):
    return lambda j: replace(j, cluster=replace(j.cluster, container=replace(j.cluster.container, **kw)))


# (id, overrides, mutation of the composed Job or None, field that must be named, substring of the message)
CASES = [
    ("world_not_divisible", LUSTRE_30B + ["cluster.nodes=3", "cluster.gpus_per_node=4"], None, "cluster.nodes",
     "% (tp 4 * pp 2 * cp 1 = 8) = 4"),
    ("dp_zero", LUSTRE_30B + ["cluster.nodes=1", "cluster.gpus_per_node=4"], None, "cluster.nodes", "dp = 4 // 8 = 0"),
    ("expert_mesh", LUSTRE_MIX + ["cluster.nodes=1"], None, "parallelism.ep", "tp 2 * ep 8 * pp 4 = 64"),
    ("heads_tp", LUSTRE_30B + ["parallelism.tp=8"], None, "model.num_attention_heads", "52 % tp 8 = 4"),
    ("groups_tp", LUSTRE_70B + ["parallelism.tp=16", "parallelism.allow_tp_across_nodes=true"], None,
     "model.num_query_groups", "num_query_groups 8 % tp 16"),
    ("heads_groups", LOCAL_TINY + ["model.num_query_groups=3"], None, "model.num_query_groups", "% num_query_groups 3"),
    ("hidden_heads", LOCAL_TINY + ["model.hidden_size=66"], None, "model.hidden_size", "66 % num_attention_heads 4"),
    ("layers_pp", LUSTRE_7B + ["parallelism.pp=3"], None, "model.num_layers", "32 % (pp 3 * vpp 1 = 3)"),
    ("layers_405b_no_embedding", ["cluster=lustre", "model=405b", "run.dir=/x",
                                  "parallelism.pp=8", "parallelism.vpp=2", "parallelism.cp=1",
                                  "parallelism.account_for_embedding_in_pipeline_split=false"], None,
     "model.num_layers", "= 127 % (pp 8 * vpp 2 = 16)"),
    ("vpp_without_pp", LUSTRE_7B + ["parallelism.vpp=2"], None, "parallelism.vpp", "vpp 2 with pp 1"),
    ("gbs_divisible", LUSTRE_7B + ["training.global_batch_size=100"], None, "training.global_batch_size",
     "100 % (micro_batch_size 1 * dp 64 = 64)"),
    ("too_few_microbatches", LUSTRE_70B + ["training.global_batch_size=8"], None, "training.global_batch_size",
     "microbatches 2"),
    ("interleaved_microbatches", ["cluster=lustre", "model=175b", "run.dir=/x", "training.global_batch_size=20"], None,
     "training.global_batch_size", "microbatches 10 % pp 8 = 2"),
    ("sp_without_tp", LUSTRE_7B + ["parallelism.tp=1"], None, "parallelism.sequence_parallel", "with tp 1"),
    ("seq_cp", LUSTRE_7B + ["parallelism.cp=3"], None, "model.seq_length", "4096 % (2 * cp 3 = 6)"),
    ("experts_ep", LUSTRE_MIX + ["parallelism.ep=3"], None, "parallelism.ep", "num_experts 8 % ep 3"),
    ("ep_dense", LUSTRE_7B + ["parallelism.ep=2"], None, "parallelism.ep", "model.num_experts = None"),
    ("tp_across_nodes", LUSTRE_7B + ["parallelism.tp=16", "parallelism.sequence_parallel=true"], None,
     "parallelism.tp", "tp 16 > cluster.gpus_per_node 8"),
    ("cp_on_cpu", LOCAL_TINY + ["parallelism.cp=2"], None, "parallelism.cp", "on cluster.gpu=cpu"),
    ("fp8_on_cpu", LOCAL_TINY + ["training.precision=fp8"], None, "training.precision", "fp8 on cluster.gpu=cpu"),
    ("param_gather_without_distopt", LUSTRE_7B + ["parallelism.distributed_optimizer=false",
                                                  "parallelism.overlap_grad_reduce=true",
                                                  "parallelism.overlap_param_gather=true"], None,
     "parallelism.overlap_param_gather", "with distributed_optimizer=false"),
    ("param_gather_without_grad_overlap", LUSTRE_7B + ["parallelism.overlap_param_gather=true"], None,
     "parallelism.overlap_param_gather", "with overlap_grad_reduce=false"),
    ("bucket_without_overlap", LUSTRE_7B + ["parallelism.bucket_size=1000000"], None, "parallelism.bucket_size",
     "bucket_size = 1000000 with overlap_grad_reduce=false"),
    ("bucket_zero", LUSTRE_7B + ["parallelism.overlap_grad_reduce=true", "parallelism.bucket_size=0"], None,
     "parallelism.bucket_size", "bucket_size = 0"),
    ("tp_comm_overlap_without_sp", LUSTRE_7B + ["parallelism.tp_comm_overlap=true",
                                                "parallelism.sequence_parallel=false"], None,
     "parallelism.tp_comm_overlap", "with tp 2 and sequence_parallel=false"),
    ("tp_comm_overlap_on_cpu", LOCAL_TINY + ["parallelism=tp2_sp", "parallelism.tp_comm_overlap=true"], None,
     "parallelism.tp_comm_overlap", "on cluster.gpu=cpu"),
    ("time_over_partition", LUSTRE_7B + ["run.time_limit_min=3000"], None, "run.time_limit_min",
     "3000 > cluster.max_time_min 2880"),
    ("lead_over_limit", LUSTRE_7B + ["run.time_limit_min=5"], None, "training.signal_lead_time_s",
     "300 >= run.time_limit_min 5 * 60 = 300"),
    ("lead_no_room", LUSTRE_7B + ["run.time_limit_min=8"], None, "training.signal_lead_time_s", "> run.time_limit_min 8"),
    ("lead_zero", LUSTRE_7B + ["training.signal_lead_time_s=0"], None, "training.signal_lead_time_s", "= 0"),
    ("indexed_no_path", LOCAL_TINY + ["data=indexed", "data.path="], None, "data.path", "data.path = ''"),
    ("recompute_enum", LOCAL_TINY + ["parallelism.recompute=partial"], None, "parallelism.recompute", "'partial'"),
    ("precision_enum", LOCAL_TINY + ["training.precision=int8"], None, "training.precision", "'int8'"),
    ("decay_enum", LOCAL_TINY + ["training.lr_decay_style=step"], None, "training.lr_decay_style", "'step'"),
    ("launcher_enum", LOCAL_TINY + ["cluster.launcher=pbs"], None, "cluster.launcher", "'pbs'"),
    ("data_kind_enum", LOCAL_TINY + ["data.kind=webdataset"], None, "data.kind", "'webdataset'"),
    ("pos_emb_enum", LOCAL_TINY + ["model.position_embedding_type=alibi"], None, "model.position_embedding_type",
     "'alibi'"),
    ("ckpt_interval_zero", LOCAL_TINY + ["training.checkpoint_interval=0"], None, "training.checkpoint_interval", "= 0"),
    ("ckpt_interval_word", LOCAL_TINY + ["training.checkpoint_interval=sometimes"], None,
     "training.checkpoint_interval", "'sometimes'"),
    ("no_length", LOCAL_TINY + ["training.train_iters=null"], None, "training.train_iters", "train_tokens = null"),
    ("unknown_gpu", LUSTRE_7B + ["cluster.gpu=tpu_v5"], None, "cluster.gpu", "tpu_v5"),
    ("precision_without_peak", LUSTRE_7B + ["training.precision=fp32"], None, "training.precision", "fp32"),
    ("name_newline", LOCAL_TINY, _run(name="a\nb"), "run.name", "newline"),
    ("name_slash", LOCAL_TINY + ["run.name=a/b"], None, "run.name", "'a/b'"),
    ("partition_newline", LUSTRE_7B, _cluster(partition="gpu\n#SBATCH --qos=high"), "cluster.partition", "newline"),
    ("env_key", LUSTRE_7B, _cluster(env={"BAD-KEY": "1"}), "cluster.env.BAD-KEY", "[A-Za-z_]"),
    ("sbatch_extra_key", LUSTRE_7B, _cluster(sbatch_extra={"Bad Key": "1"}), "cluster.sbatch_extra.Bad Key", "[a-z]"),
    ("cpus_per_task", LUSTRE_7B + ["cluster.cpus_per_node=4"], None, "cluster.cpus_per_node", "4 // gpus_per_node 8"),
    ("micro_batch_zero", LOCAL_TINY + ["training.micro_batch_size=0"], None, "training.micro_batch_size", ">= 1"),
    ("router_topk", LUSTRE_MIX + ["model.moe_router_topk=9"], None, "model.moe_router_topk", "9 not in [1"),
    ("budget_exceeded", LUSTRE_7B + ["run.budget_gpu_hours=1000"], None, "run.budget_gpu_hours", "> budget 1,000"),
    ("budget_nonpositive", LUSTRE_7B + ["run.budget_gpu_hours=0"], None, "run.budget_gpu_hours", "= 0"),
    ("budget_nan", LUSTRE_7B + ["run.budget_gpu_hours=nan"], None, "run.budget_gpu_hours", "= nan"),
    ("budget_inf", LUSTRE_7B + ["run.budget_gpu_hours=inf"], None, "run.budget_gpu_hours", "= inf"),
    ("sweep_budget_nan", LUSTRE_7B + ["run.sweep_budget_gpu_hours=nan"], None, "run.sweep_budget_gpu_hours", "= nan"),
    ("dependency_chain_negative", LUSTRE_7B + ["run.dependency_chain=-1"], None, "run.dependency_chain", "-1"),
    ("mount_with_comma", LUSTRE_7B, _container(image="img", mounts=["/a:/a,/b:/b"]), "cluster.container.mounts[0]",
     "','"),
    ("stripe_negative", LUSTRE_7B + ["cluster.lustre_stripe_count=-2"], None, "cluster.lustre_stripe_count", "-2"),
    ("keep_zero", LOCAL_TINY + ["training.keep_checkpoints=0"], None, "training.keep_checkpoints", "= 0"),
    ("python_empty", LUSTRE_7B + ["cluster.python="], None, "cluster.python", "empty"),
]


@pytest.mark.parametrize("overrides,mutate,field,fragment", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_invalid_config_is_refused_naming_the_field(overrides, mutate, field, fragment):
    job = compose_job(overrides)
    if mutate is not None:
        job = mutate(job)
    problems = check(job)
    fields = [p.field for p in problems]
    assert field in fields, f"{field} not among {fields}"
    hits = [p for p in problems if p.field == field]
    assert any(fragment in str(p) for p in hits), [str(p) for p in hits]
    assert all(p.message and (p.arithmetic or p.fix) for p in hits)
    assert field in format_problems(problems)


def test_there_are_at_least_30_distinct_invalid_configs():
    assert len({c[0] for c in CASES}) >= 30 and len({(c[3], c[4]) for c in CASES}) >= 30


def test_the_base_configs_are_valid():
    for base in (LUSTRE_7B, LUSTRE_30B, LUSTRE_70B, LUSTRE_MIX, LOCAL_TINY):
        assert check(compose_job(base)) == [], base


def test_every_problem_is_reported_not_just_the_first():
    job = compose_job(LUSTRE_30B + ["parallelism.tp=8", "training.precision=int8", "run.time_limit_min=3000",
                                    "parallelism.recompute=partial"])
    fields = {p.field for p in check(job)}
    assert {"model.num_attention_heads", "training.precision", "run.time_limit_min",
            "parallelism.recompute"} <= fields


def test_indexed_dataset_files_must_exist_when_visible(tmp_path):
    prefix = tmp_path / "corpus_text_document"
    job = compose_job(LOCAL_TINY + ["data=indexed", f"data.path={prefix}"])
    assert [p.field for p in check(job)] == ["data.path"]
    write_index(prefix, [100] * 10)  # a real (tiny) .bin/.idx pair: the check reads the index's lengths
    assert check(job) == []


def test_indexed_dataset_not_visible_here_is_refused_unless_forced():
    job = compose_job(LOCAL_TINY + ["data=indexed", "data.path=/nonexistent-fs/corpus"])
    (problem,) = check(job)
    assert problem.field == "data.path" and "/nonexistent-fs/corpus.bin" in problem.arithmetic
    assert "force=true" in problem.fix  # a path only the compute nodes see
    assert check(compose_job(LOCAL_TINY + ["data=indexed", "data.path=/nonexistent-fs/corpus", "force=true"])) == []


def test_vocab_padding_is_reported_with_its_arithmetic():
    job = compose_job(LUSTRE_30B)
    assert padded_vocab_size(job) == 32000  # 32000 is already a multiple of lcm(128, tp 4) = 128
    odd = compose_job(LUSTRE_30B + ["model.vocab_size=50257"])
    assert padded_vocab_size(odd) == 50304  # ceil(50257 / 128) * 128, the same under every tp that divides 128
    assert any("padded to 50304" in n and "lcm" in n for n in notes(odd))


def test_refused_job_reaches_no_submitter_and_writes_nothing(tmp_path):
    register_configs()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=LUSTRE_30B[:2] + [
            f"run.dir={tmp_path / 'run'}", "parallelism.tp=8", "training.global_batch_size=100"])
    runner, err = FakeSlurm(), io.StringIO()  # records every Slurm call: none must happen
    assert pretrain.main(cfg, runner=runner, out=io.StringIO(), err=err) == pretrain.EXIT_REFUSED
    assert runner.calls == []
    assert not (tmp_path / "run").exists()
    assert "model.num_attention_heads" in err.getvalue() and "training.global_batch_size" in err.getvalue()
    assert "nothing was submitted" in err.getvalue()


def test_settings_the_recipe_does_not_run_yet_are_refused_with_a_reason():
    """The planner models ZeRO-3/FSDP; the worker builds Megatron DDP + the distributed optimizer, so a
    job asking for it is refused, not run without."""
    job = compose_job(["model=70b", "cluster=lustre", "parallelism.sharding=full"])
    problems = {p.field: p for p in check(job, path_exists=lambda _: True)}
    assert "ZeRO-3/FSDP" in problems["parallelism.sharding"].message
    assert "fsdp_dtensor" in problems["parallelism.sharding"].arithmetic
    assert "distributed_optimizer=true" in problems["parallelism.sharding"].fix


@pytest.mark.parametrize("distopt", [
    ["parallelism.distributed_optimizer=false"],
    ["parallelism.distributed_optimizer=true", "parallelism.overlap_param_gather=true"],
])
def test_overlap_with_its_prerequisites_is_accepted(distopt):
    job = compose_job(LUSTRE_7B + ["parallelism.overlap_grad_reduce=true", "parallelism.bucket_size=40000000",
                                   "parallelism.tp_comm_overlap=true"] + distopt)
    assert job.parallelism.tp == 2 and job.parallelism.sequence_parallel
    assert not [p for p in check(job, path_exists=lambda _: True) if "overlap" in p.field or "bucket" in p.field]


def test_a_typed_choice_refuses_an_unknown_kernel_at_compose_time():
    with pytest.raises(Exception) as exc:
        compose_job(["model=tiny", "model.attention_backend=flash"])
    assert "expected one of [fused, unfused]" in str(exc.value.__cause__ or exc.value)


def test_memory_inside_the_error_band_is_a_warning_not_a_refusal():
    job = compose_job(["model=70b", "cluster=lustre", "cluster.gpu_memory_gb=30"])
    assert not [p for p in check(job, path_exists=lambda _: True) if p.field == "parallelism"]
    assert any(n.startswith("WARNING: estimated memory per GPU") for n in notes(job))
