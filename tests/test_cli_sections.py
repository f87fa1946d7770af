"""Config sections reach the optimizer through `anlr train`: `loraplus.lr_ratio` sets the B factors'
learning rate, `anlr.kappa` bounds the multipliers; on the tiny HF LLaMA of tests/test_cli.py."""

import numpy as np
import pytest
from safetensors.numpy import load_file

from anlr_jax import rundir
from anlr_jax.train import diagnostics_io
from anlr_jax.app import cli
from tests.helpers.tiny_run import tiny_run_config


def _train(config, run, *overrides):
  argv = ["train", "--config", str(config), f"run_dir={run}", *overrides]
  assert cli.main(argv) == 0, argv
  return run


def test_loraplus_lr_ratio_sets_the_b_factors_learning_rate(tmp_path):
  """One update from B = 0: B's update is ``-lambda eta g / (|g| + eps)``, A's ``-eta g_A / ...``
  whatever lambda, so two runs with lambda = 2 and 8 have B in the ratio 4 and the same A."""
  config = tiny_run_config(tmp_path, method="loraplus", **{"trainer.steps": 1, "eval.tasks": {}})
  adapters = {}
  for ratio in (2, 8):
    run = _train(config, tmp_path / f"ratio{ratio}", f"loraplus.lr_ratio={ratio}")
    adapters[ratio] = load_file(run / rundir.LORA_FILE)
  b_keys = [k for k in adapters[2] if k.endswith("/lora_b")]
  assert len(b_keys) == 2 * 5  # 2 layers x the paper's 5 targets
  for key in b_keys:
    b2, b8 = adapters[2][key], adapters[8][key]
    moved = np.abs(b2) > 1e-4  # |g| >> eps: Adam's first step is the full +-lr
    assert moved.mean() > 0.9, key
    np.testing.assert_allclose(b8[moved], 4 * b2[moved], rtol=1e-3)
  for key in adapters[2]:
    if key.endswith("/lora_a"):
      np.testing.assert_array_equal(adapters[2][key], adapters[8][key])


def _last_multipliers(run) -> dict[str, np.ndarray]:
  last = diagnostics_io.diagnostics_steps(str(run))[-1]
  snapshot = diagnostics_io.read_diagnostics(diagnostics_io.diagnostics_path(str(run), last))
  return {name: np.asarray(f["multipliers"]) for name, f in snapshot.modules.items()}


@pytest.fixture(scope="module")
def kappa_runs(tmp_path_factory):
  """The AnLR run config of the kappa test (diagnostics every update), and its run at the paper's
  kappa = 3, which both parametrisations compare with."""
  root = tmp_path_factory.mktemp("kappa")
  config = tiny_run_config(
      root,
      method="anlr",
      **{"trainer.steps": 3, "trainer.diag_every": 1, "anlr.warmup_steps": 1, "eval.tasks": {}},
  )
  return config, _last_multipliers(_train(config, root / "kappa3", "anlr.kappa=3"))


@pytest.mark.parametrize("kappa", [1.05, 1.5])
def test_anlr_kappa_bounds_the_multipliers_of_a_run(kappa_runs, tmp_path, kappa):
  """Past the warmup, ``log s`` is clamped to ``[-log kappa, log kappa]`` and mean-normalised, so
  every module's ``max s / min s <= kappa^2``; the paper's kappa = 3 leaves wider spreads."""
  config, wide = kappa_runs
  tight = _last_multipliers(_train(config, tmp_path / "tight", f"anlr.kappa={kappa}"))
  assert sorted(wide) == sorted(tight) and len(wide) == 2 * 5
  spread = {name: s.max(-1) / s.min(-1) for name, s in tight.items()}
  assert all(np.all(r <= kappa**2 * (1 + 1e-5)) for r in spread.values()), spread
  assert all(np.all(r > 1 + 1e-3) for r in spread.values()), spread  # past the warmup: not all 1
  for name, s in tight.items():
    np.testing.assert_allclose(s.mean(-1), 1.0, rtol=1e-5)
  assert max(float(np.max(s.max(-1) / s.min(-1))) for s in wide.values()) > kappa**2
