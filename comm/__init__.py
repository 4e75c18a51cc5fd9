"""Collectives for compressed data-parallel training: backends and the compressed allreduce.

Backends (:class:`Backend`): :class:`TorchBackend` (NCCL/Gloo via ``torch.distributed``),
:class:`MPIBackend` (mpi4py), :class:`SingleProcessBackend`; :func:`get_backend` picks one.
Multi-node jobs: :mod:`~compressed_opt.comm.topology` finds which ranks share a node
(:func:`discover_layout`, :class:`NodeLayout`) and splits a backend into intra- and inter-node
backends (:func:`node_backends`); :func:`hierarchical_compressed_allreduce` averages at full
precision inside a node and 1-bit between nodes, :func:`hierarchical_average` at full precision
throughout, the same way.
Observers (:mod:`compressed_opt.comm.observe`: :func:`add_observer`, :func:`remove_observer`,
:func:`observing`) see the compression kernels and the optimizers' waits for communication.
"""
from .backend import Backend, CommStats, CompletedWork, SingleProcessBackend, Work  # noqa: F401
from .compressed import (  # noqa: F401
    DEFAULT_BLOCK,
    CompressedAllreduce,
    Producer,
    chunk_numel,
    coalesced_compressed_allreduce,
    compressed_allreduce,
    compressed_allreduce_plan,
    error_buffer_sizes,
    expand_result_rows,
    realize,
    result_rows,
    row_bytes,
    server_valid_numel,
    wire_bytes,
)
from .hierarchical import (  # noqa: F401
    HierarchicalCompressedAllreduce,
    WireBytes,
    hierarchical_average,
    hierarchical_compressed_allreduce,
    hierarchical_compressed_allreduce_plan,
    hierarchical_error_buffer_sizes,
    hierarchical_wire_bytes,
)
from . import quantized  # noqa: F401  (the 4-bit allreduce, DiLoCo's compression="4bit")
from .observe import add_observer, observing, remove_observer  # noqa: F401
from .select import get_backend, resolve_backend  # noqa: F401
from .topology import RANKS_PER_NODE_ENV, NodeBackends, NodeLayout, discover_layout, node_backends  # noqa: F401


def __getattr__(name):
    # backends whose dependencies are optional load on first use
    if name == "TorchBackend":
        from .torch_backend import TorchBackend

        return TorchBackend
    if name == "MPIBackend":
        from .mpi_backend import MPIBackend

        return MPIBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
