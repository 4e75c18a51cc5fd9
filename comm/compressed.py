"""Compressed allreduce with error feedback (docs/design.md 2.2; Tang et al., 1-bit Adam, ICML 2021),
with one 1-bit scale per block of ``block`` elements (docs/design.md 2.2, "Block scales").

Each rank ``i`` holds ``x_i`` (``n`` elements), a *worker error* ``e_i`` (``n``) and a *server
error* ``E_i`` (one chunk of ``c`` elements: rank ``j`` serves elements ``[j c, (j+1) c)``). Each
chunk splits into ``nb = ceil(c / block)`` blocks, and every block has a scale of its own:

1. worker: ``u_i = x_i + e_i``; per block ``s = ||u_block|| / sqrt(len)``; bits ``b_i = [u_i >= 0]``;
   ``e_i <- u_i - s (2 b_i - 1)``; row ``j`` of what it sends is ``[the scales of chunk j's
   blocks | chunk j's bits]``;
2. exchange 1: all-gather of a header (every rank checks it: the same ``n``, dtype and block
   everywhere, so disagreeing ranks raise instead of hanging), then all-to-all of the rows:
   rank ``j`` gets row ``j`` of every rank;
3. server ``j``: ``z_j = (1/N) sum_i s_ib (2 b_i[j] - 1) + E_j``, ``s_ib`` rank ``i``'s scale of
   the element's block; compress ``z_j`` per block to ``[t_j | c_j]``; ``E_j <- z_j - C(z_j)``;
4. exchange 2: all-gather of the rows ``[t_j | c_j]``;
5. every rank writes ``y = concat_j t_jb (2 c_j - 1)``: the same on every rank.

One scale per block, not per buffer: a block's 1-bit noise is of the size of its own values, so
a layer (or a run of coordinates) of small values is not drowned by the large ones, and the
error feedback of many small coordinates cannot inflate one shared scale (the paper's single
scale is ``block >= c``).

Bytes each rank sends: ``(N-1) * row`` (all-to-all) + ``(N-1) * row`` (all-gather) + ``(N-1) *
16`` (header), ``row = c/8 + 4 nb`` ~ ``2 (N-1)/N * n (1/8 + 4/block)``, against ``2 (N-1)/N * 4n``
for an fp32 ring allreduce: 32x less but the scales (3% more bytes than bits alone at the default
block of 1024). The element-wise work runs in three fused kernels (``compressed_opt.cuda``).

The chunk ``c`` is ``ceil(n / N)`` rounded up to 32 elements (whole, 4-byte aligned bytes of
bits); elements past ``n`` take no part: they are not counted in any scale and carry no error.
"""
from __future__ import annotations

import contextlib
from typing import Protocol

import torch

from compressed_opt import cuda as kernels

from . import observe
from .backend import Backend

_DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
# Large exchanges go out as a few concurrent pieces: one big Gloo all-to-all or all-gather message
# reached only 50-65% of a 1 Gbit/s link, four concurrent ones its full rate (pieces >= 256 KiB).
_PIECE_BYTES = 256 * 1024
_MAX_PIECES = 4
_HEADER_INTS = 4  # block, numel low 31 bits, numel high bits, dtype code
_NO_SPAN = contextlib.nullcontext()  # (observe.span where nobody observes)
_CHUNK_ALIGN = 32
#: elements per 1-bit scale, by default (a multiple of 256)
DEFAULT_BLOCK = 1024


def chunk_numel(numel: int, world_size: int) -> int:
    """Elements each rank serves: ``ceil(numel / world_size)`` rounded up to 32."""
    if numel < 0 or world_size < 1:
        raise ValueError(f"need numel >= 0 and world_size >= 1, got {numel}, {world_size}")
    per_rank = -(-numel // world_size)
    return -(-per_rank // _CHUNK_ALIGN) * _CHUNK_ALIGN


def error_buffer_sizes(numel: int, world_size: int) -> tuple[int, int]:
    """``(worker_numel, server_numel)``: fp32 elements of the two error buffers to allocate
    (zero-initialised) for a compressed allreduce of ``numel`` elements over ``world_size``."""
    return numel, chunk_numel(numel, world_size)


def server_valid_numel(numel: int, world_size: int, rank: int) -> int:
    """How many of rank ``rank``'s server-chunk elements are real (the rest is padding)."""
    chunk = chunk_numel(numel, world_size)
    return max(0, min(chunk, numel - rank * chunk))


def row_bytes(numel: int, world_size: int, block: int = DEFAULT_BLOCK) -> int:
    """Bytes of one row (one chunk's scales and bits) of a compressed allreduce of ``numel``."""
    return kernels.rows_layout(chunk_numel(numel, world_size), block)[1]


def wire_bytes(numel: int, world_size: int, block: int = DEFAULT_BLOCK, agreed: bool = False) -> int:
    """Bytes one rank sends in one compressed allreduce of ``numel`` elements (see module doc);
    ``agreed``: without the header exchange (``CompressedAllreduce.__call__(..., agreed=True)``)."""
    n = world_size
    return (0 if agreed else (n - 1) * _HEADER_INTS * 4) + 2 * (n - 1) * row_bytes(numel, n, block)


class _RowExchange:
    """Launching an all-to-all or all-gather of rows on ``self.backend``, as one call or, when
    large, as a few concurrent column pieces staged in ``self._stage`` (a plan's and a coalesced
    exchange's)."""

    backend: Backend
    _stage: dict

    def _column_pieces(self, row_len: int) -> list[tuple[int, int]]:
        """Byte ranges of each rank's row that go out as separate, concurrent collectives: one for
        a single rank, whose collectives are local copies (pieces would only add staging copies)."""
        world = self.backend.world_size
        k = 1 if world == 1 else max(1, min(_MAX_PIECES, world * row_len // _PIECE_BYTES))
        bounds = [row_len * i // k for i in range(k + 1)]
        return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]

    def _staging(self, name: str, numel: int) -> torch.Tensor:
        buf = self._stage.get(name)
        if buf is None:
            buf = self._stage[name] = torch.empty(numel, dtype=torch.uint8, device=self.device)
        return buf

    def _exchange(self, collective, out: torch.Tensor, row: torch.Tensor, send_rows: bool, name: str, pieces):
        """Launch ``collective(recv, send, async_op=True)`` (an all-to-all or all-gather of rows
        of ``row.numel()`` bytes into ``out``, ``world`` rows) as one call or, when large, as a
        few concurrent column pieces (``pieces``: :meth:`_column_pieces` of a row's length); a
        function that waits and lays the pieces out in ``out``. ``send_rows``: what goes out is
        ``world`` rows (all-to-all), else the one ``row``."""
        if len(pieces) == 1:
            return collective(out, row, async_op=True).wait
        world = self.backend.world_size
        length = row.numel() // world if send_rows else row.numel()
        works = []
        for i, (a, b) in enumerate(pieces):
            recv = self._staging(f"{name}_recv{i}", world * (b - a))
            if send_rows:
                send = self._staging(f"{name}_send{i}", world * (b - a))
                send.view(world, b - a).copy_(row.view(world, length)[:, a:b])
            else:
                send = row[a:b]
            works.append((collective(recv, send, async_op=True), recv, a, b))

        def wait():
            for work, recv, a, b in works:
                work.wait()
                out.view(world, length)[:, a:b].copy_(recv.view(world, b - a))

        return wait


class CompressedAllreduce(_RowExchange):
    """The buffers and exchanges of compressed allreduces of one size and block on one backend
    and device.

    Made once, reused by every call: the worker's rows, the received rows, the server's output
    row and the gathered rows are allocated here and never per call.
    """

    def __init__(self, numel: int, backend: Backend, device: torch.device, block: int = DEFAULT_BLOCK):
        self.numel = numel
        self.backend = backend
        self.device = torch.device(device)
        world = backend.world_size
        if world > kernels.MAX_SERVER_ROWS:
            raise ValueError(f"at most {kernels.MAX_SERVER_ROWS} ranks are supported by the compression kernels, "
                             f"got {world}")
        self.chunk = chunk_numel(numel, world)
        kernels.check_rows_geometry(self.chunk, block)
        self.block = block
        self.row_len = kernels.rows_layout(self.chunk, block)[1]
        self.server_numel = server_valid_numel(numel, world, backend.rank)
        u8 = dict(dtype=torch.uint8, device=self.device)
        self.header_send = torch.zeros(_HEADER_INTS, dtype=torch.int32, device=self.device)
        # the size fields are the plan's; the dtype (not in the plan's key) per call
        self.header_send[0] = block
        self.header_send[1] = numel & 0x7FFFFFFF
        self.header_send[2] = numel >> 31
        self.header_recv = torch.empty(world * _HEADER_INTS, dtype=torch.int32, device=self.device)
        # rows [scales | bits]: what the worker sends to each server, what a server receives, its
        # result row, and every server's result row
        self.worker_rows = torch.empty(world * self.row_len, **u8)
        self.server_rows_in = torch.empty(world * self.row_len, **u8)
        self.server_row = torch.empty(self.row_len, **u8)
        self.gathered = torch.empty(world * self.row_len, **u8)
        self.fp32_scratch: torch.Tensor | None = None
        self._header_dtype = 0
        self._stage: dict[str, torch.Tensor] = {}  # staging of pieces, made on first use
        self._pieces = self._column_pieces(self.row_len)
        #: the kernels that serve this plan's device (chosen once: ``compressed_opt.cuda.implementation``)
        self.impl = kernels.implementation(self.device)

    def _check_agreement(self) -> None:
        rows = self.header_recv.view(self.backend.world_size, _HEADER_INTS).tolist()  # one copy
        numels = [low + (high << 31) for _, low, high, _ in rows]
        blocks = [block for block, _, _, _ in rows]
        codes = [code for _, _, _, code in rows]
        if len(set(numels)) != 1 or len(set(codes)) != 1:
            names = {v: k for k, v in _DTYPE_CODES.items()}
            per_rank = ", ".join(f"rank {r}: {n} x {names.get(c, c)}" for r, (n, c) in enumerate(zip(numels, codes)))
            raise ValueError(f"compressed_allreduce called with different tensors on different ranks ({per_rank})")
        if len(set(blocks)) != 1:
            raise ValueError(f"compressed_allreduce called with different blocks on different ranks ({blocks})")

    def __call__(self, tensor: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor,
                 agreed: bool = False, producer: Producer | None = None, expand: bool = True) -> torch.Tensor:
        """One exchange (the module docstring's steps). ``agreed``: the caller checked these
        arguments (as :func:`compressed_allreduce` does) and made every rank agree on the numel,
        dtype and block (the hierarchical exchange's agreement, or an earlier exchange of the same
        buffers), so neither the checks nor the header all-gather of exchange 1 run; the kernels
        trust the buffers' sizes, so pass ``agreed=True`` only for arguments checked before.
        ``producer``: the element-wise pass that makes ``tensor``, not run yet (:class:`Producer`).
        ``expand=False``: the result stays in
        its 1-bit rows (:attr:`gathered`, :func:`result_rows`), not decompressed into ``tensor``
        (whose values are then unspecified), for a caller that reads the rows itself."""
        if not agreed:
            realize(tensor, producer)
            producer = None
            _validate(tensor, worker_error, server_error, self.backend)
            if tensor.numel() != self.numel or tensor.device != self.device:
                raise ValueError(f"this plan exchanges {self.numel} elements on {self.device}, got {tensor.numel()} "
                                 f"on {tensor.device}")
        return self.run(tensor, worker_error, server_error, agreed, producer, expand)

    def run(self, tensor: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor,
            agreed: bool, producer: Producer | None = None, expand: bool = True) -> torch.Tensor:
        """The exchange itself (:meth:`__call__`'s), its arguments trusted: checked before by the
        caller, as ``agreed`` says (see :meth:`__call__`)."""
        backend, world = self.backend, self.backend.world_size
        flat = tensor.view(-1) if tensor.is_contiguous() else None
        if flat is not None and tensor.dtype == torch.float32:
            x = flat
        else:
            if self.fp32_scratch is None:
                self.fp32_scratch = torch.empty(self.numel, dtype=torch.float32, device=self.device)
            x = self.fp32_scratch
            x.view(tensor.shape).copy_(realize(tensor, producer))  # (on the tensor, before the copy)
            producer = None

        # 1. worker: compensate and compress every chunk into its row (the kernels unchecked: the
        # buffers are this plan's, made for its geometry, and the caller's were checked, see agreed)
        impl, observed = self.impl, observe.OBSERVERS
        with observe.span("kernel", "compress_rows_") if observed else _NO_SPAN:
            _compress(impl, x, worker_error, self.worker_rows.view(world, self.row_len), self.chunk, self.block,
                      producer)
        code = _DTYPE_CODES[tensor.dtype]
        if code != self._header_dtype:
            self.header_send[3] = self._header_dtype = code

        # 2. exchange 1: headers (checked before any size-dependent collective), then rows
        if not agreed:
            backend.all_gather(self.header_recv, self.header_send)
            if world > 1:
                self._check_agreement()
        if self.numel == 0:
            return tensor
        self._exchange(backend.all_to_all, self.server_rows_in, self.worker_rows, True, "a2a", self._pieces)()

        # 3. server: average this rank's chunk of every worker, compensate, compress
        with observe.span("kernel", "average_compress_rows_") if observed else _NO_SPAN:
            impl.average_compress_rows_(self.server_rows_in.view(world, self.row_len),
                                        server_error[: self.server_numel], self.server_row, self.chunk, self.block)

        # 4. exchange 2: every server's row
        self._exchange(backend.all_gather, self.gathered, self.server_row, False, "gather", self._pieces)()

        # 5. decompress the concatenation of the server chunks (unless the caller reads the rows)
        if not expand:
            return tensor
        with observe.span("kernel", "decompress_rows_") if observed else _NO_SPAN:
            impl.decompress_rows_(self.gathered.view(world, -1), x, self.chunk, self.block)
        if x is not flat:
            tensor.copy_(x.view(tensor.shape))
        return tensor


class _CoalescedRows(_RowExchange):
    """The packed rows of several plans' exchanges on one backend: what each rank sends to each
    (``world`` rows of ``total`` bytes), what it receives, its server rows and every rank's."""

    def __init__(self, backend: Backend, device: torch.device, total: int):
        world = backend.world_size
        self.backend, self.device, self._stage = backend, device, {}
        u8 = dict(dtype=torch.uint8, device=device)
        self.send, self.recv = torch.empty(world * total, **u8), torch.empty(world * total, **u8)
        self.server, self.gathered = torch.empty(total, **u8), torch.empty(world * total, **u8)


class Producer(Protocol):
    """What a compressed allreduce averages when its input is made by an element-wise pass not run
    yet (an optimizer's local momentum, say): the one interface by which an optimizer's pass is
    fused with the compression. The collective calls it exactly once per exchange, whichever path
    the exchange takes:

    * :meth:`compress_rows_` where the exchange compresses ``x`` right away (the flat exchange's
      worker side): the pass and ``compress_rows_(x, error, rows, chunk, block)`` in one walk over
      memory, bit for bit the two in turn, ``x`` neither read nor written; ``False``, with nothing
      done, where it cannot (another device, a geometry it was not made for);
    * :meth:`apply_` everywhere else (:func:`realize`): the pass alone, into ``x``.
    """

    def compress_rows_(self, x: torch.Tensor, error: torch.Tensor, rows: torch.Tensor, chunk: int,
                       block: int) -> bool: ...

    def apply_(self) -> None: ...


def realize(x: torch.Tensor, producer: Producer | None) -> torch.Tensor:
    """``x``, made by ``producer`` first where there is one (its :meth:`Producer.apply_`): what a
    path that reads ``x`` before compressing it (the fp32 average, the hierarchical exchange's
    reduce-scatter, a checked first call) runs at its start."""
    if producer is not None:
        producer.apply_()
    return x


def _compress(impl, x: torch.Tensor, error: torch.Tensor, rows: torch.Tensor, chunk: int, block: int,
              producer: Producer | None) -> None:
    """The worker side, ``impl.compress_rows_(x, error, rows, chunk, block)``, with ``x`` made by
    ``producer`` (``None``: ``x`` holds its values): fused with it where it can, else after it."""
    if producer is None or not producer.compress_rows_(x, error, rows, chunk, block):
        impl.compress_rows_(realize(x, producer), error, rows, chunk, block)


def coalesced_compressed_allreduce(plans: list, tensors: list, worker_errors: list, server_errors: list,
                                   producers: list | None = None, expands: list | None = None) -> list[torch.Tensor]:
    """The exchanges of several plans of one backend and device at once, each ``plans[i](tensors[i],
    worker_errors[i], server_errors[i], agreed=True)`` bit for bit, with their rows in one
    all-to-all and one all-gather instead of two collectives each: a small buffer's exchange on
    a real link is its collectives' latency. Every rank must pass plans of the same numels in the
    same order, agreed before (as for ``agreed=True``); the tensors float32 and contiguous, their
    arguments checked before (the kernels trust the sizes); the same plan may come more than once.
    Returns each exchange's result as it travelled (``[world, row]`` bytes, what
    :func:`result_rows` gives after a call of its own: views of a reused buffer, valid until the
    next coalesced exchange of the same sizes); the plans' own buffers are not used. ``producers``:
    per tensor, the element-wise pass that makes it, or ``None`` (as a plan's ``producer``);
    ``expands``: per tensor, whether its result is decompressed into it (as a plan's ``expand``)."""
    if not plans:
        return []
    backend, device, world = plans[0].backend, plans[0].device, plans[0].backend.world_size
    total = sum(p.row_len for p in plans)
    key = ("coalesced_compressed_allreduce", tuple(p.numel for p in plans), device, tuple(p.block for p in plans))
    rows = backend.workspace(key, lambda: _CoalescedRows(backend, device, total))
    impl = kernels.implementation(device)
    send, recv, gathered = (t.view(world, total) for t in (rows.send, rows.recv, rows.gathered))
    spans, a = [], 0
    for p in plans:
        spans.append((a, a + p.row_len))
        a += p.row_len
    if producers is None:
        producers = [None] * len(plans)
    with observe.span("kernel", "compress_rows_"):
        for p, x, we, (a, b), producer in zip(plans, tensors, worker_errors, spans, producers):
            _compress(impl, x.view(-1), we, send[:, a:b], p.chunk, p.block, producer)  # into its columns
    pieces = rows._column_pieces(total)
    rows._exchange(backend.all_to_all, rows.recv, rows.send, True, "a2a", pieces)()
    with observe.span("kernel", "average_compress_rows_"):
        for p, se, (a, b) in zip(plans, server_errors, spans):
            impl.average_compress_rows_(recv[:, a:b], se[: p.server_numel], rows.server[a:b], p.chunk, p.block)
    rows._exchange(backend.all_gather, rows.gathered, rows.server, False, "gather", pieces)()
    with observe.span("kernel", "decompress_rows_"):
        for p, x, (a, b), expand in zip(plans, tensors, spans, expands or [True] * len(plans)):
            if expand:
                impl.decompress_rows_(gathered[:, a:b], x.view(-1), p.chunk, p.block)
    return [gathered[:, a:b] for a, b in spans]


def error_buffer_problem(name: str, buf, expected: int, device, sizes: str) -> Exception | None:
    """What is wrong with error buffer ``name`` (``None``: nothing): a contiguous fp32 tensor of
    ``expected`` elements on ``device``; ``sizes`` says what the size was computed for."""
    if not isinstance(buf, torch.Tensor):
        return TypeError(f"{name} must be a torch.Tensor, got {type(buf).__name__}")
    if buf.dtype != torch.float32:
        return TypeError(f"{name} must be float32, got {buf.dtype}")
    if buf.device != device:
        return ValueError(f"{name} is on {buf.device} but tensor is on {device}")
    if buf.numel() != expected or not buf.is_contiguous():
        return ValueError(f"{name} must be a contiguous buffer of {expected} elements for {sizes}, got {buf.numel()}")
    return None


def _validate(tensor, worker_error, server_error, backend) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in _DTYPE_CODES:
        raise TypeError(f"compressed_allreduce takes float32, bfloat16 or float16 tensors, got {tensor.dtype}")
    if not isinstance(backend, Backend):
        raise TypeError(f"backend must be a compressed_opt.comm.Backend, got {type(backend).__name__}")
    worker_numel, server_numel = error_buffer_sizes(tensor.numel(), backend.world_size)
    sizes = f"a tensor of {tensor.numel()} elements on {backend.world_size} ranks (see error_buffer_sizes)"
    for name, buf, expected in (("worker_error", worker_error, worker_numel),
                                ("server_error", server_error, server_numel)):
        problem = error_buffer_problem(name, buf, expected, tensor.device, sizes)
        if problem is not None:
            raise problem
    if tensor.requires_grad:
        raise ValueError(
            "tensor requires grad (a parameter, or part of an autograd graph): compressed_allreduce "
            "writes the average into it in place, which autograd cannot see; pass a buffer that does "
            "not require grad (e.g. tensor.detach(), which shares its memory, under torch.no_grad())"
        )
    for name, a, other, b in (("worker_error", worker_error, "tensor", tensor),
                              ("server_error", server_error, "tensor", tensor),
                              ("server_error", server_error, "worker_error", worker_error)):
        if _overlaps(a, b):
            raise ValueError(
                f"{name} overlaps {other} in memory: the compressed allreduce writes both, so each "
                "must be a buffer of its own (allocate the error buffers separately, e.g. with "
                "torch.zeros(n) for each size from error_buffer_sizes)"
            )


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """``[first, last + 1)``: the bytes of memory ``t``'s elements can lie in (any strides)."""
    low = high = 0
    for size, stride in zip(t.shape, t.stride()):
        if stride < 0:
            low += (size - 1) * stride
        else:
            high += (size - 1) * stride
    start, item = t.data_ptr(), t.element_size()
    return start + low * item, start + (high + 1) * item


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` may share memory (conservatively: their byte spans intersect)."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device or a.device.type == "meta":
        return False
    (a0, a1), (b0, b1) = _byte_span(a), _byte_span(b)
    return a0 < b1 and b0 < a1


def compressed_allreduce(
    tensor: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor, backend: Backend,
    block: int = DEFAULT_BLOCK,
) -> torch.Tensor:
    """Average ``tensor`` over the ranks of ``backend`` with error-feedback 1-bit compression,
    one scale per ``block`` elements (a multiple of 256) of each rank's chunk.

    Returns the decompressed average (same shape and dtype; written into ``tensor``'s storage
    when it is contiguous) — identical on every rank — and updates ``worker_error`` and
    ``server_error`` in place. Allocate the error buffers once, zeroed, with the sizes from
    :func:`error_buffer_sizes`, and pass the same ones on every call for the same tensor: they
    carry what compression lost into the next call. Every rank must call with a tensor of the
    same numel and dtype, and the same ``block``; one that does not makes every rank raise
    ``ValueError``. ``tensor`` must not require grad (pass ``tensor.detach()``), and the three
    tensors must not overlap in memory: either raises ``ValueError`` naming the argument, before
    any communication. Buffers for the exchange are reused across calls (kept by ``backend``).
    """
    _validate(tensor, worker_error, server_error, backend)
    kernels.check_rows_geometry(chunk_numel(tensor.numel(), backend.world_size), block)
    plan = compressed_allreduce_plan(tensor.numel(), backend, tensor.device, block)
    return plan.run(tensor, worker_error, server_error, agreed=False)  # (checked above; the header runs)


def compressed_allreduce_plan(numel: int, backend: Backend, device, block: int = DEFAULT_BLOCK) -> CompressedAllreduce:
    """The reusable :class:`CompressedAllreduce` of ``numel`` elements on ``backend`` and
    ``device`` that :func:`compressed_allreduce` calls (made at the first call of its size). A
    caller that owns its buffers and has checked them, and whose ranks agreed on its sizes, may
    call it directly with ``agreed=True``: no argument checks and no header exchange, one
    latency-bound collective fewer per call."""
    key = _plan_key(numel, device, block)
    return backend.workspace(key, lambda: CompressedAllreduce(numel, backend, device, block))


def _plan_key(numel: int, device, block: int, kind: str = "compressed_allreduce") -> tuple:
    """The workspace key of a plan: what it is, its numel, device (``"cuda"`` as the current
    device) and block."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # "cuda" means the current device
        device = torch.device("cuda", torch.cuda.current_device())
    return (kind, numel, device, block)


def result_rows(numel: int, backend: Backend, device, block: int = DEFAULT_BLOCK) -> torch.Tensor:
    """The result of the last :func:`compressed_allreduce` of ``numel`` elements on ``backend``
    as it travelled: ``world_size`` rows of ``[fp32 block scales | sign bits]``, about ``numel/8``
    bytes in all. A view of a reused buffer: copy it to keep it. :func:`expand_result_rows`
    turns it back into the result, exactly."""
    plan = backend.find_workspace(_plan_key(numel, device, block))
    if plan is None:
        raise RuntimeError(f"no compressed_allreduce of {numel} elements ran on this backend")
    return plan.gathered


def expand_result_rows(rows: torch.Tensor, numel: int, world_size: int, out: torch.Tensor,
                       block: int = DEFAULT_BLOCK) -> torch.Tensor:
    """``out`` (fp32, ``numel``) <- the compressed allreduce result that ``rows`` encode."""
    chunk = chunk_numel(numel, world_size)
    with observe.span("kernel", "decompress_rows_"):
        kernels.decompress_rows_(rows.view(world_size, -1), out, chunk, block)
    return out
