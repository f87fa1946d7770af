"""LoRA-Dash (``anlr_jax.nn.loradash``) against a NumPy implementation of the paper's equations.

The reference below is written in the paper's (torch) layout, ``W`` of shape ``(d_out, d_in)`` and
``h = W x``, so it also checks the transposition to the Flax layout of the layer.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import anlr_jax
from anlr_jax.nn import (
    LORADASH_DEFAULTS,
    DashDirections,
    LoRADashLinear,
    LoRALinear,
    dash_launch_step,
    dash_launched,
    direction_change_rates,
    inject_loradash,
    launch_dash,
    lora_state,
    merge_all,
    select_task_directions,
    unmerge_all,
    validate_dash_config,
)


# ------------------------------------------------------------------ NumPy reference (paper layout)
def np_change_rates(w, delta):
  """``W = U diag(σ) V^T``; ``δ_i = |u_i^T ΔW v_i| / σ_i`` for every singular triplet of ``W``."""
  u, sigma, vt = np.linalg.svd(w, full_matrices=False)
  rates = np.array([abs(u[:, i] @ delta @ vt[i]) / sigma[i] for i in range(sigma.size)])
  return u, sigma, vt, rates


def np_task_directions(w, delta, s):
  """Top-``s`` directions by change rate: ``(U_s (d_out, s), V_s^T (s, d_in), rates, indices)``."""
  u, _, vt, rates = np_change_rates(w, delta)
  order = np.argsort(-rates, kind="stable")[:s]
  return u[:, order], vt[order], rates[order], order


def np_loradash_forward(x, w, bias, a_t, b_t, c, u_s, vt_s, dash):
  """``h = W x + b + c B A x + U_s diag(δ̂) V_s^T x`` for every row ``x`` (paper layout)."""
  delta = c * b_t @ a_t + u_s @ np.diag(dash) @ vt_s
  return x @ (w + delta).T + bias


def _f64(v):
  return np.asarray(v[...] if hasattr(v, "get_value") else v, np.float64)


def _layer(d_in=7, d_out=5, s=3, rank=2, seed=0, dtype=jnp.float64, **kwargs):
  """A LoRADashLinear on a random float64 base with a bias and a non-zero ``B``."""
  base = nnx.Linear(d_in, d_out, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(seed))
  base.bias[...] = jax.random.normal(jax.random.key(seed + 1), (d_out,), dtype)
  layer = LoRADashLinear(base, rank=rank, alpha=4.0, num_directions=s, rngs=nnx.Rngs(seed + 2))
  layer.lora_b[...] = 0.5 * jax.random.normal(jax.random.key(seed + 3), (rank, d_out), jnp.float32)
  return layer


def _paper_operands(layer):
  """``(W, b, A_t, B_t, c)`` of the layer in the paper's layout, float64."""
  w = _f64(layer.base.kernel).T
  return w, _f64(layer.base.bias), _f64(layer.lora_a).T, _f64(layer.lora_b).T, layer.scale


# ------------------------------------------------------------------ selection
@pytest.mark.parametrize("d_in,d_out,s", [(7, 5, 3), (5, 9, 5), (6, 6, 1)])
def test_select_task_directions_matches_numpy(d_in, d_out, s):
  with jax.enable_x64(True):
    k1, k2, k3 = jax.random.split(jax.random.key(d_in * 10 + d_out), 3)
    kernel = jax.random.normal(k1, (d_in, d_out), jnp.float64)
    a = jax.random.normal(k2, (d_in, 3), jnp.float64)
    b = jax.random.normal(k3, (3, d_out), jnp.float64)
    delta = 0.7 * a @ b  # c A B, Flax layout
    got = select_task_directions(kernel, delta, s)
    rates = direction_change_rates(kernel, delta)
    assert got.u.dtype == jnp.float64 and got.u.shape == (d_in, s) and got.v.shape == (s, d_out)
    u_ref, vt_ref, rates_ref, index_ref = np_task_directions(_f64(kernel).T, _f64(delta).T, s)
    np.testing.assert_allclose(rates, np_change_rates(_f64(kernel).T, _f64(delta).T)[3], rtol=1e-9)
    np.testing.assert_array_equal(got.index, index_ref)
    np.testing.assert_allclose(got.change_rate, rates_ref, rtol=1e-9)
    for j in range(s):  # p_j q_j^T (Flax) = (u_j v_j^T)^T (paper); sign-free
      np.testing.assert_allclose(
          np.outer(got.u[:, j], got.v[j]), np.outer(vt_ref[j], u_ref[:, j]), atol=1e-9
      )


def test_selection_is_the_top_s_by_change_rate_brute_force():
  with jax.enable_x64(True):
    d_in, d_out, s = 6, 5, 3
    k1, k2 = jax.random.split(jax.random.key(7))
    kernel = jax.random.normal(k1, (d_in, d_out), jnp.float64)
    delta = 0.3 * jax.random.normal(k2, (d_in, d_out), jnp.float64)
    got = select_task_directions(kernel, delta, s)
    _, _, _, rates = np_change_rates(_f64(kernel).T, _f64(delta).T)
    best = max(itertools.combinations(range(rates.size), s), key=lambda c: rates[list(c)].sum())
    assert set(np.asarray(got.index).tolist()) == set(best)
    chosen = rates[np.asarray(got.index)]
    others = np.delete(rates, np.asarray(got.index))
    assert chosen.min() >= others.max()
    assert np.all(np.diff(chosen) <= 0)  # by decreasing change rate


def test_change_rate_is_relative_to_the_singular_value():
  # diagonal W0: directions are the coordinate axes; ΔW adds 0.4 to σ=4 and σ=2, 0.3 to σ=1
  w0 = jnp.diag(jnp.array([4.0, 2.0, 1.0]))
  dw = jnp.diag(jnp.array([0.4, 0.4, 0.3]))
  np.testing.assert_allclose(direction_change_rates(w0, dw), [0.1, 0.2, 0.3], rtol=1e-6)
  assert select_task_directions(w0, dw, 2).index.tolist() == [2, 1]
  # a zero singular value with a non-zero projection ranks first; 0/0 ranks as 0
  w1 = jnp.diag(jnp.array([3.0, 1.0, 0.0]))
  rates = direction_change_rates(w1, jnp.diag(jnp.array([0.3, 0.0, 0.5])))
  assert rates[2] == np.inf and rates[1] == 0.0
  assert not np.any(np.isnan(direction_change_rates(w1, jnp.zeros((3, 3)))))


# ------------------------------------------------------------------ the layer
def test_defaults_are_the_papers():
  assert LORADASH_DEFAULTS == dict(num_directions=8, launch_step=100)
  layer = LoRADashLinear(nnx.Linear(16, 12, rngs=nnx.Rngs(0)), rank=4, alpha=8.0, rngs=nnx.Rngs(1))
  assert layer.num_directions == 8 and layer.launch_step == 100
  assert layer.dash_u.shape == (16, 8) and layer.dash_v.shape == (8, 12)
  assert layer.dash_scale.shape == (8,) and isinstance(layer.dash_scale, nnx.LoRAParam)
  assert isinstance(layer.dash_u, DashDirections) and not isinstance(layer.dash_u, nnx.Param)
  assert not layer.launched and np.all(np.asarray(layer.dash_index[...]) == -1)


def test_forward_before_launch_is_lora():
  with jax.enable_x64(True):
    layer = _layer()
    x = jax.random.normal(jax.random.key(9), (4, 7), jnp.float64)
    w, bias, a_t, b_t, c = _paper_operands(layer)
    s = layer.num_directions
    zeros_u, zeros_vt = np.zeros((5, s)), np.zeros((s, 7))
    ref = np_loradash_forward(_f64(x), w, bias, a_t, b_t, c, zeros_u, zeros_vt, np.zeros(s))
    np.testing.assert_allclose(layer(x), ref, atol=1e-10, rtol=0)
    # and bit for bit what LoRALinear computes with the same base and random draws
    base = nnx.Linear(7, 5, dtype=jnp.float64, param_dtype=jnp.float64, rngs=nnx.Rngs(0))
    base.bias[...] = layer.base.bias[...]
    lora = LoRALinear(base, rank=2, alpha=4.0, rngs=nnx.Rngs(2))
    lora.lora_b[...] = layer.lora_b[...]
    np.testing.assert_array_equal(lora.lora_a[...], layer.lora_a[...])
    np.testing.assert_array_equal(lora(x), layer(x))


def test_forward_after_launch_adds_the_dash_term():
  with jax.enable_x64(True):
    layer = _layer()
    w, bias, a_t, b_t, c = _paper_operands(layer)
    directions = layer.launch()
    assert layer.launched
    u_s, vt_s, rates, index = np_task_directions(w, c * b_t @ a_t, layer.num_directions)
    np.testing.assert_array_equal(directions.index, index)
    np.testing.assert_array_equal(layer.dash_index[...], index)
    np.testing.assert_allclose(layer.dash_change_rate[...], rates, rtol=1e-6)
    # launch leaves the output unchanged (dash_scale = 0) ...
    x = jax.random.normal(jax.random.key(9), (4, 7), jnp.float64)
    zero = np.zeros(layer.num_directions)
    ref0 = np_loradash_forward(_f64(x), w, bias, a_t, b_t, c, u_s, vt_s, zero)
    np.testing.assert_allclose(layer(x), ref0, atol=1e-10, rtol=0)
    # ... and a trained dash_scale amplifies exactly the chosen directions
    dash = np.array([0.7, -1.3, 0.4])
    layer.dash_scale[...] = jnp.asarray(dash, jnp.float32)
    ref = np_loradash_forward(_f64(x), w, bias, a_t, b_t, c, u_s, vt_s, _f64(layer.dash_scale))
    np.testing.assert_allclose(layer(x), ref, atol=1e-6, rtol=0)
    assert np.max(np.abs(ref - ref0)) > 0.1
    # the merged kernel holds the whole update W0 + c A B + U_s diag(δ̂) V_s
    expected = w.T + c * (b_t @ a_t).T + (u_s @ np.diag(_f64(layer.dash_scale)) @ vt_s).T
    np.testing.assert_allclose(layer.merged_kernel(), expected, atol=1e-6)


def test_dash_scale_gets_gradient_only_after_launch():
  def loss(model, x, g):
    return jnp.sum(model(x) * g)

  grad_fn = nnx.grad(loss, argnums=nnx.DiffState(0, nnx.LoRAParam))
  with jax.enable_x64(True):
    layer = _layer()
    x = jax.random.normal(jax.random.key(9), (6, 7), jnp.float64)
    g = jax.random.normal(jax.random.key(10), (6, 5), jnp.float64)
    before = nnx.to_pure_dict(grad_fn(layer, x, g))
    assert np.all(np.asarray(before["dash_scale"]) == 0.0)
    assert np.any(np.asarray(before["lora_a"]) != 0.0)
    w, _, a_t, b_t, c = _paper_operands(layer)
    layer.launch()
    after = nnx.to_pure_dict(grad_fn(layer, x, g))
    u_s, vt_s, _, _ = np_task_directions(w, c * b_t @ a_t, layer.num_directions)
    # dL/dδ̂_j = Σ_n (v_j^T x_n)(u_j^T g_n)  for  L = Σ_n g_n^T h_n
    ref = np.sum((_f64(x) @ vt_s.T) * (_f64(g) @ u_s), axis=0)
    np.testing.assert_allclose(after["dash_scale"], ref, atol=1e-6, rtol=1e-6)
    assert np.all(np.abs(ref) > 1e-3)
    for name in ("lora_a", "lora_b"):  # dash_scale = 0: the LoRA gradients are unchanged
      np.testing.assert_allclose(after[name], before[name], atol=1e-12)


def test_dropout_uses_one_mask_for_both_adapter_terms():
  layer = LoRADashLinear(
      nnx.Linear(8, 6, rngs=nnx.Rngs(0)),
      rank=2,
      alpha=2.0,
      num_directions=3,
      dropout=0.5,
      rngs=nnx.Rngs(1, dropout=2),
  )
  layer.lora_b[...] = jnp.ones((2, 6))
  layer.launch()
  layer.dash_scale[...] = jnp.array([1.0, -2.0, 0.5])
  layer.dropout.deterministic = False
  x = jax.random.normal(jax.random.key(3), (4, 8))
  replay = nnx.clone(layer.dropout)  # same RNG state: draws the mask the layer will draw
  y = layer(x)
  x_dropped = replay(x)
  assert np.any(np.asarray(x_dropped) == 0.0)
  expected = layer.base(x) + x_dropped @ layer.delta_kernel()  # x' (c A B + U diag(δ̂) V)
  np.testing.assert_allclose(y, expected, atol=1e-5)


def test_logical_axis_names_follow_the_kernel():
  base = nnx.Linear(
      8,
      6,
      kernel_metadata={"out_sharding": ("embed", "mlp"), "eager_sharding": False},
      rngs=nnx.Rngs(0),
  )
  layer = LoRADashLinear(base, rank=2, alpha=2.0, num_directions=3, rngs=nnx.Rngs(1))
  assert layer.dash_u.get_metadata()["out_sharding"] == ("embed", None)
  assert layer.dash_v.get_metadata()["out_sharding"] == (None, "mlp")
  assert layer.dash_scale.get_metadata()["out_sharding"] == (None,)


# ------------------------------------------------------------------ model level
class _MLP(nnx.Module):

  def __init__(self, rngs):
    self.up_proj = nnx.Linear(8, 12, rngs=rngs)
    self.down_proj = nnx.Linear(12, 6, rngs=rngs)
    self.head = nnx.Linear(6, 4, rngs=rngs)

  def __call__(self, x):
    return self.head(jnp.tanh(self.down_proj(jnp.tanh(self.up_proj(x)))))


def _model(s=3, t=3):
  return inject_loradash(
      _MLP(nnx.Rngs(0)),
      target_modules=("up_proj", "down_proj"),
      rank=4,
      alpha=8.0,
      num_directions=s,
      launch_step=t,
      dropout=0.0,
      rngs=nnx.Rngs(1),
  )


def test_inject_and_launch_dash_on_a_model():
  model = _model()
  assert isinstance(model.up_proj, LoRADashLinear) and isinstance(model.head, nnx.Linear)
  assert dash_launch_step(model) == 3 and not dash_launched(model)
  assert set(nnx.to_pure_dict(lora_state(model))["up_proj"]) == {"lora_a", "lora_b", "dash_scale"}
  directions = nnx.to_pure_dict(nnx.state(model, DashDirections))
  assert set(directions["down_proj"]) == {"dash_u", "dash_v", "dash_change_rate", "dash_index"}
  for layer in (model.up_proj, model.down_proj):
    layer.lora_b[...] = 0.3 * jax.random.normal(jax.random.key(4), layer.lora_b.shape)
  with pytest.raises(ValueError, match="num_directions"):
    launch_dash(model, 2)
  assert not dash_launched(model)  # a refused launch changes nothing
  chosen = launch_dash(model, 3)
  assert list(chosen) == ["down_proj", "up_proj"] and dash_launched(model)
  for path, layer in (("up_proj", model.up_proj), ("down_proj", model.down_proj)):
    ref = select_task_directions(layer.base.kernel[...], layer.lora_delta_kernel(), 3)
    np.testing.assert_array_equal(chosen[path].index, ref.index)
    np.testing.assert_allclose(layer.dash_u[...], ref.u, atol=1e-6)
  with pytest.raises(ValueError, match="already started"):
    launch_dash(model)
  # merge_all / unmerge_all (LoRALinear's) fold in the dash term too
  model.up_proj.dash_scale[...] = jnp.array([0.5, -0.2, 0.8])
  x = jax.random.normal(jax.random.key(5), (3, 8))
  y = model(x)
  np.testing.assert_allclose(merge_all(model)(x), y, atol=1e-5)
  np.testing.assert_allclose(unmerge_all(model)(x), y, atol=1e-5)
  with pytest.raises(ValueError, match="no LoRADashLinear"):
    launch_dash(_MLP(nnx.Rngs(0)))


def test_anlr_on_loradash_jitted_across_the_launch():
  """AnLR on the LoRA-Dash params in one jitted step, compiled once for both phases: ``lora_a``/
  ``lora_b`` get per-rank multipliers, ``dash_scale`` exactly AdamW's update (zero before launch).
  """
  model = _model(s=3, t=3)
  graphdef, lora, rest = nnx.split(model, nnx.LoRAParam, ...)
  params, rest = nnx.to_pure_dict(lora), nnx.to_pure_dict(rest)
  modules = anlr_jax.find_lora_modules(params)
  assert sorted((m.name, m.rank) for m in modules) == [("down_proj", 4), ("up_proj", 4)]
  adam = dict(b1=0.9, b2=0.999, eps=1e-8, weight_decay=1e-2)
  tx = optax.chain(optax.clip_by_global_norm(1.0), anlr_jax.anlr(3e-2, warmup_steps=1, **adam))
  ref = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-2, **adam))
  opt_state, ref_state = tx.init(params), ref.init(params)
  x = jax.random.normal(jax.random.key(11), (16, 8))
  y = jax.random.normal(jax.random.key(12), (16, 4))
  traces = []

  @jax.jit
  def step(params, opt_state, ref_state, rest):
    traces.append(1)

    def loss_fn(p):
      return jnp.mean((nnx.merge(graphdef, p, rest)(x) - y) ** 2)

    grads = jax.grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    ref_updates, ref_state = ref.update(grads, ref_state, params)
    return optax.apply_updates(params, updates), opt_state, ref_state, updates, ref_updates, grads

  launch_at = dash_launch_step(model)
  for t in range(1, 9):
    params, opt_state, ref_state, upd, ref_upd, grads = step(params, opt_state, ref_state, rest)
    for name in ("up_proj", "down_proj"):
      if t <= launch_at:
        assert np.all(np.asarray(grads[name]["dash_scale"]) == 0.0)
        assert np.all(np.asarray(params[name]["dash_scale"]) == 0.0)
      else:
        assert np.all(np.asarray(grads[name]["dash_scale"]) != 0.0)
      np.testing.assert_array_equal(upd[name]["dash_scale"], ref_upd[name]["dash_scale"])
      if t > 1:  # after AnLR's warmup the LoRA factors are rescaled per rank: not AdamW's update
        assert not np.allclose(upd[name]["lora_a"], ref_upd[name]["lora_a"], rtol=1e-3)
    if t == launch_at:  # what a trainer does after update t: launch on the model, re-split
      model = nnx.merge(graphdef, params, rest)
      launch_dash(model)
      _, lora_after, rest_after = nnx.split(model, nnx.LoRAParam, ...)
      rest_after = nnx.to_pure_dict(rest_after)
      assert jax.tree.structure(rest_after) == jax.tree.structure(rest)
      jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(lora_after), params)
      rest = rest_after
  assert len(traces) == 1  # one compilation for both phases
  assert np.all(np.abs(np.asarray(params["up_proj"]["dash_scale"])) > 0)
  multipliers = anlr_jax.find_anlr_state(opt_state).multipliers
  assert sorted(multipliers) == ["down_proj", "up_proj"]  # dash_scale is no LoRA module
  assert np.ptp(np.asarray(multipliers["up_proj"])) > 1e-3


# ------------------------------------------------------------------ configuration errors
@pytest.mark.parametrize("bad", [0, -1, True, 2.0, 6])
def test_bad_num_directions_names_the_key(bad):
  with pytest.raises(ValueError, match="num_directions"):
    LoRADashLinear(nnx.Linear(8, 5, rngs=nnx.Rngs(0)), rank=2, alpha=2.0, num_directions=bad,
                   rngs=nnx.Rngs(1))  # fmt: skip
  with pytest.raises(ValueError, match="num_directions"):
    select_task_directions(jnp.ones((8, 5)), jnp.ones((8, 5)), bad)


@pytest.mark.parametrize("bad", [-1, 1.5, None])
def test_bad_launch_step_names_the_key(bad):
  with pytest.raises(ValueError, match="launch_step"):
    LoRADashLinear(nnx.Linear(8, 5, rngs=nnx.Rngs(0)), rank=2, alpha=2.0, launch_step=bad,
                   rngs=nnx.Rngs(1))  # fmt: skip
  with pytest.raises(ValueError, match="launch_step"):
    validate_dash_config(4, bad)


def test_other_bad_inputs():
  with pytest.raises(ValueError, match="'down_proj'.*num_directions"):  # min(12, 6) = 6 < 7
    _model(s=7)
  with pytest.raises(ValueError, match="delta_w"):
    select_task_directions(jnp.ones((8, 5)), jnp.ones((5, 8)), 2)
  validate_dash_config(5, 0, 5, 9)  # s = min(d_in, d_out) and t = 0 are allowed
