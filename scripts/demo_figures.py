"""Re-measure every demo's figures from its recipe's header, as a user would run them.

Each recipe in recipes/demo/ opens with the commands that run it (`#   hftrain ...`, `#   accelerate launch ...`,
`#   python ...`). This script runs those commands in order from the repository root, with the venv's executables,
each command once per invocation (the demos share `hftrain tiny-model ... runs/demo/base` and the SFT model), and
prints the lines the docs quote (`hftrain: <metric>: before X -> after Y`) with each command's wall time.

    .venv/bin/python scripts/demo_figures.py                      # every demo but the tool-use pair
    .venv/bin/python scripts/demo_figures.py grpo dpo             # only these recipes (and what they need first)
    .venv/bin/python scripts/demo_figures.py --all                # the tool-use demo too (its SFT: ~15 min)

Runs go to runs/ (git-ignored); a demo whose folder already holds a finished run is refused by hftrain itself, so
start from a fresh clone or remove runs/ first, as the figures in docs/ were measured.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMOS = os.path.join(REPO, "recipes", "demo")
# The order a fresh clone can run them in (the SFT demo's model feeds DPO and KTO, the reward demo's model GRPO's,
# the SFT demo's model is the distillation demos' teacher, the short SFT the on-policy demo's student).
ORDER = ("sft", "dpo", "kto", "orpo", "qlora", "grpo", "reward", "grpo_reward_model", "distill_student_sft", "distill",
         "distill_student_sft_short", "distill_on_policy", "long_context", "vision", "vision_tiles", "vision_dpo",
         "vision_grpo")
TOOL_DEMOS = ("sft_tools", "grpo_tools")
COMMAND = re.compile(r"^#\s+((?:hftrain|accelerate launch|python)\s.*)$")
FIGURE = re.compile(r"^hftrain: \S+: before .* -> after .*$")


def header_commands(name: str) -> list[str]:
    """The commands of a recipe's header comment, trailing comments removed."""
    commands = []
    with open(os.path.join(DEMOS, f"{name}.yaml"), encoding="utf-8") as f:
        for line in f:
            if not line.startswith("#"):
                break
            match = COMMAND.match(line.rstrip("\n"))
            if match:
                commands.append(match.group(1).split("  #")[0].strip())
    return commands


def with_venv(command: str) -> list[str]:
    """The command with the venv's hftrain, accelerate and python."""
    argv = shlex.split(command)
    bin_dir = os.path.dirname(sys.executable)
    executable = "python" if argv[0] == "python" else argv[0]
    argv[0] = sys.executable if executable == "python" else os.path.join(bin_dir, executable)
    return argv


def run(command: str) -> list[str]:
    """Run one command from the repository root; its figure lines (a failure stops the script)."""
    start = time.monotonic()
    done = subprocess.run(with_venv(command), cwd=REPO, capture_output=True, text=True)
    seconds = time.monotonic() - start
    lines = (done.stdout + done.stderr).splitlines()
    print(f"$ {command}   ({seconds:.0f} s, exit {done.returncode})", flush=True)
    if done.returncode != 0:
        print("\n".join(lines[-30:]))
        raise SystemExit(done.returncode)
    return [line for line in lines if FIGURE.match(line)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("demos", nargs="*", help=f"recipes of recipes/demo/ (default: {' '.join(ORDER)})")
    parser.add_argument("--all", action="store_true", help="the tool-use demo too")
    args = parser.parse_args(argv)
    names = args.demos or list(ORDER) + (list(TOOL_DEMOS) if args.all else [])
    done: set[str] = set()
    for name in names:
        print(f"== recipes/demo/{name}.yaml", flush=True)
        for command in header_commands(name):
            if command in done or command.startswith("hftrain check"):
                continue
            done.add(command)
            for figure in run(command):
                print(f"   {figure}", flush=True)


if __name__ == "__main__":
    main()
