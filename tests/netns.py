"""Two "hosts" on one Linux machine: two network namespaces joined by a veth pair, optionally rate-shaped.

Used by the multi-node tests (tests/test_multinode.py) and the slow-link benchmark (bench/network.py). Each
namespace has its own addresses, ports and loopback; the filesystem is shared. Needs root and `ip` (iproute2);
`tc` (iproute2) for a rate. Host r's interface is `v{r}`: point gloo at it (GLOO_SOCKET_IFNAME=v{r}), or gloo binds
the hostname, which resolves to 127.0.0.1. This kernel has tbf but no netem: a rate, no added delay or loss.
Nothing here is part of a training run; it lives in the package so that tests and benchmarks share one copy.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import uuid
from contextlib import contextmanager

IFACE = ("v0", "v1")


def problem() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    if shutil.which("ip") is None:
        return "needs `ip` (iproute2) for network namespaces"
    probe = f"hfprobe{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"`ip netns add` failed: {r.stderr.strip()[:200]}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _sh(*cmd: str) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {r.stderr.strip()}")


def pids(ns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out if p.isdigit()]


def kill_all(ns: str) -> None:
    """SIGKILL every process in the namespace (this also ends stopped ones); `ip netns del` alone would leave a
    namespace alive while processes remain in it."""
    for pid in pids(ns):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def set_rate(ns: str, iface: str, rate: str | None) -> None:
    """Shape the interface's egress to `rate` (tc syntax, e.g. '20mbit'); None: unshaped. tbf drops what does not
    fit its bucket, so TCP gets ~83-87% of the set rate (measured, ../shared/FEASIBILITY.md)."""
    subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", iface, "root"], capture_output=True)
    if rate:
        _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", iface, "root", "tbf", "rate", rate,
            "burst", "32kbit", "latency", "50ms")


@contextmanager
def two_hosts(ips: tuple[str, str], rate: str | None = None):
    """Two namespaces joined by veth v0 <-> v1 with addresses `ips` (/24); both directions shaped to `rate`.
    Yields the namespace names; at exit every process in them is killed and both are removed (with the veth)."""
    tag = uuid.uuid4().hex[:6]
    ns = (f"hfn0_{tag}", f"hfn1_{tag}")
    try:
        for n in ns:
            _sh("ip", "netns", "add", n)
        _sh("ip", "link", "add", IFACE[0], "netns", ns[0], "type", "veth", "peer", "name", IFACE[1], "netns", ns[1])
        for r, n in enumerate(ns):
            _sh("ip", "-n", n, "addr", "add", f"{ips[r]}/24", "dev", IFACE[r])
            _sh("ip", "-n", n, "link", "set", "lo", "up")
            _sh("ip", "-n", n, "link", "set", IFACE[r], "up")
            set_rate(n, IFACE[r], rate)
        yield ns
    finally:
        for n in ns:
            kill_all(n)
            subprocess.run(["ip", "netns", "del", n], capture_output=True)
