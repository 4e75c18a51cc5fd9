"""CuPy path of the compression kernels (placeholder replaced by the CUDA work)."""
