"""Render a job into a requeue-aware sbatch script (pure: a Job in, the script text out).

The ``#SBATCH`` header comes from submitit's ``_make_sbatch_string`` so we inherit its quoting
and its tested flag spelling; it is a private function, hence ``submitit==1.5.4`` is pinned in
pyproject and ``tests/golden/`` catches any drift. The shell body is assembled from the pieces
in ``sbatch_templates/`` (preamble, modules, setup, environment, MASTER_ADDR, Lustre striping,
the srun step). Each ``{{name}}`` placeholder is filled with an already shell-quoted value, so
a config string can never become shell code.

Only ``read_failed_nodes`` touches the filesystem; pass ``failed_nodes=`` to stay pure.
"""
from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

from launch import spares
from launch.dist_env import rendezvous_port_shell
from launch.config import Job
from launch.paths import RunPaths
from recovery import exit_codes

TEMPLATE_DIR = Path(__file__).resolve().parent.parent / "sbatch_templates"
CODE_DIR = Path(__file__).resolve().parent.parent
_HOST = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-\[\],]*$")
_PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")


def q(value: Any) -> str:
    """Shell-quote one config value (``shlex.quote`` of its string form)."""
    return shlex.quote(str(value))


def fill(template: str, values: dict[str, str]) -> str:
    """Replace ``{{name}}`` placeholders; an unknown or unused name is an error, not a blank."""
    unused = set(values)

    def sub(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in values:
            raise KeyError(f"template placeholder {{{{{name}}}}} has no value (have {sorted(values)})")
        unused.discard(name)
        return values[name]

    out = _PLACEHOLDER.sub(sub, template)
    if unused:
        raise KeyError(f"values {sorted(unused)} are not used by the template")
    return out


def piece(name: str, values: Optional[dict[str, str]] = None, template_dir: Path = TEMPLATE_DIR) -> str:
    """One shell piece from ``sbatch_templates/<name>.sh`` with its placeholders filled."""
    return fill((template_dir / f"{name}.sh").read_text(), values or {}).rstrip("\n")


def read_failed_nodes(run_dir: str | Path) -> list[str]:
    """Hosts recorded as failing by recovery/policy.py (``[{"host": ..., "reason": ...}]``).

    Read tolerantly: a missing, unreadable or malformed file means no extra exclusions, and
    entries that are not plain host names are skipped (they go into an #SBATCH line).
    """
    try:
        data = json.loads(RunPaths.of(run_dir).failed_nodes.read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(data, list):
        return []
    hosts = []
    for entry in data:
        host = entry.get("host") if isinstance(entry, dict) else entry
        if isinstance(host, str) and _HOST.match(host):
            hosts.append(host)
    return hosts


def exclude_list(job: Job, failed_nodes: Iterable[str]) -> str:
    """cluster.exclude plus the failing hosts, de-duplicated, in a stable order."""
    seen: list[str] = []
    for host in [h.strip() for h in job.cluster.exclude.split(",")] + list(failed_nodes):
        if host and host not in seen:
            seen.append(host)
    return ",".join(seen)


def checkpoint_dir(job: Job, run_dir: str | Path) -> str:
    """Where the ranks write checkpoints (:class:`launch.paths.RunPaths`), as text for the script."""
    return str(job.paths_at(run_dir).checkpoints)


def srun_args(job: Job, run_dir: str | Path) -> list[str]:
    """Arguments of the one srun step (each element is one argv word, quoted at render time)."""
    c = job.cluster
    args = [
        "--kill-on-bad-exit=1",
        f"--nodes={c.nodes}",
        f"--ntasks-per-node={c.gpus_per_node}",
        f"--cpus-per-task={max(1, c.cpus_per_node // max(1, c.gpus_per_node))}",
        "--open-mode=append",
        f"--output={RunPaths.of(run_dir).logs}/%j_%t.out",
    ]
    if c.container.image:
        args.append(f"--container-image={c.container.image}")
        if c.container.mounts:
            args.append(f"--container-mounts={','.join(c.container.mounts)}")
        if c.container.workdir:
            args.append(f"--container-workdir={c.container.workdir}")
    return args


def sbatch_params(job: Job, run_dir: str | Path, failed_nodes: Sequence[str], dependency: Optional[str]) -> dict:
    """Keyword arguments for submitit's ``_make_sbatch_string`` (None drops a flag)."""
    c, r = job.cluster, job.run
    extra: dict[str, Any] = {"output": f"{RunPaths.of(run_dir).logs}/%j_batch.out"}
    extra["requeue" if c.requeue_allowed else "no-requeue"] = True
    if spares.in_job_enabled(job):  # a failed node must not end the allocation: the spares take over
        extra["no-kill"] = True
    extra.update({k: str(v) for k, v in c.sbatch_extra.items()})
    return dict(
        job_name=r.name,
        partition=c.partition or None,
        account=c.account or None,
        qos=c.qos or None,
        time=r.time_limit_min,
        nodes=c.nodes + (c.spare_nodes if spares.in_job_enabled(job) else 0),
        ntasks_per_node=c.gpus_per_node,
        cpus_per_task=max(1, c.cpus_per_node // max(1, c.gpus_per_node)),
        gpus_per_node=c.gpus_per_node if c.gpu != "cpu" else None,
        mem=f"{c.mem_per_node_gb}G" if c.mem_per_node_gb > 0 else None,
        exclude=exclude_list(job, failed_nodes) or None,
        dependency=dependency or None,
        signal_delay_s=job.training.signal_lead_time_s,  # rendered as --signal=USR2@<lead>, no B:
        wckey="slurmtron",
        stderr_to_stdout=True,
        use_srun=False,  # we write the srun line ourselves (per-task logs, container, no submitit pickles)
        additional_parameters=extra,
    )


def shell_body(job: Job, run_dir: str | Path, code_dir: str | Path) -> tuple[list[str], str]:
    """(setup pieces, command piece) of the script, from sbatch_templates/."""
    c = job.cluster
    setup = [piece("preamble", {"run_name": q(job.run.name), "run_dir": q(run_dir)})]
    if c.modules:
        setup.append(piece("modules", {"module_loads": "\n".join(f"module load {q(m)}" for m in c.modules)}))
    if c.setup:
        setup.append(piece("setup", {"setup_lines": "\n".join(c.setup)}))
    exports = "\n".join(f"export {k}={q(v)}" for k, v in sorted(c.env.items()))
    setup.append(piece("env", {"code_dir": q(code_dir), "exports": exports}))
    setup.append(piece("master_addr", {"master_port": rendezvous_port_shell()}))
    if c.lustre_stripe_count > 0:
        setup.append(piece("lustre", {
            "checkpoint_dir": q(checkpoint_dir(job, run_dir)),
            "stripe_count": q(c.lustre_stripe_count),
            "stripe_size": q(c.lustre_stripe_size),
        }))
    if spares.in_job_enabled(job):
        command = piece("srun_injob", {
            "srun_args": " ".join(q(a) for a in srun_args(job, run_dir)),
            "python": q(c.python),
            "exclusion_flags": "" if c.requeue_allowed else " --no-requeue",
            "nodes": q(c.nodes), "ntasks": q(c.nodes * c.gpus_per_node), "spare_nodes": q(c.spare_nodes), "budget": q(c.in_job_restarts),
            "gpus": q(c.gpus_per_node if c.gpu != "cpu" else 0),
            "master_port": rendezvous_port_shell(),
        })
        return setup, command
    command = piece("srun", {
        "srun_args": " ".join(q(a) for a in srun_args(job, run_dir)),
        "python": q(c.python),
        "exclusion_flags": "" if c.requeue_allowed else " --no-requeue",
        "requeue_on_crash": "1" if (c.requeue_allowed and job.training.requeue_on_crash) else "0",
        **exit_codes.shell_values(),
    })
    return setup, command


def render(job: Job, run_dir: str | Path, *, dependency: Optional[str] = None,
           failed_nodes: Optional[Sequence[str]] = None, code_dir: str | Path = CODE_DIR) -> str:
    """The sbatch script for ``job`` whose run directory is ``run_dir`` (absolute on a cluster).

    ``dependency`` adds ``--dependency`` (e.g. ``afterany:123``); ``failed_nodes`` defaults to
    ``<run_dir>/failed_nodes.json``; ``code_dir`` is put on PYTHONPATH so ``-m train.worker``
    imports this checkout.
    """
    from submitit.slurm.slurm import _make_sbatch_string  # private API: pinned, golden-tested

    if failed_nodes is None:
        failed_nodes = read_failed_nodes(run_dir)
    setup, command = shell_body(job, run_dir, code_dir)
    params = sbatch_params(job, run_dir, failed_nodes, dependency)
    script = _make_sbatch_string(command=command, folder=str(run_dir), setup=setup, **params)
    return script if script.endswith("\n") else script + "\n"
