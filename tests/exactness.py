"""Exactness bounds, each measured: what a comparison allows, and the largest error seen on each CPU path.

An exactness test compares two computations that are equal in exact arithmetic (2 ranks against 1, a resumed run
against an uninterrupted one, a fused loss against plain PyTorch). Their float32 results differ by rounding, and by
how much depends on the kernels' reduction order, which ATen picks by the CPU's vector width
(ATEN_CPU_CAPABILITY: avx512, avx2, default): a bound that held on one machine kind failed on another (issue 70).

So every bound is named here with the largest relative error observed under each capability it was measured on
(`scripts/exactness_spread.py` runs the tests that use bounds under each capability this CPU has, with
HFTRAIN_SPREAD_LOG set, and tabulates what `within` and `beyond` recorded). The rule for a limit:
  - at least MARGIN x the largest error seen on any path (another machine's path, or a longer reduction, may double
    or triple it: AVX-512 showed 3x the AVX2 error on the Mixtral ZeRO-3 run), and never under FLOOR (a few float32
    roundings of a value near 1);
  - below every control's error (`beyond`: the same comparison with a real fault planted, a per-micro-batch mean or
    a wrong scale), by a clear factor, so the bound still catches a fault of that size.
tests/test_exactness.py holds the table to that rule.

Errors are relative, one number per comparison, in float64: the largest |a - b| over the largest |b| of a number, a list
of numbers or a tensor (dicts and lists of tensors key by key, item by item, the largest of those).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import torch

MARGIN = 10.0
FLOOR = 1e-6
SPREAD_LOG = "HFTRAIN_SPREAD_LOG"  # a JSON-lines file: each judged error is appended to it
# Set (scripts/exactness_spread.py --record-only): errors are recorded and not judged, for a bound being measured.
RECORD_ONLY = "HFTRAIN_SPREAD_RECORD_ONLY"


@dataclasses.dataclass(frozen=True)
class Bound:
    limit: float
    seen: dict  # CPU capability (avx2, default, avx512) -> the largest relative error seen there
    what: str  # what is compared


# name -> Bound. `seen` comes from `scripts/exactness_spread.py` (its command and machine in docs/benchmarks.md);
# an avx512 figure where a machine of that kind reported one.
BOUNDS: dict[str, Bound] = {}


def _judged() -> bool:
    return os.environ.get(RECORD_ONLY) != "1"


def bound(name: str) -> Bound:
    if name not in BOUNDS and not _judged():
        return Bound(math.inf, {}, "being measured")
    if name not in BOUNDS:
        raise KeyError(f"exactness bound {name!r} is not in tests/exactness.py BOUNDS: add it with its measured spread")
    return BOUNDS[name]


def _pairs(got, want):
    """(where, got, want) for each comparison: a dict key by key, a list of tensors or dicts item by item; a number,
    a list of numbers or a tensor is one comparison."""
    if isinstance(want, dict):
        if set(got) != set(want):
            raise AssertionError(f"different keys: {sorted(set(got) ^ set(want))[:10]}")
        for k in want:
            yield from ((f"{k}{sub}", g, w) for sub, g, w in _pairs(got[k], want[k]))
    elif isinstance(want, (list, tuple)) and want and isinstance(want[0], (torch.Tensor, dict, list, tuple)):
        if len(got) != len(want):
            raise AssertionError(f"lengths differ: {len(got)} against {len(want)}")
        for i, (g, w) in enumerate(zip(got, want)):
            yield from ((f"[{i}]{sub}", gg, ww) for sub, gg, ww in _pairs(g, w))
    else:
        yield "", got, want


def _relative(got, want, scale: float = 0.0) -> float:
    g = torch.as_tensor(got, dtype=torch.float64)
    w = torch.as_tensor(want, dtype=torch.float64)
    if g.shape != w.shape:
        raise AssertionError(f"shapes differ: {tuple(g.shape)} against {tuple(w.shape)}")
    if g.numel() == 0:
        return 0.0
    difference = (g - w).abs().max()
    if not math.isfinite(float(difference)):
        return math.inf
    scale = max(float(w.abs().max()), scale)
    return float(difference) / scale if scale > 0 else float(difference)


def relative_error(got, want, scale: float = 0.0) -> tuple[float, str]:
    """The largest relative difference of `got` from `want`, and where it is (a key, an index). `scale`: the least
    magnitude a difference is measured against, for values that may be near zero (a reward, a margin)."""
    worst, where = 0.0, ""
    for at, g, w in _pairs(got, want):
        err = _relative(g, w, scale)
        if err > worst or (math.isinf(err) and not math.isinf(worst)):
            worst, where = err, at
    return worst, where


def _record(name: str, error: float, control: bool) -> None:
    path = os.environ.get(SPREAD_LOG)
    if not path:
        return
    entry = {"bound": name, "error": error, "control": control,
             "capability": torch.backends.cpu.get_cpu_capability().lower(),
             "test": os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0]}
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(entry) + "\n")


def within(name: str, got, want, label: str = "", scale: float = 0.0) -> float:
    """Assert that `got` equals `want` within bound `name`; the error is recorded for the spread table."""
    b = bound(name)
    error, where = relative_error(got, want, scale)
    _record(name, error, control=False)
    told = f"{label + ': ' if label else ''}{name} ({b.what})"
    assert error <= b.limit or not _judged(), (f"{told}: relative error {error:.3g} at {where or 'the value'} over its "
                                               f"bound {b.limit:g} (seen: {b.seen})")
    return error


def beyond(name: str, got, want, label: str = "", scale: float = 0.0) -> float:
    """The control: `got`, computed with a fault planted, differs from `want` by more than bound `name` allows, so the
    bound would catch that fault."""
    b = bound(name)
    error, _ = relative_error(got, want, scale)
    _record(name, error, control=True)
    told = f"{label + ': ' if label else ''}{name}"
    assert error > b.limit or not _judged(), (f"{told}: the control differs by only {error:.3g}, within the bound "
                                              f"{b.limit:g}: the bound cannot see this fault")
    return error
