"""A real SLURM cluster on one machine: slurmctld in this network namespace, one slurmd per node in a
network namespace of its own on a bridge, and munge. The e2e SLURM tests start it; so can a person:

    python -m tests.helpers.slurm_cluster                  # up until Ctrl-C; prints how to reach it
    python -m tests.helpers.slurm_cluster -- sbatch --wait examples/slurm/train_cpu.sbatch
                                                           # up, run one command against it, down

Needs root, iproute2 and Debian's slurmctld, slurmd, slurm-client and munge packages, which it never installs
(.ci/run does): without them it is unavailable, with the command that installs them. Everything it makes is
removed on the way out, whatever happened: the jobs, the daemons, what they started in the namespaces, the
namespaces, the bridge, the /etc/netns/<ns>/ files and its folder. Clusters side by side (tests/suite.py's
latency stage starts three at once) never share a name or a subnet; each slurmd's fixed port is in its node's
network namespace.

Like many real clusters, the nodes' host name does not lead to the nodes' network: inside each
namespace it resolves to 127.0.1.1 (Debian's default) and each node has a second interface on a
network no other node reaches. A job must find the right interface itself (phalanx/world/interface.py).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import ExitStack
from pathlib import Path

from tests.helpers.namespaces import etc_files
from tests.helpers.system_packages import IPROUTE2, SLURM

FINISHED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")
START_TIMEOUT = 60.0  # seconds for the nodes to show idle; on a busy 2-core machine it takes 2-5


class ClusterUnavailable(Exception):
    """This machine cannot host the cluster (not root, no namespaces, no packages): a reason to skip."""


def check_machine() -> None:
    """ClusterUnavailable, saying what is missing and how to install it, unless this machine can host the cluster.
    Nothing is installed here: a test suite must not change its machine (.ci/run installs the packages)."""
    if os.geteuid() != 0:
        raise ClusterUnavailable("the SLURM cluster needs root (network namespaces, daemons)")
    for package in (IPROUTE2, SLURM):
        reason = package.missing()
        if reason is not None:
            raise ClusterUnavailable(reason)


def _run(*command: str, check: bool = True, timeout: float = 30, env: dict | None = None):
    return subprocess.run(command, capture_output=True, text=True, check=check, timeout=timeout, env=env)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def _unused_subnet() -> tuple[str, socket.socket]:
    """A 10.x.y.0/24 that no address or route of this machine covers yet (its first three numbers), and the
    socket that holds it: an abstract unix socket named after it, which one process alone can bind, so that
    clusters starting at once never take the same one (each checks the routes before any has added its own).
    Closing the socket, or the process ending, lets the subnet go."""
    taken = "".join(_run("ip", "-4", what, "show", check=False).stdout for what in ("route", "addr"))
    while True:
        net = f"10.{random.randrange(200, 250)}.{random.randrange(256)}"
        if f"{net}." in taken:
            continue
        hold = socket.socket(socket.AF_UNIX)
        try:
            hold.bind(f"\0phalanx-slurm-subnet-{net}")
        except OSError:  # another cluster holds it
            hold.close()
            continue
        return net, hold


class SlurmCluster:
    """`nodes` SLURM nodes named node1..nodeN with `cpus` CPUs each, one partition. Use as a context manager.

    `env` is the environment for SLURM's commands (SLURM_CONF); `run(...)` runs one of them.
    """

    def __init__(self, nodes: int = 2, cpus: int = 2):
        self.nodes, self.cpus = nodes, cpus
        tag = uuid.uuid4().hex[:6]  # the longest name, a veth's inner end, stays within 15 characters
        self.net: str | None = None  # chosen and held in start()
        self._subnet_hold: socket.socket | None = None
        self.bridge = f"phxsb{tag}"
        self.names = [f"node{k}" for k in range(1, nodes + 1)]
        self.namespaces = [f"phxslurm{tag}{k}" for k in range(1, nodes + 1)]
        self.addresses: list[str] = []  # on the subnet start() holds
        self.host_ends = [f"phxs{tag}h{k}" for k in range(1, nodes + 1)]  # the bridge's side of each link
        self.spare_ends = [f"phxs{tag}x{k}" for k in range(1, nodes + 1)]  # the far end of each spare network
        self.controller_addr = ""
        self.dir: Path | None = None
        self.env: dict = {}
        self._daemons: list[subprocess.Popen] = []
        self._made: list[tuple[str, str]] = []  # what to remove, in reverse order
        self._etc = ExitStack()  # the namespaces' /etc/netns files

    # -- building ----------------------------------------------------------------------------------

    def __enter__(self) -> SlurmCluster:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, timeout: float = START_TIMEOUT) -> SlurmCluster:
        check_machine()
        self.dir = Path(tempfile.mkdtemp(prefix="phalanx-slurm-"))
        os.chmod(self.dir, 0o755)  # munged insists that no one else may write above its files
        try:
            self.net, self._subnet_hold = _unused_subnet()
            self.addresses = [f"{self.net}.{10 + k}" for k in range(1, self.nodes + 1)]
            self.controller_addr = f"{self.net}.1"
            self._network()
            self._munge()
            self._write_config()
            self._daemons.append(self._spawn("slurmctld", "/usr/sbin/slurmctld", "-D", "-i"))
            for name, namespace in zip(self.names, self.namespaces):
                self._daemons.append(self._spawn(f"slurmd-{name}", "ip", "netns", "exec", namespace,
                                                 "/usr/sbin/slurmd", "-D", "-N", name))
            self._wait_idle(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _network(self) -> None:
        made = _run("ip", "netns", "add", self.namespaces[0], check=False)
        if made.returncode != 0:
            raise ClusterUnavailable(f"cannot create a network namespace ({made.stderr.strip()})")
        self._made.append(("netns", self.namespaces[0]))
        for namespace in self.namespaces[1:]:
            _run("ip", "netns", "add", namespace)
            self._made.append(("netns", namespace))
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        self._made.append(("link", self.bridge))
        _run("ip", "addr", "add", f"{self.controller_addr}/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        hosts = [f"{self.controller_addr} {socket.gethostname()}-ctl", "127.0.0.1 localhost",
                 f"127.0.1.1 {socket.gethostname()}"]  # the machine's name leads nowhere useful, as on Debian
        hosts += [f"{addr} {name}" for addr, name in zip(self.addresses, self.names)]
        for k, (namespace, addr, host_end, spare_end) in enumerate(zip(self.namespaces, self.addresses,
                                                                       self.host_ends, self.spare_ends)):
            self._link(host_end, namespace, "eth0", f"{addr}/24")
            _run("ip", "link", "set", host_end, "master", self.bridge)
            _run("ip", "link", "set", host_end, "up")
            # A second network (a storage or management one on real clusters) that reaches no other node.
            self._link(spare_end, namespace, "eth1", f"192.168.{200 + k}.2/24")
            _run("ip", "link", "set", spare_end, "up")
            _run("ip", "-n", namespace, "link", "set", "lo", "up")
            # resolv.conf empty: no DNS to wait for, names come from hosts
            self._etc.enter_context(etc_files(namespace, {"hosts": "\n".join(hosts) + "\n", "resolv.conf": ""}))

    def _link(self, outer: str, namespace: str, inner: str, cidr: str) -> None:
        """A veth pair: `outer` stays here, `inner` goes into the namespace with address `cidr`."""
        _run("ip", "link", "add", outer, "type", "veth", "peer", "name", f"{outer}i")
        self._made.append(("link", outer))  # a namespace's end may outlive it (gVisor): remove both sides
        _run("ip", "link", "set", f"{outer}i", "netns", namespace)
        _run("ip", "-n", namespace, "link", "set", f"{outer}i", "name", inner)
        _run("ip", "-n", namespace, "addr", "add", cidr, "dev", inner)
        _run("ip", "-n", namespace, "link", "set", inner, "up")

    def _munge(self) -> None:
        key = self.dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        self.munge_socket = str(self.dir / "munge.socket")
        self._daemons.append(self._spawn(
            "munged", "/usr/sbin/munged", "-F", "--force", f"--socket={self.munge_socket}", f"--key-file={key}",
            f"--pid-file={self.dir / 'munged.pid'}", f"--log-file={self.dir / 'munged.log'}",
            f"--seed-file={self.dir / 'munged.seed'}"))
        deadline = time.monotonic() + 15
        while not os.path.exists(self.munge_socket):
            if time.monotonic() > deadline or self._daemons[-1].poll() is not None:
                raise RuntimeError(f"munged did not start:\n{self._log('munged')}")
            time.sleep(0.05)

    def _write_config(self) -> None:
        d = self.dir
        self.controller_port = _free_port()
        (d / "state").mkdir()
        nodes = "\n".join(f"NodeName={name} NodeAddr={addr} CPUs={self.cpus} RealMemory=1000 State=UNKNOWN"
                          for name, addr in zip(self.names, self.addresses))
        config = f"""\
ClusterName=phalanx
SlurmctldHost={socket.gethostname()}({self.controller_addr})
SlurmctldPort={self.controller_port}
SlurmdPort=6818
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket},cred_expire=10
StateSaveLocation={d / 'state'}
SlurmdSpoolDir={d}/spool-%n
SlurmctldPidFile={d / 'slurmctld.pid'}
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d / 'slurmctld.log'}
SlurmdLogFile={d}/slurmd-%n.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
KillWait=30
MinJobAge=600
JobRequeue=1
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
        (d / "slurm.conf").write_text(config)
        # /sys/fs/cgroup is a tmpfs of v1 hierarchies here: slurmd would look for cgroup v2 without this.
        (d / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\n")
        (d / "plugstack.conf").write_text("")
        self.env = {**os.environ, "SLURM_CONF": str(d / "slurm.conf")}

    def _spawn(self, name: str, *command: str) -> subprocess.Popen:
        log = open(self.dir / f"{name}.out", "w")
        try:
            return subprocess.Popen(command, env=self.env or os.environ, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            log.close()

    def _log(self, name: str) -> str:
        texts = []
        for path in sorted(self.dir.glob(f"{name}*")):
            if path.suffix in (".out", ".log"):
                texts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-3000:]}")
        return "\n".join(texts)

    def _wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        states = ""
        while time.monotonic() < deadline:
            for daemon in self._daemons:
                if daemon.poll() is not None:
                    raise RuntimeError(f"{daemon.args} exited with {daemon.returncode}:\n{self.logs()}")
            done = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False)
            states = done.stdout.strip()
            if done.returncode == 0 and sorted(states.split("\n")) == [f"{name} idle" for name in self.names]:
                return
            time.sleep(0.2)
        raise RuntimeError(f"the nodes are not idle after {timeout:.0f}s (sinfo: {states!r}):\n{self.logs()}")

    # -- using -------------------------------------------------------------------------------------

    def run(self, *command: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
        """Run a SLURM command (sinfo, sbatch, scontrol, ...) against this cluster."""
        return _run(*command, check=check, timeout=timeout, env=self.env)

    def submit(self, script, *args: str, flags=(), cwd=None, env: dict | None = None) -> int:
        """`sbatch [flags] script [args]` from `cwd` (the job's SLURM_SUBMIT_DIR) with `env`; the job id."""
        done = subprocess.run(["sbatch", "--parsable", *flags, str(script), *args], capture_output=True, text=True,
                              cwd=cwd, env={**(env or os.environ), "SLURM_CONF": self.env["SLURM_CONF"]}, timeout=30)
        if done.returncode != 0:
            raise RuntimeError(f"sbatch failed ({done.returncode}): {done.stderr}")
        return int(done.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """`scontrol show job`'s fields: JobState, ExitCode, Restarts, RunTime, ..."""
        shown = self.run("scontrol", "show", "job", "--oneliner", str(job_id)).stdout
        return dict(field.split("=", 1) for field in shown.split() if "=" in field)

    def wait(self, job_id: int, timeout: float, until=FINISHED) -> dict[str, str]:
        """Poll the job until its state is one of `until`; its fields. TimeoutError (with them) after `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            fields = self.job(job_id)
            if fields.get("JobState") in until:
                return fields
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {fields.get('JobState')} after {timeout:.0f}s: {fields}")
            time.sleep(0.25)

    def logs(self) -> str:
        """The daemons' logs, for a failure message."""
        return "\n".join(self._log(name) for name in ("munged", "slurmctld", "slurmd"))

    # -- tearing down ------------------------------------------------------------------------------

    def stop(self) -> None:
        """Remove everything start() made; safe after a failed start and when called twice."""
        if self._daemons and self._daemons[0].poll() is None and self.env:
            self.run("scancel", "--full", "--signal=KILL", "--user=root", check=False)
        self._kill_namespace_processes()  # the jobs' processes: slurmstepd outlives slurmd
        for daemon in reversed(self._daemons):
            if daemon.poll() is None:
                daemon.send_signal(signal.SIGTERM)
                try:
                    daemon.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    daemon.kill()
                    daemon.wait()
        self._daemons = []
        self._kill_namespace_processes()
        for kind, name in reversed(self._made):
            if kind == "netns":
                _run("ip", "netns", "del", name, check=False)
            elif kind == "link":
                _run("ip", "link", "del", name, check=False)
        self._made = []
        self._etc.close()
        if self._subnet_hold is not None:  # its address went with the bridge
            self._subnet_hold.close()
            self._subnet_hold = None
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    def _kill_namespace_processes(self) -> None:
        """SIGKILL every process in this cluster's namespaces (all of them started by its slurmds)."""
        for kind, namespace in self._made:
            if kind != "netns":
                continue
            listed = _run("ip", "netns", "pids", namespace, check=False)
            for pid in listed.stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass


def main(argv: list[str]) -> int:
    command = argv[argv.index("--") + 1:] if "--" in argv else []
    try:
        cluster = SlurmCluster().start()
    except ClusterUnavailable as exc:
        print(f"slurm_cluster: cannot run here: {exc}", file=sys.stderr)
        return 2
    # The cluster comes down on Ctrl-C and on SIGTERM too.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        print(f"slurm_cluster: nodes {', '.join(f'{n} ({a})' for n, a in zip(cluster.names, cluster.addresses))} "
              f"idle; files in {cluster.dir}", file=sys.stderr, flush=True)
        if command:
            return subprocess.run(command, env=cluster.env).returncode
        print(f"slurm_cluster: export SLURM_CONF={cluster.env['SLURM_CONF']}   # then sbatch, srun, squeue; "
              f"Ctrl-C tears it down", file=sys.stderr, flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 0
    finally:
        cluster.stop()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
