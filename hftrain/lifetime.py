"""A worker's lifetime: it ends with its launcher, and a rank that stops answering fails the job, named.

Why this is needed: torch elastic (the agent inside `accelerate launch` and `torchrun`) starts each worker with
`start_new_session=True` (torch/distributed/elastic/multiprocessing/subprocess_handler/subprocess_handler.py), so
a worker sits in a session and process group of its own: a terminal's Ctrl-C or a kill of the launcher's process
group does not reach it, and a SIGKILLed launcher forwards nothing. Such workers run on as orphans and go on
writing checkpoints and the final model. And a SIGSTOPped (or hung) rank makes the others wait in a collective
for the whole process-group timeout (30 minutes by default) without a word.

- `die_with_parent()`: the kernel sends this process SIGKILL when its parent (the launcher) ends (Linux
  PR_SET_PDEATHSIG), with a watchdog thread polling the parent pid as the portable fallback. SIGKILL, not SIGTERM:
  no handler runs, so nothing (checkpoint, final model) is written after the launcher is gone.
- `start_heartbeat()`: every rank writes a counter into the process group's store every few seconds; rank 0
  watches every other rank, the others watch rank 0. A counter that does not move for `timeout` seconds (on the
  watcher's own clock: no clock skew between hosts matters) ends the watcher with a message naming the rank, its
  host and pid; the launcher then stops the whole job. A SIGSTOPped process's threads stop too, so its counter
  stops; a rank busy alone (rank 0 tokenising while the others wait at a barrier, a save) still beats.
"""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from . import PARENT_PID_AT_START

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
DEEPSPEED_NODE_LAUNCHER = b"deepspeed.launcher.launch"  # started per node by DeepSpeed's runner (`deepspeed ...`)
_WATCHING: list[bool] = []  # die_with_parent ran in this process
HEARTBEAT_PREFIX = "hftrain/heartbeat"
DONE = "done"


def prctl_function():
    """libc's prctl, or None off Linux (or without a libc ctypes can open)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl
    except (OSError, AttributeError):
        return None


def launched_by_a_launcher() -> bool:
    """This process was started by a launcher that should own it: torch elastic (`torchrun`, `accelerate launch`
    with several processes) exports TORCHELASTIC_RUN_ID; accelerate's one-process launcher and DeepSpeed's node
    launcher export nothing of their own, so the parent's command line is looked at. A plain `python recipes/sft.py` (e.g. under nohup) is not tied to the
    shell that started it."""
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        return True
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as fh:
            argv = fh.read().split(b"\0")
    except OSError:
        return False
    return any(a.endswith(b"accelerate") or a in (b"accelerate.commands.launch", DEEPSPEED_NODE_LAUNCHER)
               for a in argv)


def _proc(pid: int, what: str) -> bytes:
    try:
        with open(f"/proc/{pid}/{what}", "rb") as fh:
            return fh.read()
    except OSError:
        return b""


def _identity(pid: int) -> bytes:
    """The pid's start time (/proc/PID/stat field 22): the same pid with another start time is another process; b""
    for none, or a zombie (dead, not yet reaped by its parent)."""
    fields = _proc(pid, "stat").rsplit(b")", 1)[-1].split()
    return fields[19] if len(fields) > 19 and fields[0] != b"Z" else b""


def outer_launchers(parent: int) -> list[tuple[int, bytes]]:
    """Launchers above the parent that own this worker too, as (pid, identity). DeepSpeed's runner (`deepspeed`,
    deepspeed.launcher.runner) starts a node launcher (deepspeed.launcher.launch, the worker's parent) that does not
    end with it: without this a SIGKILLed runner would leave the node launcher and its workers training on. Linux
    (/proc) only; elsewhere [] (the parent alone is watched)."""
    if DEEPSPEED_NODE_LAUNCHER not in _proc(parent, "cmdline").split(b"\0"):
        return []
    stat = _proc(parent, "stat")
    runner = int(stat.rsplit(b")", 1)[-1].split()[1]) if stat else 0
    argv = _proc(runner, "cmdline").split(b"\0")
    if runner > 1 and any(a.endswith(b"deepspeed") or a == b"deepspeed.launcher.runner" for a in argv):
        return [(runner, _identity(runner))]
    return []


def set_parent_death_signal(sig: int = signal.SIGKILL, prctl=None) -> bool:
    """Ask the kernel to send `sig` to this process when the thread that forked it ends; False where unsupported.
    torch elastic and `hftrain launch` start their children from the main thread, so this is the parent's end."""
    prctl = prctl or prctl_function()
    return prctl is not None and prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0


def _parent_gone(original: int) -> None:
    try:
        print(f"hftrain: the launcher (pid {original}) has ended; ending this worker (pid {os.getpid()}) so that "
              "nothing is written after it", file=sys.stderr, flush=True)
    except OSError:  # stderr was a pipe to the launcher: nobody reads it now
        pass
    os.kill(os.getpid(), signal.SIGKILL)


def die_with_parent(poll_seconds: float = 1.0) -> None:
    """End this process within seconds of its parent's end: the kernel's parent-death signal (Linux) and a daemon
    thread that compares the parent pid with the one seen when hftrain was first imported (every platform; on Linux
    it also covers a parent that died before the signal was armed: this process was then already re-parented), and
    watches the launchers above the parent that own this worker too (outer_launchers: DeepSpeed's runner)."""
    if _WATCHING:
        return
    _WATCHING.append(True)
    original = PARENT_PID_AT_START
    set_parent_death_signal()
    if os.getppid() != original:
        _parent_gone(original)

    outer = outer_launchers(original)

    def watch():
        while True:
            time.sleep(poll_seconds)
            if os.getppid() != original:
                _parent_gone(original)
            for pid, identity in outer:
                if _identity(pid) != identity:
                    _parent_gone(pid)

    threading.Thread(target=watch, name="hftrain-parent-watch", daemon=True).start()


def run_owned(cmd: list[str]) -> int:
    """Run a launcher as a child that cannot outlive this process (`hftrain launch`); return its exit status
    (128 + N when signal N ended it).

    The child gets a process group of its own (a terminal's Ctrl-C reaches this process alone, which forwards
    SIGINT, SIGTERM and SIGHUP once, so torch elastic's agent gets each signal once and stops its workers) and, on
    Linux, the parent-death signal SIGKILL: if this process is SIGKILLed the launcher dies too, and its workers
    with it (die_with_parent)."""
    me, prctl = os.getpid(), prctl_function()

    def in_child():  # after fork, before exec: nothing that takes a lock (threads of the parent are gone)
        if prctl is not None:
            set_parent_death_signal(signal.SIGKILL, prctl)
        if os.getppid() != me:  # the parent died before the signal was armed
            os._exit(1)

    proc, pending = None, []

    def forward(sig, frame):  # a signal that comes before the child exists is delivered once it does
        if proc is None:
            pending.append(sig)
        else:
            proc.send_signal(sig)

    # The handlers go in before the child starts: a signal between the two would otherwise end this process alone
    # (KeyboardInterrupt) and leave the child running in its own process group.
    old = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        proc = subprocess.Popen(cmd, process_group=0, preexec_fn=in_child)
        for sig in pending:
            proc.send_signal(sig)
        code = proc.wait()
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    return code if code >= 0 else 128 - code


def end_on_interrupt() -> None:
    """SIGINT ends this worker at once, as SIGTERM does. torch elastic relays the signal it got to its workers
    (a Ctrl-C of `accelerate launch` or `hftrain launch` arrives here as SIGINT); Python's KeyboardInterrupt would
    surface only when the main thread returns to Python: a rank waiting in a collective for a peer that is already
    gone would sit until the agent's SIGKILL 30 s later, and `finally` blocks would run on the way out."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Heartbeat:
    """See the module's docstring. `store` is a store of this thread's own (Store.clone: a store object must not be
    shared between threads); `exit` ends the process (os._exit; tests pass their own)."""

    def __init__(self, store, rank: int, world_size: int, timeout: float, interval: float, attempt: int = 0,
                 exit=os._exit):
        self.store, self.rank, self.world, self.timeout, self.interval = store, rank, world_size, timeout, interval
        self.prefix = f"{HEARTBEAT_PREFIX}/{attempt}/"
        self.me = f"{socket.gethostname()} {os.getpid()}"
        self.watched = [r for r in range(world_size) if r != rank] if rank == 0 else [0]
        self.seen: dict[int, tuple[str | None, float]] = {}  # rank -> (last value, monotonic time it changed)
        self.store_failing_since: float | None = None
        self.stopped = threading.Event()
        self.exit = exit
        self.thread = threading.Thread(target=self._run, name="hftrain-heartbeat", daemon=True)

    def start(self) -> "Heartbeat":
        self.thread.start()
        return self

    def stop(self) -> None:
        """This rank is done (normal end): stop beating and watching, and tell the watchers not to wait for it."""
        if self.stopped.is_set():
            return
        self.stopped.set()
        if self.thread.is_alive():
            self.thread.join(timeout=2 * self.interval + 1)
        try:
            self.store.set(self.prefix + str(self.rank), f"{DONE} {self.me}")
        except Exception:  # noqa: BLE001 - the store may be gone already (the launcher's), nobody waits then
            pass

    def _run(self) -> None:
        seq = 0
        while not self.stopped.is_set():
            seq += 1
            self.beat(seq)
            self.stopped.wait(self.interval)

    def beat(self, seq: int, now: float | None = None) -> None:
        """One round: write this rank's counter, read the watched ranks', end the process on one stale too long."""
        now = time.monotonic() if now is None else now
        try:
            self.store.set(self.prefix + str(self.rank), f"{seq} {self.me}")
            keys = [self.prefix + str(r) for r in self.watched]
            values = {r: (self.store.get(k).decode() if self.store.check([k]) else None)
                      for r, k in zip(self.watched, keys)}
            self.store_failing_since = None
        except Exception as e:  # noqa: BLE001 - any store failure: the store's host (launcher or rank 0) is gone
            if self.store_failing_since is None:
                self.store_failing_since = now
            elif now - self.store_failing_since > self.timeout:
                self._fail(f"the job's store (MASTER_ADDR {os.environ.get('MASTER_ADDR')} port "
                           f"{os.environ.get('MASTER_PORT')}, held by the launcher or rank 0) has not answered for "
                           f"{now - self.store_failing_since:.0f} s ({type(e).__name__}: {str(e)[:200]})")
            return
        for r, value in values.items():
            last, since = self.seen.get(r, (None, None))
            if since is None or value != last:  # first look, or it moved
                self.seen[r] = (value, now)
                continue
            if value is not None and value.startswith(DONE + " "):
                continue
            if now - since > self.timeout:
                host, pid = value.split()[1:3] if value else ("unknown", "unknown")
                what = "has not answered" if value else "has not started its heartbeat"
                self._fail(f"rank {r} (host {host}, pid {pid}) {what} for {now - since:.0f} s (stopped, hung or dead)")

    def _fail(self, what: str) -> None:
        print(f"hftrain: rank {self.rank}: {what}; ending this rank (status 1) so that the launcher stops the job. "
              "strategy.rank_timeout sets this limit in seconds (0 turns the check off).", file=sys.stderr, flush=True)
        sys.stdout.flush()
        self.exit(1)


_HEARTBEAT: list[Heartbeat] = []


def start_heartbeat(timeout: float) -> Heartbeat | None:
    """Start this rank's heartbeat on the default process group's store (a clone: its own connection, with a
    short timeout so that a stopped store host is noticed); None when off (timeout 0) or alone."""
    if timeout <= 0 or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    interval = min(5.0, timeout / 5)
    store = dist.distributed_c10d._get_default_store().clone()  # private, no public accessor of the group's store
    store.set_timeout(timedelta(seconds=max(interval, 1.0)))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    hb = Heartbeat(store, dist.get_rank(), dist.get_world_size(), timeout, interval, attempt).start()
    _HEARTBEAT.append(hb)
    atexit.register(hb.stop)
    return hb


def stop_heartbeat() -> None:
    """This rank ends normally (distributed.shutdown): the others stop waiting for it."""
    while _HEARTBEAT:
        _HEARTBEAT.pop().stop()
