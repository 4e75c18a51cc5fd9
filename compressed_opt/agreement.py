"""Every rank takes the same decisions: the small collectives that compare the ranks before they act.

A data-parallel job hangs or silently diverges when its ranks decide differently (one skips a
step, one freezes, one is a step ahead) or enter different collectives. :class:`RankAgreement`
holds the comparisons an optimizer makes, each one collective (every rank calls it at the same
point) that either returns what every rank then knows alike or raises on every rank at once,
naming what differs and what to change (docs/design.md 3.2):

* :meth:`RankAgreement.signatures`: before the first step, the parameter shapes, the buckets and
  the hyperparameters, and where each rank entered the step;
* :meth:`RankAgreement.entry`: every later step's first collective, at whichever entry point
  communicates first (backward's first gradient hook, a DDP hook's first bucket, or ``step()``
  without a backward): the bucket layout's hash, the entry and the step;
* :meth:`RankAgreement.any_rank`: whether some rank's flag is set (a compression step's
  non-finite gradient, at the end of backward);
* :meth:`RankAgreement.step`: in ``step()``, before any state changes: the step, the stage, the
  hyperparameters, whether the loop touched ``p.grad``, whether a gradient is non-finite, and the
  algorithm's per-step statistics;
* :meth:`RankAgreement.round`: a local-step outer optimizer's synchronisation (:mod:`compressed_opt.diloco`):
  the inner step, the fragment, its size and the outer hyperparameters;
* :meth:`RankAgreement.warmup`: each of its data parallel warmup steps: the inner step, its
  settings, and whether some rank's GradScaler found inf/NaN (every replica then skips);
* :meth:`RankAgreement.identical`: whether a value (a checksum of the gradients) is the same, bit
  for bit, on every rank;
* :meth:`RankAgreement.rank0_decides` and :meth:`RankAgreement.broadcast_parameters`: rank 0's
  decision or parameters on every rank.

Every per-step comparison starts with one all-gather of the same fixed-size header (:data:`HEADER`
int64: what the collective is, the step, its fields), so that ranks that reached different points
of the step (one in ``step()``, another already in the next backward because it skipped
``step()``) meet in collectives of the same size and raise, naming where each rank is, instead
of pairing a collective with another of a different size (Gloo aborts the process) or decoding one
as the other. A rank whose loop skipped ``step()`` after its backward says so at its next
``zero_grad()`` (:meth:`RankAgreement.skipped`): where every rank skipped, the step is dropped
on every rank alike; where only some did, every rank raises.

It keeps no state of the optimizer's: the caller passes what is compared.
"""
from __future__ import annotations

import dataclasses
import hashlib
import struct

import torch
import torch.distributed as dist

#: where a rank's step first communicated (compared by :meth:`RankAgreement.entry`); before the first
#: step's agreement, a rank may also reach it from ``zero_grad()`` after a backward without ``step()``
ENTRY_BACKWARD, ENTRY_STEP, ENTRY_SKIPPED = 1, 2, 3

#: int64 values in a per-step comparison's header: what it is, the step, four fields, the rank's place
#: in the whole job (with HSDP the optimizer's ranks are one replica group of it: the error names
#: the ranks a user launched)
HEADER = 7
#: the header's first value: this tag plus what the collective is (a value no field takes by chance)
_TAG = 0x436F4167 << 16
ENTRY, FINISHED, STEP, SKIPPED, ROUND, WARMUP, COMPARED = 1, 2, 3, 4, 5, 6, 7
#: where a rank is, for each kind of comparison (the error names it)
_WHERE = {ENTRY: "started the backward of step {}", FINISHED: "finished the backward of step {}",
          STEP: "called step() for step {}", SKIPPED: "ran the backward of step {} and then zero_grad() without step()",
          ROUND: "ended a round (an outer synchronisation) at inner step {}", WARMUP: "took warmup step {}",
          COMPARED: "compared its gradients at inner step {}"}
#: what a local-step outer optimizer's replicas out of step are told (its loop has no collective
#: between rounds, so a skipped step() shows at the next exchange)
_LOCAL_STEPS_HINT = ("Every replica must call step() on every iteration, as many times as the others: a loop that "
                     "skips it on one replica only (`if torch.isfinite(loss): optimizer.step()`) shifts that "
                     "replica's rounds. A GradScaler's skip is no such skip: step() is still called and counts it")


def job_position(backend) -> tuple[int, int]:
    """This process's rank and the job's size: the whole job's (DCP writes one checkpoint for every
    rank, and with HSDP or a pipeline the optimizer's backend is one group of it), or the backend's
    without a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return backend.rank, backend.world_size


class RanksOutOfStep(RuntimeError):
    """The ranks reached different points of a step (one skipped ``step()``, ...): raised on every rank."""


@dataclasses.dataclass(frozen=True)
class StepVerdict:
    """What :meth:`RankAgreement.step` found, the same on every rank."""

    #: some rank's loop changed ``p.grad`` between backward and ``step()``
    touched: bool
    #: some rank's gradients hold inf/NaN (no GradScaler)
    nonfinite: bool
    #: every rank's statistics, one row per rank (float64)
    statistics: torch.Tensor


class RankAgreement:
    """The comparisons of one optimizer's ranks over ``backend`` (see the module docstring);
    ``name`` (the optimizer's class) starts every error message."""

    def __init__(self, backend, name: str):
        self.backend, self.name = backend, name
        #: one rank: nothing to compare
        self.alone = backend.world_size == 1
        self._job_rank = job_position(backend)[0]

    def _gather(self, row: torch.Tensor) -> torch.Tensor:
        world = self.backend.world_size
        out = torch.empty(world * row.numel(), dtype=row.dtype, device=row.device)
        self.backend.all_gather(out, row)
        return out.view(world, -1)

    def _header(self, kind: int, step: int, fields: list[int], device) -> torch.Tensor:
        """Every rank's header (``(world, HEADER)`` int64): one all-gather of this rank's ``kind``,
        ``step``, ``fields`` (at most four) and place in the job. Raises :class:`RanksOutOfStep` on
        every rank alike where the ranks are in comparisons of different kinds (they all hold the
        same table); a difference of step within one kind is the caller's to name."""
        row = torch.zeros(HEADER, dtype=torch.int64)
        row[0], row[1], row[HEADER - 1] = _TAG + kind, step, self._job_rank
        row[2:2 + len(fields)] = torch.tensor(fields, dtype=torch.int64)
        table = self._gather(row.to(device))
        if bool((table[:, 0] == table[0, 0]).all()):
            return table
        self._out_of_step(table.cpu().tolist())

    def _out_of_step(self, rows: list) -> None:
        """Raise, naming where each rank is (``rows``: the gathered headers)."""
        where: dict[str, list[int]] = {}
        for tag, step, *fields, job_rank in rows:
            kind = tag - _TAG
            if kind == ENTRY and fields[1] == ENTRY_STEP:  # (no hook saw its backward: FSDP's gradients)
                kind = STEP
            said = _WHERE[kind].format(step) if kind in _WHERE else "is in another collective (not a comparison)"
            where.setdefault(said, []).append(job_rank)
        said = "; ".join(f"rank(s) {ranks} {what}" for what, ranks in where.items())
        kinds = {row[0] - _TAG for row in rows}
        if kinds & {ROUND, WARMUP}:
            hint = _LOCAL_STEPS_HINT
        elif SKIPPED in kinds:
            hint = ("every rank must call step() after its backward, or none: a loop that decides per rank "
                    "(`if torch.isfinite(loss): optimizer.step()`, a GradScaler that found inf on one rank "
                    "only) skips on one rank only. Let every rank decide alike (all-reduce the decision), or "
                    "leave non-finite gradients to step(), which skips on every rank together")
        else:
            hint = "every rank must run the same steps: backward then step(), in the same order"
        raise RanksOutOfStep(f"{self.name}: the ranks are out of step: {said}. {hint}")

    # --- before the first step ---------------------------------------------------------------------
    def signatures(self, signature: list[int], entry: int, step: int, device) -> None:
        """Raise on every rank unless every rank has the same ``signature`` (:func:`signature`)
        and entered the step the same way."""
        if self.alone:
            return
        rows = self._gather(torch.tensor(signature + [entry, self._job_rank], dtype=torch.int64,
                                         device=device)).cpu().tolist()
        self._check_entries([row[-2] for row in rows], [row[-1] for row in rows], step)
        problems = []
        for r, row in enumerate(rows[1:], start=1):
            cap_differs = row[6] != rows[0][6]
            if cap_differs:
                problems.append(
                    f"rank {r} has bucket_cap_mb={row[6] / 2**20:g} unlike rank 0's {rows[0][6] / 2**20:g} "
                    "(the ranks would cut different buckets)"
                )
            if row[4:6] != rows[0][4:6] or (row[:2] != rows[0][:2] and not cap_differs):
                problems.append(
                    f"rank {r} has {row[4]} parameters / {row[5]} elements in buckets unlike rank 0's "
                    f"{rows[0][4]} / {rows[0][5]} (parameter shapes, dtypes, order or requires_grad differ, "
                    "or the buckets: bucket_cap_mb)"
                )
            if row[2:4] != rows[0][2:4]:
                problems.append(f"rank {r}'s hyperparameters differ from rank 0's")
        if problems:
            raise ValueError(
                f"{self.name}: the ranks disagree, so their collectives would not match: " + "; ".join(problems)
                + ". Build the model and optimizer identically on every rank."
            )

    # --- every step ----------------------------------------------------------------------------------
    def entry(self, layout_hash: int, entry: int, step: int, device) -> None:
        """A step's first collective: raise on every rank if some ranks entered it from backward
        and others from ``step()`` without a backward, or if their trainable parameters differ
        (``layout_hash``: :func:`layout_hash` of their buckets)."""
        if self.alone:
            return
        header = self._header(ENTRY, step, [layout_hash, entry], device)
        gathered = header[:, 2:4]
        if bool((gathered == gathered[0]).all()):
            return  # (as a rule: the rest only says what differs)
        rows = gathered.tolist()
        self._check_entries([row[1] for row in rows], header[:, -1].tolist(), step)
        differ = [r for r, row in enumerate(rows) if row[0] != rows[0][0]]
        if differ:
            raise ValueError(
                f"{self.name}: at step {step} the trainable parameters of rank(s) {differ} differ from rank 0's "
                "(requires_grad changed, or a param group was added, on some ranks only): change them on every "
                "rank alike, before the same step"
            )

    def _check_entries(self, entries: list[int], job_ranks: list[int], step: int) -> None:
        if len(set(entries)) == 1:
            return
        if ENTRY_SKIPPED in entries:
            self._out_of_step([[_TAG + (SKIPPED if e == ENTRY_SKIPPED else STEP), step, 0, 0, 0, 0, r]
                               for e, r in zip(entries, job_ranks)])
        backward = [r for e, r in zip(entries, job_ranks) if e == ENTRY_BACKWARD]
        alone = [r for e, r in zip(entries, job_ranks) if e != ENTRY_BACKWARD]
        raise RuntimeError(
            f"{self.name}: at step {step} rank(s) {alone} called step() without a backward since the last step (no "
            f"gradient of this optimizer's parameters reached it), while rank(s) {backward} ran backward: every "
            "rank must run backward before step(). A rank without data for a step still runs a backward (e.g. of "
            "0 * the loss of any batch); a rank that stops early must stop every rank."
        )

    def any_rank(self, flag: bool, step: int, device) -> bool:
        """Whether ``flag`` is set on some rank, at the end of ``step``'s backward (one all-gather of
        a header)."""
        if self.alone:
            return flag
        return bool(self._header(FINISHED, step, [int(flag)], device)[:, 2].any())

    def skipped(self, step: int, device) -> None:
        """At ``zero_grad()`` on a rank whose backward of ``step`` was not followed by ``step()``:
        returns where every rank skipped it (the step is dropped on every rank alike), else raises
        :class:`RanksOutOfStep` on every rank (the others are in ``step()``, where they meet this)."""
        if not self.alone:
            self._header(SKIPPED, step, [], device)

    def round(self, step: int, fragment: int, numel: int, hyperparameters: int, device) -> None:
        """Before a local-step optimizer's outer exchange of ``fragment`` (``numel`` elements) after
        inner step ``step``: raise on every rank unless every rank is at the same step, fragment and
        size with the same outer hyperparameters (one all-gather of a header)."""
        if self.alone:
            return
        header = self._header(ROUND, step, [fragment, numel, hyperparameters], device)
        rows = header[:, 1:5].cpu().tolist()
        if all(row == rows[0] for row in rows):
            return
        if any(row[:3] != rows[0][:3] for row in rows):
            said = "; ".join(f"rank {r} at inner step {row[0]} (fragment {row[1]} of {row[2]} elements)"
                             for r, row in enumerate(rows))
            raise RanksOutOfStep(
                f"{self.name}: the replicas are out of step at an outer synchronisation: {said}. {_LOCAL_STEPS_HINT}")
        differ = [r for r, row in enumerate(rows) if row[3] != rows[0][3]]
        raise ValueError(f"{self.name}: at inner step {step} the outer hyperparameters (lr, momentum, nesterov, "
                         f"compression, error_feedback, warmup_steps) or the inner optimizer's (lr, betas, eps, "
                         f"weight_decay) "
                         f"of rank(s) {differ} differ from rank 0's: change them on every rank alike")

    def warmup(self, step: int, hyperparameters: int, flag: bool, device) -> bool:
        """Before a local-step outer optimizer's data parallel warmup step ``step``: raise on every
        rank unless every rank is at that step with the same ``hyperparameters``; else whether
        ``flag`` (a GradScaler's inf/NaN) is set on some rank (one all-gather of a header)."""
        if self.alone:
            return flag
        header = self._header(WARMUP, step, [hyperparameters, int(flag)], device)
        rows = header[:, 1:3].cpu().tolist()
        if all(row == rows[0] for row in rows):
            return bool(header[:, 3].any())
        if any(row[0] != rows[0][0] for row in rows):
            self._out_of_step(header.cpu().tolist())
        differ = [r for r, row in enumerate(rows) if row[1] != rows[0][1]]
        raise ValueError(f"{self.name}: at warmup step {step} the outer hyperparameters (compression, "
                         f"error_feedback, warmup_steps) or the inner optimizer's (lr, betas, eps, weight_decay) of "
                         f"rank(s) {differ} differ from rank 0's: change them on every rank alike")

    def identical(self, value: float, step: int, device) -> bool:
        """Whether the float ``value`` is bit for bit the same on every rank, at ``step`` (one
        all-gather of a header)."""
        if self.alone:
            return True
        bits = struct.unpack("<q", struct.pack("<d", value))[0]
        return bool((self._header(COMPARED, step, [bits], device)[:, 2] == bits).all())

    def step(self, step: int, stage: int, hyperparameters: int, touched: bool, nonfinite: bool,
             statistics: torch.Tensor, device) -> StepVerdict:
        """One small all-gather per step, before any state changes: raise on every rank if the
        ranks are at different steps or stages or their hyperparameters (``hyperparameters``:
        :func:`hyperparameter_hash`) differ; else what every rank decides from the flags."""
        statistics = statistics.to(device=device, dtype=torch.float64).reshape(-1)
        if self.alone:
            return StepVerdict(touched, nonfinite, statistics.view(1, -1))
        header = self._header(STEP, step, [stage, hyperparameters, int(touched) | int(nonfinite) << 1,
                                           statistics.numel()], device)
        ints, flags = header[:, 1:4], header[:, 4]
        touched_any, nonfinite_any = bool((flags & 1).any()), bool((flags & 2).any())
        sizes = set(header[:, 5].tolist())
        if len(sizes) > 1:
            raise RanksOutOfStep(f"{self.name}: at step {step} the ranks' per-step statistics differ in size "
                                 f"({sorted(sizes)}): the ranks are in different modes (variance tracking, a DDP hook)")
        # (the statistics travel as the bits of their float64 values)
        stats = (self._gather(statistics.view(torch.int64)).view(torch.float64) if statistics.numel()
                 else torch.zeros(len(header), 0, dtype=torch.float64, device=device))
        if bool((ints == ints[0]).all()):  # (as a rule: the rest only says what differs)
            return StepVerdict(touched_any, nonfinite_any, stats)
        rows, ranks, problems = ints.tolist(), header[:, -1].tolist(), []  # (named by their ranks in the job)
        first = ranks[0]
        for r, row in zip(ranks[1:], rows[1:]):
            if row[:2] != rows[0][:2]:
                problems.append(f"rank {r} is at step {row[0]} (stage {row[1]}), rank {first} at step {rows[0][0]} "
                                f"(stage {rows[0][1]})")
            elif row[2] != rows[0][2]:
                problems.append(f"rank {r}'s learning rate, betas, eps or weight decay differ from rank {first}'s")
        if problems:
            raise ValueError(
                f"{self.name}: the ranks disagree at step {step}: " + "; ".join(problems)
                + ". Change hyperparameters on every rank alike (an LR scheduler on every rank) and resume "
                "every rank from the checkpoint of the same step."
            )
        return StepVerdict(touched_any, nonfinite_any, stats)

    # --- rank 0 decides ------------------------------------------------------------------------------
    def rank0_decides(self, wants: bool, device) -> bool:
        """Rank 0's ``wants``, on every rank (a one-element broadcast): for decisions computed
        from floats that might differ between ranks in the last bit, such as an auto freeze."""
        if self.alone:
            return wants
        flag = torch.tensor([1 if wants else 0], dtype=torch.int32, device=device)
        self.backend.broadcast(flag, src=0)
        return bool(flag.item())

    @torch.no_grad()
    def broadcast_parameters(self, params) -> None:
        """Every rank starts from rank 0's parameters, as DDP does (ranks that seeded differently
        would otherwise train different models without a word). One broadcast per dtype and
        device."""
        if self.alone:
            return
        groups: dict = {}
        for p in params:
            groups.setdefault((p.dtype, p.device), []).append(p)
        for same in groups.values():
            flat = torch._utils._flatten_dense_tensors([p.detach() for p in same])
            self.backend.broadcast(flat, src=0)
            torch._foreach_copy_([p.detach() for p in same],
                                 torch._utils._unflatten_dense_tensors(flat, [p.detach() for p in same]))


def signature(buckets, param_groups, extra: tuple, bucket_cap_bytes: int) -> list[int]:
    """The integers :meth:`RankAgreement.signatures` compares: hashes of the buckets' parameter
    shapes and of the hyperparameters (with ``extra``: the optimizer's own options), the number of
    parameters and elements, and the bucket cap on its own (different caps lay out different
    buckets, and collectives)."""
    shapes = hashlib.sha256()
    hparams = hashlib.sha256()
    n_params = total = 0
    for b in buckets:
        for p in b.params:
            shapes.update(repr((b.index, b.group_index, tuple(p.shape), str(p.dtype))).encode())
            n_params += 1
            total += p.numel()
    for g in param_groups:
        hparams.update(repr(sorted((k, v) for k, v in g.items() if k != "params" and _plain(v))).encode())
    hparams.update(repr(extra).encode())
    as_ints = lambda h: list(struct.unpack("<qq", h.digest()[:16]))  # noqa: E731
    return as_ints(shapes) + as_ints(hparams) + [n_params, total, bucket_cap_bytes]


def hyperparameter_hash(param_groups, keys=("lr", "betas", "eps", "weight_decay")) -> int:
    """A 63-bit hash of the hyperparameters every rank must share at every step (each group's
    ``keys``: by default lr, betas, eps and weight decay, what a scheduler changes)."""
    h = hashlib.blake2b(digest_size=8)
    for g in param_groups:
        for key in keys:
            value = g.get(key)
            if isinstance(value, torch.Tensor):
                value = value.item()
            h.update(repr(value).encode())
    return int.from_bytes(h.digest(), "little") >> 1


def layout_hash(buckets) -> int:
    """A 63-bit hash of the buckets' parameter shapes and dtypes, in order (the same on every rank
    whose trainable parameters are the same)."""
    h = hashlib.blake2b(digest_size=8)
    for b in buckets:
        h.update(repr((b.index, b.group_index, [(tuple(p.shape), str(p.dtype)) for p in b.params])).encode())
    return int.from_bytes(h.digest(), "little") >> 1


def _plain(value) -> bool:
    return isinstance(value, (int, float, str, bool, tuple, type(None)))
