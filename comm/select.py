"""``get_backend``: pick the collectives' backend from how the job was launched."""
from __future__ import annotations

import os

from .backend import Backend, SingleProcessBackend

# Environment variables that MPI launchers (mpiexec of MPICH/Open MPI/Intel MPI, srun with PMI)
# set in every rank, with the number of ranks.
_MPI_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS")


def _launched_world_size(names=("WORLD_SIZE", *_MPI_SIZE_VARS)) -> tuple[str, int] | None:
    """The first of ``names`` that says a launcher started more than one rank, and its value."""
    for var in names:
        value = os.environ.get(var)
        if value and value.isdigit() and int(value) > 1:
            return var, int(value)
    return None


def _mpi_launched() -> bool:
    return _launched_world_size(_MPI_SIZE_VARS) is not None


def get_backend(kind: str = "auto", **kwargs) -> Backend:
    """The backend for ``kind``: ``"torch"``, ``"mpi"``, ``"single"`` or ``"auto"``.

    ``auto``: a :class:`TorchBackend` when ``torch.distributed`` is initialised; an
    :class:`MPIBackend` when launched by ``mpiexec``/``srun`` with more than one rank; a
    :class:`SingleProcessBackend` for a plain single-process run. A multi-rank launch that has
    neither (``torchrun`` without ``init_process_group``, ``mpiexec`` without mpi4py) raises,
    rather than training each rank alone. ``kwargs`` go to the backend's constructor.
    """
    if kind == "torch":
        from .torch_backend import TorchBackend

        return TorchBackend(**kwargs)
    if kind == "mpi":
        from .mpi_backend import MPIBackend

        return MPIBackend(**kwargs)
    if kind == "single":
        return SingleProcessBackend()
    if kind != "auto":
        raise ValueError(f"backend kind must be 'auto', 'torch', 'mpi' or 'single', got {kind!r}")

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        from .torch_backend import TorchBackend

        return TorchBackend(**kwargs)
    if _mpi_launched():
        from .mpi_backend import MPIBackend

        try:
            return MPIBackend(**kwargs)
        except ImportError as exc:
            raise RuntimeError(
                "launched under an MPI launcher but mpi4py is not importable: "
                "pip install 'compressed-opt[mpi]', or initialise torch.distributed"
            ) from exc
    launched = _launched_world_size()
    if launched is not None:
        var, size = launched
        raise RuntimeError(
            f"{var}={size} says this is one of {size} ranks, but torch.distributed is not "
            "initialised: create the optimizer after the process group exists (with transformers' "
            "Trainer, after TrainingArguments(...), which starts it; with accelerate, after "
            "Accelerator(); with Lightning, in configure_optimizers), or call "
            "torch.distributed.init_process_group() first"
        )
    return SingleProcessBackend()


def resolve_backend(backend) -> Backend:
    """An optimizer's ``backend=`` argument as a :class:`Backend`: ``None`` picks one
    (:func:`get_backend`), a backend is itself, and a one-dimensional ``DeviceMesh`` (one
    dimension of a mesh, e.g. ``mesh["replicate"]`` or ``mesh["dp"]``) is a :class:`TorchBackend`
    over its process group."""
    if backend is None:
        return get_backend("auto")
    if isinstance(backend, Backend):
        return backend
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # pragma: no cover - every supported torch has it
        DeviceMesh = ()
    if isinstance(backend, DeviceMesh):
        if backend.ndim != 1:
            raise ValueError(f"backend= takes one dimension of a DeviceMesh (e.g. mesh['replicate']), got a "
                             f"{backend.ndim}-D mesh {backend.mesh_dim_names}")
        return get_backend("torch", group=backend.get_group())
    raise TypeError(f"backend must be a compressed_opt.comm.Backend, a one-dimensional DeviceMesh or None, "
                    f"got {type(backend).__name__}")
