"""What tests and benchmarks share beyond pytest's fixtures (conftest.py): importable as `tests.support` from the
repository root (benchmarks put it on sys.path)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port free on this machine now, for a local launch's rendezvous (tests and benchmarks start many)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
