"""``python -P -m e2e`` (with ``benchmarks/`` on ``sys.path``): the end-to-end benchmark's command line."""
import sys

from .cli import cli

sys.exit(cli())
