"""Per-rank maths against NumPy (float64, materialised), LoRA discovery, LoRA+ and spectra."""

import itertools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import anlr_jax
from anlr_jax.optim import rank_stats
from tests import numpy_anlr


@pytest.mark.parametrize(
    "lead,d_in,r,d_out",
    [((), 7, 3, 5), ((), 4, 8, 6), ((3,), 6, 4, 9), ((2, 3), 5, 2, 4), ((), 9, 1, 3)],
)
@pytest.mark.parametrize("layout", ["flax", "peft"])
def test_velocity_equals_materialised_frobenius(lead, d_in, r, d_out, layout):
  rng = np.random.default_rng(hash((lead, d_in, r, d_out)) % 2**32)
  a, ga = rng.normal(size=lead + (d_in, r)), rng.normal(size=lead + (d_in, r))
  b, gb = rng.normal(size=lead + (r, d_out)), rng.normal(size=lead + (r, d_out))
  expected = np.zeros(lead + (r,))
  for idx in itertools.product(*[range(n) for n in lead]):
    expected[idx] = numpy_anlr.velocity(a[idx], b[idx], ga[idx], gb[idx])
  with jax.enable_x64(True):
    if layout == "flax":
      got = rank_stats.rank_velocity(
          jnp.asarray(a), jnp.asarray(b), jnp.asarray(ga), jnp.asarray(gb)
      )
    else:  # PEFT: A (r, d_in), B (d_out, r): feature axes are -1 and -2
      t = lambda x: jnp.asarray(np.swapaxes(x, -1, -2))
      got = rank_stats.rank_velocity(t(a), t(b), t(ga), t(gb), a_axis=-1, b_axis=-2)
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-10, atol=1e-12)
  got32 = rank_stats.rank_velocity(*(jnp.asarray(x, jnp.bfloat16) for x in (a, b, ga, gb)))
  assert got32.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(got32), expected, rtol=0.05, atol=0.05)


def test_velocity_cancellation_clamped_at_zero():
  # gA_k = -c_k A_k, gB_k = c_k B_k: gA_k B_k^T + A_k gB_k^T = 0, the true velocity is 0. In
  # float32 the three terms of nu_k^2 = c^2|A|^2|B|^2 + c^2|A|^2|B|^2 - 2 c^2|A|^2|B|^2 round
  # differently: for random A, B, c about a third of the ranks come out slightly negative (NaN
  # without the clamp at 0).
  rng = np.random.default_rng(7)
  for lead in [(), (3,)]:
    a = jnp.asarray(rng.normal(size=lead + (16, 64)), jnp.float32)
    b = jnp.asarray(rng.normal(size=lead + (64, 8)), jnp.float32)
    c = jnp.asarray(np.exp(rng.uniform(-3.0, 3.0, size=lead + (64,))), jnp.float32)
    ga, gb = -c[..., None, :] * a, c[..., :, None] * b
    nu = rank_stats.rank_velocity(a, b, ga, gb)
    assert nu.shape == lead + (64,) and bool(jnp.all(jnp.isfinite(nu)))
    assert bool(jnp.all(nu >= 0.0))
    # what is left is rounding: ~sqrt(float32 eps) of the size of each of the two rank-one terms
    scale = c * jnp.linalg.norm(a, axis=-2) * jnp.linalg.norm(b, axis=-1)
    assert float(jnp.max(nu / scale)) < 3e-3


def test_snr_matches_numpy():
  rng = np.random.default_rng(0)
  da, db = rng.normal(size=(2, 6, 3)), rng.normal(size=(2, 3, 4))
  got = rank_stats.rank_snr(jnp.asarray(da, jnp.float32), jnp.asarray(db, jnp.float32))
  want = np.stack([numpy_anlr.snr(da[i], db[i]) for i in range(2)])
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5)


def test_sensitivity_matches_numpy():
  rng = np.random.default_rng(1)
  a, ga, b, gb = (rng.normal(size=s) for s in [(6, 3), (6, 3), (3, 4), (3, 4)])
  got = rank_stats.rank_sensitivity(*(jnp.asarray(x, jnp.float32) for x in (a, b, ga, gb)))
  want = [np.abs(ga[:, k] * a[:, k]).sum() + np.abs(gb[k] * b[k]).sum() for k in range(3)]
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5)


@pytest.mark.parametrize("signal", ["random", "sensitivity", "velocity", "snr"])
def test_ablation_signals_mean_one_and_bounded(signal):
  rng = np.random.default_rng(2)
  params = {
      "m": {
          "lora_a": jnp.asarray(rng.normal(size=(8, 6)), jnp.float32),
          "lora_b": jnp.asarray(rng.normal(size=(6, 5)), jnp.float32),
      }
  }
  tx = anlr_jax.anlr(1e-2, warmup_steps=0, signal=signal, kappa=2.0)
  state = tx.init(params)
  seen = []
  for i in range(3):
    g = jax.tree.map(
        lambda x: jnp.asarray(
            rng.normal(size=x.shape) * np.linspace(0.1, 3, x.shape[-1]), jnp.float32
        ),
        params,
    )
    _, state = jax.jit(tx.update)(g, state, params)
    s = anlr_jax.find_anlr_state(state).multipliers["m"]
    np.testing.assert_allclose(float(s.mean()), 1.0, rtol=1e-6)
    assert float(s.max() / s.min()) <= 4.0 * (1 + 1e-5)
    if i > 0:  # at t = 1, m_hat / sqrt(v_hat) = sign(g): the SNR is the same for every rank
      assert float(jnp.ptp(s)) > 1e-3
    seen.append(np.asarray(s))
  if signal == "random":
    assert not np.allclose(seen[0], seen[1])  # redrawn every step
    tx2 = anlr_jax.anlr(1e-2, warmup_steps=0, signal=signal, kappa=2.0, seed=1)
    _, st2 = tx2.update(g, tx2.init(params), params)
    assert not np.allclose(np.asarray(anlr_jax.find_anlr_state(st2).multipliers["m"]), seen[0])


def test_velocity_only_signal_is_monotone_in_velocity():
  nu = jnp.asarray([[0.5, 1.0, 2.0, 4.0]])
  s = rank_stats.module_multipliers(nu, jnp.ones_like(nu), alpha=2.0, beta=0.0, kappa=100.0)
  assert bool(jnp.all(jnp.diff(s[0]) < 0))  # slow components are boosted
  want = (1 / nu**2) / jnp.mean(1 / nu**2)  # unclamped: s ∝ nu^-alpha
  chex.assert_trees_all_close(s, want, rtol=1e-5)


def test_a_degenerate_module_keeps_unit_multipliers():
  """A module whose mean velocity (alpha != 0) or mean SNR (beta != 0) is exactly 0 keeps ``s = 1``
  in every rank while the other signal is non-zero; the healthy module beside it is rescaled."""
  nu = jnp.asarray([[0.0, 0.0, 0.0, 0.0], [0.5, 1.0, 2.0, 4.0], [0.5, 1.0, 2.0, 4.0]])
  snr = jnp.asarray([[0.2, 1.0, 3.0, 0.7], [0.2, 1.0, 3.0, 0.7], [0.0, 0.0, 0.0, 0.0]])

  def multipliers(alpha, beta):
    s = np.asarray(rank_stats.module_multipliers(nu, snr, alpha=alpha, beta=beta, kappa=4.0))
    assert np.isfinite(s).all() and np.ptp(s[1]) > 0.1, (alpha, beta)
    return s

  s = multipliers(2.0, 1.0)  # nu_bar = 0 in module 0, snr = 0 in module 2
  np.testing.assert_array_equal(s[0], np.ones(4))
  np.testing.assert_array_equal(s[2], np.ones(4))
  s = multipliers(0.0, 1.0)  # velocity unused: module 0 follows its SNR, module 2 stays 1
  assert np.ptp(s[0]) > 0.1
  np.testing.assert_array_equal(s[2], np.ones(4))
  s = multipliers(2.0, 0.0)  # SNR unused: module 2 follows its velocity, module 0 stays 1
  np.testing.assert_array_equal(s[0], np.ones(4))
  assert np.ptp(s[2]) > 0.1


def test_find_lora_modules_layouts_and_paths():
  params = {
      "model": {
          "layers": [
              {
                  "q_proj": {
                      "lora_a": jnp.ones((4, 2)),
                      "lora_b": jnp.ones((2, 3)),
                      "kernel": jnp.ones((4, 3)),
                  }
              }
          ]
      },
      "peft": {
          "x": {"lora_A": {"weight": jnp.ones((2, 5))}, "lora_B": {"weight": jnp.ones((6, 2))}}
      },
  }
  mods = anlr_jax.find_lora_modules(params, anlr_jax.FLAX)
  assert [m.name for m in mods] == ["model.layers.0.q_proj"]
  assert [m.name for m in anlr_jax.find_lora_modules(params)] == ["model.layers.0.q_proj", "peft.x"]
  both = anlr_jax.find_lora_modules(params, [anlr_jax.FLAX, anlr_jax.PEFT])
  assert sorted(m.name for m in both) == ["model.layers.0.q_proj", "peft.x"]
  prefix = {"model": anlr_jax.FLAX, "peft": anlr_jax.PEFT}
  assert sorted(m.name for m in anlr_jax.find_lora_modules(params, prefix)) == [
      "model.layers.0.q_proj",
      "peft.x",
  ]
  assert [
      m.name
      for m in anlr_jax.find_lora_modules(params, lambda p: {"model": None, "peft": anlr_jax.PEFT})
  ] == ["peft.x"]
  with pytest.raises(ValueError, match="a_rank_axis"):
    anlr_jax.LoraDims(a_rank_axis=0)


def test_loraplus_scales_b_only():
  rng = np.random.default_rng(3)
  params = {
      "m": {
          "lora_a": jnp.asarray(rng.normal(size=(6, 3)), jnp.float32),
          "lora_b": jnp.asarray(rng.normal(size=(3, 4)), jnp.float32),
      },
      "bias": jnp.ones(4),
  }
  g = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), jnp.float32), params)
  u, _ = anlr_jax.loraplus(1e-3, lr_ratio=16.0).update(
      g, anlr_jax.loraplus(1e-3).init(params), params
  )
  ref, _ = optax.adamw(1e-3, weight_decay=1e-4).update(g, optax.adamw(1e-3).init(params), params)
  chex.assert_trees_all_close(u["m"]["lora_a"], ref["m"]["lora_a"])
  chex.assert_trees_all_close(u["bias"], ref["bias"])
  chex.assert_trees_all_close(u["m"]["lora_b"], 16.0 * ref["m"]["lora_b"], rtol=1e-6)
  with pytest.raises(ValueError, match="lr_ratio"):
    anlr_jax.loraplus(1e-3, lr_ratio=0.0)


def _with_spectrum(sigmas, d_in=12, d_out=10, seed=0):
  rng = np.random.default_rng(seed)
  r = len(sigmas)
  u, _ = np.linalg.qr(rng.normal(size=(d_in, r)))
  v, _ = np.linalg.qr(rng.normal(size=(d_out, r)))
  return jnp.asarray(u * np.asarray(sigmas), jnp.float32), jnp.asarray(v.T, jnp.float32)


def test_effective_rank_and_energy_known_spectra():
  a, b = _with_spectrum([1.0, 1.0, 1.0, 1.0, 0.0, 0.0])
  np.testing.assert_allclose(float(anlr_jax.effective_rank(a, b)), 4.0, rtol=1e-4)
  np.testing.assert_allclose(
      np.asarray(anlr_jax.cumulative_energy(a, b)), [0.25, 0.5, 0.75, 1, 1, 1], atol=1e-5
  )
  sig = np.array([3.0, 2.0, 1.0])
  a, b = _with_spectrum(sig)
  p = sig**2 / np.sum(sig**2)
  np.testing.assert_allclose(
      float(anlr_jax.effective_rank(a, b)), np.exp(-np.sum(p * np.log(p))), rtol=1e-4
  )
  np.testing.assert_allclose(np.asarray(anlr_jax.singular_values(a, b)), sig, rtol=1e-4)
  # stacked modules and the zero product
  a2 = jnp.stack([a, jnp.zeros_like(a)])
  b2 = jnp.stack([b, b])
  er = anlr_jax.effective_rank(a2, b2)
  assert er.shape == (2,) and float(er[1]) == 0.0
  # compare with a direct SVD of the materialised product
  rng = np.random.default_rng(5)
  a3, b3 = rng.normal(size=(9, 4)), rng.normal(size=(4, 7))
  s_direct = np.linalg.svd(a3 @ b3, compute_uv=False)[:4]
  np.testing.assert_allclose(
      np.asarray(anlr_jax.singular_values(jnp.asarray(a3), jnp.asarray(b3))), s_direct, rtol=1e-4
  )


def test_diagnostics_summaries():
  params = {"m": {"lora_a": jnp.ones((6, 4)), "lora_b": jnp.ones((4, 5))}}
  tx = optax.chain(optax.clip_by_global_norm(1.0), anlr_jax.anlr(1e-2, warmup_steps=0))
  state = tx.init(params)
  g = {"m": {"lora_a": jnp.ones((6, 4)) * jnp.arange(1.0, 5.0), "lora_b": jnp.zeros((4, 5))}}
  _, state = jax.jit(tx.update)(g, state, params)
  d = jax.jit(anlr_jax.diagnostics)(state)
  nu = np.asarray(anlr_jax.find_anlr_state(state).nu_bar["m"])
  np.testing.assert_allclose(
      float(d["modules"]["m"]["velocity_cv"]), nu.std() / nu.mean(), rtol=1e-5
  )
  np.testing.assert_allclose(float(d["modules"]["m"]["velocity_max_min"]), 4.0, rtol=1e-5)
  s = np.asarray(d["modules"]["m"]["multipliers"])
  np.testing.assert_allclose(float(d["mean"]["multiplier_max_min"]), s.max() / s.min(), rtol=1e-5)
