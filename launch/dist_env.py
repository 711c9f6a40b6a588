"""Who am I in the job: rank, local rank, world size, node list, rendezvous address.

Two sources, checked in this order:

* the Slurm task environment (``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``,
  ``SLURM_STEP_NODELIST``, else ``SLURM_JOB_NODELIST``): every ``srun`` task is one rank, no torchrun in between, so
  signals reach the trainer directly;
* torchrun-style variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
  ``MASTER_PORT``), which the ``cluster=local`` launcher sets.

Explicit ``MASTER_ADDR``/``MASTER_PORT`` win over anything derived, so a site can pin them
in the rendered script. Pure functions over an ``env`` mapping; the hostname expander and
resolver are injected so tests need no Slurm and no DNS.
"""
from __future__ import annotations

import random
import re
import socket
import subprocess
from dataclasses import dataclass, field
from typing import Callable, List, Mapping, Optional


@dataclass(frozen=True)
class DistEnv:
    """One rank's place in the job."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    nodes: List[str] = field(default_factory=list)
    source: str = "single"  # slurm | torchrun | single

    @property
    def init_method(self) -> str:
        return f"tcp://{self.master_addr}:{self.master_port}"


def expand_nodelist(nodelist: str) -> List[str]:
    """Expand Slurm's compressed host list (``node[01-03,7],gpu-a``) without calling Slurm.

    Handles one bracket group per name, which is what Slurm emits for a job's nodes; for
    anything fancier :func:`scontrol_hostnames` asks ``scontrol show hostnames``.
    """
    out: List[str] = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", nodelist):
        part = part.strip()
        if not part:
            continue
        m = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", part)
        if not m:
            out.append(part)
            continue
        prefix, ranges, suffix = m.groups()
        for rng in ranges.split(","):
            if "-" in rng:
                lo, hi = rng.split("-", 1)
                width = len(lo)
                for i in range(int(lo), int(hi) + 1):
                    out.append(f"{prefix}{i:0{width}d}{suffix}")
            else:
                out.append(f"{prefix}{rng}{suffix}")
    return out


def scontrol_hostnames(nodelist: str, runner: Callable[..., subprocess.CompletedProcess] = subprocess.run) -> List[str]:
    """``scontrol show hostnames`` when available; the built-in parser otherwise."""
    try:
        res = runner(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return expand_nodelist(nodelist)
    if res.returncode != 0 or not res.stdout.strip():
        return expand_nodelist(nodelist)
    return res.stdout.split()


def resolve_address(host: str, resolver: Callable[[str], str] = socket.gethostbyname) -> str:
    """A rendezvous address every rank can reach: the host's IP, or the name if DNS fails."""
    try:
        return resolver(host)
    except OSError:
        return host


# The Slurm rendezvous port: PORT_BASE + (job id + PORT_STRIDE x restart) % PORT_SPAN, i.e. 20000-31999, below
# Linux's ephemeral range (net.ipv4.ip_local_port_range, 32768-60999 by default), where the kernel hands out the
# ports of outgoing connections (gloo's and NCCL's among them) and a listen can lose the race for one. The job id
# keeps concurrent jobs on a node apart; the restart count (Slurm's plus the in-job relaunches) moves a requeued
# job or a relaunched step to another port, since its previous attempt's may still be in TIME_WAIT. PORT_STRIDE is
# prime and coprime to PORT_SPAN, so one job visits all PORT_SPAN ports before it repeats one.
PORT_BASE, PORT_SPAN, PORT_STRIDE = 20000, 12000, 7919
EPHEMERAL_LOW = 32768  # Linux's default net.ipv4.ip_local_port_range starts here


def rendezvous_port(job_id: int, restart: int) -> int:
    """The rendezvous port of attempt ``restart`` (Slurm's restart count plus the in-job offset) of job ``job_id``:
    the formula the sbatch script evaluates (:func:`rendezvous_port_shell`), in [PORT_BASE, PORT_BASE + PORT_SPAN)."""
    return PORT_BASE + (int(job_id) + PORT_STRIDE * int(restart)) % PORT_SPAN


def rendezvous_port_shell() -> str:
    """:func:`rendezvous_port` as a bash arithmetic expansion over the step's environment (``SLURM_JOB_ID``,
    ``SLURM_RESTART_COUNT``, ``SLURMTRON_IN_JOB_OFFSET``): what the rendered script exports as ``MASTER_PORT``."""
    restart = "${SLURM_RESTART_COUNT:-0} + ${SLURMTRON_IN_JOB_OFFSET:-0}"
    return f"$(({PORT_BASE} + (${{SLURM_JOB_ID:-0}} + {PORT_STRIDE} * ({restart})) % {PORT_SPAN}))"


def _count(env: Mapping[str, str], key: str) -> int:
    raw = str(env.get(key) or "").strip()
    return int(raw) if raw.isdigit() else 0


def default_port(job_id: Optional[str], env: Optional[Mapping[str, str]] = None) -> int:
    """The rendezvous port when the script exported none: :func:`rendezvous_port` of the job id and the restart
    count in ``env`` (``SLURM_RESTART_COUNT`` + ``SLURMTRON_IN_JOB_OFFSET``); 29500 outside a Slurm job."""
    if job_id and job_id.isdigit():
        env = env or {}
        return rendezvous_port(int(job_id), _count(env, "SLURM_RESTART_COUNT") + _count(env, "SLURMTRON_IN_JOB_OFFSET"))
    return 29500


def from_env(
    env: Mapping[str, str],
    *,
    expand: Callable[[str], List[str]] = expand_nodelist,
    resolver: Callable[[str], str] = resolve_address,
) -> DistEnv:
    """Read this rank's place from Slurm's or torchrun's variables (see the module docstring)."""
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and "RANK" not in env:
        # the step's nodes: with spare nodes (recovery/injob.py) the step runs on some of the allocation's
        nodes = expand(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
                       or "") or ["127.0.0.1"]
        addr = env.get("MASTER_ADDR") or resolver(nodes[0])
        port = int(env.get("MASTER_PORT") or default_port(env.get("SLURM_JOB_ID"), env))
        return DistEnv(
            rank=int(env["SLURM_PROCID"]),
            world_size=int(env["SLURM_NTASKS"]),
            local_rank=int(env.get("SLURM_LOCALID", "0")),
            master_addr=addr,
            master_port=port,
            nodes=nodes,
            source="slurm",
        )
    if "RANK" in env and "WORLD_SIZE" in env:
        addr = env.get("MASTER_ADDR", "127.0.0.1")
        return DistEnv(
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", "0")),
            master_addr=resolver(addr),
            master_port=int(env.get("MASTER_PORT", "29500")),
            nodes=[addr],
            source="torchrun",
        )
    return DistEnv(0, 1, 0, "127.0.0.1", int(env.get("MASTER_PORT", "29500")), ["127.0.0.1"], "single")


LOCAL_NODE_ENV = "SLURMTRON_NODE"  # cluster=local with cluster.nodes > 1: the simulated node of a rank


def simulated_node(rank: int, per_node: int) -> str:
    """``node1``: the simulated node of ``rank`` when ``cluster=local`` groups its ranks ``per_node`` at a time."""
    return f"node{rank // max(1, per_node)}"


def rank_of(env: Mapping[str, str]) -> int:
    """This rank's number without resolving any host (torchrun's ``RANK``, Slurm's ``SLURM_PROCID``, else 0); raises
    ValueError for a value that is not a number."""
    raw = env.get("RANK") if "RANK" in env else env.get("SLURM_PROCID")
    return int(raw or 0)


def local_rank_of(env: Mapping[str, str]) -> int:
    """This rank's place on its node without resolving any host (torchrun's ``LOCAL_RANK``, Slurm's
    ``SLURM_LOCALID``, else 0); raises ValueError for a value that is not a number."""
    raw = env.get("LOCAL_RANK") if "LOCAL_RANK" in env else env.get("SLURM_LOCALID")
    return int(raw or 0)


def node_name(env: Mapping[str, str], hostname: Callable[[], str] = socket.gethostname) -> str:
    """This rank's node: the simulated node of ``cluster=local`` (``SLURMTRON_NODE``), Slurm's ``SLURMD_NODENAME``,
    else the host name. The local checkpoint tier keys its directories and its ring by it."""
    return env.get(LOCAL_NODE_ENV) or env.get("SLURMD_NODENAME") or hostname()


PG_TIMEOUT_S = 1800  # torch.distributed's process-group timeout for training (a hung collective raises after it)


def backend(cuda_available: bool) -> str:
    """NCCL when CUDA is present, gloo otherwise."""
    return "nccl" if cuda_available else "gloo"


def free_port(rng: Optional[random.Random] = None) -> int:
    """A port for the rendezvous store, chosen *below* Linux's ephemeral range (32768+).

    ``bind(0)`` hands out an ephemeral port, and on a busy machine gloo's own connections
    (also ephemeral) can take it between our check and the store's listen ("server socket
    has failed to listen"). A random port under 32768 that binds now is far less contended.
    """
    rng = rng or random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(20000, 32000)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-32000")
