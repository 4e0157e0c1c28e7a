"""The hard part of the user-code time limit (user_code.py): a small watchdog process that ends this process when a
call of the user's code is still running past its deadline, even a call stuck in C code that holds the GIL.

Why a process: the time limit's first part, SIGALRM (user_code.time_limit), works only where the call gives control
back to the interpreter (Python code, `time.sleep`, `re`, which check for signals): a signal's Python handler runs
between bytecodes, so a C function that loops holding the GIL (`sum(range(10**12))`, a C extension's long call) is
never interrupted, and a watchdog *thread* would need that GIL too. A second process needs nothing of this one.

How: the first limited call starts the watchdog (`python -I -S` on this file: the standard library only, nothing of
hftrain, torch or the user's code), once per process (a forked child starts its own). Each call writes one line
to its stdin when it starts, "<id> <deadline> <message>" (the deadline on CLOCK_MONOTONIC, which every process
shares), and "<id>" when it ends, however it ends (lines under PIPE_BUF bytes: one write each, never interleaved
between threads). At a deadline still armed the watchdog writes the message, one line on stderr naming the function
and the limit, and sends this process SIGKILL (no handler of ours could run while the GIL is held); it ends itself
when this process ends (its stdin reaches end of file) and ignores SIGINT (a terminal's Ctrl-C is this process's).
"""

from __future__ import annotations

import itertools
import os
import select
import signal
import subprocess
import sys
import threading
import time

MESSAGE_BYTES = 3000  # one line, well under PIPE_BUF (4096 on Linux): a write of it is atomic


class _Watchdog:
    """This process's watchdog (started on first use; see the module docstring)."""

    _lock = threading.Lock()
    _process: subprocess.Popen | None = None
    _owner = -1  # the pid that started `_process` (a forked child must start its own)
    _ids = itertools.count(1)

    @classmethod
    def _start(cls) -> None:
        cls._process = subprocess.Popen([sys.executable, "-I", "-S", os.path.abspath(__file__), str(os.getpid())],
                                        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, bufsize=0)
        cls._owner = os.getpid()

    @classmethod
    def _write(cls, line: str) -> None:
        data = line.encode("utf-8", "replace")
        with cls._lock:
            if cls._owner != os.getpid():
                cls._start()
            try:
                os.write(cls._process.stdin.fileno(), data)
            except BrokenPipeError:  # the watchdog was ended from outside: a new one
                cls._start()
                os.write(cls._process.stdin.fileno(), data)

    @classmethod
    def arm(cls, deadline: float, message: str) -> int:
        call = next(cls._ids)
        text = " ".join(message.split())[:MESSAGE_BYTES]
        cls._write(f"{call} {deadline!r} {text}\n")
        return call

    @classmethod
    def disarm(cls, call: int) -> None:
        cls._write(f"{call}\n")


class hard_deadline:
    """A context under which this process is ended, `message` written on stderr, if it is still inside `seconds`
    from now (see the module docstring)."""

    def __init__(self, seconds: float, message: str):
        self.seconds, self.message, self._call = seconds, message, None

    def __enter__(self):
        self._call = _Watchdog.arm(time.monotonic() + self.seconds, self.message)
        return self

    def __exit__(self, *exc):
        _Watchdog.disarm(self._call)
        return False


def _read_lines(armed: dict, pending: bytearray) -> bool:
    """The lines waiting on stdin applied to `armed` ({id: (deadline, message)}); False at end of file."""
    data = os.read(0, 65536)
    if not data:
        return False
    pending += data
    *lines, rest = bytes(pending).split(b"\n")
    pending[:] = rest
    for line in lines:
        call, _, armed_with = line.partition(b" ")
        if armed_with:
            deadline, _, message = armed_with.partition(b" ")
            armed[call] = (float(deadline), message + b"\n")
        else:
            armed.pop(call, None)
    return True


def serve(target: int) -> None:
    """The watchdog's loop: `target` (this process's parent) ended at the first deadline still armed."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    armed: dict[bytes, tuple[float, bytes]] = {}
    pending = bytearray()
    while True:
        due = min((deadline for deadline, _ in armed.values()), default=None)
        wait = None if due is None else max(0.0, due - time.monotonic())
        if select.select([0], [], [], wait)[0]:
            if not _read_lines(armed, pending):
                return  # the target ended
            continue
        late = [message for deadline, message in armed.values() if deadline <= time.monotonic()]
        if late:
            os.write(2, late[0])
            try:
                os.kill(target, signal.SIGKILL)
            except ProcessLookupError:
                pass
            return


if __name__ == "__main__":
    serve(int(sys.argv[1]))
