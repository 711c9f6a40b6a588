"""A real Slurm cluster on one machine, for the ``slurm``-marked tests.

Why a real one: ``--requeue`` semantics, signal timing, NODE_FAIL and preemption under
GraceTime are what slurmtron promises; a fake at the subprocess boundary cannot tell whether
any of it works (``../shared/notes/real-slurm-locally.md`` records what was seen to work).

What it starts, all under one temporary state directory and all listening on 127.0.0.1 only:
munged, MariaDB (``--skip-grant-tables``, loopback), slurmdbd (so ``sacct`` has records),
slurmctld and ``nodes`` slurmd daemons (``<prefix>1..N``, 8 fake GPUs each: character devices
made with ``mknod c 1 3``). Every daemon's PID is written under ``<root>/pids/`` and ``stop``
ends exactly those PIDs (and the job processes their slurmd started).

Node names are added to /etc/hosts (one marked line per cluster; removed on stop) so that
``MASTER_ADDR=<first node>`` resolves in the jobs.

Standalone, for debugging::

    python tests/slurm_cluster.py start [--root DIR]   # prints: export SLURM_CONF=...
    python tests/slurm_cluster.py stop  [--root DIR]

Must run as root (jobs run as root; the Debian packages are installed with apt when missing).
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "slurmdbd", "munge", "mariadb-server")
BINARIES = ("slurmctld", "slurmd", "slurmdbd", "sbatch", "sacct", "munged", "mariadbd", "mariadb-install-db")
HOSTS_MARK = "# slurmtron-test-cluster"
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL",
         "DEADLINE"}


@dataclass(frozen=True)
class ClusterSpec:
    """The cluster's shape; ``hydra_conf/cluster/slurm_local.yaml`` must agree with it."""

    nodes: int = 12  # 3 concurrent 2-node jobs (one with 2 spares), the light lane's 2, nodes to requeue onto
    gpus_per_node: int = 8  # fake GPUs (character devices)
    cpus_per_node: int = 4  # declared CPUs (SlurmdParameters=config_overrides allows more than the host has)
    node_prefix: str = "stn"  # node names stn1..stnN (resolved through /etc/hosts)
    partition: str = "debug"  # default partition: preemptible (REQUEUE) with a grace time
    urgent_partition: str = "urgent"  # higher PriorityTier: its jobs preempt the default partition's
    grace_time_s: int = 30  # SIGTERM to the steps, then this long before the kill and requeue
    max_time_min: int = 30  # partition MaxTime

    @property
    def node_names(self) -> List[str]:
        return [f"{self.node_prefix}{i}" for i in range(1, self.nodes + 1)]

    @property
    def node_range(self) -> str:
        return f"{self.node_prefix}[1-{self.nodes}]"


@dataclass(frozen=True)
class Ports:
    """Loopback ports picked at start, so two clusters on one machine do not collide."""

    slurmctld: int
    slurmdbd: int
    mysql: int
    slurmd: List[int]


@dataclass(frozen=True)
class Layout:
    """Where everything lives under the state directory (short paths: unix sockets < 108 chars)."""

    root: Path

    @property
    def etc(self) -> Path:
        return self.root / "etc"

    @property
    def slurm_conf(self) -> Path:
        return self.etc / "slurm.conf"

    @property
    def munge_socket(self) -> Path:
        return self.root / "munge" / "munge.sock"

    @property
    def pids(self) -> Path:
        return self.root / "pids"

    @property
    def logs(self) -> Path:
        return self.root / "log"

    @property
    def gpu_dev(self) -> Path:
        return self.root / "dev"


# ----------------------------------------------------------------------------- pure renderers


def render_slurm_conf(spec: ClusterSpec, lay: Layout, ports: Ports, hostname: str, first_job_id: int = 1) -> str:
    """slurm.conf tuned for fast, observable recovery (see the notes for why each line).

    ``first_job_id`` differs per cluster so that two clusters on one machine (parallel test
    sessions) do not hand out the same job ids, from which the batch script derives
    MASTER_PORT.
    """
    nodes = "\n".join(
        f"NodeName={n} NodeHostname=localhost NodeAddr=127.0.0.1 Port={p} "
        f"CPUs={spec.cpus_per_node} RealMemory=4000 Gres=gpu:{spec.gpus_per_node} State=UNKNOWN"
        for n, p in zip(spec.node_names, ports.slurmd)
    )
    r = lay.root
    return f"""\
ClusterName=slurmtron
FirstJobId={first_job_id}
SlurmctldHost={hostname}(127.0.0.1)
SlurmctldPort={ports.slurmctld}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire=10: a requeued job restarts after ~11 s instead of the default 120 s
AuthInfo=socket={lay.munge_socket},cred_expire=10
CommunicationParameters=NoInAddrAny,NoCtldInAddrAny
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/pids/slurmctld.pidfile
SlurmdPidFile={r}/pids/slurmd-%n.pidfile
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=1
ReturnToService=2
JobRequeue=1
# refuse at submission what a partition cannot run (as many sites do), not pend forever
EnforcePartLimits=ALL
SlurmdTimeout=10
SlurmctldTimeout=30
MessageTimeout=10
KillWait=5
InactiveLimit=0
MinJobAge=300
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort={ports.slurmdbd}
# clients that talk to slurmdbd ignore AuthInfo; this is how they find the munge socket
AccountingStoragePass={lay.munge_socket}
JobCompType=jobcomp/filetxt
JobCompLoc={r}/log/jobcomp.txt
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
{nodes}
PartitionName={spec.partition} Nodes={spec.node_range} Default=YES MaxTime={spec.max_time_min} State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime={spec.grace_time_s}
PartitionName={spec.urgent_partition} Nodes={spec.node_range} MaxTime={spec.max_time_min} State=UP PriorityTier=10 PreemptMode=OFF
"""


def render_slurmdbd_conf(lay: Layout, ports: Ports) -> str:
    """slurmdbd.conf; slurmdbd reads it from SLURM_CONF's directory (it has no -f)."""
    r = lay.root
    return f"""\
AuthType=auth/munge
AuthInfo=socket={lay.munge_socket}
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort={ports.slurmdbd}
# with NoInAddrAny slurmdbd binds to its hostname's address; start() runs it in a UTS
# namespace whose hostname is localhost, so it listens on 127.0.0.1 only
CommunicationParameters=NoInAddrAny
SlurmUser=root
LogFile={r}/log/slurmdbd.log
PidFile={r}/pids/slurmdbd.pidfile
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort={ports.mysql}
StorageUser=slurm
StorageLoc=slurm_acct_db
"""


def render_gres_conf(spec: ClusterSpec, lay: Layout) -> str:
    """Every node shares the same fake devices: Slurm only needs character devices to count."""
    last = spec.gpus_per_node - 1
    return f"NodeName={spec.node_range} Name=gpu File={lay.gpu_dev}/nvidia[0-{last}]\n"


def hosts_line(spec: ClusterSpec, lay: Layout) -> str:
    return f"127.0.0.1 {' '.join(spec.node_names)} {HOSTS_MARK} {lay.root}"


def with_hosts_line(text: str, line: str) -> str:
    """/etc/hosts with ``line`` present exactly once (idempotent)."""
    lines = [x for x in text.splitlines() if x != line]
    return "\n".join(lines + [line]) + "\n"


def without_hosts_line(text: str, line: str) -> str:
    return "\n".join(x for x in text.splitlines() if x != line) + "\n"


# ----------------------------------------------------------------------------- side effects


Runner = Callable[..., subprocess.CompletedProcess]


def _run(cmd: Sequence[str], timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, **kw)


def missing_binaries() -> List[str]:
    return [b for b in BINARIES if shutil.which(b) is None]


def ensure_packages(run: Runner = _run) -> None:
    """Install Debian's Slurm, munge and MariaDB when missing (a fresh CI machine).

    A temporary policy-rc.d stops the packages' init scripts from starting system daemons:
    this cluster starts its own, on loopback, from its own state directory.
    """
    if not missing_binaries():
        return
    if os.geteuid() != 0:
        raise RuntimeError(f"missing {missing_binaries()} and not root: apt-get install {' '.join(PACKAGES)}")
    policy = Path("/usr/sbin/policy-rc.d")
    added = not policy.exists()
    if added:
        policy.write_text("#!/bin/sh\nexit 101\n")
        policy.chmod(0o755)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    try:
        for cmd in (["apt-get", "update"],
                    ["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES]):
            res = run(cmd, timeout=600, env=env)
            if res.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    finally:
        if added:
            policy.unlink()
    if missing_binaries():
        raise RuntimeError(f"still missing after apt-get: {missing_binaries()}")


def free_ports(n: int, low: int = 12000, high: int = 20000) -> List[int]:
    """Distinct free loopback ports below the ephemeral range (and below the job-id-derived
    MASTER_PORTs at 20000+): on a busy machine a port picked from the ephemeral range can be
    taken by some outgoing connection before the daemon binds it."""
    rng, out = random.SystemRandom(), []
    for port in rng.sample(range(low, high), high - low):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        out.append(port)
        if len(out) == n:
            return out
    raise RuntimeError(f"fewer than {n} free ports in {low}-{high}")


def _spawn(lay: Layout, name: str, cmd: List[str], env: Dict[str, str], cwd: Path) -> int:
    """Start a foreground daemon in its own session; its PID goes to pids/<name>.pid."""
    log = open(lay.logs / f"{name}.stdout", "ab")
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    log.close()
    (lay.pids / f"{name}.pid").write_text(str(proc.pid))
    return proc.pid


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie child of this process counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _reap(pids: List[int]) -> None:
    """Collect those of ``pids`` that are our exited children, so they are not zombies.

    Only these PIDs: a ``waitpid(-1)`` would also take the exit status of some other thread's
    ``subprocess.run`` child (which then reads as 0).
    """
    for pid in pids:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass


def wait_until(pred: Callable[[], bool], timeout: float, what: str, interval: float = 0.3) -> None:
    """Poll ``pred`` until true; raise TimeoutError naming ``what``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def slurmdbd_command(run: Runner = _run) -> List[str]:
    """slurmdbd, kept on loopback.

    slurmdbd has no bind-address setting: with ``NoInAddrAny`` it binds to its hostname's
    address. Inside a UTS namespace whose hostname is ``localhost`` that is 127.0.0.1; where
    namespaces are not allowed (an unprivileged container), the machine's own hostname must
    already resolve to loopback, or we refuse rather than listen on the network.
    """
    if run(["unshare", "--uts", "true"], timeout=10).returncode == 0:
        return ["unshare", "--uts", "sh", "-c", "hostname localhost && exec slurmdbd -D"]
    try:
        addrs = {a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)}
    except OSError:
        addrs = set()
    if addrs and all(a.startswith("127.") for a in addrs):
        return ["slurmdbd", "-D"]
    raise RuntimeError(f"cannot keep slurmdbd on loopback: no UTS namespace (unshare) and the hostname "
                       f"{socket.gethostname()!r} resolves to {sorted(addrs)}")


def _munge_key(path: Path) -> None:
    path.write_bytes(os.urandom(1024))
    path.chmod(0o400)


def _fake_gpus(spec: ClusterSpec, lay: Layout) -> None:
    lay.gpu_dev.mkdir(exist_ok=True)
    for i in range(spec.gpus_per_node):
        dev = lay.gpu_dev / f"nvidia{i}"
        if not dev.exists():
            os.mknod(dev, 0o666 | 0o020000, os.makedev(1, 3))  # S_IFCHR, like /dev/null


def _hosts_add(line: str, hosts: Path = Path("/etc/hosts")) -> None:
    hosts.write_text(with_hosts_line(hosts.read_text(), line))


def _hosts_remove(line: str, hosts: Path = Path("/etc/hosts")) -> None:
    text = hosts.read_text()
    if line in text.splitlines():
        hosts.write_text(without_hosts_line(text, line))


@dataclass
class Cluster:
    """A started cluster: its spec, state directory and the client environment."""

    spec: ClusterSpec
    lay: Layout

    @property
    def env(self) -> Dict[str, str]:
        """The environment for Slurm clients (and the jobs, which inherit it through sbatch)."""
        return {**os.environ, "SLURM_CONF": str(self.lay.slurm_conf)}

    def run(self, *cmd: str, timeout: float = 30, check: bool = True) -> subprocess.CompletedProcess:
        res = _run(cmd, timeout=timeout, env=self.env)
        if check and res.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} -> {res.returncode}\n{res.stdout}\n{res.stderr}")
        return res

    def sacct(self, job_id: str, duplicates: bool = True) -> List[Dict[str, str]]:
        """sacct rows of one job (allocation lines only; with -D every requeued run too).

        sacct has no restart count in 22.05: count the REQUEUED/NODE_FAIL/PREEMPTED rows, or
        read ``Restarts`` from :meth:`job` while the controller remembers the job.
        """
        fields = "JobID,JobName,State,ExitCode,NodeList,Start,End,Elapsed,Partition,Reason"
        args = ["sacct", "-j", str(job_id), "-X", "--parsable2", "--noheader", f"--format={fields}"]
        if duplicates:
            args.insert(1, "-D")
        out = self.run(*args).stdout
        keys = fields.split(",")
        return [dict(zip(keys, line.split("|"))) for line in out.splitlines() if line.strip()]

    def sacct_dump(self, job_id: str) -> str:
        """The raw ``sacct -D --parsable2`` text of a job and its steps (what analysis reads)."""
        fields = ("JobID,JobIDRaw,JobName,Partition,State,ExitCode,DerivedExitCode,NNodes,NodeList,AllocTRES,"
                  "Submit,Eligible,Start,End,Elapsed,Timelimit,Reason")
        return self.run("sacct", "-D", "-j", str(job_id), "--parsable2", f"--format={fields}").stdout

    def job(self, job_id: str) -> Dict[str, str]:
        """``scontrol show job`` as a dict ({} once the controller forgot it)."""
        res = self.run("scontrol", "-o", "show", "job", str(job_id), check=False)
        if res.returncode != 0:
            return {}
        out: Dict[str, str] = {}
        for tok in res.stdout.split():
            k, _, v = tok.partition("=")
            out.setdefault(k, v)
        return out

    def state(self, job_id: str) -> str:
        """The controller's live JobState ('' once it forgot the job)."""
        return self.job(job_id).get("JobState", "")

    def wait_end(self, job_id: str, timeout: float) -> str:
        """Wait for a final state in the controller *and* in sacct (slurmdbd lags a little).

        A requeue passes through REQUEUED/PENDING, which are not final, so this returns only
        when the job (all its restarts) is over.
        """
        wait_until(lambda: self.state(job_id) in FINAL or not self.job(job_id), timeout,
                   f"job {job_id} to end (now {self.state(job_id) or 'gone'})", interval=1)
        final = self.state(job_id)
        wait_until(lambda: self._sacct_state(job_id) == final or (not final and self._sacct_state(job_id) in FINAL),
                   30, f"sacct to record job {job_id} as {final}", interval=1)
        return self._sacct_state(job_id)

    def _sacct_state(self, job_id: str) -> str:
        rows = self.sacct(job_id, duplicates=False)  # a job that lost a node under --no-kill: RESIZING, then its end
        return rows[-1]["State"].split()[0] if rows else ""

    def crash_node(self, node: str) -> List[int]:
        """A node dies: SIGKILL its slurmd and every job process on it (by PID). Returns the PIDs."""
        slurmd = _pids(self.lay)[f"slurmd-{node}"]
        assert _environ(slurmd).get("SLURM_CONF") == str(self.lay.slurm_conf), f"slurmd of {node} is not running"
        pids = [slurmd] + job_processes(self.lay, node)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _reap(pids)
        return pids

    def restart_slurmd(self, node: str) -> int:
        """Bring a crashed node back (ReturnToService=2 returns it to service on registration)."""
        return _spawn(self.lay, f"slurmd-{node}", ["slurmd", "-D", "-N", node], self.env, self.lay.root)

    def hostnames(self, nodelist: str) -> List[str]:
        """``stn[1-2]`` -> ``['stn1', 'stn2']`` (Slurm's own expansion)."""
        return self.run("scontrol", "show", "hostnames", nodelist).stdout.split()

    def in_service(self, node: str) -> bool:
        """Whether ``node`` takes jobs. A node Slurm drained itself because a killed step's processes outlived
        UnkillableStepTimeout ("Kill task failed": a 2-core machine at load 20 can take that long to tear a rank
        down) is resumed here, as its admin would: the scenarios that kill nodes need them all back afterwards."""
        state = self.node_state(node)
        if state.startswith("drain") or state == "drng":
            reason = self.run("sinfo", "-h", "-n", node, "-p", self.spec.partition, "-o", "%E", check=False).stdout
            if "Kill task failed" in reason:
                self.run("scontrol", "update", f"NodeName={node}", "State=RESUME", check=False)
                state = self.node_state(node)
        return state in ("idle", "mix", "alloc")

    def node_state(self, node: str) -> str:
        res = self.run("sinfo", "-h", "-n", node, "-p", self.spec.partition, "-o", "%t", check=False)
        return res.stdout.strip()

    def diagnostics(self, tail: int = 40) -> str:
        """The tails of the Slurm daemon logs: what a failed CI run needs to be diagnosable."""
        parts = []
        for f in sorted(self.lay.logs.glob("slurm*.log")) + sorted(self.lay.logs.glob("jobcomp.txt")):
            lines = f.read_text(errors="replace").splitlines()[-tail:]
            parts.append(f"===== {f.name} (last {len(lines)} lines)\n" + "\n".join(lines))
        return "\n".join(parts)


def start(root: Path, spec: ClusterSpec = ClusterSpec(), timeout: float = 90) -> Cluster:
    """Start munge, MariaDB, slurmdbd, slurmctld and the slurmd nodes; wait until all nodes are idle."""
    ensure_packages()
    lay = Layout(root)
    for d in ("etc", "munge", "pids", "log", "state", "spool", "db", "tmp"):
        (root / d).mkdir(parents=True, exist_ok=True)
    (root / "munge").chmod(0o755)
    picked = free_ports(3 + spec.nodes)
    ports = Ports(slurmctld=picked[0], slurmdbd=picked[1], mysql=picked[2], slurmd=picked[3:])
    first_job_id = random.SystemRandom().randrange(100, 12000, 100)  # MASTER_PORT 20000 + id stays below 32768
    lay.slurm_conf.write_text(render_slurm_conf(spec, lay, ports, socket.gethostname().split(".")[0], first_job_id))
    (lay.etc / "slurmdbd.conf").write_text(render_slurmdbd_conf(lay, ports))
    (lay.etc / "slurmdbd.conf").chmod(0o600)
    (lay.etc / "gres.conf").write_text(render_gres_conf(spec, lay))
    _fake_gpus(spec, lay)
    (lay.etc / "hosts_line").write_text(hosts_line(spec, lay))
    _hosts_add(hosts_line(spec, lay))
    cluster = Cluster(spec, lay)
    env = cluster.env
    try:
        key = root / "munge" / "munge.key"
        _munge_key(key)
        _spawn(lay, "munged", ["munged", "-F", "--force", f"--socket={lay.munge_socket}", f"--key-file={key}",
                               f"--pid-file={root}/munge/munged.pidfile", f"--log-file={lay.logs}/munged.log",
                               f"--seed-file={root}/munge/seed"], env, root)
        res = _run(["mariadb-install-db", "--no-defaults", f"--datadir={root}/db", "--user=root",
                    "--auth-root-authentication-method=normal", "--skip-test-db"], timeout=120)
        if res.returncode != 0:
            raise RuntimeError(f"mariadb-install-db failed:\n{res.stdout}\n{res.stderr}")
        _spawn(lay, "mariadbd", ["mariadbd", "--no-defaults", f"--datadir={root}/db", f"--socket={root}/db.sock",
                                 f"--port={ports.mysql}", "--bind-address=127.0.0.1", "--user=root",
                                 "--skip-grant-tables", f"--log-error={lay.logs}/mariadb.log",
                                 "--innodb-buffer-pool-size=32M"], env, root)
        wait_until(lambda: lay.munge_socket.exists(), 20, "munged socket")
        wait_until(lambda: _port_open(ports.mysql), 60, "MariaDB on 127.0.0.1")
        _spawn(lay, "slurmdbd", slurmdbd_command(), env, root)
        wait_until(lambda: _port_open(ports.slurmdbd), 60, "slurmdbd on 127.0.0.1")
        _spawn(lay, "slurmctld", ["slurmctld", "-D", "-i"], env, root)
        wait_until(lambda: _port_open(ports.slurmctld), 60, "slurmctld on 127.0.0.1")
        for n in spec.node_names:
            (root / "spool" / n).mkdir(exist_ok=True)
            _spawn(lay, f"slurmd-{n}", ["slurmd", "-D", "-N", n], env, root)
        wait_until(lambda: _all_idle(cluster) or _dead(lay), timeout, "all nodes idle in sinfo", interval=1)
        if _dead(lay):
            raise RuntimeError(f"daemons exited: {_dead(lay)}")
    except BaseException as e:
        print(cluster.diagnostics(), file=sys.stderr)
        stop(root)
        raise RuntimeError(f"local Slurm cluster failed to start: {e}") from e
    return cluster


def _dead(lay: Layout) -> List[str]:
    """Daemons of this cluster that have exited (a start-up failure shows in their log)."""
    pids = _pids(lay)
    _reap(list(pids.values()))
    return sorted(name for name, pid in pids.items() if not _alive(pid))


def _all_idle(cluster: Cluster) -> bool:
    res = cluster.run("sinfo", "-h", "-N", "-p", cluster.spec.partition, "-o", "%N %t", check=False, timeout=10)
    states = dict(line.split() for line in res.stdout.splitlines() if line.strip())
    return res.returncode == 0 and len(states) == cluster.spec.nodes and set(states.values()) == {"idle"}


def _environ(pid: int) -> Dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def job_processes(lay: Layout, node: Optional[str] = None) -> List[int]:
    """slurmstepd and job-task processes of *this* cluster (optionally of one node), by PID.

    slurmstepd re-parents to init, so it is found by its environment instead: it inherits
    SLURM_CONF from our slurmd, and job tasks inherit it from the submitting client (sbatch
    exports the environment). A node's processes carry SLURMD_NODENAME (tasks) or are the
    stepd parents of those tasks.
    """
    conf, me = str(lay.slurm_conf), os.getpid()
    out: List[int] = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == me:
            continue
        pid = int(d.name)
        env = _environ(pid)
        if env.get("SLURM_CONF") != conf:
            continue
        is_step, is_task = _comm(pid) == "slurmstepd", "SLURM_JOB_ID" in env and "SLURM_STEP_ID" in env
        if not (is_step or is_task):
            continue
        if node is None or env.get("SLURMD_NODENAME") == node or (is_step and _stepd_node(pid) == node):
            out.append(pid)
    return out


def _stepd_node(pid: int) -> str:
    """The node a slurmstepd serves: the SLURMD_NODENAME of any task it started."""
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid:
                name = _environ(int(d.name)).get("SLURMD_NODENAME")
                if name:
                    return name
    return ""


def _pids(lay: Layout) -> Dict[str, int]:
    out = {}
    for f in lay.pids.glob("*.pid"):
        try:
            out[f.stem] = int(f.read_text().strip())
        except ValueError:
            continue
    return out


def _stop_pids(pids: List[int], timeout: float = 10, conf: Optional[Path] = None) -> None:
    """SIGTERM, wait, SIGKILL. With ``conf``, only PIDs whose environment names this cluster's
    SLURM_CONF: a stale pid file must not kill whatever process reuses the number now."""
    if conf is not None:
        pids = [p for p in pids if _environ(p).get("SLURM_CONF") == str(conf)]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        _reap(pids)
        time.sleep(0.2)
    for pid in pids:
        if _alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    _reap(pids)


def stop(root: Path) -> None:
    """Cancel every job, then stop each daemon by its saved PID (slurmd first, munge last)."""
    lay = Layout(root)
    pids = _pids(lay)
    if "slurmctld" in pids and _alive(pids["slurmctld"]):
        _run(["scancel", "--full", "--user=root"], timeout=15, env={**os.environ, "SLURM_CONF": str(lay.slurm_conf)})
    conf = lay.slurm_conf
    _stop_pids([p for n, p in pids.items() if n.startswith("slurmd-")], conf=conf)
    # whatever the scancel left (steps of a node whose slurmd was killed): end them by PID
    _stop_pids(job_processes(lay), timeout=5)
    for name in ("slurmctld", "slurmdbd", "mariadbd", "munged"):
        if name in pids:
            _stop_pids([pids[name]], timeout=15, conf=conf)
    for f in lay.pids.glob("*.pid"):
        f.unlink()
    if (lay.etc / "hosts_line").exists():
        _hosts_remove((lay.etc / "hosts_line").read_text())


def _default_root() -> Path:
    return Path(tempfile.gettempdir()) / "slurmtron-cluster"


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=["start", "stop"])
    ap.add_argument("--root", type=Path, default=_default_root(), help="state directory")
    args = ap.parse_args(argv)
    if args.action == "start":
        t0 = time.monotonic()
        if args.root.exists():  # a previous cluster here: stop it, start clean
            stop(args.root)
            shutil.rmtree(args.root)
        cluster = start(args.root)
        print(f"# started in {time.monotonic() - t0:.1f}s; logs in {cluster.lay.logs}", file=sys.stderr)
        print(f"export SLURM_CONF={cluster.lay.slurm_conf}")
    else:
        t0 = time.monotonic()
        stop(args.root)
        print(f"# stopped in {time.monotonic() - t0:.1f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
