"""Properties of the AnLR transform: jit, wrappers, NNX, dtypes, sharding, degenerate cases, errors."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import anlr_jax


def _params(dtype=jnp.float32, seed=0):
  k = jax.random.split(jax.random.key(seed), 6)
  return {
      "q": {
          "lora_a": jax.random.normal(k[0], (16, 4), dtype),
          "lora_b": 0.1 * jax.random.normal(k[1], (4, 8), dtype),
      },
      "stack": {
          "lora_a": jax.random.normal(k[2], (8, 16, 4), dtype),
          "lora_b": 0.1 * jax.random.normal(k[3], (8, 4, 16), dtype),
      },
      "norm": jnp.ones((8,), dtype),
  }


def _grads(params, step):
  key = jax.random.fold_in(jax.random.key(42), step)
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(key, len(leaves))
  return treedef.unflatten([jax.random.normal(kk, x.shape, x.dtype) for kk, x in zip(keys, leaves)])


def _run(tx, params, steps, grads_fn=_grads, jit=True):
  state = tx.init(params)
  update = jax.jit(tx.update) if jit else tx.update
  for i in range(steps):
    updates, state = update(grads_fn(params, i), state, params)
    params = optax.apply_updates(params, updates)
  return params, state


def test_compiles_once():
  traces = []
  tx = anlr_jax.anlr(optax.linear_schedule(1e-3, 0.0, 10), warmup_steps=1)

  def update(g, s, p):
    traces.append(1)
    return tx.update(g, s, p)

  jitted = jax.jit(update)
  params = _params()
  state = tx.init(params)
  for i in range(4):
    u, state = jitted(_grads(params, i), state, params)
    params = optax.apply_updates(params, u)
  assert len(traces) == 1
  assert jitted._cache_size() == 1


def test_state_dtypes_and_structure_fixed_bf16():
  params = _params(jnp.bfloat16)
  tx = anlr_jax.anlr(1e-3, warmup_steps=1)
  state0 = tx.init(params)
  _, state = _run(tx, params, 3)
  chex.assert_trees_all_equal_structs(state0, state)
  chex.assert_trees_all_equal_dtypes(state0, state)
  st = anlr_jax.find_anlr_state(state)
  for tree in (st.nu_bar, st.snr, st.multipliers):
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(tree))
  assert st.multipliers["stack"].shape == (8, 4)
  u, _ = jax.jit(tx.update)(_grads(params, 9), state, params)  # _run's compiled update
  chex.assert_trees_all_equal_dtypes(u, params)
  assert all(bool(jnp.all(jnp.isfinite(x.astype(jnp.float32)))) for x in jax.tree.leaves(u))


def test_inject_hyperparams_f32_hparams_bf16_params():
  params = _params(jnp.bfloat16)
  lr = 1e-2
  tx = optax.inject_hyperparams(anlr_jax.anlr, hyperparam_dtype=jnp.float32)(
      learning_rate=lr, alpha=2.0, kappa=3.0, warmup_steps=1
  )
  # Same updates as the non-injected optimizer, step by step at the same parameters (bf16 moments
  # and rounding differ by < 3e-4 here; Adam's updates are ~lr = 1e-2 in size), with the injected
  # hyperparameters and with scale_by_anlr over an injected inner adamw (the wrapper form).
  ref = anlr_jax.anlr(lr, warmup_steps=1)
  inner = optax.inject_hyperparams(optax.adamw, hyperparam_dtype=jnp.float32)(
      learning_rate=lr, weight_decay=1e-4
  )
  wrap = anlr_jax.scale_by_anlr(inner, warmup_steps=1)
  atol = 5e-4
  txs = (ref, tx, wrap)
  states = [t.init(params) for t in txs]
  state0 = states[1]
  assert state0.hyperparams["learning_rate"].dtype == jnp.float32
  updates = [jax.jit(t.update) for t in txs]
  f32 = lambda tree: [np.asarray(x).astype(np.float32) for x in jax.tree.leaves(tree)]
  p = params
  for i in range(4):  # the last two updates are anisotropic (warmup_steps=1, update 2 is the first)
    g = _grads(params, i)
    out = [upd(g, st, p) for upd, st in zip(updates, states)]
    states = [st for _, st in out]
    u_ref, u_inj, u_wrap = (f32(u) for u, _ in out)
    for x_ref, x_inj, x_wrap in zip(u_ref, u_inj, u_wrap):
      np.testing.assert_allclose(x_inj, x_ref, atol=atol, rtol=0)
      np.testing.assert_allclose(x_wrap, x_ref, atol=atol, rtol=0)
      # the updates are large against the tolerance: a no-op (or a wrong learning rate) fails
      assert np.mean(np.abs(x_ref)) > 5 * atol
    p = optax.apply_updates(p, out[0][0])
  chex.assert_trees_all_equal_structs(state0, states[1])
  chex.assert_trees_all_equal_dtypes(state0, states[1])
  s_ref, s_inj = (anlr_jax.find_anlr_state(states[j]).multipliers for j in (0, 1))
  for name in ("q", "stack"):
    assert np.ptp(np.asarray(s_inj[name]), axis=-1).max() > 1e-2  # the rule is on (injected knobs)
    np.testing.assert_allclose(np.asarray(s_inj[name]), np.asarray(s_ref[name]), atol=1e-2)
  # the bf16 parameters did move, by more than the tolerance
  for x, x0 in zip(f32(p), f32(params)):
    assert np.abs(x - x0).max() > 10 * atol


def test_apply_if_finite_skips_bad_batch():
  params = _params()
  tx = optax.apply_if_finite(anlr_jax.anlr(1e-2, warmup_steps=0), max_consecutive_errors=5)
  state = tx.init(params)
  u, state = jax.jit(tx.update)(_grads(params, 0), state, params)
  params = optax.apply_updates(params, u)
  bad = _grads(params, 1)
  bad["q"]["lora_a"] = bad["q"]["lora_a"].at[0, 0].set(jnp.nan)
  u_bad, state_bad = jax.jit(tx.update)(bad, state, params)
  new_params = optax.apply_updates(params, u_bad)
  chex.assert_trees_all_equal(new_params, params)
  chex.assert_trees_all_equal(
      anlr_jax.find_anlr_state(state_bad.inner_state), anlr_jax.find_anlr_state(state.inner_state)
  )
  assert int(state_bad.notfinite_count) == 1


def test_multisteps_equals_mean_gradient():
  params = _params()
  tx = optax.MultiSteps(anlr_jax.anlr(1e-2, warmup_steps=1), every_k_schedule=2)
  ref = anlr_jax.anlr(1e-2, warmup_steps=1)
  state, ref_state = tx.init(params), ref.init(params)
  update, ref_update = jax.jit(tx.update), jax.jit(ref.update)  # one program each, not op by op
  p, p_ref = params, params
  for step in range(3):
    g1, g2 = _grads(p, 2 * step), _grads(p, 2 * step + 1)
    u, state = update(g1, state, p)
    p = optax.apply_updates(p, u)
    u, state = update(g2, state, p)
    p = optax.apply_updates(p, u)
    u_ref, ref_state = ref_update(jax.tree.map(lambda a, b: (a + b) / 2, g1, g2), ref_state, p_ref)
    p_ref = optax.apply_updates(p_ref, u_ref)
  chex.assert_trees_all_close(p, p_ref, rtol=1e-5, atol=1e-6)


class _Net(nnx.Module):

  def __init__(self, rngs):
    self.q = nnx.LoRA(16, 4, 8, rngs=rngs)
    self.up = nnx.LoRA(8, 2, 16, rngs=rngs)

  def __call__(self, x):
    return self.up(jnp.tanh(self.q(x)))


def test_nnx_optimizer_matches_pure_dict_run():
  model = _Net(nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (4, 16))
  pure0 = nnx.state(model, nnx.LoRAParam).to_pure_dict()
  tx = anlr_jax.anlr(1e-2, warmup_steps=1)
  opt = nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)

  @nnx.jit
  def step(model, opt, x):
    loss, grads = nnx.value_and_grad(
        lambda m: jnp.mean(m(x) ** 2), argnums=nnx.DiffState(0, nnx.LoRAParam)
    )(model)
    opt.update(model, grads)
    return loss

  ref_state = tx.init(pure0)
  p_ref = pure0

  def ref_loss(p):
    m = _Net(nnx.Rngs(0))
    nnx.update(m, p)
    return jnp.mean(m(x) ** 2)

  ref_grad, ref_update = jax.jit(jax.grad(ref_loss)), jax.jit(tx.update)  # the reference, jitted
  for _ in range(4):
    g_ref = ref_grad(p_ref)
    u, ref_state = ref_update(g_ref, ref_state, p_ref)
    p_ref = optax.apply_updates(p_ref, u)
    step(model, opt, x)
  chex.assert_trees_all_close(
      nnx.state(model, nnx.LoRAParam).to_pure_dict(), p_ref, rtol=1e-5, atol=1e-7
  )
  diag = anlr_jax.diagnostics(opt.opt_state)
  assert set(diag["modules"]) == {"q", "up"}
  assert int(diag["count"]) == 4
  np.testing.assert_allclose(np.asarray(diag["modules"]["q"]["multipliers"]).mean(), 1.0, rtol=1e-6)


@pytest.mark.parametrize("batch_modules", [False, True])
def test_sharded_state_types_and_results_match_unsharded(batch_modules):
  assert jax.device_count() == 8
  mesh = jax.make_mesh((8,), ("x",))
  params = _params()
  params["k"] = jax.tree.map(lambda x: 0.5 * x, params["q"])  # q's shapes: batched with it
  spec = {
      "q": {"lora_a": P("x", None), "lora_b": P(None, "x")},
      "k": {"lora_a": P("x", None), "lora_b": P(None, "x")},
      "stack": {"lora_a": P("x", None, None), "lora_b": P("x", None, None)},
      "norm": P("x"),
  }
  tx = anlr_jax.anlr(1e-2, warmup_steps=1, batch_modules=batch_modules)
  kind = lambda tree: [(x.dtype, x.shape, x.sharding) for x in jax.tree.leaves(tree)]
  with jax.set_mesh(mesh):
    sharded = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, spec)
    state0 = tx.init(sharded)
    update = jax.jit(tx.update)
    p, state = sharded, state0
    for i in range(3):
      u, state = update(_grads(params, i), state, p)
      p = optax.apply_updates(p, u)
      assert kind(state) == kind(state0)
      assert jax.tree.structure(state) == jax.tree.structure(state0)
    assert update._cache_size() == 1
  assert anlr_jax.find_anlr_state(state).nu_bar["stack"].sharding.spec == P("x", None)
  p_ref, _ = _run(tx, params, 3)
  chex.assert_trees_all_close(p, p_ref, rtol=1e-5, atol=1e-7)


def test_degenerate_cases_are_finite():
  params = {
      "zero_grad": {"lora_a": jnp.ones((6, 4)), "lora_b": jnp.ones((4, 5))},
      "dead_rank": {
          "lora_a": jnp.ones((6, 4)).at[:, 1].set(0.0),
          "lora_b": jnp.ones((4, 5)).at[1].set(0.0),
      },
      "rank_one": {"lora_a": jnp.ones((6, 1)), "lora_b": jnp.ones((1, 5))},
      "b_zero_init": {"lora_a": jnp.ones((6, 4)), "lora_b": jnp.zeros((4, 5))},
  }
  tx = anlr_jax.anlr(1e-2, warmup_steps=0)
  state = tx.init(params)

  def grads(p, i):
    g = _grads(p, i)
    g["zero_grad"] = jax.tree.map(jnp.zeros_like, g["zero_grad"])
    g["dead_rank"]["lora_a"] = g["dead_rank"]["lora_a"].at[:, 1].set(0.0)
    g["dead_rank"]["lora_b"] = g["dead_rank"]["lora_b"].at[1].set(0.0)
    return g

  update = jax.jit(tx.update)
  for i in range(3):
    u, state = update(grads(params, i), state, params)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(u))
    s = anlr_jax.find_anlr_state(state).multipliers
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(s))
    chex.assert_trees_all_close(s["zero_grad"], jnp.ones(4))
    chex.assert_trees_all_close(s["rank_one"], jnp.ones(1))
    # the dead component is clamped (velocity 0 -> boost kappa, SNR 0 -> damp): finite, mean 1
    np.testing.assert_allclose(float(jnp.mean(s["dead_rank"])), 1.0, rtol=1e-6)
    params = optax.apply_updates(params, u)


@pytest.mark.parametrize(
    "kwargs,word",
    [
        (dict(kappa=1.0), "kappa"),
        (dict(kappa=0.5), "kappa"),
        (dict(rho=1.0), "rho"),
        (dict(rho=-0.1), "rho"),
        (dict(warmup_steps=-1), "warmup_steps"),
        (dict(signal="fast"), "signal"),
    ],
)
def test_bad_arguments(kwargs, word):
  with pytest.raises(ValueError, match=word):
    anlr_jax.anlr(1e-3, **kwargs)
  with pytest.raises(ValueError, match=word):
    anlr_jax.scale_by_anlr(optax.adamw(1e-3), **kwargs)


def test_rank_mismatch_names_module():
  params = {"layers": {"0": {"q_proj": {"lora_a": jnp.ones((6, 4)), "lora_b": jnp.ones((3, 5))}}}}
  with pytest.raises(ValueError, match=r"layers\.0\.q_proj"):
    anlr_jax.anlr(1e-3).init(params)
  orphan = {"layers": {"k_proj": {"lora_a": jnp.ones((6, 4))}}}
  with pytest.raises(ValueError, match=r"layers\.k_proj"):
    anlr_jax.anlr(1e-3).init(orphan)


def test_init_on_concrete_params_compiles_nothing_beyond_adamw_init():
  # Eager ``tx.init`` (e.g. ``nnx.Optimizer``): the per-rank state is made on the host and placed
  # like its parameter, not by XLA programs compiled for each shape (which stay in the process).
  compiles = []

  def listener(event, duration, **kwargs):
    if event == "/jax/core/compile/backend_compile_duration":
      compiles.append(event)

  params = {
      "q": {"lora_a": jnp.ones((37, 5)), "lora_b": jnp.ones((5, 41))}
  }  # shapes used nowhere else
  optax.adamw(1e-3).init(params)  # Adam's moments: compiled here, reused below
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    state = anlr_jax.anlr(1e-3).init(params)
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  assert compiles == []
  st = anlr_jax.find_anlr_state(state)
  np.testing.assert_array_equal(st.multipliers["q"], np.ones(5, np.float32))
  np.testing.assert_array_equal(st.nu_bar["q"], np.zeros(5, np.float32))


def _rank_weighted_grads(params, step):
  """``_grads`` with the ranks of every LoRA factor scaled from 0.2 to 3: components move at
  clearly different speeds."""
  g = _grads(params, step)
  for name in ("q", "stack"):
    r = params[name]["lora_a"].shape[-1]
    w = jnp.linspace(0.2, 3.0, r)
    g[name]["lora_a"] = g[name]["lora_a"] * w
    g[name]["lora_b"] = g[name]["lora_b"] * w[:, None]
  return g


@pytest.mark.parametrize("warmup", [0, 3])
def test_warmup_boundary_is_exact(warmup):
  """s = 1 exactly (the updates are optax.adamw's) for updates 1..w; update w+1 is anisotropic."""
  params = _params()
  tx = anlr_jax.anlr(1e-2, warmup_steps=warmup)
  ref = optax.adamw(1e-2, weight_decay=1e-4)
  state, ref_state = tx.init(params), ref.init(params)
  update, ref_update = jax.jit(tx.update), jax.jit(ref.update)
  p = params
  for t in range(1, warmup + 2):
    g = _rank_weighted_grads(params, t)
    u, state = update(g, state, p)
    u_ref, ref_state = ref_update(g, ref_state, p)
    s = {k: np.asarray(v) for k, v in anlr_jax.find_anlr_state(state).multipliers.items()}
    assert int(anlr_jax.find_anlr_state(state).count) == t
    np.testing.assert_allclose(np.asarray(u["norm"]), np.asarray(u_ref["norm"]), rtol=1e-6)
    if t <= warmup:
      for v in s.values():
        np.testing.assert_array_equal(v, np.ones_like(v))
      chex.assert_trees_all_close(u, u_ref, rtol=1e-6, atol=1e-9)
    else:  # update warmup + 1: every module (every slice of the stacked one) is anisotropic
      for v in s.values():
        assert np.ptp(v, axis=-1).min() > 0.05
        np.testing.assert_allclose(v.mean(-1), 1.0, rtol=1e-6)
      for name in ("q", "stack"):
        assert np.abs(np.asarray(u[name]["lora_a"] - u_ref[name]["lora_a"])).max() > 1e-3
    p = optax.apply_updates(p, u)


@pytest.mark.parametrize("kappa", [2.0, 8.0])
def test_random_control_is_log_uniform_in_the_clamp_range(kappa):
  """signal='random': log s_k ~ U[-log kappa, log kappa] before mean normalisation, mean 1 after.

  Only s / mean(s) is observable. For r = 256 draws, log mean_j(s_j) is its expectation
  log(sinh(L) / L) (L = log kappa) to within ~0.035 L (one standard deviation), so
  ``log s + log(sinh(L) / L)`` recovers the draws before normalisation up to that shift, and
  log s_max - log s_min is exactly the spread of the draws."""
  r, lead = 256, 8
  rng = np.random.default_rng(9)
  params = {
      "m": {
          "lora_a": jnp.asarray(rng.normal(size=(lead, 4, r)), jnp.float32),
          "lora_b": jnp.asarray(rng.normal(size=(lead, r, 3)), jnp.float32),
      }
  }
  grads = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), jnp.float32), params)
  tx = anlr_jax.anlr(1e-2, warmup_steps=0, signal="random", kappa=kappa, seed=11)
  state, update = tx.init(params), jax.jit(tx.update)
  log_kappa = np.log(kappa)
  shift = np.log(np.sinh(log_kappa) / log_kappa)
  draws, seen = [], []
  for i in range(3):
    _, state = update(grads, state, params)
    s = np.asarray(anlr_jax.find_anlr_state(state).multipliers["m"], np.float64)
    assert s.shape == (lead, r)
    np.testing.assert_allclose(s.mean(-1), 1.0, rtol=1e-5)  # mean 1 per module (slice)
    log_s = np.log(s)
    spread = log_s.max(-1) - log_s.min(-1)
    assert spread.max() <= 2 * log_kappa * (1 + 1e-5)  # every draw within a 2 log(kappa) range
    assert spread.min() > 1.9 * log_kappa  # ... and r = 256 draws span it
    draws.append(log_s + shift)
    seen.append(s)
  x = np.concatenate(draws).ravel() / log_kappa  # the draws before normalisation, / log(kappa)
  assert x.min() >= -1.15 and x.max() <= 1.15
  assert x.min() < -0.9 and x.max() > 0.9  # the range is filled at both ends ...
  assert abs(np.mean(np.abs(x) < 0.5) - 0.5) < 0.05  # ... uniformly: half of it lies in [-L/2, L/2]
  assert abs(np.mean(x)) < 0.1
  # a fresh draw for every step and every slice
  assert not np.allclose(seen[0], seen[1])
  assert not np.allclose(seen[0][0], seen[0][1])


def test_cancelling_velocity_through_the_transform_is_finite_and_non_negative():
  """gA_k = -c_k A_k, gB_k = c_k B_k (random c_k): the velocity of every component is 0, and in
  float32 about a third of the nu_k^2 come out slightly negative; the clamp keeps nu_bar finite."""
  rng = np.random.default_rng(8)
  a = jnp.asarray(rng.normal(size=(2, 16, 64)), jnp.float32)
  b = jnp.asarray(rng.normal(size=(2, 64, 8)), jnp.float32)
  params = {"m": {"lora_a": a, "lora_b": b}}
  tx = anlr_jax.anlr(1e-3, warmup_steps=0)
  state, bound, update = tx.init(params), 0.0, jax.jit(tx.update)
  for _ in range(2):
    c = jnp.asarray(np.exp(rng.uniform(-3.0, 3.0, size=(2, 64))), jnp.float32)
    g = {"m": {"lora_a": -c[:, None, :] * a, "lora_b": c[:, :, None] * b}}
    u, state = update(g, state, params)
    st = anlr_jax.find_anlr_state(state)
    nu_bar, s = np.asarray(st.nu_bar["m"]), np.asarray(st.multipliers["m"])
    assert np.all(np.isfinite(nu_bar)) and np.all(nu_bar >= 0.0)
    # what is left is rounding, ~sqrt(float32 eps) of the size of the rank-one terms
    scale = np.asarray(c * jnp.linalg.norm(a, axis=-2) * jnp.linalg.norm(b, axis=-1))
    bound = np.maximum(bound, scale)  # nu_bar averages this step's and the last step's nu
    assert np.all(nu_bar < 3e-3 * bound)
    assert np.all(np.isfinite(s)) and np.all(s > 0.0)
    np.testing.assert_allclose(s.mean(-1), 1.0, rtol=1e-5)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(u))


def test_init_gives_every_state_leaf_its_own_buffer():
  """A train step donates its state: two leaves sharing one buffer would be donated twice."""
  params = {
      "q": {"lora_a": jnp.ones((2, 8, 4)), "lora_b": jnp.zeros((2, 4, 8))},
      "v": {"lora_a": jnp.ones((8, 4)), "lora_b": jnp.zeros((4, 8))},
  }
  for signal in ("anlr", "sensitivity"):
    state = anlr_jax.anlr(1e-3, signal=signal).init(params)
    leaves = [x for x in jax.tree.leaves(state) if isinstance(x, jax.Array)]
    pointers = [x.unsafe_buffer_pointer() for x in leaves]
    assert len(set(pointers)) == len(pointers), signal
    step = jax.jit(lambda s: jax.tree.map(lambda x: x + 1, s), donate_argnums=0)
    jax.block_until_ready(step(state))
