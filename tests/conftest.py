import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
# No environment pin of the library's behaviour: the tests run what users run (the defaults); a
# test that needs another path or hierarchy passes it as an argument.
os.environ.pop("COMPRESSED_OPT_PATH", None)
sys.path.insert(0, os.path.dirname(__file__))  # tests/distributed.py and the reference helpers

import torch  # noqa: E402

torch.set_num_threads(1)
