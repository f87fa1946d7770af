"""Test session setup: 8 fake CPU devices, set before any JAX computation runs; a fresh
compilation-cache directory for the CLI and a fresh cache of benchmark training files, removed when
the session ends; no test may leave a run
in the checkout's (or the working directory's) ``runs/``.

Every test sees the same 8-device CPU backend; unsharded tests simply run on device 0. The files
holding a test marked ``slow`` are collected first (see ``pytest_collection_modifyitems``). Under
``CI=true`` a skip is a failure (``tests/helpers/ci_skips.py``).
"""

import atexit
import functools
import os
import shutil
import tempfile

import pytest

# Under CI=true a skipped test fails (importing the hooks registers them).
from tests.helpers.ci_skips import pytest_make_collect_report, pytest_runtest_makereport  # noqa

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The suite is bound by XLA compile time (tiny models, many programs): LLVM's optimisation level 0
# halves the CPU backend's compile time of a train step and leaves what the programs compute as it
# is (no fast-math either way); XLA:CPU's older loop emitters instead of its MLIR fusion emitters
# take about a quarter less CPU again over the suite's files (every test passes either way). Set
# before JAX starts; subprocesses inherit it (the tests that give a subprocess a device count
# append to it).
FAST_COMPILE_FLAGS = (
    "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    " --xla_cpu_use_fusion_emitters=false"
)
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE_FLAGS}".strip()
# The CLI's persistent compilation cache: one fresh directory per test session (and its
# subprocesses), so the suite neither reads nor fills the user's ~/.cache; removed at exit.
os.environ["ANLR_COMPILE_CACHE"] = tempfile.mkdtemp(prefix="anlr-xla-")
atexit.register(functools.partial(shutil.rmtree, os.environ["ANLR_COMPILE_CACHE"], True))
# The same for the cache of benchmark training files (data.train: benchmark://<set>/tune).
os.environ["ANLR_CACHE_DIR"] = tempfile.mkdtemp(prefix="anlr-cache-")
atexit.register(functools.partial(shutil.rmtree, os.environ["ANLR_CACHE_DIR"], True))

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


# The shipped configs' run_dir is relative (runs/...): a test that runs one must chdir to its
# tmp_path or set run_dir, or it leaves runs/ behind where nobody sees it (git ignores runs/).
CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS_DIRS = sorted({os.path.realpath(os.path.join(d, "runs")) for d in (CHECKOUT, os.getcwd())})


def _entries(folder: str) -> set[str] | None:
  """The names in ``folder``; None when it does not exist."""
  return set(os.listdir(folder)) if os.path.isdir(folder) else None


def pytest_collection_modifyitems(items):
  """The files holding a test marked ``slow`` go first, in their order, the others after them.

  ``.ci/run`` hands whole files to its two workers in collection order
  (``--dist loadfile --no-loadscope-reorder``): the long files start first and the many short ones
  fill in at the end, instead of one worker running the last long file while the other waits (the
  default order, files with the most tests first, puts the one-test end-to-end files last)."""
  slow = {item.path for item in items if item.get_closest_marker("slow")}
  items.sort(key=lambda item: item.path not in slow)  # stable: the order within a file is kept


@pytest.fixture(autouse=True)
def _no_run_left_in_the_checkout():
  before = {d: _entries(d) for d in RUNS_DIRS}
  yield
  for folder in RUNS_DIRS:
    after = _entries(folder)
    if after is not None and (before[folder] is None or after - before[folder]):
      left = sorted(after - (before[folder] or set())) or "an empty directory"
      pytest.fail(f"the test left {left} in {folder}: write under tmp_path", pytrace=False)
