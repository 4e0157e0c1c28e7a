"""The one user-code guard (hftrain/methods/grpo/user_code.py, watchdog.py) that GRPO's reward functions, tools and
environments run in, fast and in-process but for one forked case: a tool and an environment method that time out
or raise are counted alike by the one set of counters; Python code past its limit stops there (a time-out) in and
out of the main thread; a call stuck in C code holding the GIL, which no signal interrupts, ends its process within
the limit and the grace, with one line naming the function and the limit, instead of hanging the rank."""

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from hftrain.methods.grpo.environments import guarded_environment
from hftrain.methods.grpo.user_code import GRACE_S, CallCounts, TimeLimit, UserCodeFailure, call_user_code
from hftrain.methods.grpo.tools import guarded

LIMIT = TimeLimit(0.5, "grpo.tool_timeout")
REAL_EXIT = os._exit


def stuck_in_python(x: int) -> str:
    """Sleep far past the limit.

    Args:
        x: Unused.
    """
    time.sleep(60)
    return "late"


def refusing(x: int) -> str:
    """Refuse every call.

    Args:
        x: Unused.
    """
    raise ValueError("no")


class Game:
    """A game whose moves hang or raise."""

    def reset(self, **row):
        return None

    def stuck_in_python(self, x: int) -> str:
        """Sleep far past the limit.

        Args:
            x: Unused.
        """
        return stuck_in_python(x)

    def refusing(self, x: int) -> str:
        """Refuse every call.

        Args:
            x: Unused.
        """
        return refusing(x)


def test_a_tool_and_an_environment_method_that_time_out_or_raise_are_counted_alike():
    tool_counts, env_counts = CallCounts(), CallCounts()
    tools = {f.__name__: guarded(f, LIMIT, tool_counts) for f in (stuck_in_python, refusing)}
    game = guarded_environment(Game, LIMIT, env_counts)()
    game.reset()
    start = time.monotonic()
    assert tools["stuck_in_python"](x=1) == "error: stuck_in_python did not return within grpo.tool_timeout=0.5 s"
    assert game.stuck_in_python(x=1) == ("error: stuck_in_python did not return within grpo.tool_timeout=0.5 s: the "
                                         "environment crashed")
    # interrupted: far below the 60 s each call takes by itself, whatever the machine's load
    assert time.monotonic() - start < 30
    game.reset()  # the crashed instance is replaced
    assert tools["refusing"](x=1).startswith("error: refusing raised ValueError: no")
    assert game.refusing(x=1).startswith("error: refusing raised ValueError: no") and not game.crashed
    told = tool_counts.take()
    assert told == {"calls": 2, "errors": 2, "timeouts": 1, "crashes": 0, "cut": 0}
    assert env_counts.take() == {**told, "crashes": 1}  # the environment's crash is counted beside


def retrying(x: int) -> str:
    """Catch every Exception and try again, as a tool with a retry loop does.

    Args:
        x: Unused.
    """
    while True:
        try:
            time.sleep(60)
            return "late"
        except Exception:  # noqa: BLE001 - the user's retry loop
            continue


def leaving(x: int) -> str:
    """End the process at once, saving nothing.

    Args:
        x: The status.
    """
    os._exit(x)


def test_a_tool_that_catches_the_time_out_or_calls_os_exit_fails_only_that_call():
    """A retry loop catching Exception swallowed the time-out (it was an Exception) and the watchdog then ended the
    whole rank; os._exit(0) ended the run with status 0, no model and no word. Each is now that call's error, and
    the process goes on (this test's own process is the proof: it would be killed or exit here)."""
    counts = CallCounts()
    tools = {f.__name__: guarded(f, LIMIT, counts) for f in (retrying, leaving)}
    assert tools["retrying"](x=1) == "error: retrying did not return within grpo.tool_timeout=0.5 s"
    assert tools["leaving"](x=0) == "error: leaving called os._exit(0)"
    assert counts.take() == {"calls": 2, "errors": 2, "timeouts": 1, "crashes": 0, "cut": 0}
    assert os._exit is REAL_EXIT  # put back after the call


def test_python_code_past_its_limit_stops_there_in_any_thread():
    """In the main thread SIGALRM stops the call at the limit; outside it (no signal is delivered there) the call
    is let run, and the watchdog would end the process only GRACE_S later: a short call there is not touched."""
    with pytest.raises(UserCodeFailure) as e:
        call_user_code(stuck_in_python, "a tool", (1,), limit=LIMIT)
    assert e.value.timed_out and e.value.reason == "did not return within grpo.tool_timeout=0.5 s"
    seen = []
    thread = threading.Thread(target=lambda: seen.append(call_user_code(
        lambda: time.sleep(0.7) or "done", "a tool", limit=LIMIT)))
    thread.start()
    thread.join(10)
    assert seen == ["done"]


STUCK_IN_C = textwrap.dedent("""
    import sys, time
    from hftrain.methods.grpo.rewards import Reward

    def counts_to_a_trillion(prompts, completions, **kw):
        return [float(sum(range(10 ** 13)))] * len(completions)  # C code holding the GIL: no signal handler runs

    print("started", time.monotonic(), file=sys.stderr, flush=True)
    Reward(counts_to_a_trillion, "counts_to_a_trillion", "grpo.rewards.1", timeout=0.5)(prompts=["p"],
                                                                                       completions=["a"])
    print("returned", file=sys.stderr)
""")


@pytest.mark.launches
def test_a_reward_stuck_in_c_code_ends_its_rank_within_the_limit_and_the_grace_naming_it():
    run = subprocess.run([sys.executable, "-c", STUCK_IN_C], capture_output=True, text=True, timeout=120)
    ended = time.monotonic()
    started = float(next(line.split()[1] for line in run.stderr.splitlines() if line.startswith("started")))
    assert run.returncode == -9, run.stderr[-2000:]  # SIGKILL: no handler of the stuck process could run
    assert "returned" not in run.stderr
    assert ("hftrain: error: grpo.rewards.1 (counts_to_a_trillion) did not return within grpo.reward_timeout=0.5 s "
            f"and did not give control back to Python {GRACE_S:g} s later (a call stuck in C code, which no signal "
            "interrupts): this rank is ended (SIGKILL). Make it faster, or raise grpo.reward_timeout (0: no limit)"
            ) in run.stderr
    # the limit and the grace, not the hours of the count; 30 s for a loaded machine's start-up and scheduling
    assert ended - started < 0.5 + GRACE_S + 30, ended - started
