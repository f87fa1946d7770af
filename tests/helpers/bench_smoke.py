"""The benchmarks' smallest model settings and the fast-compile fixture, shared by the benchmark smoke
tests (import `fast_xla` into a test module: it applies to every test there)."""

import pytest

TINY = [
    "--hidden",
    "64",
    "--layers",
    "2",
    "--heads",
    "4",
    "--ffn",
    "64",
    "--vocab",
    "64",
    "--batch",
    "2",
    "--seq",
    "16",
    "--rank",
    "4",
]
"""The smallest model: every weight 64 x 64, so each process compiles few distinct init shapes."""


@pytest.fixture(autouse=True, scope="module")
def fast_xla():
  """XLA's cheapest compile (most optimisations off) here and in the workers (which inherit the
  environment): these tests check what the scripts run and print, not how fast the steps are."""
  import jax

  patch = pytest.MonkeyPatch()
  patch.setenv("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
  before = jax.config.values["jax_disable_most_optimizations"]
  jax.config.update("jax_disable_most_optimizations", True)
  yield
  jax.config.update("jax_disable_most_optimizations", before)
  patch.undo()
