"""The kernels: error-feedback 1-bit compression and the element-wise passes around it, each with a
PyTorch reference, a C implementation for CPU tensors and, where it pays, a CUDA one.

=====================  =================================================================================
module                 what it holds
=====================  =================================================================================
``rows``               the 1-bit rows a buffer travels as; the compression kernels on them, checked;
                       which implementation serves a device (``kernel_path``, ``implementation``);
                       :class:`CompressedResult`, an exchange's result as its rows
``segments``           :class:`Segments`, a flat buffer's partition into layers
``reference``          every pass in PyTorch: the definition the native passes give bit for bit
``cpu``                the C implementation (``*_cpu.c``, built by ``build``); where the C passes may
                       read and write (:class:`Sources`, :class:`Destinations`)
``gpu``                the CUDA implementation (``onebit.cu`` through CuPy)
``registry``           :class:`Kernels`: the passes of the 1-bit exchange bound to the implementation
                       that serves a device, chosen once (``kernels_for``)
``harness``            the one check of a native pass against its reference, once per process
``segmented``          the segmented passes, checked, for any caller
``lamb_passes``,       the optimizers' own passes: 1-bit LAMB's compression step and warmup, its
``lamb_warmup``,       trust-ratio directions' norms, ZeRO's local momentum and updates, 0/1 Adam's
``direction_norms``,   local steps
``zero_passes``,
``local_steps``
=====================  =================================================================================

Float buffers are fp32. CUDA tensors run the CuPy kernels on the current stream (no
synchronisation); CPU tensors run the C library (compiled at first use, or loaded from the cache),
or the PyTorch reference where it can be neither loaded nor built. ``COMPRESSED_OPT_KERNELS=reference``
forces the reference. The submodules never import this package's names: it only gathers theirs.
"""
from __future__ import annotations

if __name__ != "compressed_opt.cuda":  # pragma: no cover - only when the repo root is on sys.path
    # This folder installs as compressed_opt.cuda. Imported as a top-level ``cuda`` (a script run
    # from the repository root puts it on sys.path) it would shadow NVIDIA's ``cuda`` package,
    # which torch and CuPy import; an ImportError lets them fall back cleanly.
    raise ImportError(
        f"{__file__} is compressed_opt.cuda, not NVIDIA's 'cuda' package: do not put the "
        "compressed-opt source root on sys.path (run Python with -P, or from another folder)"
    )

from . import cpu, harness, lamb_passes, lamb_warmup, local_steps, reference, registry, zero_passes
from .cpu import Destinations, Sources, library_allowed, readable_in_place
from .cpu import addressable as plain_memory
from .direction_norms import direction_sumsq
from .local_steps import (ZeroOneSyncBefore, signed_denominator, zero_one_local_step_, zero_one_passes_serve,
                          zero_one_phase_a_update_, zero_one_sync_after_, zero_one_sync_before_)
from .reference import Descend, Lerp, LerpScaleClamp, ScaleClamp
from .registry import Kernels, kernels_for
from .rows import (MAX_SERVER_ROWS, CompressedResult, average_compress_rows_, check_block, check_rows_geometry,
                   compress_rows_, decompress_rows_, implementation, kernel_path, rows_layout)
from .segmented import (divide_descend_, divide_where_nonzero_, gather_, keep_descend_, lerp, lerp_scale_clamp,
                        lerp_scale_clamp_, scale_clamp, scale_clamp_, segment_sumsq, sumsq_each, sumsq_native_)
from .segments import Segments

__all__ = [
    "compress_rows_", "average_compress_rows_", "decompress_rows_", "rows_layout", "check_rows_geometry",
    "check_block", "kernel_path", "implementation", "MAX_SERVER_ROWS", "CompressedResult",
    "plain_memory", "library_allowed", "readable_in_place", "Destinations", "Sources",
    "Segments", "segment_sumsq", "sumsq_each", "sumsq_native_", "gather_",
    "lerp_scale_clamp_", "scale_clamp_", "divide_where_nonzero_", "lerp_scale_clamp", "scale_clamp", "lerp",
    "LerpScaleClamp", "ScaleClamp", "Lerp", "Descend", "divide_descend_", "keep_descend_",
    "Kernels", "kernels_for", "direction_sumsq",
    "cpu", "harness", "reference", "registry", "lamb_passes", "lamb_warmup", "zero_passes", "local_steps",
    "signed_denominator", "zero_one_passes_serve", "zero_one_local_step_", "zero_one_sync_before_",
    "zero_one_phase_a_update_", "zero_one_sync_after_", "ZeroOneSyncBefore",
]
