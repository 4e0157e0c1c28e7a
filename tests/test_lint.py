"""The code base stays clean under ruff (pyproject.toml's [tool.ruff]: pycodestyle errors and warnings, pyflakes,
lines within 120 characters)."""
import subprocess
import sys

import pytest

from .conftest import REPO

PATHS = ["hftrain", "tests", "bench", "scripts", "recipes"]


def test_ruff_check_passes():
    pytest.importorskip("ruff", reason="ruff is not installed (pip install -e '.[test]')")
    r = subprocess.run([sys.executable, "-m", "ruff", "check", *PATHS], cwd=REPO, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, f"`ruff check {' '.join(PATHS)}` found problems:\n{r.stdout}{r.stderr}"
