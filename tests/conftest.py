import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO_TRAIN = os.path.join(REPO, "data", "demo", "train.jsonl")
DEMO_EVAL = os.path.join(REPO, "data", "demo", "eval.jsonl")
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


def run(cmd: list[str], timeout: int = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run a command from the repository root; the output is printed on failure by the caller's assert."""
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", **(env or {}))
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=full_env)


PY = sys.executable
# `accelerate launch` of the interpreter running the tests (the venv need not be on PATH).
ACCELERATE_LAUNCH = [PY, "-m", "accelerate.commands.launch"]
