"""The CLI imports a method's trainer only when a command needs it (hftrain/methods/registry.py): `hftrain --help`,
`hftrain score --help`, `hftrain config --all` and `hftrain check` of an SFT recipe load no TRL trainer, nor an
hftrain module of a TRL-based method. Measured in a fresh interpreter (this one has imported every trainer); no
launcher, no training."""

import json
import os
import subprocess
import sys
import textwrap

from .conftest import REPO
from .test_bad_input import W

# Run in a fresh interpreter: the three commands, the modules they left loaded, then the negative control (a TRL
# method's entry loaded the way every command once loaded all of them) and the modules after it.
PROBE = textwrap.dedent("""
    import json, sys
    from hftrain.cli import main

    def trainers():
        return sorted(m for m in sys.modules if m.startswith(("trl.trainer.", "trl.experimental."))
                      and m.endswith("_trainer") or m in TRL_METHOD_MODULES)

    from hftrain.methods import METHODS
    TRL_METHOD_MODULES = {e.module for e in METHODS if e.name != "sft"}
    for argv in json.loads(sys.argv[1]):
        try:
            code = main(argv)
        except SystemExit as stop:
            code = stop.code
        assert code in (0, None), (argv, code)
    after_commands = trainers()
    next(e for e in METHODS if e.name == "dpo").load()
    print(json.dumps({"after_commands": after_commands, "after_loading_dpo": trainers()}))
""")


def test_help_config_and_check_of_an_sft_recipe_import_no_trl_trainer(tmp_path, tiny_model_dir):
    recipe = W(str(tmp_path), tiny_model_dir).recipe()
    commands = [["--help"], ["score", "--help"], ["config", "--all", "--output", str(tmp_path / "configs")],
                ["check", recipe]]
    env = {**os.environ, "PYTHONPATH": REPO}
    out = subprocess.run([sys.executable, "-c", PROBE, json.dumps(commands)], cwd=str(tmp_path), env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert loaded["after_commands"] == []
    # The check sees a trainer when one is loaded: TRL's DPO trainer and hftrain's DPO module.
    assert "trl.trainer.dpo_trainer" in loaded["after_loading_dpo"]
    assert any(m.endswith(".dpo") for m in loaded["after_loading_dpo"])
