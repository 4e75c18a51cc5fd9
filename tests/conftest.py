import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
# The optimizers' default path ("auto") measures each bucket's 1-bit and fp32 exchange at the
# first step and takes the faster: on this machine's loopback that is mostly fp32, and the tests
# are about the 1-bit exchange. They pin it here (every rank and launched process inherits it);
# the tests of the default itself and of path="measure" say so explicitly (test_hierarchy.py).
os.environ["COMPRESSED_OPT_PATH"] = "1bit"
sys.path.insert(0, os.path.dirname(__file__))  # tests/distributed.py and the reference helpers

import torch  # noqa: E402

torch.set_num_threads(1)
