import os
import sys
from pathlib import Path

# Triton kernels are tested on the CPU through Triton's interpreter; it must be chosen before triton is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
# The CPU kernel's fp32 path ("c"): tests compare the kernels with the reference at float32 tolerance.  The integer
# path ("c-int", the default where the CPU has AVX-512 VBMI + VNNI) is tested with its own bound where named
# (tests/kernels/test_cpu_int.py, and the cache's decode step in tests/cache/test_attention.py).
os.environ.setdefault("QJL_CPU_IMPL", "c")
# shared test helpers (tiny models, kernel cases) import as top-level modules
sys.path.insert(0, str(Path(__file__).parent / "helpers"))

import pytest  # noqa: E402
import torch  # noqa: E402


# One intra-op thread: the statistical tests build thousands of small matrices, where a second thread only
# adds contention (130-278 ms instead of 3-5 ms per orthogonal sketch on a loaded 2-core machine), and fixed
# threads make every float sum reproducible.  Tests of multi-threaded kernels set their own count.
torch.set_num_threads(1)


def pytest_configure(config):
    # Under pytest-xdist (`-n auto`), tests marked `xdist_group` run on one worker, so an expensive module
    # fixture (a 10,000-seed sketch family) is computed once, not once per worker that draws one of its tests.
    # Plain `-n` means `--dist load`, which ignores the groups: make it `loadgroup` (the same scheduling for
    # every unmarked test).  Workers parse the command line again, so they learn it from the controller.
    if getattr(config.option, "dist", "no") == "load":
        config.option.dist = "loadgroup"
    if getattr(config, "workerinput", {}).get("qjl_dist") == "loadgroup":
        config.option.loadgroup = True  # the worker then suffixes node ids with their group


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """pytest-xdist's controller, before starting a worker: pass on the distribution mode chosen above."""
    node.workerinput["qjl_dist"] = node.config.option.dist


@pytest.fixture(autouse=True)
def _deterministic_global_rng():
    torch.manual_seed(0)
    yield
