"""What an optimizer's communication costs: bytes per step, counted, by stage.

:class:`TrafficMeter` reads the optimizer's backend counters (:class:`compressed_opt.comm.CommStats`,
bytes this rank sent, as each collective's algorithm sends them) at the end of every ``step()``
and books the difference to the stage the step belonged to: the full-precision warmup or the
compression stage (0/1 Adam: before or after its first 1-bit step). One-time work (the first
step's agreement and parameter broadcast, choosing the exchange) is booked apart as setup.
:class:`CommReport` is what ``optimizer.comm_stats()`` returns: those numbers beside what an fp32
ring all-reduce of the same parameters sends per rank, ``2 (N - 1) / N * 4 n`` bytes.

The counters are the backend's: an optimizer that shares its backend with other code (a second
optimizer, the user's own collectives) books their bytes too.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging

logger = logging.getLogger("compressed_opt")

WARMUP, COMPRESSION = "warmup", "compression"
INTER_NODE = "inter_node."  # the prefix of what crossed between nodes (compressed_opt.averaging)


def _totals(stats) -> tuple[int, int]:
    """(all bytes, bytes between the nodes) the backend's counters hold."""
    sent = stats.bytes_sent
    return sum(sent.values()), sum(v for k, v in sent.items() if k.startswith(INTER_NODE))


class TrafficMeter:
    """Bytes per step of one optimizer's backend, by stage (see the module docstring)."""

    def __init__(self, backend):
        self._backend = backend
        self._mark = _totals(backend.stats)
        self._excluded = (0, 0)  # setup bytes since the mark
        self.setup_bytes = 0
        #: stage -> [steps, bytes, bytes between nodes]
        self.stages = {WARMUP: [0, 0, 0], COMPRESSION: [0, 0, 0]}
        self.last_step_bytes = 0

    @contextlib.contextmanager
    def setup(self):
        """Bytes sent inside the block are one-time setup, not a step's."""
        before = _totals(self._backend.stats)
        try:
            yield
        finally:
            after = _totals(self._backend.stats)
            sent = (max(0, after[0] - before[0]), max(0, after[1] - before[1]))
            self.setup_bytes += sent[0]
            self._excluded = (self._excluded[0] + sent[0], self._excluded[1] + sent[1])

    def end_step(self, stage: str) -> int:
        """Book what was sent since the last step (setup aside) to ``stage``; returns the step's bytes."""
        now = _totals(self._backend.stats)
        if now[0] < self._mark[0]:  # the counters were reset (stats.reset()): count from zero
            self._mark = (0, 0)
        sent = max(0, now[0] - self._mark[0] - self._excluded[0])
        inter = max(0, now[1] - self._mark[1] - self._excluded[1])
        self._mark, self._excluded = now, (0, 0)
        entry = self.stages[stage]
        entry[0] += 1
        entry[1] += sent
        entry[2] += inter
        self.last_step_bytes = sent
        return sent

    def per_step(self, stage: str) -> tuple[float | None, float | None]:
        """(bytes, bytes between nodes) per step of ``stage``, mean over its steps (``None``: none)."""
        steps, sent, inter = self.stages[stage]
        return (sent / steps, inter / steps) if steps else (None, None)


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


class Reporting:
    """What a :class:`~compressed_opt.optimizer.CompressedOptimizer` tells its user (a part of
    the class): :meth:`comm_stats`, and rank 0's WARNING-level lines at the first step and at
    the first compression step (shown without any logging set up)."""

    def comm_stats(self) -> CommReport:
        """This rank's communication so far, by stage: bytes per step in warmup and in the
        compression stage (counted on the backend), against an fp32 all-reduce of the same
        parameters, with the freeze step, the exchange and the path of each bucket
        (:class:`CommReport`; ``print()`` it for a summary)."""
        buckets = self._buckets or []
        numel = self._trainable_numel()
        paths: dict[str, int] = {}
        for b in buckets:
            path = self.exchanges.path_of(b)
            paths[path] = paths.get(path, 0) + 1
        meter = self._traffic
        warmup, _ = meter.per_step(WARMUP)
        compression, inter = meter.per_step(COMPRESSION)
        return CommReport(
            optimizer=type(self).__name__, world_size=self.backend.world_size,
            stage=COMPRESSION if self.compressing else WARMUP, global_step=self.global_step,
            freeze_step=self._last_warmup_step(), exchange=self.exchanges.describe(), paths=paths,
            warmup_steps=meter.stages[WARMUP][0], warmup_bytes_per_step=warmup,
            compression_steps=meter.stages[COMPRESSION][0], compression_bytes_per_step=compression,
            compression_inter_node_bytes_per_step=inter if self.exchanges.hierarchical else None,
            fp32_allreduce_bytes_per_step=fp32_allreduce_bytes(numel, self.backend.world_size),
            setup_bytes=meter.setup_bytes,
        )

    def _trainable_numel(self) -> int:
        if self._buckets:
            return sum(b.numel for b in self._buckets)
        return sum(p.numel() for g in self.param_groups for p in g["params"] if p.requires_grad)

    def _last_warmup_step(self) -> int | None:
        """The last full-precision step (``None``: not decided yet)."""
        return getattr(self, "freeze_step", None)

    def _schedule(self) -> str:
        """When the optimizer compresses, in words (for the log line at its first step)."""
        step = self._last_warmup_step()
        if step is None:
            return "full precision until the variance settles (freeze_step='auto'), then the 1-bit exchange"
        return f"full precision through step {step}, then the 1-bit exchange"

    def _warmup_left_at_default(self) -> bool:
        """Whether the warmup's length is the constructor's default (a run may never compress)."""
        return False

    def _announce(self, stage: str) -> None:
        """Rank 0's WARNING-level lines (shown by default): at the first step of this optimizer, what
        it will do; at its first compression step, what compression really does, with the bytes
        counted."""
        if self.backend.world_size == 1 or self.backend.rank != 0:
            return
        report = None
        if "start" not in self._announced:
            self._announced.add("start")
            report = self.comm_stats()
            paths = ", ".join(f"{n} on the {'1-bit exchange' if p == '1bit' else 'fp32 average'}"
                              for p, n in sorted(report.paths.items()))
            where = " (path from COMPRESSED_OPT_PATH)" if self._path_from_env else ""
            message = (f"compressed_opt: {report.optimizer} on {report.world_size} ranks, step {report.global_step}: "
                       f"{self._trainable_numel():,} parameters in {len(self._buckets or [])} bucket(s) "
                       f"({paths}{where}); exchange: {report.exchange}; {self._schedule()}. "
                       "optimizer.comm_stats() has the bytes per step.")
            if self._warmup_left_at_default() and not self.compressing:
                message += (f" NOTE: the warmup length is left at its default ({self._last_warmup_step()} steps): a "
                            "shorter run never compresses. Pass freeze_step=N (about 15-25% of the run's steps) or "
                            "freeze_step='auto'.")
            logger.warning(message)
        if stage == COMPRESSION and "compression" not in self._announced:
            self._announced.add("compression")
            report = self.comm_stats()
            fp32 = report.paths.get("fp32", 0)
            why = ""
            if fp32:
                why = (" (path='fp32')" if self.path == "fp32" else
                       " (path='measure': the fp32 average measured faster for their size)")
            before = ("no warmup step in this process" if report.warmup_bytes_per_step is None
                      else f"{report.warmup_bytes_per_step:,.0f} bytes per warmup step")
            sent = self._traffic.last_step_bytes
            ratio = "" if not sent else f", {report.fp32_allreduce_bytes_per_step / sent:.1f}x fewer than"
            logger.warning(
                "compressed_opt: %s compresses from step %d: %d bucket(s) on the 1-bit exchange, %d on fp32%s; "
                "exchange: %s. This rank sent %s bytes in this step (%s%s an fp32 all-reduce's %s).",
                report.optimizer, self.global_step, report.paths.get("1bit", 0), fp32, why, report.exchange,
                f"{sent:,}", before, ratio, f"{report.fp32_allreduce_bytes_per_step:,.0f}")

