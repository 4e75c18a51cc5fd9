"""compressed-opt: communication-compressed optimizers for PyTorch data-parallel training.

Drop-in ``torch.optim`` replacements that warm up at full precision, then communicate 1-bit
compressed momentum with error feedback: :class:`OnebitAdam`, :class:`OnebitLamb`,
:class:`ZeroOneAdam`; and :class:`DiLoCo`, a local-step outer optimizer around any inner one,
its pseudo-gradient exchanged at fp32, bf16 or 1-bit with error feedback. Collectives go
through :mod:`compressed_opt.comm` backends; the element-wise kernels live in
:mod:`compressed_opt.cuda`.
"""
try:
    from compressed_opt import comm, cuda  # noqa: F401
except ImportError as _error:  # the source folder shadowing an install? (tests/test_kernel_loading.py)
    from ._source_tree import shadowing_error

    _shadowing = shadowing_error(_error, __path__[0])
    if _shadowing is None:
        raise
    raise _shadowing from None
from compressed_opt.comm import compressed_allreduce, get_backend  # noqa: F401

from .ddp import register_ddp_comm_hook  # noqa: F401
from .deepspeed_compat import from_deepspeed_config  # noqa: F401
from .diloco import DiLoCo  # noqa: F401
from . import integrations  # noqa: F401  (the frameworks' checkpoints: one line each)
from .freeze import VarianceStabilityRule  # noqa: F401
from .onebit_adam import OnebitAdam  # noqa: F401
from .onebit_lamb import OnebitLamb  # noqa: F401
from .zero_one_adam import ZeroOneAdam  # noqa: F401

__version__ = "0.1.0"
__all__ = [
    "OnebitAdam",
    "OnebitLamb",
    "ZeroOneAdam",
    "DiLoCo",
    "VarianceStabilityRule",
    "from_deepspeed_config",
    "register_ddp_comm_hook",
    "integrations",
    "compressed_allreduce",
    "get_backend",
    "comm",
    "cuda",
]
