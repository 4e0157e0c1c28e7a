"""Several machines: each checks in with machine 0 before any launcher starts, so that a missing, duplicate or wrong
machine rank, or a machine that cannot reach machine 0, is an error at launch, never a hang.

Why by hand: torch elastic's static rendezvous (what `accelerate launch` uses across machines) trusts each machine's
rank. Two machines that both take rank 0 each start the job's store and wait for the others; one fails on a busy
port or an address that is not its own, the other waits without a word until its rendezvous times out (15 minutes).
A duplicate rank 1 joins a job twice. A machine that cannot reach machine 0 retries silently as long.

`check_in` runs in `hftrain launch` on every machine, on machine 0's address and port (strategy.main_process_ip and
main_process_port), with torch's own TCPStore (the kind of store the launch itself uses next):
- machine 0 must own that address (it binds a socket to it), then serves a store there and waits for every other
  rank to check in, each once; then it lets them go and closes the store, and the launch starts on the port;
- machine K > 0 connects to it (within the timeout, naming the address when it cannot), adds one to its rank's
  counter (a second machine with the same rank sees 2 and stops, naming the first one's host), and waits to be let
  go. A rank that machine 0 never hears from is named when the timeout ends.
The timeout is strategy.rank_timeout (the same patience as for a rank that stops answering mid-run).
"""

from __future__ import annotations

import socket
import time
from datetime import timedelta

from ..errors import LaunchError

PREFIX = "hftrain/launch"
DEFAULT_TIMEOUT = 900  # seconds: torch elastic's own rendezvous timeout, when strategy.rank_timeout is 0 (off)


def is_local_address(host: str) -> bool:
    """Whether `host` is an address of this machine: a socket can be bound to it."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, kind, proto, _, addr in infos:
        try:
            with socket.socket(family, kind, proto) as s:
                s.bind((addr[0], 0))
                return True
        except OSError:
            continue
    return False


def _store(host: str, port: int, server: bool, timeout: float):
    from torch.distributed import TCPStore

    return TCPStore(host, port, is_master=server, wait_for_workers=False, timeout=timedelta(seconds=timeout),
                    use_libuv=True)


def check_in(host: str, port: int, rank: int, machines: int, timeout: float, say=print) -> None:
    """See the module's docstring. Returns once every machine has checked in; LaunchError otherwise."""
    where = f"{host}:{port}"
    if rank == 0:
        if not is_local_address(host):
            raise LaunchError(
                f"strategy.machine_rank is 0 but strategy.main_process_ip {host} is not an address of this machine "
                f"({socket.gethostname()}): machine 0 is the one at {host}. Give this machine its own rank "
                f"(--machine-rank K, K = 1 .. {machines - 1}), or run machine 0 on {host}")
        _serve(host, port, machines, timeout, where, say)
    else:
        _join(host, port, rank, timeout, where, say)


def _serve(host: str, port: int, machines: int, timeout: float, where: str, say) -> None:
    try:
        store = _store(host, port, True, timeout)
    except Exception as e:  # noqa: BLE001 - torch's errors for a busy or unusable port
        raise LaunchError(f"machine 0 cannot listen on {where} ({type(e).__name__}: {str(e).splitlines()[0][:200]}): "
                          "is another job using strategy.main_process_port? Choose a free port") from None
    say(f"hftrain: machine 0 waiting at {where} for machine(s) 1 .. {machines - 1} to check in "
        f"(at most {timeout:.0f} s)")
    keys = {k: f"{PREFIX}/machine/{k}" for k in range(1, machines)}
    deadline = time.monotonic() + timeout
    while True:
        missing = [k for k, key in keys.items() if not store.check([key])]
        if not missing:
            break
        if time.monotonic() > deadline:
            raise LaunchError(
                f"machine rank(s) {', '.join(map(str, missing))} did not check in at {where} within {timeout:.0f} s "
                f"(strategy.rank_timeout): start `hftrain launch ... --machine-rank K` on each of them with the same "
                "strategy.main_process_ip and main_process_port, and check that they can reach this address")
        time.sleep(0.2)
    hosts = {k: store.get(f"{PREFIX}/host/{k}").decode() for k in keys}
    store.set(f"{PREFIX}/go", "1")
    acks = [f"{PREFIX}/ack/{k}" for k in keys]
    end = time.monotonic() + 30  # each machine reads "go" and says so before the store closes
    while not store.check(acks) and time.monotonic() < end:
        time.sleep(0.1)
    say("hftrain: every machine checked in: " + ", ".join(f"rank {k} on {h}" for k, h in sorted(hosts.items())))
    time.sleep(0.5)  # the other machines close their connections first
    del store


def _join(host: str, port: int, rank: int, timeout: float, where: str, say) -> None:
    say(f"hftrain: machine {rank} checking in with machine 0 at {where} (at most {timeout:.0f} s)")
    try:
        store = _store(host, port, False, timeout)
    except Exception as e:  # noqa: BLE001 - torch's errors for an address it cannot reach in time
        raise LaunchError(
            f"machine {rank} cannot reach machine 0 at {where} within {timeout:.0f} s (strategy.rank_timeout; "
            f"{type(e).__name__}: {str(e).splitlines()[0][:200]}): start machine 0 first, and check "
            "strategy.main_process_ip / main_process_port and that this machine can reach that address") from None
    n = store.add(f"{PREFIX}/machine/{rank}", 1)
    if n > 1:
        first = store.get(f"{PREFIX}/host/{rank}").decode() if store.check([f"{PREFIX}/host/{rank}"]) else "another"
        raise LaunchError(f"machine rank {rank} is taken: {first} checked in with it first. Each machine needs its own "
                          "--machine-rank (0 on machine 0, then 1, 2, ...)")
    store.set(f"{PREFIX}/host/{rank}", socket.gethostname())
    try:
        store.wait([f"{PREFIX}/go"], timedelta(seconds=timeout))
    except Exception:  # noqa: BLE001 - machine 0 gave up on a missing machine, or went away
        raise LaunchError(f"machine 0 at {where} did not start the job within {timeout:.0f} s: another machine has "
                          "not checked in (machine 0's output names it)") from None
    store.set(f"{PREFIX}/ack/{rank}", "1")
    del store


def port_in_use(port: int) -> bool:
    """Whether something on this machine answers on TCP `port` (accelerate's own test: a connect to localhost)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        return s.connect_ex(("localhost", port)) == 0


def port_holder(port: int) -> str | None:
    """Who listens on TCP `port` here, as the system says it ('pid 123: python -m ...'), or None where it does not say
    (another user's process without root, a platform psutil cannot read). psutil comes with accelerate."""
    import psutil

    try:
        for c in psutil.net_connections(kind="tcp"):
            if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN and c.pid:
                return f"pid {c.pid}: {' '.join(psutil.Process(c.pid).cmdline())[:120]}"
    except (psutil.Error, OSError):
        return None
    return None


def held_port_problem(port: int, machines: int, rank: int, chosen: bool) -> tuple[str, str] | None:
    """("strategy.main_process_port", why) when machine 0's rendezvous port is already in use on this machine.
    Judged only on machine 0 (the others connect to it, they bind nothing) and only for a port the launch will use:
    one the recipe chose, or any port of a launch over several machines. On one machine with no port chosen, accelerate
    launch itself moves to a free port when its default (29500) is taken (torch's standalone rendezvous, for torch's
    launcher and DeepSpeed's alike). A port out of range is accelerate's to refuse."""
    if rank != 0 or not 0 < port < 65536 or not (chosen or machines > 1) or not port_in_use(port):  # 70000: its own
        return None
    holder = port_holder(port)
    fix = ("choose a free port, the same on every machine" if machines > 1 else
           "choose a free port, or remove strategy.main_process_port to let the launch pick one")
    return ("strategy.main_process_port", f"strategy.main_process_port ({port}): the port is in use on this machine "
            f"(machine 0, where the job's rendezvous listens){f', held by {holder}' if holder else ''}: {fix}")
