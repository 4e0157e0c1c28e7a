"""A real SLURM cluster on one Linux machine: slurmctld (and munged) in this network namespace on a bridge, and two
slurmd, each in a network namespace of its own joined to the bridge by a veth pair: two "nodes" with their own
addresses, ports and loopback, sharing the filesystem (hence output_dir). ../shared/FEASIBILITY.md has how it was
found to work (SLURM 22.05, Debian's packages).

- Each node's interface is named `hf0` (names are per namespace, so one recipe's `strategy.socket_ifname: hf0` fits
  both, as `eth0` would on a real cluster).
- slurmd is started with `nsenter --net=... unshare --mount`, not `ip netns exec`: the latter remounts /sys, hides
  the cgroup tree, and slurmd 22.05 then fails to start.
- Both namespaces share the machine's hostname, which resolves to 127.0.0.1: each slurmd gets a private hosts file
  (bind-mounted over /etc/hosts in its own mount namespace, which its jobs inherit) mapping the node names and the
  hostname to that node's address, as a real cluster's DNS would.
- Needs root, `ip` (iproute2) and the packages (scripts/install_slurm.sh installs them); `problem()` says why not.
Test infrastructure only; nothing here is part of hftrain.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from contextlib import contextmanager

from tests import netns

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = ("slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel", "munged")
NET = "10.97.0"  # the controller .1, node r .{2 + r}
IFACE = "hf0"
NODES = ("node0", "node1")


def problem(install: bool = True) -> str | None:
    """Why a cluster cannot be stood up here (None: it can). With `install`, missing packages are installed first
    (scripts/install_slurm.sh: root and apt-get)."""
    why = netns.problem()
    if why:
        return why
    if install and any(shutil.which(t) is None for t in TOOLS):
        r = subprocess.run(["bash", os.path.join(REPO, "scripts", "install_slurm.sh")], capture_output=True, text=True,
                           timeout=600)
        if r.returncode != 0:
            return f"SLURM packages missing and not installable: {(r.stderr or r.stdout).strip()[-300:]}"
    missing = [t for t in TOOLS if shutil.which(t) is None]
    return f"SLURM tools missing: {', '.join(missing)} (scripts/install_slurm.sh)" if missing else None


def _sh(*cmd: str) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {r.stderr.strip()}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


SLURM_CONF = """\
ClusterName=hftrain
SlurmctldHost={host}({net}.1)
SlurmctldPort={port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={munge_socket},cred_expire=15
CredType=cred/munge
StateSaveLocation={tmp}/state
SlurmdSpoolDir={tmp}/spool/%n
SlurmctldPidFile={tmp}/slurmctld.pid
SlurmdPidFile={tmp}/slurmd-%n.pid
SlurmctldLogFile={tmp}/slurmctld.log
SlurmdLogFile={tmp}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={tmp}/jobcomp.txt
MpiDefault=none
ReturnToService=2
KillWait=5
MinJobAge=600
JobRequeue=1
InactiveLimit=0
SlurmdTimeout=120
NodeName={node0} NodeAddr={net}.2 CPUs={cpus} State=UNKNOWN
NodeName={node1} NodeAddr={net}.3 CPUs={cpus} State=UNKNOWN
PartitionName=test Nodes={node0},{node1} Default=YES MaxTime=INFINITE State=UP
"""


class Cluster:
    """A running cluster; `env` is the environment for the clients (sbatch, squeue, scontrol, scancel)."""

    def __init__(self, tmp: str, tag: str, namespaces: tuple[str, str]):
        self.tmp, self.tag, self.namespaces = tmp, tag, namespaces
        self.conf = os.path.join(tmp, "slurm.conf")
        self.env = dict(os.environ, SLURM_CONF=self.conf)
        self.daemons: list[subprocess.Popen] = []

    def run(self, *cmd: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        r = subprocess.run(cmd, capture_output=True, text=True, env=self.env, timeout=timeout)
        if check and r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()}\n{self.logs()}")
        return r

    def sbatch(self, *args: str, env: dict | None = None) -> int:
        r = subprocess.run(["sbatch", "--parsable", *args], capture_output=True, text=True,
                           env={**self.env, **(env or {})}, timeout=60)
        if r.returncode != 0:
            raise RuntimeError(f"sbatch {' '.join(args)} failed: {r.stderr.strip()}")
        return int(r.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, RunTime, TimeLimit, Restarts, ExitCode, ...)."""
        out = self.run("scontrol", "show", "job", "-o", str(job_id)).stdout
        return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)

    def wait_state(self, job_id: int, states: set[str], timeout: float, poll: float = 1.0) -> dict[str, str]:
        """Poll until the job's state is one of `states` (`sbatch --wait` polls at growing intervals)."""
        end = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            if time.monotonic() > end:
                raise AssertionError(f"job {job_id} is {info.get('JobState')} after {timeout} s, not {states}\n"
                                     f"{self.logs()}")
            time.sleep(poll)

    def node_pids(self) -> dict[str, list[int]]:
        """Per node, the processes in its namespace other than its slurmd (and the helpers that started it)."""
        mine = {p.pid for p in self.daemons}
        out = {}
        for name, ns in zip(NODES, self.namespaces):
            pids = []
            for pid in netns.pids(ns):
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as fh:
                        argv = fh.read().split(b"\0")
                except OSError:
                    continue
                if pid in mine or (argv and os.path.basename(argv[0]) in (b"slurmd", b"nsenter", b"unshare")):
                    continue
                pids.append(pid)
            out[name] = pids
        return out

    def logs(self, tail: int = 2000) -> str:
        parts = []
        for name in ("slurmctld.log", *(f"slurmd-{n}.log" for n in NODES)):
            path = os.path.join(self.tmp, name)
            if os.path.exists(path):
                with open(path, errors="replace") as fh:
                    parts.append(f"--- {name}\n{fh.read()[-tail:]}")
        return "\n".join(parts)


def _hosts(r: int) -> str:
    me = f"{NET}.{2 + r}"
    lines = ["127.0.0.1 localhost", f"{me} {socket.gethostname()}"]
    lines += [f"{NET}.{2 + k} {n}" for k, n in enumerate(NODES)]
    return "\n".join(lines) + "\n"


def _start_munge(tmp: str) -> tuple[subprocess.Popen, str]:
    d = os.path.join(tmp, "munge")
    os.makedirs(d, mode=0o755)
    key = os.path.join(d, "munge.key")
    with open(key, "wb") as fh:
        fh.write(os.urandom(1024))
    os.chmod(key, 0o600)
    sock = os.path.join(d, "munge.socket")
    proc = subprocess.Popen(["munged", "-F", "--force", f"--key-file={key}", f"--socket={sock}",
                             f"--pid-file={d}/munged.pid", f"--log-file={d}/munged.log", f"--seed-file={d}/seed"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    end = time.monotonic() + 30
    while not os.path.exists(sock):
        if proc.poll() is not None or time.monotonic() > end:
            raise RuntimeError("munged did not start: "
                               f"{proc.stderr.read().decode() if proc.poll() is not None else ''}")
        time.sleep(0.1)
    return proc, sock


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with open(f"/proc/{pid}/stat") as fh:  # a zombie is not alive
        return fh.read().rsplit(")", 1)[1].split()[0] != "Z"


def _ours(pid: int, tmp: str) -> bool:
    """The pid is alive and is one of this cluster's daemons (its command line names the cluster's folder): a pid
    recorded long ago may belong to another process now."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return _alive(pid) and tmp.encode() in fh.read()
    except OSError:
        return False


def _teardown(record: dict) -> None:
    """Remove what one cluster made (its record, cluster.json): daemons, namespaces with every process in them, the
    bridge, munged, the folder."""
    daemons = [p for p in record.get("daemons", []) + [record.get("munged") or 0] if p and _ours(p, record["tmp"])]
    for pid in daemons:
        os.kill(pid, signal.SIGTERM)
    time.sleep(0.5 if daemons else 0)
    for pid in daemons:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
    for n in record.get("namespaces", []):
        netns.kill_all(n)
        subprocess.run(["ip", "netns", "del", n], capture_output=True)
    if record.get("bridge"):
        subprocess.run(["ip", "link", "del", record["bridge"]], capture_output=True)
    shutil.rmtree(record["tmp"], ignore_errors=True)


def remove_stale() -> list[str]:
    """Tear down clusters whose test process died without doing it (SIGKILLed): they would hold the addresses."""
    removed = []
    for path in glob.glob(os.path.join(tempfile.gettempdir(), "hftrain-slurm-*", "cluster.json")):
        try:
            with open(path) as fh:
                record = json.load(fh)
        except (OSError, ValueError):
            continue
        if not _alive(record["owner"]):
            _teardown(record)
            removed.append(record["tmp"])
    return removed


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def cluster():
    """Stand the cluster up (about 10 s), yield it, and tear it down whatever happens: jobs cancelled, daemons
    stopped, every process left in the namespaces SIGKILLed, namespaces, bridge and files removed."""
    remove_stale()
    tag = uuid.uuid4().hex[:6]
    bridge, ns = f"hfbr{tag}", (f"hfs0_{tag}", f"hfs1_{tag}")
    tmp = tempfile.mkdtemp(prefix="hftrain-slurm-")
    os.chmod(tmp, 0o755)  # munge's socket: every folder above it must be traversable by the daemons
    c = Cluster(tmp, tag, ns)
    munged = None
    record = {"owner": os.getpid(), "tmp": tmp, "bridge": bridge, "namespaces": list(ns), "daemons": []}

    def remember():
        record["daemons"] = [p.pid for p in c.daemons]
        record["munged"] = munged.pid if munged is not None else None
        with open(os.path.join(tmp, "cluster.json"), "w") as fh:
            json.dump(record, fh)

    # A SIGTERM (a runner's timeout) ends the test process through `finally`, which tears the cluster down.
    main = threading.current_thread() is threading.main_thread()
    old = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143)) if main else None
    try:
        remember()
        _sh("ip", "link", "add", bridge, "type", "bridge")
        _sh("ip", "addr", "add", f"{NET}.1/24", "dev", bridge)
        _sh("ip", "link", "set", bridge, "up")
        for r, n in enumerate(ns):
            _sh("ip", "netns", "add", n)
            _sh("ip", "link", "add", f"hfh{r}{tag}", "type", "veth", "peer", "name", IFACE, "netns", n)
            _sh("ip", "link", "set", f"hfh{r}{tag}", "master", bridge, "up")
            _sh("ip", "-n", n, "addr", "add", f"{NET}.{2 + r}/24", "dev", IFACE)
            _sh("ip", "-n", n, "link", "set", "lo", "up")
            _sh("ip", "-n", n, "link", "set", IFACE, "up")
            with open(os.path.join(tmp, f"hosts-{NODES[r]}"), "w") as fh:
                fh.write(_hosts(r))
            os.makedirs(os.path.join(tmp, "spool", NODES[r]))
        os.makedirs(os.path.join(tmp, "state"))
        munged, munge_socket = _start_munge(tmp)
        remember()
        with open(c.conf, "w") as fh:
            fh.write(SLURM_CONF.format(host=socket.gethostname(), net=NET, port=_free_port(), tmp=tmp,
                                       munge_socket=munge_socket, cpus=os.cpu_count() or 1, node0=NODES[0],
                                       node1=NODES[1]))
        c.daemons.append(subprocess.Popen(["slurmctld", "-D", "-i", "-f", c.conf], env=c.env,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                          start_new_session=True))
        for r, n in enumerate(ns):
            hosts = os.path.join(tmp, f"hosts-{NODES[r]}")
            inner = f"mount --bind {hosts} /etc/hosts && exec slurmd -D -f {c.conf} -N {NODES[r]}"
            c.daemons.append(subprocess.Popen(
                ["nsenter", f"--net=/run/netns/{n}", "unshare", "--mount", "--propagation", "private", "sh", "-c",
                 inner], env=c.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
        remember()
        end = time.monotonic() + 90
        while True:  # both nodes idle: registered with the controller
            r = c.run("sinfo", "-h", "-N", "-o", "%N %t", check=False)
            states = dict(line.split() for line in r.stdout.splitlines() if len(line.split()) == 2)
            if all(states.get(n) == "idle" for n in NODES):
                break
            dead = [p.args for p in c.daemons if p.poll() is not None]
            if dead or time.monotonic() > end:
                raise RuntimeError(f"cluster did not come up (nodes {states}, exited {dead})\n{c.logs()}")
            time.sleep(0.5)
        yield c
    finally:
        if c.daemons and c.daemons[0].poll() is None:
            subprocess.run(["scancel", "--full", "--user", "root"], env=c.env, capture_output=True, timeout=30)
        for p in reversed(c.daemons):
            _stop(p)
        for n in ns:
            netns.kill_all(n)
            subprocess.run(["ip", "netns", "del", n], capture_output=True)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True)
        if munged is not None:
            _stop(munged)
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
            signal.signal(signal.SIGTERM, old)
