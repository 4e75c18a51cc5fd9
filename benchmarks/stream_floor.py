"""The stream floor: about the least time this machine takes to move a pass's streams.

A plain copy's bandwidth (``step_vs_fused.py``'s roofline) is one number for every pass; a pass
that reads three streams and writes one moves memory in another mix, at another rate. The floor of
a pass with ``r`` reads and ``w`` writes (:data:`native_passes.STREAMS`) is the time of a C loop
(``stream_floor.c``, compiled here as the kernels are) that moves exactly those streams over
the same number of elements and does nothing else: the outputs that are inputs written in place,
the others only written (non-temporal stores), the reads-only pass a sum of squares.
A pass with those streams can hardly beat it on this machine (the loop's own time moves from run to
run: passes have come out at 0.83 of it); a pass at 1.0 of it is at the limit.

The floor of a step is the sum of its passes' floors: the step of an implementation whose passes
each ran at the floor and that spent nothing outside them. :func:`time_floors` times each floor
loop in turn with a baseline (fused AdamW's step), so that the ratio of the two is the best ratio
these streams allow, measured in one run (the machine's drift hits both alike); :class:`Floors`
lets a caller run them between its own timings (``step_vs_fused.py --passes``: after each step).

    python -P benchmarks/stream_floor.py --elements 9000000      # each (reads, writes) of the table
"""
from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

_SOURCE = os.path.join(HERE, "stream_floor.c")
_library = None


def library() -> ctypes.CDLL:
    """``stream_floor.c`` compiled as the kernels are (``compressed_opt.cuda.build.compile_like_kernels``),
    once per process. Raises ``RuntimeError`` saying why where it cannot be compiled."""
    global _library
    if _library is None:
        from compressed_opt.cuda import build

        target = os.path.join(tempfile.mkdtemp(prefix="stream_floor_"), "stream_floor.so")
        failure = build.compile_like_kernels([_SOURCE], target)
        if failure is not None:
            raise RuntimeError(f"{_SOURCE} cannot be compiled here: {failure}")
        lib = ctypes.CDLL(target)
        lib.sf_loop.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
        lib.sf_loop.restype = ctypes.c_double
        _library = lib
    return _library


class FloorLoop:
    """The floor loop of ``reads`` and ``writes`` streams of ``numel`` fp32 elements, its buffers
    made once (``reads`` of them, and the written-only outputs: ``writes - reads`` where positive)."""

    def __init__(self, reads: int, writes: int, numel: int):
        if not 1 <= reads <= 8 or writes < 0:
            raise ValueError(f"a floor loop reads 1 to 8 streams and writes none or more, "
                             f"got {reads} reads and {writes} writes")
        self.reads, self.writes, self.numel = reads, writes, numel
        #: the inputs, then the written-only outputs (the first ``min(reads, writes)`` inputs are outputs too)
        self.buffers = [torch.rand(numel) for _ in range(reads + max(0, writes - reads))]
        ins = [b.data_ptr() for b in self.buffers[:reads]]
        outs = ins[:min(reads, writes)] + [b.data_ptr() for b in self.buffers[reads:]]
        self._in = (ctypes.c_int64 * reads)(*ins)
        self._out = (ctypes.c_int64 * max(1, writes))(*outs)
        self._lib = library()

    def __call__(self) -> float:
        return self._lib.sf_loop(self._in, self.reads, self._out, self.writes, self.numel)


class Floors:
    """Floor loops over ``numel`` elements, one per ``(reads, writes)`` pair of the names added
    (:meth:`add`), and a ``baseline`` (``None``: none), timed together by :meth:`run_once` so that a
    caller can run them between its own timings (the machine's drift hits all alike)."""

    def __init__(self, numel: int, baseline=None):
        self.numel, self.baseline = numel, baseline
        self.names: dict = {}
        self._loops: dict = {}
        self._times: dict = {None: []} if baseline is not None else {}

    def add(self, name: str, pair: tuple[int, int]) -> None:
        """Time ``name`` as the floor loop of ``pair`` (made once per pair) from the next run on."""
        self.names[name] = pair
        if pair not in self._loops:
            self._loops[pair] = FloorLoop(*pair, self.numel)
            self._times[pair] = []

    def run_once(self, measured: bool = True) -> None:
        """Run the baseline and each loop once, in turn, keeping their times when ``measured``."""
        runs = ([(None, self.baseline)] if self.baseline is not None else []) + list(self._loops.items())
        for key, run in runs:
            start = time.perf_counter()
            run()
            took = time.perf_counter() - start
            if measured:
                self._times[key].append(took)

    def medians(self) -> dict:
        """The median time in seconds of each name's loop, and of the baseline under ``None``."""
        medians = {key: statistics.median(ts) for key, ts in self._times.items() if ts}
        out = {name: medians[pair] for name, pair in self.names.items() if pair in medians}
        if None in medians:
            out[None] = medians[None]
        return out


def time_floors(streams: dict, numel: int, baseline=None, repeats: int = 7) -> dict:
    """The median time in seconds of each ``(reads, writes)`` of ``streams`` (a name per pair) as a
    floor loop over ``numel`` elements, and of ``baseline()`` (``None``: none) under the key
    ``None``: each run in turn, ``repeats`` times, after one unmeasured run of each."""
    floors = Floors(numel, baseline)
    for name, pair in streams.items():
        floors.add(name, pair)
    floors.run_once(measured=False)
    for _ in range(repeats):
        floors.run_once()
    return floors.medians()


def main(argv=None) -> int:
    from native_passes import STREAMS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--elements", type=int, default=9_000_000)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    pairs = {f"{r} reads, {w} writes": (r, w) for r, w in sorted(set(STREAMS.values()))}
    floors = time_floors(pairs, args.elements, repeats=args.repeats)
    for name, seconds in floors.items():
        r, w = pairs[name]
        print(f"{name:18s} {1e3 * seconds:8.2f} ms  {(r + w) * 4 * args.elements / seconds / 1e9:6.1f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
