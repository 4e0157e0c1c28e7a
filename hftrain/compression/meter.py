"""What the gradient collectives cost: their bytes and the share of a step any of them was in flight, and how much of
that the backward pass hid (interval arithmetic on the collectives' and the hooks' times)."""

from __future__ import annotations

import math
import threading
import time

import torch


def merge(intervals) -> list[tuple[float, float]]:
    """The union of [start, end] intervals as sorted, disjoint intervals (empty ones dropped)."""
    out: list[list[float]] = []
    for a, b in sorted((a, b) for a, b in intervals if b > a):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def length(intervals) -> float:
    return sum(b - a for a, b in merge(intervals))


def minus(intervals, holes) -> list[tuple[float, float]]:
    """The parts of `intervals` outside every interval of `holes`."""
    out = []
    holes = merge(holes)
    for a, b in merge(intervals):
        for h0, h1 in holes:
            if h1 <= a or h0 >= b:
                continue
            if h0 > a:
                out.append((a, h0))
            a = max(a, h1)
            if a >= b:
                break
        if a < b:
            out.append((a, b))
    return out


class CommMeter:
    """Bytes and timing of the gradient collectives. Hooks call `record` (each collective's bytes and in-flight
    interval) and `hook_call` (the time the backward thread spent inside the hook); the callback reads `step_end`.

    Overlap: DDP calls the hook of a bucket as soon as its gradients are computed, so the call for the last bucket
    (`bucket.is_last()`) marks the end of the backward's compute. Communication is *hidden* while a collective is in
    flight before that mark and the backward thread is not itself waiting inside a hook (a hook that blocks, like
    PowerSGD's on gloo, stalls the backward: its communication hides nothing)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.bytes_raw = 0.0
        self.bytes_sent = 0.0
        self._intervals: list[list[float]] = []
        self._in_hook: list[tuple[float, float]] = []
        self._backward_end: float | None = None

    def record(self, raw: float, sent: float, start: float | None = None) -> list[float]:
        """Count one bucket's bytes; returns the [start, end] interval that the caller closes on completion."""
        interval = [time.perf_counter() if start is None else start, math.inf]
        with self._lock:
            self.bytes_raw += raw
            self.bytes_sent += sent
            self._intervals.append(interval)
        return interval

    def close(self, interval: list[float]) -> None:
        interval[1] = time.perf_counter()

    def hook_call(self, start: float, end: float, last_bucket: bool) -> None:
        with self._lock:
            self._in_hook.append((start, end))
            if last_bucket:
                self._backward_end = start

    def step_end(self, step_start: float) -> dict:
        """This step's totals. time_share: the union of in-flight intervals over the step's wall time; seconds: that
        union; hidden_share: the part of it overlapped with the backward's compute (class docstring)."""
        now = time.perf_counter()
        with self._lock:
            raw, sent, intervals, in_hook, end = (self.bytes_raw, self.bytes_sent, self._intervals, self._in_hook,
                                                  self._backward_end)
            self.bytes_raw, self.bytes_sent, self._intervals, self._in_hook = 0.0, 0.0, [], []
            self._backward_end = None
        flight = merge((max(a, step_start), min(b, now)) for a, b in intervals)
        busy = length(flight)
        hidden = 0.0
        if end is not None:
            hidden = length(minus([(a, min(b, end)) for a, b in flight], in_hook))
        return {"bytes_raw": raw, "bytes_sent": sent, "time_share": busy / max(now - step_start, 1e-9),
                "seconds": busy, "hidden_share": hidden / busy if busy > 0 else 0.0}


def timed(meter: CommMeter, fut: torch.futures.Future, raw: float, sent: float,
           start: float | None = None) -> torch.futures.Future:
    interval = meter.record(raw, sent, start)

    def done(f):
        meter.close(interval)
        return f.value()

    return fut.then(done)
