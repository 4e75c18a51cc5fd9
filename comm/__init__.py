"""Collectives for compressed data-parallel training: backends and the compressed allreduce."""
from .backend import Backend, CommStats, CompletedWork, SingleProcessBackend, Work  # noqa: F401
