"""A request to save and stop: SIGUSR1, as SLURM sends it before a job's time limit (`sbatch --signal=USR1@T`, which
the script `hftrain config --slurm` writes asks for) or as `kill -USR1 PID` does by hand.

The handler only records the request; the trainer (stop_request/mixin.py) acts on it between optimizer
steps, at a step every rank agrees on, and saves a complete checkpoint there. Without a handler SIGUSR1 would end
the process at once (its default action), losing everything since the last checkpoint.

Armed by the run's set-up (launch.setup_run), before the model loads: a request that comes during loading is kept and
honoured after the first step. Launchers must not die of it: the SLURM script starts them with SIGUSR1 ignored,
which their workers inherit until this handler replaces it.
"""

from __future__ import annotations

import signal
import threading
import time

SIGNAL = signal.SIGUSR1
_REQUESTS: list[float] = []  # monotonic times at which a request came, this process


def _on_signal(signum, frame) -> None:
    _REQUESTS.append(time.monotonic())


def arm() -> bool:
    """Handle SIGUSR1 as a save-and-stop request from now on; False where it cannot be (not the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    signal.signal(SIGNAL, _on_signal)
    return True


def requested() -> bool:
    """A request has come to this process."""
    return bool(_REQUESTS)


def clear() -> None:
    """Forget the requests (a new run in the same process: tests)."""
    _REQUESTS.clear()
