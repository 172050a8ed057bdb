"""Timing work the way `alpac calibrate` times every row: the median of repeated timings after
a warm-up, short work repeated, every rank taking part agreeing on the repeat count."""

from __future__ import annotations

import statistics
import time

REPS = 5
TARGET = 4e-3  # seconds: shorter work is repeated inside one execution
# Across ranks, a collective sometimes waits a scheduler tick for another process (gloo on
# CPU: a small all-reduce takes 0.35 ms back to back, 4 ms now and then, more often with gaps
# between them): longer and more timings, so that the median is the back-to-back cost.
ACROSS_REPS, ACROSS_TARGET = 9, 50e-3
MAX_REPEAT = 512


def per_op(run, agree, ops: int = 1, sync=None) -> float:
    """Seconds per operation of `run(r)`, which does `r * ops` operations and waits for them
    (and may return the seconds they took as a float, when it does more than them). `agree(r)`
    gives every rank taking part rank 0's repeat count, so that all run alike; the ranks warm
    up with it. With `sync()` (work every rank does at once) each timing starts in
    step with the other ranks; without (work across ranks, whose collectives wait for each
    other) the timings are more and longer."""
    def clock(repeat: int) -> float:
        if sync is not None:
            sync()
        t0 = time.perf_counter()
        took = run(repeat)
        return took if isinstance(took, float) else time.perf_counter() - t0

    run(1)  # compiles and warms up
    once = [clock(1) for _ in range(3)]
    target, reps = (TARGET, REPS) if sync is not None else (ACROSS_TARGET, ACROSS_REPS)
    repeat = agree(max(1, min(MAX_REPEAT, int(target / max(min(once), 1e-7)))))
    if repeat == 1:  # long work: the first timings count
        return statistics.median(once + [clock(1) for _ in range(reps - 3)]) / ops
    run(repeat)
    return statistics.median(clock(repeat) for _ in range(reps)) / (repeat * ops)
