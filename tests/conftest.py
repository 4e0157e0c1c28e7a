import os
import signal
import subprocess
import sys

import pytest

from hftrain.launch.preflight import deepspeed_op_builders, extensions_dir, op_is_built

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO_TRAIN = os.path.join(REPO, "data", "demo", "train.jsonl")
DEMO_EVAL = os.path.join(REPO, "data", "demo", "eval.jsonl")
PY = sys.executable
# `accelerate launch` of the interpreter running the tests (the venv need not be on PATH).
ACCELERATE_LAUNCH = [PY, "-m", "accelerate.commands.launch"]
SMALL = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1}


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from hftrain.tiny import build_tiny_model, texts_of_jsonl

    out = str(tmp_path_factory.mktemp("tiny") / "base")
    build_tiny_model(out, texts_of_jsonl([DEMO_TRAIN]), config=SMALL, vocab_size=300, seed=0)
    return out


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


# Every launch of the session (and its workers) finds DeepSpeed's ops in the cache hftrain uses.
EXTENSIONS = extensions_dir()


def run(cmd: list[str], timeout: int = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run a command from the repository root; the output is printed on failure by the caller's assert.

    The command gets a process group of its own, killed whole on a time-out: killing only the launcher would
    leave its workers running (and holding CPU, ports or a DeepSpeed build lock) through the rest of the suite."""
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", **(env or {}))
    with subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env,
                          start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@pytest.fixture(scope="session")
def deepspeed_ops():
    """DeepSpeed's CPU ops must be built before the first DeepSpeed launch (scripts/setup.sh builds them): a build
    inside a test would run within that test's time-out, with two ranks racing for the build lock."""
    missing = [b.name for b in deepspeed_op_builders() if not op_is_built(b, EXTENSIONS)]
    if missing:
        pytest.fail(f"DeepSpeed op(s) {', '.join(missing)} not built in {EXTENSIONS}: run "
                    "`.venv/bin/python scripts/build_deepspeed_ops.py` (scripts/setup.sh does)", pytrace=False)
