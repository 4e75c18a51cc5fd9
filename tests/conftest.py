import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
# No environment pin of the library's behaviour: the tests run what users run (the defaults); a
# test that needs another path or hierarchy passes it as an argument.
os.environ.pop("COMPRESSED_OPT_PATH", None)
sys.path.insert(0, os.path.dirname(__file__))  # tests/distributed.py and the reference helpers

import torch  # noqa: E402

torch.set_num_threads(1)

# make test runs two xdist workers that take whole files (--dist loadfile --no-loadscope-reorder): the
# files below, the longest (make test --durations=0 on 2 cores, longest first), go first and the rest
# follow in collection order, so that no long file starts last and leaves one worker alone at the end.
# (xdist's own order, by number of tests, put these few-test files last.) Measured with the rank preload of
# tests/distributed.py; remeasure when a file grows.
LONGEST_FIRST = (
    "test_sharded_recipes.py", "test_integrations.py", "test_benchmarks_smoke.py", "test_train_bench.py",
    "test_mpi_backend.py", "test_dcp_reshard.py", "test_torch_state_dict.py", "test_fsdp_hsdp.py", "test_hierarchy.py",
    "test_onebit_adam.py", "test_faults.py", "test_kernel_loading.py", "test_hsdp.py",
)


def pytest_collection_modifyitems(config, items):
    first = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))  # stable: each file keeps its order
