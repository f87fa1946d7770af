"""LoRA-Pro: the closed form against NumPy and brute-force least squares, the optimizer end to end."""

import doctest
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import anlr_jax
from anlr_jax.optim.lorapro import (
    LoraProState,
    equivalent_gradient,
    lorapro_gradients,
    solve_sylvester_psd,
)
from tests import numpy_lorapro as ref

SCALE = 2.0


def _rng(seed):
  return np.random.default_rng(seed)


def _consistent_grads(rng, a, b, s):
  """Flax-layout LoRA gradients derived from a full gradient ``g`` (paper layout ``(m, n)``)."""
  A, B = a.T, b.T
  g = rng.normal(size=(B.shape[0], A.shape[1]))
  return g, (s * B.T @ g).T, (s * g @ A.T).T


# --------------------------------------------------------------------------------------------------
# The closed form of one module.


def test_sylvester_solution_satisfies_its_equation():
  rng = _rng(0)
  with jax.enable_x64(True):
    for r, k in [(1, 1), (3, 3), (4, 2)]:
      bm, am = rng.normal(size=(7, r)), rng.normal(size=(k, 9))
      p, q, c = bm.T @ bm, am @ am.T, rng.normal(size=(r, k))
      x = np.asarray(solve_sylvester_psd(jnp.asarray(p), jnp.asarray(q), jnp.asarray(c)))
      assert x.dtype == np.float64
      np.testing.assert_allclose(p @ x + x @ q, c, rtol=1e-9, atol=1e-10)
      np.testing.assert_allclose(x, ref.sylvester_kron(p, q, c), rtol=1e-8, atol=1e-10)
  # float32, batched over a leading axis
  bm, am = rng.normal(size=(2, 7, 3)), rng.normal(size=(2, 3, 9))
  p, q = np.swapaxes(bm, -1, -2) @ bm, am @ np.swapaxes(am, -1, -2)
  c = rng.normal(size=(2, 3, 3))
  x = np.asarray(solve_sylvester_psd(*(jnp.asarray(v, jnp.float32) for v in (p, q, c))))
  assert x.dtype == np.float32
  np.testing.assert_allclose(p @ x + x @ q, c, rtol=1e-3, atol=1e-3)
  # singular (both zero): the minimum-norm solution, 0, not NaN
  x0 = solve_sylvester_psd(jnp.zeros((2, 2)), jnp.zeros((3, 3)), jnp.zeros((2, 3)))
  np.testing.assert_array_equal(np.asarray(x0), 0.0)


@pytest.mark.parametrize("sylvester", [True, False])
@pytest.mark.parametrize("shape", [(6, 2, 5), (9, 3, 4), (5, 1, 5)])
def test_adjusted_gradients_match_numpy(shape, sylvester):
  n, r, m = shape
  rng = _rng(n * 100 + r)
  a, b = rng.normal(size=(n, r)), rng.normal(size=(r, m))
  ga, gb = rng.normal(size=(n, r)), rng.normal(
      size=(r, m)
  )  # any gradients, not only consistent ones
  with jax.enable_x64(True):
    g_a, g_b, x = lorapro_gradients(
        *(jnp.asarray(v) for v in (a, b, ga, gb)), scale=SCALE, ridge=1e-8, sylvester=sylvester
    )
    geq = equivalent_gradient(*(jnp.asarray(v) for v in (a, b, ga, gb)), scale=SCALE, ridge=1e-8)
  e_a, e_b, e_x = ref.adjusted(a.T, b.T, ga.T, gb.T, SCALE, 1e-8, sylvester)
  np.testing.assert_allclose(np.asarray(g_a), e_a.T, rtol=1e-6, atol=1e-9)
  np.testing.assert_allclose(np.asarray(g_b), e_b.T, rtol=1e-6, atol=1e-9)
  np.testing.assert_allclose(np.asarray(x), e_x, rtol=1e-6, atol=1e-9)
  # the equivalent gradient comes back in the kernel layout (d_in, d_out)
  e_eq = SCALE * (b.T @ e_a + e_b @ a.T)
  np.testing.assert_allclose(np.asarray(geq), e_eq.T, rtol=1e-6, atol=1e-9)
  if sylvester:  # X satisfies B^T B X + X A A^T = -(1/s^2) (B^T B + d I)^+ g_A A^T
    A, B = a.T, b.T
    rhs = -ref.inverse(B.T @ B, 1e-8) @ ga.T @ A.T / SCALE**2
    np.testing.assert_allclose(B.T @ B @ e_x + e_x @ A @ A.T, rhs, rtol=1e-9, atol=1e-10)
    np.testing.assert_allclose(
        B.T @ B @ np.asarray(x) + np.asarray(x) @ A @ A.T, rhs, rtol=1e-6, atol=1e-9
    )


def test_peft_layout_is_the_papers():
  rng = _rng(3)
  A, B = rng.normal(size=(2, 5)), rng.normal(
      size=(6, 2)
  )  # PEFT: lora_A (r, d_in), lora_B (d_out, r)
  gA, gB = rng.normal(size=(2, 5)), rng.normal(size=(6, 2))
  with jax.enable_x64(True):
    g_a, g_b, _ = lorapro_gradients(
        *(jnp.asarray(v) for v in (A, B, gA, gB)), scale=SCALE, dims=anlr_jax.PEFT
    )
    flax_a, flax_b, _ = lorapro_gradients(*(jnp.asarray(v.T) for v in (A, B, gA, gB)), scale=SCALE)
    geq = equivalent_gradient(
        *(jnp.asarray(v) for v in (A, B, gA, gB)), scale=SCALE, dims=anlr_jax.PEFT
    )
  e_a, e_b, _ = ref.adjusted(A, B, gA, gB, SCALE, 1e-8)
  np.testing.assert_allclose(np.asarray(g_a), e_a, rtol=1e-6, atol=1e-9)
  np.testing.assert_allclose(np.asarray(g_b), e_b, rtol=1e-6, atol=1e-9)
  np.testing.assert_allclose(np.asarray(flax_a), e_a.T, rtol=1e-6, atol=1e-9)
  np.testing.assert_allclose(np.asarray(flax_b), e_b.T, rtol=1e-6, atol=1e-9)
  assert geq.shape == (6, 5)  # (d_out, d_in)


def _lora_operator(A, B, s):
  """The linear map (g^A, g^B) -> s (B g^A + g^B A) on row-major vec, as a matrix."""
  m, r = B.shape
  n = A.shape[1]
  return s * np.concatenate([np.kron(B, np.eye(n)), np.kron(np.eye(m), A.T)], axis=1), (
      r * n,
      m * r,
  )


@pytest.mark.parametrize("shape", [(6, 2, 5), (4, 3, 7)])
def test_equivalent_step_is_the_least_squares_projection(shape):
  """Brute force: the equivalent step minimises ||s(B g^A + g^B A) - g||_F, and among all minimisers
  LoRA-Pro's (Sylvester X) is the closest to the LoRA gradients."""
  n, r, m = shape
  rng = _rng(7 + n)
  a, b = rng.normal(size=(n, r)), rng.normal(size=(r, m))
  g, ga, gb = _consistent_grads(rng, a, b, SCALE)
  A, B = a.T, b.T
  with jax.enable_x64(True):
    args = [jnp.asarray(v) for v in (a, b, ga, gb)]
    g_a, g_b, _ = lorapro_gradients(*args, scale=SCALE, ridge=0.0)
    z_a, z_b, _ = lorapro_gradients(*args, scale=SCALE, ridge=0.0, sylvester=False)
    geq = np.asarray(equivalent_gradient(*args, scale=SCALE, ridge=0.0))
  GA, GB = np.asarray(g_a).T, np.asarray(g_b).T
  ZA, ZB = np.asarray(z_a).T, np.asarray(z_b).T

  op, (na, _) = _lora_operator(A, B, SCALE)
  z0 = np.linalg.lstsq(op, g.reshape(-1), rcond=None)[0]
  best = (op @ z0).reshape(m, n)
  assert np.linalg.norm(best - g) > 1e-3  # g is not reachable: the test is not trivial
  for ua, ub in [(GA, GB), (ZA, ZB)]:  # every X gives the same, optimal, equivalent step
    np.testing.assert_allclose(SCALE * (B @ ua + ub @ A), best, rtol=1e-8, atol=1e-10)
  np.testing.assert_allclose(geq, best.T, rtol=1e-8, atol=1e-10)

  # Among the minimisers z0 + null(op), the one closest to the LoRA gradients:
  _, sv, vt = np.linalg.svd(op)
  null = vt[np.sum(sv > 1e-10 * sv[0]) :].T
  assert null.shape[1] == r * r  # {(XA, -BX)}: the paper's free X
  z_lora = np.concatenate([ga.T.reshape(-1), gb.T.reshape(-1)])
  z_star = z0 + null @ (null.T @ (z_lora - z0))
  np.testing.assert_allclose(GA, z_star[:na].reshape(r, n), rtol=1e-7, atol=1e-9)
  np.testing.assert_allclose(GB, z_star[na:].reshape(m, r), rtol=1e-7, atol=1e-9)
  dist = lambda ua, ub: np.sum((ua - ga.T) ** 2) + np.sum((ub - gb.T) ** 2)
  assert dist(GA, GB) < dist(ZA, ZB)


def test_b_zero_at_init():
  """B = 0 (the usual init): B^T B is singular; g_A = 0 exactly, so g^A = 0, X = 0 and
  g^B = g_B (A A^T + d I)^-1 / s^2, finite."""
  rng = _rng(11)
  a, b = rng.normal(size=(6, 2)), np.zeros((2, 5))
  _, ga, gb = _consistent_grads(rng, a, b, SCALE)
  assert not ga.any()
  e_a, e_b, _ = ref.adjusted(a.T, b.T, ga.T, gb.T, SCALE, 1e-8)
  for dtype, tol in [(jnp.float64, 1e-9), (jnp.float32, 1e-5)]:
    with jax.enable_x64(dtype == jnp.float64):
      g_a, g_b, x = lorapro_gradients(*(jnp.asarray(v, dtype) for v in (a, b, ga, gb)), scale=SCALE)
      assert np.isfinite(np.asarray(g_b)).all()
      np.testing.assert_array_equal(np.asarray(g_a), 0.0)
      np.testing.assert_array_equal(np.asarray(x), 0.0)
      np.testing.assert_allclose(np.asarray(g_b), e_b.T, rtol=tol, atol=tol)


# --------------------------------------------------------------------------------------------------
# The optimizer.


def _params(dtype=jnp.float32, seed=0):
  k = jax.random.split(jax.random.key(seed), 5)
  return {
      "q": {
          "lora_a": 0.5 * jax.random.normal(k[0], (7, 3), dtype),
          "lora_b": 0.5 * jax.random.normal(k[1], (3, 5), dtype),
      },
      "stack": {
          "lora_a": 0.5 * jax.random.normal(k[2], (2, 6, 2), dtype),
          "lora_b": 0.5 * jax.random.normal(k[3], (2, 2, 4), dtype),
      },
      "dense": jax.random.normal(k[4], (4, 3), dtype),
      "norm": jnp.ones((5,), dtype),
  }


def _grads(params, step):
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.fold_in(jax.random.key(42), step), len(leaves))
  return treedef.unflatten([jax.random.normal(kk, x.shape, x.dtype) for kk, x in zip(keys, leaves)])


HP = dict(b1=0.9, b2=0.99, eps=1e-8, weight_decay=0.1)


@pytest.mark.parametrize("mode", ["full", "efficient"])
def test_optimizer_matches_numpy_reference(mode):
  schedule = optax.linear_schedule(2e-2, 5e-3, 4)
  steps = 4
  with jax.enable_x64(True):
    params = _params(jnp.float64)
    tx = anlr_jax.lorapro(schedule, scale=SCALE, mode=mode, **HP)
    state = tx.init(params)
    update = jax.jit(tx.update)
    np_params = jax.tree.map(np.array, params)  # writable copies
    slices = {  # (module, slice index) -> numpy moments
        ("q", None): ref.init_moments(np_params["q"]["lora_a"], np_params["q"]["lora_b"], mode),
        **{
            ("stack", i): ref.init_moments(
                np_params["stack"]["lora_a"][i], np_params["stack"]["lora_b"][i], mode
            )
            for i in range(2)
        },
    }
    for t in range(1, steps + 1):
      grads = _grads(params, t)
      updates, state = update(grads, state, params)
      params = optax.apply_updates(params, updates)
      np_grads = jax.tree.map(np.asarray, grads)
      for (name, i), (mu, nu) in list(slices.items()):
        sel = (lambda x: x) if i is None else (lambda x: x[i])
        a_new, b_new, mu, nu = ref.module_step(
            sel(np_params[name]["lora_a"]),
            sel(np_params[name]["lora_b"]),
            sel(np_grads[name]["lora_a"]),
            sel(np_grads[name]["lora_b"]),
            mu,
            nu,
            t,
            lr=float(schedule(t - 1)),
            s=SCALE,
            ridge=1e-8,
            mode=mode,
            b1=HP["b1"],
            b2=HP["b2"],
            eps=HP["eps"],
            wd=HP["weight_decay"],
        )
        slices[(name, i)] = (mu, nu)
        if i is None:
          np_params[name] = {"lora_a": a_new, "lora_b": b_new}
        else:
          np_params[name]["lora_a"][i], np_params[name]["lora_b"][i] = a_new, b_new
      for name in ("q", "stack"):
        for leaf in ("lora_a", "lora_b"):
          np.testing.assert_allclose(
              np.asarray(params[name][leaf]), np_params[name][leaf], rtol=1e-6, atol=1e-9
          )
    if mode == "full":  # the moments, kept in the kernel layout (d_in, d_out)
      np.testing.assert_allclose(
          np.asarray(state.lora_mu["q"]), slices[("q", None)][0].T, rtol=1e-6, atol=1e-12
      )
      np.testing.assert_allclose(
          np.asarray(state.lora_nu["stack"][1]), slices[("stack", 1)][1].T, rtol=1e-6, atol=1e-12
      )


@pytest.mark.parametrize("mode", ["full", "efficient"])
@pytest.mark.parametrize("use_mask", [False, True])
def test_non_lora_leaves_get_exactly_adamw(mode, use_mask):
  mask = (lambda p: jax.tree.map(lambda x: x.ndim > 1, p)) if use_mask else None
  schedule = optax.linear_schedule(1e-2, 1e-3, 5)
  tx = anlr_jax.lorapro(schedule, scale=SCALE, mode=mode, mask=mask, **HP)
  adamw = optax.adamw(schedule, mask=mask, **HP)
  params = _params()
  state, ref_state = tx.init(params), adamw.init(params)
  update, ref_update = jax.jit(tx.update), jax.jit(adamw.update)
  p_ref = params
  for t in range(3):
    u, state = update(_grads(params, t), state, params)
    u_ref, ref_state = ref_update(_grads(p_ref, t), ref_state, p_ref)
    for leaf in ("dense", "norm"):
      np.testing.assert_array_equal(np.asarray(u[leaf]), np.asarray(u_ref[leaf]))
      assert not np.array_equal(np.asarray(u["q"]["lora_a"]), np.asarray(u_ref["q"]["lora_a"]))
    params, p_ref = optax.apply_updates(params, u), optax.apply_updates(p_ref, u_ref)


def test_mask_switches_lora_decay():
  params = _params()
  grads = jax.tree.map(jnp.zeros_like, params)  # zero gradients: the delta is the decay alone
  mask = jax.tree.map(lambda _: True, params)
  mask["q"]["lora_b"] = False
  for mode, factor in [("full", np.sqrt(1 - 0.1 * 0.5) - 1), ("efficient", -0.1 * 0.5)]:
    tx = anlr_jax.lorapro(0.1, scale=SCALE, weight_decay=0.5, mask=mask, mode=mode)
    u, _ = jax.jit(tx.update)(grads, tx.init(params), params)
    np.testing.assert_allclose(u["q"]["lora_a"], factor * params["q"]["lora_a"], rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(u["q"]["lora_b"]), 0.0)
    np.testing.assert_allclose(u["stack"]["lora_b"], factor * params["stack"]["lora_b"], rtol=1e-5)


@pytest.mark.parametrize("mode", ["full", "efficient"])
def test_stacked_slices_are_independent_modules(mode):
  params = _params()
  unstacked = {
      "q": params["q"],
      **{
          f"s{i}": {"lora_a": params["stack"]["lora_a"][i], "lora_b": params["stack"]["lora_b"][i]}
          for i in range(2)
      },
  }
  tx = anlr_jax.lorapro(1e-2, scale=SCALE, mode=mode, **HP)
  s1, s2 = tx.init(params), tx.init(unstacked)
  update = jax.jit(tx.update)
  p1, p2 = params, unstacked
  for t in range(3):
    g1 = _grads(params, t)
    g2 = {
        "q": g1["q"],
        **{f"s{i}": {k: g1["stack"][k][i] for k in ("lora_a", "lora_b")} for i in range(2)},
    }
    u1, s1 = update(g1, s1, p1)
    u2, s2 = update(g2, s2, p2)
    p1, p2 = optax.apply_updates(p1, u1), optax.apply_updates(p2, u2)
    for i in range(2):
      for k in ("lora_a", "lora_b"):
        np.testing.assert_allclose(u1["stack"][k][i], u2[f"s{i}"][k], rtol=2e-4, atol=1e-6)


def test_jit_compiles_once_and_matches_eager():
  traces = []
  tx = anlr_jax.lorapro(optax.linear_schedule(1e-2, 0.0, 10), scale=SCALE)

  def update(g, s, p):
    traces.append(1)
    return tx.update(g, s, p)

  jitted = jax.jit(update)
  params = eager = _params()
  state = eager_state = tx.init(params)
  for t in range(2):
    u, state = jitted(_grads(params, t), state, params)
    ue, eager_state = tx.update(_grads(eager, t), eager_state, eager)
    params, eager = optax.apply_updates(params, u), optax.apply_updates(eager, ue)
  u, state = jitted(_grads(params, 2), state, params)
  assert len(traces) == 1
  chex.assert_trees_all_close(params, eager, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("mode", ["full", "efficient"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_shapes_and_dtypes_preserved(dtype, mode):
  params = _params(dtype)
  tx = anlr_jax.lorapro(1e-3, scale=SCALE, mode=mode)
  state = tx.init(params)
  assert isinstance(state, LoraProState)
  if mode == "full":
    assert state.lora_mu["q"].shape == (7, 5) and state.lora_mu["stack"].shape == (2, 6, 4)
    assert state.lora_mu["q"].dtype == jnp.float32  # moments float32 for bf16 factors
  update = jax.jit(tx.update)
  for t in range(2):
    u, new_state = update(_grads(params, t), state, params)
    chex.assert_trees_all_equal_shapes_and_dtypes(u, params)
    chex.assert_trees_all_equal_structs(new_state, state)
    chex.assert_trees_all_equal_shapes_and_dtypes(new_state, state)
    assert all(np.isfinite(np.asarray(x, np.float32)).all() for x in jax.tree.leaves(u))
    state, params = new_state, optax.apply_updates(params, u)
  if dtype == jnp.float32:
    wide = anlr_jax.lorapro(1e-3, scale=SCALE, moment_dtype=jnp.bfloat16).init(params)
    assert wide.lora_mu["q"].dtype == jnp.bfloat16


def test_training_from_b_zero_init_is_finite():
  """A real gradient from B = 0 (nnx.LoRA's init), through nnx.Optimizer, equals the pure-dict run."""

  class Net(nnx.Module):

    def __init__(self, rngs):
      self.q = nnx.LoRA(8, 2, 6, rngs=rngs)

    def __call__(self, x):
      return jnp.tanh(self.q(x))

  x = jax.random.normal(jax.random.key(1), (16, 8))
  y = jax.random.normal(jax.random.key(2), (16, 6))
  model = Net(nnx.Rngs(0))
  pure0 = nnx.state(model, nnx.LoRAParam).to_pure_dict()
  tx = anlr_jax.lorapro(1e-2, scale=1.0, weight_decay=0.0)  # nnx.LoRA has no output scale
  opt = nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)

  @nnx.jit
  def step(model, opt):
    loss, grads = nnx.value_and_grad(
        lambda m: jnp.mean((m(x) - y) ** 2), argnums=nnx.DiffState(0, nnx.LoRAParam)
    )(model)
    opt.update(model, grads)
    return loss

  def ref_loss(p):
    m = Net(nnx.Rngs(0))
    nnx.update(m, p)
    return jnp.mean((m(x) - y) ** 2)

  p_ref, ref_state = pure0, tx.init(pure0)
  losses = []
  ref_grad, ref_update = jax.jit(jax.grad(ref_loss)), jax.jit(tx.update)  # the reference, jitted
  for _ in range(5):
    u, ref_state = ref_update(ref_grad(p_ref), ref_state, p_ref)
    p_ref = optax.apply_updates(p_ref, u)
    losses.append(float(step(model, opt)))
  assert np.isfinite(losses).all() and losses[-1] < losses[0]
  chex.assert_trees_all_close(
      nnx.state(model, nnx.LoRAParam).to_pure_dict(), p_ref, rtol=1e-4, atol=1e-6
  )


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(learning_rate=0.0), "learning_rate"),
        (dict(learning_rate=-1e-3), "learning_rate"),
        (dict(scale=0.0), "scale"),
        (dict(scale=-2.0), "scale"),
        (dict(scale=float("nan")), "scale"),
        (dict(scale=None), "scale"),
        (dict(b1=1.0), "b1"),
        (dict(b2=-0.1), "b2"),
        (dict(eps=-1e-8), "eps"),
        (dict(weight_decay=-1.0), "weight_decay"),
        (dict(ridge=-1.0), "ridge"),
        (dict(mode="fast"), "mode"),
        (dict(moment_dtype=jnp.int32), "moment_dtype"),
    ],
)
def test_bad_arguments(kwargs, name):
  args = dict(learning_rate=1e-3, scale=SCALE) | kwargs
  with pytest.raises(ValueError, match=name):
    anlr_jax.lorapro(args.pop("learning_rate"), **args)


def test_does_not_compose_with_anlr():
  params = _params()
  tx = anlr_jax.scale_by_anlr(anlr_jax.lorapro(1e-3, scale=SCALE), warmup_steps=0)
  state = tx.init(params)
  with pytest.raises(ValueError, match="one moment per parameter"):
    tx.update(_grads(params, 0), state, params)


def test_docstring_example_runs():
  module = sys.modules["anlr_jax.optim.lorapro"]
  result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
  assert result.attempted > 0 and result.failed == 0
