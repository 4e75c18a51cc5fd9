"""The native passes inside real steps: how long each took, and the bandwidth its bytes needed.

:func:`timed_passes` wraps every function of the C library (``compressed_opt.cuda.cpu.library()``,
the ``co_*`` functions the optimizers call through it) with a clock while its ``with`` block runs,
so that the steps inside it run exactly as a user's do (the same passes, arguments and caches),
and adds up each function's time and calls. :data:`STREAMS` counts what each pass reads and writes,
in streams of the bucket's fp32 bytes (4 bytes per element; the 1-bit rows, 1/32 of that plus the
block scales, are left out), in the configuration a default step runs it; a pass missing from the
table is still timed, its bandwidth left out.

With every element of the step's buckets passing once through each pass (each runs once per bucket
and step), ``streams * 4 * elements / time`` is the bandwidth the pass needed; against a plain copy's
(``8 * elements / time``: read and write counted, as here) that is the issue's measure of a pass
close to the memory-bandwidth limit. ``benchmarks/step_vs_fused.py --passes`` reports it per row.
"""
from __future__ import annotations

import collections
import contextlib
import time

#: per native pass, ``(reads, writes)`` in streams of the bucket's fp32 bytes, as a default step
#: runs it (the C sources' comments list what each reads and writes)
STREAMS: dict[str, tuple[int, int]] = {
    # the gradients' sums of squares (finiteness, variance tracking) and the gather
    "co_sumsq_each": (1, 0),  # g
    "co_segment_sumsq": (1, 0),  # x
    "co_gather": (1, 1),  # g; x
    # the worker's compression, with the local momentum formed inside it
    "co_compress_rows": (2, 1),  # x, e; e
    "co_lerp_scale_clamp": (3, 1),  # x, m, R; x (the local momentum alone)
    "co_lerp_scale_clamp_compress_sources": (4, 1),  # g, m, R, e; e
    "co_lerp_scale_clamp_compress_rows": (4, 1),  # x, m, R, e; e
    "co_lerp_compress_sources": (3, 1),  # g, m, e; e
    "co_lerp_compress_rows": (3, 1),  # x, m, e; e
    "co_scale_clamp_compress_rows": (3, 1),  # x, R, e; e
    "co_zero_momentum_compress_rows": (3, 1),  # R, g, e; e (the kept rows)
    "co_zo_sync_before_compress_rows": (5, 2),  # g, m, sden, R, e; m, e (one-step intervals: no accumulator)
    # the server's average and compression (one rank: its chunk is the whole bucket)
    "co_average_compress_rows": (1, 1),  # e; e
    # the update from the result's rows
    "co_rows_divide_zero_descend": (2, 2),  # R, p; p, m
    "co_rows_keep_descend": (2, 2),  # den, p; p, m
    "co_zero_rows_descend": (2, 1),  # R, p; p
    "co_lamb_rows_variance_maxima": (4, 2),  # R, m, v, den; m, v
    "co_lamb_descend": (3, 1),  # m, den, p; p
    "co_zo_sync_after_rows": (3, 3),  # R, sden, anchor; m, anchor, p
    "co_zo_phase_a_rows": (4, 2),  # R, sden, m, p; m, p
    # 1-bit LAMB under ZeRO (one rank: its chunk is the whole bucket)
    "co_rows_quotient_finite": (1, 1),  # R; the previous momentum
    "co_zero_lamb_rows_descend": (2, 1),  # R, p; p
    # 1-bit LAMB's measuring steps
    "co_direction_sumsq": (3, 0),  # x, den, p
    "co_zero_local_momentum": (2, 1),  # R, g; x
    "co_divide_where_nonzero": (2, 1),  # y, R; y
}


def streams_of(name: str) -> int | None:
    """Streams a pass moves (reads and writes), ``None`` for a pass the table does not know."""
    rw = STREAMS.get(name)
    return None if rw is None else rw[0] + rw[1]


@contextlib.contextmanager
def timed_passes(lib):
    """Inside the block, every ``co_*`` function of ``lib`` (a ``ctypes.CDLL``) is timed; yields a
    ``{name: [seconds, calls]}`` that fills as they run. The functions are put back on exit."""
    totals: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
    originals = {name: fn for name, fn in vars(lib).items() if name.startswith("co_")}

    def clocked(name, fn):
        def call(*args):
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                entry = totals[name]
                entry[0] += time.perf_counter() - start
                entry[1] += 1
        return call

    for name, fn in originals.items():
        setattr(lib, name, clocked(name, fn))
    try:
        yield totals
    finally:
        for name, fn in originals.items():
            setattr(lib, name, fn)


def pass_rows(totals: dict, steps: int, numel: int, copy_bandwidth: float) -> list[dict]:
    """Per pass, slowest first: its time per step, calls per step, the share of the elements it
    covers a step, streams, the bandwidth its bytes needed and that over a plain copy's (``None``
    where the streams are unknown). A call covers one bucket, the most calls any pass makes a step
    being the buckets (the sums run every step): a pass that runs on some steps only (1-bit LAMB's
    measuring steps) is counted for the buckets it ran on."""
    rows = []
    buckets = max((calls / steps for _, calls in totals.values()), default=1.0)
    for name, (seconds, calls) in sorted(totals.items(), key=lambda kv: -kv[1][0]):
        per_step = seconds / steps
        streams = streams_of(name)
        share = min(1.0, calls / steps / buckets)  # of the elements, a step, on average
        needed = None if streams is None or per_step <= 0 else streams * 4 * numel * share / per_step
        rows.append({"pass": name, "ms": 1e3 * per_step, "calls": calls / steps, "share": share, "streams": streams,
                     "bandwidth": needed, "of_copy": None if needed is None else needed / copy_bandwidth})
    return rows


def describe(rows: list[dict], step_ms: float) -> str:
    """The rows as indented lines, and what the steps (their mean time ``step_ms``, the clocks on)
    spent outside the passes."""
    lines = []
    for r in rows:
        bw = "" if r["bandwidth"] is None else (f", {r['streams']} streams: {r['bandwidth'] / 1e9:6.1f} GB/s, "
                                                 f"{r['of_copy']:.2f} of a copy's")
        if r.get("floor_ms"):
            bw += f", {r['over_floor']:.2f}x its stream floor ({r['floor_ms']:.2f} ms)"
        lines.append(f"      {r['pass']:38s} {r['ms']:7.2f} ms ({r['calls']:g} calls a step){bw}")
    rest = step_ms - sum(r["ms"] for r in rows)
    lines.append(f"      {'outside the native passes':38s} {rest:7.2f} ms")
    return "\n".join(lines)
