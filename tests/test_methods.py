"""The method table: every method builds and trains; optimizers match optax / NumPy references."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import anlr_jax
from anlr_jax.methods import METHOD_NAMES, METHODS, get_method, method_optimizer
from anlr_jax.nn import inject_lora, iter_lora_layers

PAPER_METHODS = (
    "lora",
    "rslora",
    "loraplus",
    "anlr",
    "pissa",
    "milora",
    "dora",
    "anlr+pissa",
    "anlr+milora",
    "anlr+dora",
    "anlr-velocity",
    "anlr-snr",
    "random",
    "sensitivity",
)
BASELINES = ("adalora", "lorapro", "loradash", "anlr+loradash")  # test_methods_more_baselines.py


class TwoProj(nnx.Module):

  def __init__(self, rngs):
    self.q_proj = nnx.Linear(8, 6, rngs=rngs)
    self.v_proj = nnx.Linear(6, 8, rngs=rngs)

  def __call__(self, x):
    return self.v_proj(jnp.tanh(self.q_proj(x)))


def test_table_holds_exactly_the_documented_methods():
  assert set(METHOD_NAMES) == set(PAPER_METHODS) | set(BASELINES)
  assert get_method("anlr+dora").use_dora and get_method("anlr+dora").optimizer == "anlr"
  assert get_method("anlr+pissa").init == "pissa" and get_method("anlr+milora").init == "milora"
  assert get_method("rslora").use_rslora and get_method("lora").optimizer == "adamw"
  assert {get_method(n).signal for n in ("anlr-velocity", "anlr-snr", "random", "sensitivity")} == {
      "velocity",
      "snr",
      "random",
      "sensitivity",
  }
  assert all(
      get_method(n).signal in anlr_jax.SIGNALS for n in METHOD_NAMES if get_method(n).uses_anlr
  )


def test_layer_optimizer_and_signal_are_enums_that_keep_their_names():
  from anlr_jax.methods import Layer, Method, Optimizer
  from anlr_jax.optim import Signal

  spec = get_method("anlr+loradash")
  assert spec.layer is Layer.LORADASH and spec.optimizer is Optimizer.ANLR
  assert spec.signal is Signal.ANLR and (spec.layer, spec.optimizer) == ("loradash", "anlr")
  assert Method("m", "by name", optimizer="loraplus").optimizer is Optimizer.LORAPLUS
  with pytest.raises(ValueError, match="bogus"):
    Method("m", "a bad optimizer", optimizer="bogus")


def test_unknown_method_lists_the_allowed_ones():
  with pytest.raises(ValueError, match="unknown method 'qlora'.*anlr\\+dora.*sensitivity"):
    get_method("qlora")
  with pytest.raises(ValueError, match="unknown method"):
    method_optimizer("qlora", 1e-3)
  with pytest.raises(ValueError, match="anlr_kwargs has unknown keys \\['gamma'\\]"):
    method_optimizer("anlr", 1e-3, anlr_kwargs={"gamma": 1.0})


@pytest.mark.parametrize("name", PAPER_METHODS)
def test_every_method_injects_its_layers_and_trains(name):
  method = METHODS[name]
  model = inject_lora(
      TwoProj(nnx.Rngs(0)),
      target_modules=("q_proj", "v_proj"),
      rank=2,
      alpha=4.0,
      dropout=0.0,
      rngs=nnx.Rngs(1),
      **method.lora_kwargs(),
  )
  layers = dict(iter_lora_layers(model))
  assert set(layers) == {"q_proj", "v_proj"}
  for layer in layers.values():
    assert (layer.init, layer.use_rslora, layer.use_dora) == (
        method.init,
        method.use_rslora,
        method.use_dora,
    )
    assert hasattr(layer, "lora_magnitude") == method.use_dora
  tx = method_optimizer(name, 1e-2, anlr_kwargs={"warmup_steps": 0})
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)
  x = jax.random.normal(jax.random.key(0), (4, 8))
  before = jax.tree.map(jnp.copy, nnx.state(model, nnx.LoRAParam))

  def loss_fn(m):
    return jnp.mean((m(x) - 1.0) ** 2)

  losses = []
  for _ in range(3):
    loss, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, nnx.LoRAParam))(model)
    optimizer.update(model, grads)
    losses.append(float(loss))
  assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
  after = nnx.state(model, nnx.LoRAParam)
  assert any(
      np.abs(np.asarray(a) - np.asarray(b)).max() > 0
      for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after))
  )
  if method.uses_anlr:
    state = anlr_jax.find_anlr_state(optimizer.opt_state)
    assert int(state.count) == 3 and set(state.multipliers) == {"q_proj", "v_proj"}
  else:
    with pytest.raises(ValueError, match="AnLRState"):
      anlr_jax.find_anlr_state(optimizer.opt_state)


# ------------------------------------------------------------------ optimizer references
D_IN, R, D_OUT = 7, 4, 5


def _params_and_grads():
  keys = jax.random.split(jax.random.key(3), 4)
  params = {
      "q": {
          "lora_a": jax.random.normal(keys[0], (D_IN, R)),
          "lora_b": jax.random.normal(keys[1], (R, D_OUT)),
      }
  }
  grads = [
      {
          "q": {
              "lora_a": jax.random.normal(k, (D_IN, R)) * (1 + jnp.arange(R)),
              "lora_b": jax.random.normal(jax.random.fold_in(k, 1), (R, D_OUT)),
          }
      }
      for k in keys[2:]
  ]
  return params, grads


def _run(tx, params, grads):
  state, updates = tx.init(params), []
  for g in grads:
    u, state = tx.update(g, state, params)
    updates.append(u)
    params = optax.apply_updates(params, u)
  return updates, state, params


def test_lora_is_clipped_adamw():
  params, grads = _params_and_grads()
  ours, _, _ = _run(method_optimizer("lora", 1e-2, clip_norm=0.5, weight_decay=0.1), params, grads)
  ref, _, _ = _run(
      optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2, weight_decay=0.1)),
      params,
      grads,
  )
  chex.assert_trees_all_close(ours, ref, atol=1e-7, rtol=1e-6)
  # Tracked for diagnostics: the same updates, plus per-rank statistics in the state.
  tracked, state, _ = _run(
      method_optimizer("lora", 1e-2, clip_norm=0.5, weight_decay=0.1, track_rank_stats=True),
      params,
      grads,
  )
  chex.assert_trees_all_close(tracked, ref, atol=1e-7, rtol=1e-6)
  d = anlr_jax.diagnostics(state)
  assert float(d["modules"]["q"]["velocity_max_min"]) > 1.0
  chex.assert_trees_all_close(d["modules"]["q"]["multipliers"], jnp.ones(R))


def test_loraplus_scales_only_b():
  params, grads = _params_and_grads()
  ours, _, _ = _run(method_optimizer("loraplus", 1e-2, clip_norm=None, lr_ratio=4.0), params, grads)
  ref, _, _ = _run(optax.adamw(1e-2, weight_decay=0.0), params, grads)
  for o, r in zip(ours, ref):
    chex.assert_trees_all_close(o["q"]["lora_a"], r["q"]["lora_a"], atol=1e-7, rtol=1e-6)
    chex.assert_trees_all_close(o["q"]["lora_b"], 4.0 * r["q"]["lora_b"], atol=1e-7, rtol=1e-6)


def test_loraplus_peft_layout_scales_lora_B_only():
  """lora_dims=PEFT: lora_B (d_out, r) gets lr_ratio x the AdamW update, lora_A (r, d_in) and other
  leaves exactly AdamW's; with the Flax layout no PEFT factor is found or scaled."""
  rng = np.random.default_rng(4)
  f32 = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  params = {
      "q_proj": {"lora_A": {"weight": f32(R, D_IN)}, "lora_B": {"weight": f32(D_OUT, R)}},
      "stack": {"lora_A": f32(3, R, D_IN), "lora_B": f32(3, D_OUT, R)},  # stacked, no 'weight'
      "bias": f32(D_OUT),
  }
  ratio = 4.0  # a power of two: the scaled update is exactly representable
  kw = dict(weight_decay=0.1)
  ours = anlr_jax.loraplus(1e-2, lr_ratio=ratio, lora_dims=anlr_jax.PEFT, **kw)
  flax_dims = anlr_jax.loraplus(
      1e-2, lr_ratio=ratio, lora_dims=anlr_jax.FLAX, require_lora=False, **kw
  )
  ref = optax.adamw(1e-2, **kw)
  states = [t.init(params) for t in (ours, flax_dims, ref)]
  p = params
  for _ in range(3):
    g = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), jnp.float32), params)
    (u, s0), (u_flax, s1), (u_ref, s2) = (
        t.update(g, st, p) for t, st in zip((ours, flax_dims, ref), states)
    )
    states = [s0, s1, s2]
    for name in ("q_proj", "stack"):
      chex.assert_trees_all_equal(u[name]["lora_A"], u_ref[name]["lora_A"])
      chex.assert_trees_all_equal(
          u[name]["lora_B"], jax.tree.map(lambda x: ratio * x, u_ref[name]["lora_B"])
      )
    chex.assert_trees_all_equal(u["bias"], u_ref["bias"])
    chex.assert_trees_all_equal(u_flax, u_ref)  # lora_A/lora_B are not Flax names: plain AdamW
    p = optax.apply_updates(p, u)  # the same parameters for every optimizer (weight decay)


def _numpy_multipliers(params2, grads, *, alpha, beta, kappa, b1=0.9, b2=0.999, eps=1e-8):
  """docs/method.md steps 2-6 at update t=2 with rho=0 (EMA = current velocity), in float64 NumPy."""
  a, b = (np.asarray(params2["q"][k], np.float64) for k in ("lora_a", "lora_b"))
  g1, g2 = ({k: np.asarray(g["q"][k], np.float64) for k in ("lora_a", "lora_b")} for g in grads)
  ga, gb = g2["lora_a"], g2["lora_b"]
  nu = np.sqrt(
      np.maximum(
          (ga**2).sum(0) * (b**2).sum(1)
          + (a**2).sum(0) * (gb**2).sum(1)
          + 2 * (ga * a).sum(0) * (b * gb).sum(1),
          0.0,
      )
  )
  direction = {}
  for k in ("lora_a", "lora_b"):
    m = b1 * (1 - b1) * g1[k] + (1 - b1) * g2[k]
    v = b2 * (1 - b2) * g1[k] ** 2 + (1 - b2) * g2[k] ** 2
    m_hat, v_hat = m / (1 - b1**2), v / (1 - b2**2)
    direction[k] = m_hat / (np.sqrt(v_hat) + eps)
  snr = np.sqrt((direction["lora_a"] ** 2).sum(0) + (direction["lora_b"] ** 2).sum(1))
  log_s = alpha * np.log(1.0 / (nu / nu.mean())) + beta * np.log(snr / snr.mean())
  s = np.exp(np.clip(log_s, -np.log(kappa), np.log(kappa)))
  return s / s.mean()


@pytest.mark.parametrize(
    "name, alpha, beta", [("anlr", 2.0, 1.0), ("anlr-velocity", 2.0, 0.0), ("anlr-snr", 0.0, 1.0)]
)
def test_anlr_methods_multipliers_match_numpy(name, alpha, beta):
  params, grads = _params_and_grads()
  knobs = dict(alpha=2.0, beta=1.0, kappa=3.0, rho=0.0, warmup_steps=0)
  tx = method_optimizer(name, 1e-2, clip_norm=None, anlr_kwargs=knobs)
  state, p = tx.init(params), params
  u, state = tx.update(grads[0], state, p)
  p2 = optax.apply_updates(p, u)
  _, state = tx.update(grads[1], state, p2)
  got = np.asarray(anlr_jax.find_anlr_state(state).multipliers["q"])
  want = _numpy_multipliers(p2, grads, alpha=alpha, beta=beta, kappa=3.0)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
  assert np.abs(got - 1.0).max() > 1e-3  # the multipliers are not trivially uniform


def test_random_control_differs_from_the_fused_rule_and_stays_in_range():
  params, grads = _params_and_grads()
  knobs = dict(kappa=3.0, rho=0.0, warmup_steps=0)
  _, state, _ = _run(
      method_optimizer("random", 1e-2, clip_norm=None, anlr_kwargs=knobs), params, grads
  )
  s = np.asarray(anlr_jax.find_anlr_state(state).multipliers["q"])
  np.testing.assert_allclose(s.mean(), 1.0, rtol=1e-5)
  assert s.min() >= 1 / 9 - 1e-6 and s.max() <= 9 + 1e-6
  _, fused, _ = _run(
      method_optimizer("anlr", 1e-2, clip_norm=None, anlr_kwargs=knobs), params, grads
  )
  assert np.abs(s - np.asarray(anlr_jax.find_anlr_state(fused).multipliers["q"])).max() > 1e-3


def test_the_benchmarks_optimizers_come_from_the_method_assembly(monkeypatch):
  """benchmarks/common.jax_optimizer builds through method_optimizer, which hands AnLR its
  batch_modules (anlr-unbatched: False)."""
  import anlr_jax.methods as methods_module
  from benchmarks.common import jax_optimizer

  seen = []
  real = methods_module.anlr
  monkeypatch.setattr(
      methods_module, "anlr", lambda *a, **kw: seen.append(kw["batch_modules"]) or real(*a, **kw)
  )
  jax_optimizer("anlr")
  jax_optimizer("anlr-unbatched")
  jax_optimizer("anlr", batch_modules=True)
  assert seen == [None, False, True]
  params = {"w": jnp.ones((3,))}
  grads = {"w": jnp.full((3,), 0.5)}
  tx, ref = jax_optimizer("adamw"), optax.adamw(1e-4, weight_decay=0.01)
  got, _ = tx.update(grads, tx.init(params), params)
  want, _ = ref.update(grads, ref.init(params), params)
  chex.assert_trees_all_close(got, want)
  with pytest.raises(ValueError, match="must be one of"):
    jax_optimizer("sgd")
