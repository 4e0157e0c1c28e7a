"""hftrain as a user installs it: a wheel built from this checkout, installed (not editable) into a fresh virtualenv,
runs the demo recipe from another folder with `hftrain sft` (2 processes under accelerate launch).

The fresh venv gets hftrain from the wheel only; its dependencies are those of the test's own environment, made
visible through a .pth line (a plain path entry: the test environment's editable hftrain, which is a .pth *inside* that
site-packages, is not processed), so no download is needed and no other copy of hftrain can be imported.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig

import pytest

from tests.conftest import REPO
from tests.support import free_port

pytestmark = [pytest.mark.launches, pytest.mark.cluster]


def sh(cmd, cwd, timeout=600, env=None):
    # without PYTHONPATH: a checkout on it (the suite run from a worktree) would shadow the wheel's hftrain
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                       env={**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, **(env or {})})
    assert r.returncode == 0, (cmd, r.stdout[-3000:], r.stderr[-5000:])
    return r


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(python, hftrain script) of a fresh venv holding hftrain from a wheel of this checkout."""
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"  # a copy: building writes build/ and *.egg-info next to the sources
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".git", ".venv", "runs", "build", "*.egg-info",
                                                             "__pycache__", ".pytest_cache"))
    sh([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(root / "dist"),
        str(src)], cwd=root)
    (wheel,) = (root / "dist").glob("hftrain-*.whl")
    venv = root / "venv"
    sh([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=root)
    py = venv / "bin" / "python"
    site = sh([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=root).stdout.strip()
    deps = sysconfig.get_paths()["purelib"]
    with open(os.path.join(site, "hftrain_test_deps.pth"), "w") as fh:
        fh.write(deps + "\n")
    sh([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index", "-q", str(wheel)],
       cwd=root)
    return py, venv / "bin" / "hftrain", root


def test_the_installed_wheel_runs_the_demo_from_another_folder(installed, tmp_path):
    py, hftrain, _ = installed
    where = sh([str(py), "-c", "import hftrain, hftrain.recipes.sft; print(hftrain.__file__)"], cwd=tmp_path)
    assert str(py.parent.parent) in where.stdout and REPO not in where.stdout, where.stdout  # the wheel's copy

    # A user's folder: the demo's recipe and data copied in, nothing of the repository on the path.
    shutil.copytree(os.path.join(REPO, "data", "demo"), tmp_path / "data" / "demo")
    shutil.copytree(os.path.join(REPO, "recipes", "demo"), tmp_path / "recipes" / "demo")
    sh([str(hftrain), "tiny-model", "--data", "data/demo/train.jsonl", "--output", "runs/demo/base"], cwd=tmp_path)
    r = sh([str(hftrain), "sft", "recipes/demo/sft.yaml", "training.max_steps=3", "training.eval_steps=3",
            "eval.exact_match=4", "training.disable_tqdm=true", f"strategy.main_process_port={free_port()}"],
           cwd=tmp_path, env={"PATH": f"{py.parent}{os.pathsep}{os.environ['PATH']}"})
    out = tmp_path / "runs" / "demo" / "sft"  # output_dir resolved once, against the folder the run starts in
    assert "-m hftrain.recipes.sft" in r.stdout and f"hftrain: saved to {out}" in r.stdout + r.stderr
    assert (out / "model.safetensors").is_file() and (out / "recipe.yaml").is_file()
    import json

    info = json.loads((out / "run_info.json").read_text())
    assert info["world_size"] == 2 and info["global_step"] == 3
