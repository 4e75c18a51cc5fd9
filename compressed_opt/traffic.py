"""What an optimizer tells its user about its communication: ``comm_stats()`` and rank 0's lines.

The engine's traffic meter (:class:`compressed_opt.engine.TrafficMeter`) books the bytes of every
``step()`` to the stage the step belonged to: the full-precision warmup or the compression stage
(0/1 Adam: before or after its first 1-bit step). :class:`CommReport` is what
``optimizer.comm_stats()`` returns (:func:`report`): those numbers beside what an fp32 ring
all-reduce of the same parameters sends per rank, ``2 (N - 1) / N * 4 n`` bytes. :func:`announce`
writes rank 0's WARNING-level lines, shown without any logging set up: one at the first step (the
parameters, buckets, exchange and when it will compress) and one at the first compression step
(the bytes this rank sent in it).
"""
from __future__ import annotations

import dataclasses
import logging

from .engine import COMPRESSION, WARMUP

logger = logging.getLogger("compressed_opt")


@dataclasses.dataclass(frozen=True)
class CommReport:
    """An optimizer's communication, as this rank counted it (``optimizer.comm_stats()``).

    Bytes are what this rank sent, per ``step()`` call, averaged over the steps of each stage
    since the optimizer was made (or resumed): ``None`` for a stage with no steps yet."""

    optimizer: str
    world_size: int
    #: ``"warmup"`` (full precision) or ``"compression"``
    stage: str
    global_step: int
    #: the last full-precision step (``None``: not decided yet, e.g. ``freeze_step="auto"``)
    freeze_step: int | None
    #: the exchange in use, e.g. ``"flat 1-bit over 8 ranks"`` (``None`` before the first step)
    exchange: str | None
    #: per bucket: ``"1bit"`` or ``"fp32"``, how many buckets take each
    paths: dict
    warmup_steps: int
    warmup_bytes_per_step: float | None
    compression_steps: int
    compression_bytes_per_step: float | None
    #: what crossed between nodes per compression step (hierarchical exchange; else ``None``)
    compression_inter_node_bytes_per_step: float | None
    #: what an fp32 ring all-reduce of the trainable parameters sends per rank: ``2 (N-1)/N * 4 n``
    fp32_allreduce_bytes_per_step: float
    #: one-time bytes (first step's checks and parameter broadcast, choosing the exchange)
    setup_bytes: int

    @property
    def compression_ratio(self) -> float | None:
        """How many times fewer bytes a compression step sends than an fp32 all-reduce."""
        sent = self.compression_bytes_per_step
        if not sent:
            return None
        return self.fp32_allreduce_bytes_per_step / sent

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "compression_ratio": self.compression_ratio}

    def __str__(self) -> str:
        def size(b):
            return "-" if b is None else _human(b)

        lines = [
            f"{self.optimizer} on {self.world_size} rank(s), step {self.global_step}, {self.stage} stage "
            f"(freeze step: {'not decided' if self.freeze_step is None else self.freeze_step})",
            f"  exchange: {self.exchange or 'chosen at the first step'}; buckets per path: "
            + (", ".join(f"{k} {v}" for k, v in sorted(self.paths.items())) or "-"),
            f"  warmup: {self.warmup_steps} steps, {size(self.warmup_bytes_per_step)} per step",
            f"  compression: {self.compression_steps} steps, {size(self.compression_bytes_per_step)} per step"
            + ("" if self.compression_inter_node_bytes_per_step is None
               else f" ({size(self.compression_inter_node_bytes_per_step)} between nodes)"),
            f"  an fp32 all-reduce of these parameters: {size(self.fp32_allreduce_bytes_per_step)} per step"
            + ("" if self.compression_ratio is None else f"; compression sends {self.compression_ratio:.1f}x fewer"),
        ]
        return "\n".join(lines)


def _human(nbytes: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"


def fp32_allreduce_bytes(numel: int, world_size: int) -> float:
    """Bytes each rank sends in a ring all-reduce of ``numel`` fp32 values over ``world_size``."""
    return 2 * (world_size - 1) / world_size * 4 * numel if world_size > 1 else 0.0


def report(engine, algorithm) -> CommReport:
    """An engine's communication so far (``optimizer.comm_stats()``): its traffic meter's bytes per
    step by stage, the exchange and its paths, against an fp32 all-reduce of the same parameters."""
    paths: dict[str, int] = {}
    for b in engine._buckets or ():
        path = engine.exchange.path_of(b.numel)
        paths[path] = paths.get(path, 0) + 1
    meter = engine.traffic
    warmup, _ = meter.per_step(WARMUP)
    compression, inter = meter.per_step(COMPRESSION)
    return CommReport(
        optimizer=engine.name, world_size=engine.backend.world_size,
        stage=COMPRESSION if algorithm.compressing else WARMUP, global_step=engine.global_step,
        freeze_step=algorithm.last_warmup_step, exchange=engine.exchange.describe(), paths=paths,
        warmup_steps=meter.stages[WARMUP][0], warmup_bytes_per_step=warmup,
        compression_steps=meter.stages[COMPRESSION][0], compression_bytes_per_step=compression,
        compression_inter_node_bytes_per_step=inter if engine.exchange.hierarchical else None,
        fp32_allreduce_bytes_per_step=fp32_allreduce_bytes(engine.numel(), engine.backend.world_size),
        setup_bytes=meter.setup_bytes,
    )


def announce(said: set, engine, algorithm, stage: str) -> None:
    """Rank 0's WARNING-level lines (shown by default): at an optimizer's first step, what it will
    do; at its first compression step, what compression really does, with the bytes counted.
    ``said`` (the optimizer's) keeps which were written."""
    if engine.backend.world_size == 1 or engine.backend.rank != 0:
        said.update(("start", "compression"))
        return
    if "start" not in said:
        said.add("start")
        rep = report(engine, algorithm)
        paths = ", ".join(f"{n} on the {'1-bit exchange' if p == '1bit' else 'fp32 average'}"
                          for p, n in sorted(rep.paths.items()))
        where = " (path from COMPRESSED_OPT_PATH)" if engine.path_from_env else ""
        message = (f"compressed_opt: {rep.optimizer} on {rep.world_size} ranks, step {rep.global_step}: "
                   f"{engine.numel():,} parameters in {len(engine._buckets or [])} bucket(s) "
                   f"({paths}{where}); exchange: {rep.exchange}; {algorithm.schedule()}. "
                   "optimizer.comm_stats() has the bytes per step.")
        if algorithm.warmup_at_default() and not algorithm.compressing:
            message += (f" NOTE: the warmup length is left at its default ({algorithm.last_warmup_step} steps): a "
                        "shorter run never compresses. Pass freeze_step=N (about 15-25% of the run's steps) or "
                        "freeze_step='auto'.")
        logger.warning(message)
    if stage == COMPRESSION and "compression" not in said:
        said.add("compression")
        rep = report(engine, algorithm)
        fp32 = rep.paths.get("fp32", 0)
        why = ""
        if fp32:
            why = (" (path='fp32')" if engine.path == "fp32" else
                   " (path='measure': the fp32 average measured faster for their size)")
        before = ("no warmup step in this process" if rep.warmup_bytes_per_step is None
                  else f"{rep.warmup_bytes_per_step:,.0f} bytes per warmup step")
        sent = engine.traffic.last_step_bytes
        ratio = "" if not sent else f", {rep.fp32_allreduce_bytes_per_step / sent:.1f}x fewer than"
        logger.warning(
            "compressed_opt: %s compresses from step %d: %d bucket(s) on the 1-bit exchange, %d on fp32%s; "
            "exchange: %s. This rank sent %s bytes in this step (%s%s an fp32 all-reduce's %s).",
            rep.optimizer, engine.global_step, rep.paths.get("1bit", 0), fp32, why, rep.exchange,
            f"{sent:,}", before, ratio, f"{rep.fp32_allreduce_bytes_per_step:,.0f}")
