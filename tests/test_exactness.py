"""The exactness bounds (tests/exactness.py) hold to their rule: each measured on both CPU paths of the machine kind
(avx2 and default; avx512 where a machine of that kind reported it), its limit MARGIN x the largest error seen and no
looser, every bound used by a test and every name a test uses in the table; `within` and `beyond` judge what they
say they judge."""

import math
import os
import re

import pytest
import torch

from tests.exactness import BOUNDS, FLOOR, MARGIN, RECORD_ONLY, beyond, relative_error, within

TESTS = os.path.dirname(os.path.abspath(__file__))
GPU_ONLY = {"bench_gpu.chunked_vs_logits.loss_cuda_bf16"}  # bench/gpu.py's bf16 on a GPU: no GPU measured it
NAME = re.compile(r"""(?:within|beyond)\(\s*(?:"([^"]+)"|\n\s*"([^"]+)")""")


def _names_used() -> set[str]:
    used = set()
    for f in os.listdir(TESTS):
        if f.startswith("test_") and f.endswith(".py") and f != "test_exactness.py":
            text = open(os.path.join(TESTS, f), encoding="utf-8").read()
            used |= {a or b for a, b in NAME.findall(text)}
            used |= set(re.findall(r'"([a-z0-9_]+(?:\.[a-z0-9_]+)+)"', text)) & set(BOUNDS)  # names kept in variables
            for prefix in re.findall(r'assert_resume_exact\([^)]*"([a-z0-9_.]+)"\)', text):  # tests/support.py's
                used |= {f"{prefix}.resumed_vs_uninterrupted.{what}" for what in ("losses", "weights")}
    return used


def _smallest_limit(worst: float) -> float:
    """The rule's limit: MARGIN x the worst error, at least FLOOR, rounded up to 1, 2 or 5 of its decade."""
    need = max(MARGIN * worst, FLOOR)
    decade = 10 ** math.floor(math.log10(need))
    return next(s * decade for s in (1, 2, 5, 10) if need <= s * decade * (1 + 1e-9))


@pytest.mark.parametrize("name", sorted(BOUNDS))
def test_each_bound_is_measured_on_both_paths_and_no_looser_than_its_rule(name):
    b = BOUNDS[name]
    if name in GPU_ONLY:
        assert not b.seen and "not measured" in b.note
        return
    assert {"avx2", "default"} <= set(b.seen), f"{name}: measure it on both CPU paths (scripts/exactness_spread.py)"
    assert b.limit == pytest.approx(_smallest_limit(max(b.seen.values())), rel=1e-9), (name, b.limit, b.seen)


def test_every_bound_is_used_and_every_used_name_is_a_bound():
    used = _names_used()
    assert used - set(BOUNDS) == set(), "names used by tests but not in tests/exactness.py BOUNDS"
    assert set(BOUNDS) - used == set(), "bounds no test uses"


def test_the_relative_error_is_the_largest_difference_over_the_largest_value():
    assert relative_error([1.0, 2.0], [1.0, 2.0004])[0] == pytest.approx(2e-4, rel=1e-3)
    assert relative_error({"a": torch.ones(3), "b": torch.zeros(2)}, {"a": torch.ones(3), "b": torch.ones(2)}) == (
        1.0, "b")
    assert relative_error(1e-9, 0.0, scale=1.0)[0] == pytest.approx(1e-9)
    assert math.isinf(relative_error([float("nan")], [1.0])[0])
    with pytest.raises(AssertionError, match="different keys"):
        relative_error({"a": 1.0}, {"b": 1.0})


def test_within_and_beyond_refuse_what_they_should(monkeypatch):
    monkeypatch.delenv(RECORD_ONLY, raising=False)
    name = "checkpoints.resume_vs_uninterrupted.weights"  # limit 1e-6
    assert within(name, [1.0], [1.0 + 1e-7]) < 1e-6
    with pytest.raises(AssertionError, match="over its bound"):
        within(name, [1.0], [1.0 + 1e-5])
    with pytest.raises(AssertionError, match="barely sees"):
        beyond(name, [1.0], [1.0 + 5e-6])  # beyond the bound, but not by MARGIN
    beyond(name, [1.0], [1.1])
    with pytest.raises(KeyError, match="not in tests/exactness.py BOUNDS"):
        within("no.such.bound", 1.0, 1.0)
