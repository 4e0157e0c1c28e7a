"""`accelerate launch` as `hftrain launch` runs it (`python -m hftrain.launch.launcher <accelerate launch args>`):
accelerate's own launch command, with its endings told in one line and an exit status instead of a traceback.

torch elastic (inside accelerate) answers SIGINT, SIGTERM and SIGHUP by stopping its workers and raising
SignalException, and a failed worker by raising ChildFailedError; accelerate lets both through, so every Ctrl-C and
every refused recipe ended `hftrain launch` in a Python traceback with status 1. Here a signal ends the launcher
with 128 + N (130 for Ctrl-C, 143 for SIGTERM, as a shell reports a process that signal ended), and a failed worker
with that worker's status (2 for a user error, whose one message the worker has printed; 128 + N for a worker a
signal ended), after torch's own summary of the failure."""

from __future__ import annotations

import signal
import sys


def _name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def status_of(failures: dict) -> int:
    """The exit status of a launch whose workers failed: the first failure's (a signal: 128 + N), else 1."""
    first = min(failures.values(), key=lambda f: getattr(f, "timestamp", 0))
    code = getattr(first, "exitcode", 1)
    return 128 - code if code < 0 else (code or 1)


def main(argv: list[str]) -> int:
    from accelerate.commands.launch import launch_command, launch_command_parser
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    args = launch_command_parser().parse_args(argv)
    try:
        launch_command(args)
    except SignalException as e:
        print(f"hftrain: the launcher got {_name(e.sigval)}: its workers were stopped", file=sys.stderr, flush=True)
        return 128 + int(e.sigval)
    except KeyboardInterrupt:  # before torch elastic's handlers were installed
        print("hftrain: the launcher got SIGINT: stopped", file=sys.stderr, flush=True)
        return 128 + signal.SIGINT
    except ChildFailedError as e:
        print(e.format_msg(), file=sys.stderr, flush=True)  # torch's summary: ranks, exit codes, causes
        return status_of(e.failures)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
