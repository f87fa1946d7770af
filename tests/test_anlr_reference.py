"""AnLR against independent references: NumPy from the equations, optax.adamw, Proposition 2."""

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

HP = dict(b1=0.9, b2=0.99, eps=1e-8, weight_decay=0.05)
ANLR = dict(alpha=2.0, beta=1.0, kappa=3.0, rho=0.8)


def _schedule(count):
  return 1e-2 * (1.0 - count / 60.0)


def _params(rng, dtype=np.float64):
  shapes = {
      "attn/q": ((6, 4), (4, 5)),
      "attn/k": ((6, 4), (4, 5)),  # same shapes as q: batched with it (batch_modules=True)
      "mlp/up": ((3, 5, 3), (3, 3, 7)),  # stacked (3 layers), rank 3
      "mlp/down": ((7, 8), (8, 2)),  # r = 8 > d_out: still well defined
  }
  params = {}
  for name, (sa, sb) in shapes.items():
    group, leaf = name.split("/")
    params.setdefault(group, {})[leaf] = {
        "lora_a": rng.normal(size=sa).astype(dtype),
        "lora_b": (0.3 * rng.normal(size=sb)).astype(dtype),
    }
  params["bias"] = rng.normal(size=(5,)).astype(dtype)
  return params


def _flat(tree):
  return {
      jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(tree)
  }


def _grads(rng, params, scale_by_rank=True):
  def g(path, x):
    out = rng.normal(size=x.shape)
    if scale_by_rank and x.ndim >= 2:  # make ranks move at different speeds
      r = x.shape[-1] if jax.tree_util.keystr(path).endswith("'lora_a']") else x.shape[-2]
      w = np.linspace(0.2, 2.0, r)
      out = out * (w if out.shape[-1] == r else w[:, None])
    return out

  return jax.tree_util.tree_map_with_path(g, params)


@pytest.mark.parametrize("batch_modules", [True, False])
def test_trajectory_matches_numpy_reference(batch_modules):
  """25 steps (warmup 4, weight decay, a schedule, 4 modules incl. stacked, one plain leaf)."""
  rng = np.random.default_rng(0)
  with jax.enable_x64(True):
    params = _params(rng)
    tx = anlr_jax.anlr(_schedule, **HP, **ANLR, warmup_steps=4, batch_modules=batch_modules)
    state = tx.init(params)
    update = jax.jit(tx.update)
    flat0 = _flat(params)
    modules = {
        f"{group}.{leaf}": (f"['{group}']['{leaf}']['lora_a']", f"['{group}']['{leaf}']['lora_b']")
        for group in ("attn", "mlp")
        for leaf in params[group]
    }
    ref = numpy_anlr.NumpyAnLR(
        flat0,
        modules,
        lr=_schedule,
        b1=HP["b1"],
        b2=HP["b2"],
        eps=HP["eps"],
        wd=HP["weight_decay"],
        alpha=ANLR["alpha"],
        beta=ANLR["beta"],
        kappa=ANLR["kappa"],
        rho=ANLR["rho"],
        warmup=4,
    )
    ref_params = flat0
    anisotropic_steps = 0
    for _ in range(25):
      grads = _grads(rng, params)
      updates, state = update(grads, state, params)
      params = optax.apply_updates(params, updates)
      ref_params = ref.step(ref_params, _flat(grads))
      got = _flat(params)
      for key in got:
        np.testing.assert_allclose(got[key], ref_params[key], rtol=1e-6, atol=1e-12, err_msg=key)
      s = anlr_jax.find_anlr_state(state).multipliers
      if ref.t > 4:
        anisotropic_steps += 1
        assert any(float(np.ptp(np.asarray(v))) > 1e-3 for v in s.values())
      for name in modules:
        np.testing.assert_allclose(np.asarray(s[name]), ref.last_s[name], rtol=1e-9)
    assert anisotropic_steps == 21


@pytest.mark.parametrize("signal,warmup", [("uniform", 0), ("anlr", 30)])
def test_equals_adamw_when_isotropic(signal, warmup):
  """With signal='uniform', or during warmup, AnLR is optax.adamw (same arguments)."""
  rng = np.random.default_rng(1)
  params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), _params(rng))
  sched = optax.linear_schedule(1e-2, 1e-3, 20)
  tx = anlr_jax.anlr(sched, **HP, **ANLR, signal=signal, warmup_steps=warmup)
  ref = optax.adamw(sched, **HP)
  s, s_ref = tx.init(params), ref.init(params)
  p, p_ref = params, params
  for _ in range(12):
    g = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), _grads(rng, params))
    u, s = jax.jit(tx.update)(g, s, p)
    u_ref, s_ref = jax.jit(ref.update)(g, s_ref, p_ref)
    chex.assert_trees_all_close(u, u_ref, rtol=1e-6, atol=1e-9)
    p, p_ref = optax.apply_updates(p, u), optax.apply_updates(p_ref, u_ref)
  chex.assert_trees_all_close(p, p_ref, rtol=1e-6)


def test_proposition_2_post_step_scaling_equals_per_component_lr():
  """s_k * (AdamW delta) == AdamW with learning rate s_k * eta_t per component, built explicitly."""
  rng = np.random.default_rng(2)
  with jax.enable_x64(True):
    params = _params(rng)
    eta = 3e-3
    tx = anlr_jax.anlr(eta, **HP, **ANLR, warmup_steps=0)
    state = tx.init(params)
    adam = optax.chain(
        optax.scale_by_adam(b1=HP["b1"], b2=HP["b2"], eps=HP["eps"]),
        optax.add_decayed_weights(HP["weight_decay"]),
    )
    adam_state = adam.init(params)
    update, adam_update = jax.jit(tx.update), jax.jit(adam.update)  # one program each
    for _ in range(6):
      grads = _grads(rng, params)
      updates, state = update(grads, state, params)
      direction, adam_state = adam_update(grads, adam_state, params)
      s = anlr_jax.find_anlr_state(state).multipliers
      # Per-parameter learning rate: s_k * eta on component k, eta elsewhere.
      lr = jax.tree.map(lambda x: np.full(x.shape, eta), params)
      for group in ("attn", "mlp"):
        for leaf in params[group]:
          sk = np.asarray(s[f"{group}.{leaf}"])
          lr[group][leaf]["lora_a"] = eta * np.broadcast_to(
              sk[..., None, :], params[group][leaf]["lora_a"].shape
          )
          lr[group][leaf]["lora_b"] = eta * np.broadcast_to(
              sk[..., :, None], params[group][leaf]["lora_b"].shape
          )
      explicit = jax.tree.map(lambda l, d: -l * d, lr, direction)
      chex.assert_trees_all_close(updates, explicit, rtol=1e-10, atol=1e-14)
      params = optax.apply_updates(params, updates)


def test_mean_one_and_clamp():
  rng = np.random.default_rng(3)
  nu = jnp.asarray(rng.exponential(size=(4, 16)) ** 3, jnp.float32)
  snr = jnp.asarray(rng.exponential(size=(4, 16)), jnp.float32)
  kappa = 3.0
  s = rank_stats.module_multipliers(nu, snr, alpha=2.0, beta=1.0, kappa=kappa)
  chex.assert_trees_all_close(jnp.mean(s, -1), jnp.ones(4), rtol=1e-6)
  # Before normalisation every s_k lies in [1/kappa, kappa], so the spread is at most kappa^2 ...
  spread = jnp.max(s, -1) / jnp.min(s, -1)
  assert float(jnp.max(spread)) <= kappa**2 * (1 + 1e-5)
  # ... and with such extreme signals the clamp is active (spread reaches kappa^2 exactly).
  np.testing.assert_allclose(np.asarray(spread), kappa**2, rtol=1e-5)
  # Recover the pre-normalisation values: they are the clipped log-score.
  nu_t, snr_t = nu / nu.mean(-1, keepdims=True), snr / snr.mean(-1, keepdims=True)
  raw = jnp.exp(jnp.clip(-2.0 * jnp.log(nu_t) + jnp.log(snr_t), -jnp.log(kappa), jnp.log(kappa)))
  chex.assert_trees_all_close(s, raw / raw.mean(-1, keepdims=True), rtol=1e-5)


def test_peft_layout_equals_flax_layout():
  """The PEFT layout (A (r, in), B (out, r)) gives the transposed updates of the Flax layout."""
  rng = np.random.default_rng(4)
  a, b = rng.normal(size=(6, 4)), 0.3 * rng.normal(size=(4, 5))
  flax_p = {"m": {"lora_a": jnp.asarray(a, jnp.float32), "lora_b": jnp.asarray(b, jnp.float32)}}
  peft_p = {
      "m": {
          "lora_A": {"weight": flax_p["m"]["lora_a"].T},
          "lora_B": {"weight": flax_p["m"]["lora_b"].T},
      }
  }
  tx_f = anlr_jax.anlr(1e-2, warmup_steps=0)
  tx_p = anlr_jax.anlr(1e-2, warmup_steps=0, lora_dims=anlr_jax.PEFT)
  sf, sp = tx_f.init(flax_p), tx_p.init(peft_p)
  update_f, update_p = jax.jit(tx_f.update), jax.jit(tx_p.update)  # one program each
  for _ in range(5):
    g = {
        "m": {
            "lora_a": jnp.asarray(rng.normal(size=(6, 4)), jnp.float32),
            "lora_b": jnp.asarray(rng.normal(size=(4, 5)), jnp.float32),
        }
    }
    gp = {"m": {"lora_A": {"weight": g["m"]["lora_a"].T}, "lora_B": {"weight": g["m"]["lora_b"].T}}}
    uf, sf = update_f(g, sf, flax_p)
    up, sp = update_p(gp, sp, peft_p)
    chex.assert_trees_all_close(up["m"]["lora_A"]["weight"], uf["m"]["lora_a"].T, rtol=1e-6)
    chex.assert_trees_all_close(up["m"]["lora_B"]["weight"], uf["m"]["lora_b"].T, rtol=1e-6)
    flax_p, peft_p = optax.apply_updates(flax_p, uf), optax.apply_updates(peft_p, up)
  assert float(jnp.ptp(anlr_jax.find_anlr_state(sp).multipliers["m"])) > 1e-3


def _modules(params):
  """Module name -> (A, B) flat keys of ``_params``' LoRA modules."""
  return {
      f"{group}.{leaf}": (f"['{group}']['{leaf}']['lora_a']", f"['{group}']['{leaf}']['lora_b']")
      for group in ("attn", "mlp")
      for leaf in params[group]
  }


def _per_slice(fn, a, *rest):
  """``fn`` of 2-D (A, B, ...) slices over the leading axes of ``a``: an array ``(..., r)``."""
  out = np.zeros(a.shape[:-2] + (a.shape[-1],))
  for idx in itertools.product(*[range(n) for n in a.shape[:-2]]):
    out[idx] = fn(a[idx], *(x[idx] for x in rest))
  return out


def _np_sensitivity(a, b, ga, gb):
  """sum over A[:, k] and B[k, :] of |g * theta|, rank by rank (2-D slices)."""
  r = a.shape[1]
  return np.array(
      [np.sum(np.abs(ga[:, k] * a[:, k])) + np.sum(np.abs(gb[k, :] * b[k, :])) for k in range(r)]
  )


def _np_score_multipliers(score, kappa):
  """log s_k = clip(log(x_k / mean_j x_j), -log kappa, log kappa), then s / mean(s)."""
  log_s = np.clip(np.log(score / score.mean(-1, keepdims=True)), -np.log(kappa), np.log(kappa))
  s = np.exp(log_s)
  return s / s.mean(-1, keepdims=True)


def _permuted_rank_grads(rng, params, step):
  """Gradients whose per-rank scale is a fresh permutation every step: the ordering of the
  current per-rank signals differs from that of their EMA."""

  def g(path, x):
    out = rng.normal(size=x.shape)
    if x.ndim >= 2:
      is_a = jax.tree_util.keystr(path).endswith("'lora_a']")
      r = x.shape[-1] if is_a else x.shape[-2]
      w = np.geomspace(0.1, 4.0, r)[np.random.default_rng(100 + step).permutation(r)]
      out = out * (w if is_a else w[:, None])
    return out

  return jax.tree_util.tree_map_with_path(g, params)


@pytest.mark.parametrize("batch_modules", [True, False])
def test_sensitivity_signal_matches_numpy(batch_modules):
  """signal='sensitivity': EMA (rho) of sum |g * theta| per component, from this step's gradients
  and pre-update parameters; log s = clip(log(score / mean score)), mean-normalised. A larger
  sensitivity gives a larger multiplier."""
  rng = np.random.default_rng(5)
  rho, kappa = 0.7, 4.0
  with jax.enable_x64(True):
    params = _params(rng)
    modules = _modules(params)
    tx = anlr_jax.anlr(
        3e-3,
        **HP,
        rho=rho,
        kappa=kappa,
        warmup_steps=0,
        signal="sensitivity",
        batch_modules=batch_modules,
    )
    state = tx.init(params)
    update = jax.jit(tx.update)
    ema = {
        n: np.zeros(_flat(params)[a].shape[:-2] + (_flat(params)[a].shape[-1],))
        for n, (a, _) in modules.items()
    }
    inside_clamp = 0
    for step in range(5):
      grads = _permuted_rank_grads(rng, params, step)
      fp, fg = _flat(params), _flat(grads)
      updates, state = update(grads, state, params)
      st = anlr_jax.find_anlr_state(state)
      ema_matters = False
      for name, (ka, kb) in modules.items():
        score = _per_slice(_np_sensitivity, fp[ka], fp[kb], fg[ka], fg[kb])
        ema[name] = rho * ema[name] + (1 - rho) * score
        np.testing.assert_allclose(np.asarray(st.sensitivity[name]), ema[name], rtol=1e-12)
        want = _np_score_multipliers(ema[name], kappa)
        got = np.asarray(st.multipliers[name])
        np.testing.assert_allclose(got, want, rtol=1e-10, err_msg=f"{name} step {step + 1}")
        # the sign: the multipliers are non-decreasing in the (EMA) sensitivity
        log_ratio = np.log(ema[name] / ema[name].mean(-1, keepdims=True))
        inside_clamp += int(np.sum(np.abs(log_ratio) < np.log(kappa)))
        order = np.argsort(ema[name], axis=-1)
        assert np.all(np.diff(np.take_along_axis(got, order, -1), axis=-1) >= -1e-12)
        ema_matters |= bool(np.abs(_np_score_multipliers(score, kappa) - want).max() > 1e-2)
      if step > 0:  # without the EMA (current score only) the multipliers would differ
        assert ema_matters
      params = optax.apply_updates(params, updates)
    assert inside_clamp > 80  # most multipliers (101 of 125) are set by the score, not the clamp


def test_velocity_ema_starts_at_zero_and_runs_during_warmup():
  """nu_bar_1 = (1-rho) nu_1 and nu_bar_2 = rho (1-rho) nu_1 + (1-rho) nu_2, with nu_t the
  materialised Frobenius velocity of update t (pre-update parameters), during warmup too."""
  rng = np.random.default_rng(6)
  rho = 0.7
  with jax.enable_x64(True):
    params = _params(rng)
    modules = _modules(params)
    for warmup in (0, 10):
      tx = anlr_jax.anlr(1e-2, **HP, alpha=2.0, beta=1.0, kappa=3.0, rho=rho, warmup_steps=warmup)
      state, p, update = tx.init(params), params, jax.jit(tx.update)
      nus = []
      for step in range(2):
        grads = _grads(rng, p)
        fp, fg = _flat(p), _flat(grads)
        nus.append(
            {
                n: _per_slice(numpy_anlr.velocity, fp[ka], fp[kb], fg[ka], fg[kb])
                for n, (ka, kb) in modules.items()
            }
        )
        updates, state = update(grads, state, p)
        nu_bar = anlr_jax.find_anlr_state(state).nu_bar
        for n in modules:
          if step == 0:
            want = (1 - rho) * nus[0][n]
          else:
            want = rho * (1 - rho) * nus[0][n] + (1 - rho) * nus[1][n]
          np.testing.assert_allclose(np.asarray(nu_bar[n]), want, rtol=1e-12, err_msg=n)
        p = optax.apply_updates(p, updates)
