"""Several runs in one launch (issue 36): where the launcher itself is not under test, a matrix of variants (loss
configurations, preference losses, compression methods, ...) pays the interpreter, the imports and the process
group once instead of once per variant. Run under any launcher, like a recipe script:

    python -m accelerate.commands.launch --config_file accelerate_configs/zero2.yaml tests/matrix_worker.py PLAN.json

PLAN.json is a list of {"name", "module", "argv", "status"}: each variant is `module.main(argv)` in turn (a recipe
script such as hftrain.recipes.sft, or a test driver with the same `main(argv)`), on the one process group, and each
rank writes `status.rank<R>.json`: {"ok": true} or {"ok": false, "error": the traceback's tail}. Before each variant
a line `hftrain-matrix: variant NAME` is printed on both streams, so its output can be told from the others'.

A variant that fails ends the launch (exit 1): on several ranks the others may be inside a collective that will
never complete, and the variants after it are left without a status (reported as not run by tests/conftest.py).

Between variants the process group is kept (distributed.shutdown stops the heartbeat and waits for the other ranks,
nothing more), and accelerate's per-run state (AcceleratorState, GradientState: the strategy's plugin holds the
run's batch size and accumulation) is reset, as a new process would have it; the group is torn down after the last.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import traceback

from hftrain import distributed, outdir
from hftrain.launch import setup

_shutdown = distributed.shutdown
MARK = "hftrain-matrix: variant "  # printed before each variant, on standard output and standard error


def _keep_group(wait: bool = True) -> None:
    distributed.stop_heartbeat()
    if wait:
        distributed.barrier()
    sys.stdout.flush()
    sys.stderr.flush()


def _fresh_accelerate_state() -> None:
    from accelerate.state import AcceleratorState, GradientState
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()
    # the ZeRO-3 config the last variant's TrainingArguments registered with transformers: a new process has none
    # (with it, models built before the next variant's arguments, e.g. preflight's meta model, would be partitioned)
    unset_hf_deepspeed_config()


def _meet_after_setup() -> None:
    """A fresh launch's ranks meet when its process group starts, inside setup_run, after each rank has checked the
    recipe; in one launch the group exists already, so the ranks meet right after setup_run instead. Without it the
    main rank could claim output_dir before a slower rank had checked it, and that rank would find the folder in use
    (by its own job). Every module holding setup_run (the lifecycle, test drivers) gets the wrapped one."""
    original = setup.setup_run

    def setup_run_then_meet(*args, **kwargs):
        run = original(*args, **kwargs)
        distributed.barrier()
        return run

    for module in list(sys.modules.values()):
        if getattr(module, "setup_run", None) is original:
            module.setup_run = setup_run_then_meet


def run_variant(variant: dict) -> bool:
    for stream in (sys.stdout, sys.stderr):  # one write: the ranks share the streams
        stream.write(f"\n{MARK}{variant['name']}\n")
        stream.flush()
    status = {"ok": True}
    try:
        module = importlib.import_module(variant["module"])
        _meet_after_setup()
        module.main(variant["argv"])
    except SystemExit as e:
        if e.code not in (0, None):  # a user error's message is printed by one rank a machine: keep each rank's
            cause = f": {type(e.__context__).__name__}: {e.__context__}" if e.__context__ is not None else ""
            status = {"ok": False, "error": f"exit status {e.code}{cause}"}
    except BaseException:  # noqa: BLE001 - reported under the variant's name, then the launch ends
        status = {"ok": False, "error": traceback.format_exc()[-6000:]}
    outdir.release_all()  # as a launch's end would: a later variant may resume the folder
    with open(f"{variant['status']}.rank{distributed.rank()}.json", "w") as fh:
        json.dump(status, fh)
    if not status["ok"]:
        print(f"hftrain-matrix: {variant['name']} failed: {status['error']}", file=sys.stderr, flush=True)
    return status["ok"]


def main(plan_path: str) -> int:
    with open(plan_path) as fh:
        plan = json.load(fh)
    distributed.shutdown = _keep_group
    failed = False
    try:
        for variant in plan:
            if not run_variant(variant):
                failed = True  # the other ranks may be waiting in a collective: no barrier at the end
                break
            _fresh_accelerate_state()
    finally:
        distributed.shutdown = _shutdown
    _shutdown(wait=not failed)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # `tests.` drivers importable
    sys.exit(main(sys.argv[1]))
