"""LoRALinear against NumPy (from the equations) and against PEFT/torch for DoRA gradients."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from anlr_jax.nn.lora import LoRALinear, lora_scale

D_IN, D_OUT = 6, 5
VARIANTS = [
    dict(),
    dict(use_rslora=True),
    dict(init="pissa"),
    dict(init="milora"),
    dict(use_dora=True),
    dict(use_dora=True, init="pissa"),
]


def _linear(seed=0, use_bias=True, d_in=D_IN, d_out=D_OUT):
  lin = nnx.Linear(d_in, d_out, use_bias=use_bias, rngs=nnx.Rngs(seed))
  if use_bias:
    lin.bias[...] = jax.random.normal(jax.random.key(seed + 100), (d_out,))
  return lin


def _x(n=7, d_in=D_IN, seed=3):
  return jax.random.normal(jax.random.key(seed), (n, d_in))


def _randomise_adapter(layer, seed=5):
  """Give B (and DoRA's magnitude) non-trivial values so the update is not zero."""
  k1, k2 = jax.random.split(jax.random.key(seed))
  layer.lora_b[...] = 0.3 * jax.random.normal(k1, layer.lora_b.shape)
  if layer.use_dora:
    layer.lora_magnitude[...] = layer.lora_magnitude[...] * (
        1.0 + 0.2 * jax.random.normal(k2, layer.lora_magnitude.shape)
    )


@pytest.mark.parametrize(
    "kwargs", VARIANTS, ids=lambda k: "-".join(f"{a}={b}" for a, b in k.items()) or "lora"
)
def test_output_unchanged_at_init(kwargs):
  base = _linear()
  w0, b0 = np.asarray(base.kernel[...]), np.asarray(base.bias[...])
  x = _x()
  layer = LoRALinear(base, rank=3, alpha=8.0, rngs=nnx.Rngs(1), **kwargs)
  chex.assert_trees_all_close(layer(x), np.asarray(x) @ w0 + b0, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "kwargs", VARIANTS, ids=lambda k: "-".join(f"{a}={b}" for a, b in k.items()) or "lora"
)
def test_merge_unmerge_roundtrip(kwargs):
  layer = LoRALinear(_linear(), rank=3, alpha=8.0, rngs=nnx.Rngs(1), **kwargs)
  _randomise_adapter(layer)
  x = _x()
  y_adapter = layer(x)
  w_before = np.asarray(layer.base.kernel[...])
  merged = np.asarray(layer.merged_kernel())
  # merged_kernel reproduces the forward as a plain linear layer.
  chex.assert_trees_all_close(
      np.asarray(x) @ merged + np.asarray(layer.base.bias[...]), y_adapter, atol=1e-5, rtol=1e-5
  )
  layer.merge()
  assert layer.merged
  assert not np.allclose(np.asarray(layer.base.kernel[...]), w_before, atol=1e-3)
  chex.assert_trees_all_close(layer(x), y_adapter, atol=1e-5, rtol=1e-5)
  chex.assert_trees_all_close(layer.merged_kernel(), merged)
  with pytest.raises(ValueError, match="already merged"):
    layer.merge()
  layer.unmerge()
  assert not layer.merged
  chex.assert_trees_all_close(layer.base.kernel[...], w_before, atol=1e-6, rtol=1e-5)
  chex.assert_trees_all_close(layer(x), y_adapter, atol=1e-5, rtol=1e-5)
  with pytest.raises(ValueError, match="not merged"):
    layer.unmerge()


def _dora_numpy(x, x_ad, w0, bias, a, b, m, scale):
  """DoRA forward from the equations (float64)."""
  x, x_ad, w0, a, b, m = (np.asarray(t, np.float64) for t in (x, x_ad, w0, a, b, m))
  norm = np.linalg.norm(w0 + scale * a @ b, axis=0)
  factor = m / norm
  return x @ w0 + bias + (factor - 1.0) * (x_ad @ w0) + factor * scale * (x_ad @ a @ b)


def test_dora_forward_matches_numpy_eval_and_train():
  layer = LoRALinear(_linear(), rank=2, alpha=3.0, dropout=0.4, use_dora=True, rngs=nnx.Rngs(7))
  _randomise_adapter(layer)
  x = _x()
  args = (
      np.asarray(layer.base.kernel[...]),
      np.asarray(layer.base.bias[...]),
      layer.lora_a[...],
      layer.lora_b[...],
      layer.lora_magnitude[...],
      layer.scale,
  )
  # Eval: no dropout; equals b + (m/n) (x W0 + c x A B).
  expected = _dora_numpy(x, x, *args)
  chex.assert_trees_all_close(layer(x), expected, atol=1e-5, rtol=1e-5)
  w0 = np.asarray(args[0], np.float64)
  factor = np.asarray(args[4]) / np.linalg.norm(
      w0 + args[5] * np.asarray(args[2]) @ np.asarray(args[3]), axis=0
  )
  alt = args[1] + factor * (
      np.asarray(x) @ w0 + args[5] * np.asarray(x) @ np.asarray(args[2]) @ np.asarray(args[3])
  )
  chex.assert_trees_all_close(layer(x), alt, atol=1e-5, rtol=1e-5)
  # Train: the adapter path and the DoRA correction see the dropped input, the base does not.
  layer.train()
  x_dropped = nnx.clone(layer).dropout(x)  # same RNG state -> same mask as the next call
  assert np.any(np.asarray(x_dropped) == 0.0)
  chex.assert_trees_all_close(layer(x), _dora_numpy(x, x_dropped, *args), atol=1e-5, rtol=1e-5)


def test_dora_gradients_match_peft():
  from peft import LoraConfig, get_peft_model

  layer = LoRALinear(_linear(), rank=2, alpha=3.0, use_dora=True, rngs=nnx.Rngs(7))
  _randomise_adapter(layer)
  x = _x()

  class Wrap(torch.nn.Module):

    def __init__(self):
      super().__init__()
      self.proj = torch.nn.Linear(D_IN, D_OUT)

    def forward(self, t):
      return self.proj(t)

  torch_model = Wrap()
  with torch.no_grad():
    torch_model.proj.weight.copy_(torch.tensor(np.asarray(layer.base.kernel[...]).T))
    torch_model.proj.bias.copy_(torch.tensor(np.asarray(layer.base.bias[...])))
  peft_model = get_peft_model(
      torch_model, LoraConfig(r=2, lora_alpha=3.0, target_modules=["proj"], use_dora=True)
  )
  proj = peft_model.base_model.model.proj
  with torch.no_grad():
    proj.lora_A["default"].weight.copy_(torch.tensor(np.asarray(layer.lora_a[...]).T))
    proj.lora_B["default"].weight.copy_(torch.tensor(np.asarray(layer.lora_b[...]).T))
    proj.lora_magnitude_vector["default"].weight.copy_(
        torch.tensor(np.asarray(layer.lora_magnitude[...]))
    )
  xt = torch.tensor(np.asarray(x))
  torch_out = peft_model(xt)
  (torch_out**2).sum().backward()

  grads = nnx.grad(lambda m: jnp.sum(m(x) ** 2), argnums=nnx.DiffState(0, nnx.LoRAParam))(layer)
  chex.assert_trees_all_close(layer(x), torch_out.detach().numpy(), atol=1e-5, rtol=1e-5)
  chex.assert_trees_all_close(
      grads["lora_a"][...], proj.lora_A["default"].weight.grad.numpy().T, atol=1e-4, rtol=1e-4
  )
  chex.assert_trees_all_close(
      grads["lora_b"][...], proj.lora_B["default"].weight.grad.numpy().T, atol=1e-4, rtol=1e-4
  )
  chex.assert_trees_all_close(
      grads["lora_magnitude"][...],
      proj.lora_magnitude_vector["default"].weight.grad.numpy(),
      atol=1e-4,
      rtol=1e-4,
  )


@pytest.mark.parametrize("rank,alpha", [(1, 2.0), (4, 16.0), (3, 5.0)])
def test_rslora_scale(rank, alpha):
  assert lora_scale(rank, alpha, use_rslora=True) == pytest.approx(alpha / math.sqrt(rank))
  assert lora_scale(rank, alpha, use_rslora=False) == pytest.approx(alpha / rank)
  layer = LoRALinear(_linear(), rank=rank, alpha=alpha, use_rslora=True, rngs=nnx.Rngs(2))
  assert layer.scale == pytest.approx(alpha / math.sqrt(rank))
  _randomise_adapter(layer)
  x = _x()
  a, b = np.asarray(layer.lora_a[...]), np.asarray(layer.lora_b[...])
  expected = np.asarray(layer.base(x)) + alpha / math.sqrt(rank) * np.asarray(x) @ a @ b
  chex.assert_trees_all_close(layer(x), expected, atol=1e-5, rtol=1e-5)


def test_dropout_only_in_train_mode_and_only_on_adapter_input():
  layer = LoRALinear(_linear(), rank=2, alpha=2.0, dropout=0.5, rngs=nnx.Rngs(4))
  _randomise_adapter(layer)
  x = jax.random.normal(jax.random.key(9), (64, D_IN))
  a, b = np.asarray(layer.lora_a[...]), np.asarray(layer.lora_b[...])
  base_out = np.asarray(layer.base(x))
  no_dropout = base_out + layer.scale * np.asarray(x) @ a @ b
  # Created in eval mode: deterministic, no dropout.
  chex.assert_trees_all_close(layer(x), no_dropout, atol=1e-5, rtol=1e-5)
  chex.assert_trees_all_close(layer(x), layer(x))
  layer.train()
  x_dropped = np.asarray(nnx.clone(layer).dropout(x))
  zero_fraction = np.mean(x_dropped == 0.0)
  assert 0.35 < zero_fraction < 0.65
  kept = x_dropped != 0.0
  chex.assert_trees_all_close(x_dropped[kept], 2.0 * np.asarray(x)[kept], rtol=1e-6)
  y_train = np.asarray(layer(x))
  chex.assert_trees_all_close(
      y_train, base_out + layer.scale * x_dropped @ a @ b, atol=1e-5, rtol=1e-5
  )
  assert not np.allclose(y_train, no_dropout, atol=1e-3)
  assert not np.allclose(np.asarray(layer(x)), y_train, atol=1e-3)  # a fresh mask each call
  layer.eval()
  chex.assert_trees_all_close(layer(x), no_dropout, atol=1e-5, rtol=1e-5)
  layer.train()
  layer.dropout.rngs = None  # a dropout without a stream of its own: nnx's own one-line error
  with pytest.raises(ValueError, match="no `rngs` argument was provided to Dropout"):
    layer(x)


@pytest.mark.parametrize("init", ["pissa", "milora"])
def test_svd_inits_pick_top_or_bottom_triplets(init):
  rank, alpha = 2, 4.0
  base = _linear(use_bias=False)
  w0 = np.asarray(base.kernel[...], np.float64)
  layer = LoRALinear(base, rank=rank, alpha=alpha, init=init, rngs=nnx.Rngs(1))
  u, s, vt = np.linalg.svd(w0, full_matrices=False)
  idx = slice(0, rank) if init == "pissa" else slice(len(s) - rank, len(s))
  rest = np.ones(len(s), bool)
  rest[idx] = False
  truncation = (u[:, idx] * s[idx]) @ vt[idx]
  a, b = np.asarray(layer.lora_a[...]), np.asarray(layer.lora_b[...])
  scale = alpha / rank
  chex.assert_trees_all_close(scale * a @ b, truncation, atol=1e-5)
  # A and B share the singular values equally: A^T A = B B^T = diag(S_I / c).
  chex.assert_trees_all_close(a.T @ a, np.diag(s[idx] / scale), atol=1e-5)
  chex.assert_trees_all_close(b @ b.T, np.diag(s[idx] / scale), atol=1e-5)
  residual = np.asarray(layer.base.kernel[...])
  chex.assert_trees_all_close(residual, w0 - truncation, atol=1e-5)
  chex.assert_trees_all_close(
      np.linalg.svd(residual, compute_uv=False)[: rest.sum()], s[rest], atol=1e-5
  )
  chex.assert_trees_all_close(layer.init_lora_a[...], a)
  chex.assert_trees_all_close(layer.init_lora_b[...], b)


def test_default_init_is_kaiming_uniform_and_zero_b():
  d_in, rank = 64, 32
  layer = LoRALinear(_linear(d_in=d_in, d_out=8), rank=rank, alpha=1.0, rngs=nnx.Rngs(11))
  a = np.asarray(layer.lora_a[...])
  bound = 1.0 / math.sqrt(d_in)  # torch kaiming_uniform_(a=sqrt(5)) on an (r, d_in) weight
  assert a.shape == (d_in, rank) and a.dtype == np.float32
  assert np.all(np.abs(a) <= bound) and np.max(np.abs(a)) > 0.95 * bound
  assert abs(np.var(a) - bound**2 / 3.0) < 0.1 * bound**2 / 3.0
  chex.assert_trees_all_equal(layer.lora_b[...], np.zeros((rank, 8), np.float32))
  torch_w = torch.empty(rank, d_in)
  torch.nn.init.kaiming_uniform_(torch_w, a=math.sqrt(5))
  assert float(torch_w.abs().max()) <= bound + 1e-7


def test_only_adapter_params_are_lora_params_and_trained():
  import optax

  layer = LoRALinear(_linear(), rank=2, alpha=2.0, use_dora=True, rngs=nnx.Rngs(1))
  assert set(nnx.state(layer, nnx.LoRAParam).keys()) == {"lora_a", "lora_b", "lora_magnitude"}
  kernel_before = np.asarray(layer.base.kernel[...])
  optimizer = nnx.Optimizer(layer, optax.adamw(1e-2), wrt=nnx.LoRAParam)
  x = _x()

  @nnx.jit
  def step(layer, optimizer):
    grads = nnx.grad(
        lambda m: jnp.mean((m(x) - 1.0) ** 2), argnums=nnx.DiffState(0, nnx.LoRAParam)
    )(layer)
    optimizer.update(layer, grads)

  step(layer, optimizer)
  chex.assert_trees_all_equal(layer.base.kernel[...], kernel_before)
  assert np.max(np.abs(np.asarray(layer.lora_b[...]))) > 1e-3  # B starts at 0; Adam moves it by ~lr


def test_dtype_preserved_under_jit_bf16_base():
  base = nnx.Linear(D_IN, D_OUT, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  layer = LoRALinear(base, rank=2, alpha=2.0, rngs=nnx.Rngs(1))
  assert layer.lora_a.dtype == jnp.float32
  y = nnx.jit(lambda m, x: m(x))(layer, _x().astype(jnp.bfloat16))
  assert y.dtype == jnp.bfloat16
  assert layer.merged_kernel().dtype == jnp.bfloat16


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(rank=0, alpha=1.0), "rank"),
        (dict(rank=2, alpha=-1.0), "alpha"),
        (dict(rank=2, alpha=1.0, dropout=1.0), "dropout"),
        (dict(rank=2, alpha=1.0, init="olora"), "init"),
        (dict(rank=9, alpha=1.0, init="pissa"), "rank=9"),
    ],
)
def test_bad_arguments_raise_naming_them(kwargs, match):
  with pytest.raises(ValueError, match=match):
    LoRALinear(_linear(), rngs=nnx.Rngs(0), **kwargs)
  with pytest.raises(TypeError, match="base"):
    LoRALinear(nnx.Dropout(0.1), rank=1, alpha=1.0, rngs=nnx.Rngs(0))


def test_logical_axis_names_follow_the_kernel():
  base = nnx.Linear(
      D_IN,
      D_OUT,
      kernel_metadata={"out_sharding": ("embed", "mlp"), "eager_sharding": False},
      rngs=nnx.Rngs(0),
  )
  layer = LoRALinear(base, rank=2, alpha=2.0, use_dora=True, init="pissa", rngs=nnx.Rngs(1))
  assert layer.lora_a.get_metadata()["out_sharding"] == ("embed", None)
  assert layer.lora_b.get_metadata()["out_sharding"] == (None, "mlp")
  assert layer.lora_magnitude.get_metadata()["out_sharding"] == ("mlp",)
  with nnx.logical_axis_rules([("embed", "fsdp"), ("mlp", "tp")]):
    spec = nnx.get_partition_spec(nnx.state(layer, nnx.LoRAParam))
  assert tuple(spec["lora_a"].get_value()) == ("fsdp", None)
  assert tuple(spec["lora_b"].get_value()) == (None, "tp")
  plain = LoRALinear(_linear(), rank=2, alpha=2.0, rngs=nnx.Rngs(1))
  assert "out_sharding" not in plain.lora_a.get_metadata()


@pytest.mark.parametrize("custom_backward", [True, False])
def test_low_rank_product_gradients_match_numpy(custom_backward):
  """The hand-written backward of (x A) B against the gradients written out in NumPy."""
  from anlr_jax.nn.lora import low_rank_product

  kx, ka, kb, kw = jax.random.split(jax.random.key(0), 4)
  x = jax.random.normal(kx, (2, 3, 6))  # leading axes are flattened to tokens
  a = jax.random.normal(ka, (6, 4))
  b = jax.random.normal(kb, (4, 5))
  w = jax.random.normal(kw, (2, 3, 5))  # loss = sum(w * (x A) B)

  def loss(x, a, b):
    y = low_rank_product(x, a, b, precision="highest", custom_backward=custom_backward)
    return jnp.sum(w * y)

  y = low_rank_product(x, a, b, custom_backward=custom_backward)
  dx, da, db = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, a, b)
  xn, an, bn, wn = (np.asarray(v, np.float64) for v in (x, a, b, w))
  x2, w2 = xn.reshape(-1, 6), wn.reshape(-1, 5)
  np.testing.assert_allclose(np.asarray(y), (xn @ an) @ bn, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(
      np.asarray(dx), (w2 @ bn.T @ an.T).reshape(2, 3, 6), rtol=1e-4, atol=1e-5
  )
  np.testing.assert_allclose(np.asarray(da), x2.T @ (w2 @ bn.T), rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(np.asarray(db), (x2 @ an).T @ w2, rtol=1e-4, atol=1e-5)


def test_low_rank_product_bf16_gradients_keep_dtypes():
  from anlr_jax.nn.lora import low_rank_product

  x = jnp.ones((3, 6), jnp.bfloat16)
  a, b = jnp.ones((6, 2), jnp.bfloat16), jnp.ones((2, 4), jnp.bfloat16)
  grads = jax.grad(lambda *v: jnp.sum(low_rank_product(*v).astype(jnp.float32)), (0, 1, 2))(x, a, b)
  assert [g.dtype for g in grads] == [jnp.bfloat16] * 3
  np.testing.assert_allclose(np.asarray(grads[1], np.float32), np.full((6, 2), 12.0))


def test_forward_mode_autodiff_with_the_hand_written_backward_off():
  """``custom_backward = False`` routes the adapter through automatic differentiation, so
  ``jax.jacfwd`` works (on the CPU the default hand-written backward allows reverse mode only) and
  agrees with ``jax.jacrev`` through the default path."""
  layer = LoRALinear(_linear(), rank=3, alpha=6.0, rngs=nnx.Rngs(1))
  _randomise_adapter(layer)
  x = _x(n=4)
  graphdef, lora, rest = nnx.split(layer, nnx.LoRAParam, ...)

  lora = nnx.to_pure_dict(lora)

  def f(a, flag):
    layer = nnx.merge(graphdef, {**lora, "lora_a": a}, rest)
    layer.custom_backward = flag
    return layer(x)

  a = lora["lora_a"]
  forward = jax.jacfwd(lambda a: f(a, False))(a)
  reverse = jax.jacrev(lambda a: f(a, None))(a)
  np.testing.assert_allclose(np.asarray(forward), np.asarray(reverse), rtol=1e-5, atol=1e-6)
  assert float(jnp.max(jnp.abs(forward))) > 0
