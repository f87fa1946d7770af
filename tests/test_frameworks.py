"""AnLR on the JAX ecosystem's LoRA trees: Qwix (einsum, conv), PEFT files, Equinox, quax, optax
composition; factors with several feature axes against the NumPy reference; never a silent AdamW."""

import re
import warnings

import chex
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import qwix
from flax import nnx

import anlr_jax
from anlr_jax.optim.detect import UnpairedFactorsWarning
from anlr_jax.train import stack_layers
from tests import numpy_anlr

# Every tree here that AnLR trains is found whole: a leaf named like a LoRA factor left out warns.
pytestmark = pytest.mark.filterwarnings("error::anlr_jax.optim.detect.UnpairedFactorsWarning")

HP = dict(b1=0.9, b2=0.99, eps=1e-8, weight_decay=0.05)
ANLR = dict(alpha=2.0, beta=1.0, kappa=3.0, rho=0.8)

# (A shape, B shape, batch axes): Qwix on nnx.Einsum ('BTD,NDH->BTNH' and 'BTNH,NHD->BTD'), on
# nnx.Conv (3x3 kernel, 3 input channels), and the second one stacked over 3 layers.
MULTI_AXIS = {
    "q_einsum": ((16, 4), (4, 2, 8), 0),
    "o_einsum": ((2, 8, 4), (4, 16), 0),
    "conv": ((3, 3, 3, 4), (4, 8), 0),
    "stacked_o": ((3, 2, 8, 4), (3, 4, 16), 1),
}


def _to_2d(x, n_batch, rank_last):
  """A factor with its feature axes flattened: ``(*batch, prod(in), r)`` or ``(*batch, r, prod)``."""
  batch = x.shape[:n_batch]
  return (
      x.reshape(batch + (-1, x.shape[-1]))
      if rank_last
      else x.reshape(batch + (x.shape[n_batch], -1))
  )


@pytest.mark.parametrize("batch_modules", [False, True])
def test_multi_axis_factors_match_numpy_reference_on_the_2d_reshape(batch_modules):
  """Qwix-shaped factors (several feature axes) follow the NumPy reference run on the same factors
  reshaped to 2-D, step for step (12 steps, warmup 3), multipliers included."""
  rng = np.random.default_rng(0)
  with jax.enable_x64(True):
    params = {
        name: {"w_lora_a": rng.normal(size=sa), "w_lora_b": 0.3 * rng.normal(size=sb)}
        for name, (sa, sb, _) in MULTI_AXIS.items()
    }
    params["bias"] = rng.normal(size=(5,))
    flat2d = lambda tree: {  # noqa: E731
        **{
            f"{n}/{k}": _to_2d(np.asarray(tree[n][k]), nb, k.endswith("_a"))
            for n, (_, _, nb) in MULTI_AXIS.items()
            for k in ("w_lora_a", "w_lora_b")
        },
        "bias": np.asarray(tree["bias"]),
    }
    modules = {f"{n}.w": (f"{n}/w_lora_a", f"{n}/w_lora_b") for n in MULTI_AXIS}
    ref = numpy_anlr.NumpyAnLR(
        flat2d(params),
        modules,
        lr=lambda t: 1e-2,
        b1=HP["b1"],
        b2=HP["b2"],
        eps=HP["eps"],
        wd=HP["weight_decay"],
        warmup=3,
        **ANLR,
    )
    tx = anlr_jax.anlr(1e-2, **HP, **ANLR, warmup_steps=3, batch_modules=batch_modules)
    state = tx.init(params)
    update = jax.jit(tx.update)
    ref_params = flat2d(params)
    for step in range(12):
      grads = jax.tree.map(lambda x: rng.normal(size=x.shape) * (1 + (x.ndim > 1)), params)
      updates, state = update(grads, state, params)
      params = optax.apply_updates(params, updates)
      ref_params = ref.step(ref_params, flat2d(grads))
      got = flat2d(params)
      for key in got:
        np.testing.assert_allclose(got[key], ref_params[key], rtol=1e-7, atol=1e-12, err_msg=key)
      for name in modules:
        np.testing.assert_allclose(np.asarray(state.multipliers[name]), ref.last_s[name], rtol=1e-9)
    assert step >= 3 and all(np.ptp(np.asarray(s)) > 1e-3 for s in state.multipliers.values())
    assert state.multipliers["stacked_o.w"].shape == (3, 4)


def test_find_lora_modules_axes_of_multi_axis_and_stacked_factors():
  tree = {
      n: {"w_lora_a": jax.ShapeDtypeStruct(sa, jnp.float32), "w_lora_b": jnp.zeros(sb)}
      for n, (sa, sb, _) in MULTI_AXIS.items()
  }
  got = {
      m.name: (m.rank, m.a_feature_axis, m.b_feature_axis) for m in anlr_jax.find_lora_modules(tree)
  }
  assert got == {
      "q_einsum.w": (4, -2, (-2, -1)),
      "o_einsum.w": (4, (-3, -2), -1),
      "conv.w": (4, (-4, -3, -2), -1),
      "stacked_o.w": (4, (-3, -2), -1),
  }
  # a rank that no split of the axes gives is an error naming the module
  with pytest.raises(ValueError, match=r"'q_einsum.w'.*rank axes disagree"):
    anlr_jax.find_lora_modules(
        {"q_einsum": {"w_lora_a": jnp.zeros((16, 4)), "w_lora_b": jnp.zeros((3, 8))}}
    )


class _Block(nnx.Module):
  """nnx.Conv, nnx.Einsum (two output axes), nnx.Linear and nnx.LinearGeneral."""

  def __init__(self, rngs):
    self.conv = nnx.Conv(3, 8, kernel_size=(3, 3), rngs=rngs)
    self.q = nnx.Einsum("btd,dnh->btnh", (8, 2, 4), rngs=rngs)
    self.up = nnx.Linear(8, 16, rngs=rngs)
    self.out = nnx.LinearGeneral(16, (2, 8), rngs=rngs)

  def __call__(self, x):  # x (b, 4, 4, 3)
    h = self.conv(x).reshape(x.shape[0], 16, 8)
    h = self.q(h).reshape(x.shape[0], 16, 8)
    return self.out(self.up(jax.nn.gelu(h))).reshape(x.shape[0], 16, 16)


def test_qwix_lora_on_linear_einsum_and_conv_trains_with_nnx_optimizer():
  """Qwix's ``<weight>_lora_a``/``_lora_b`` are found with no lora_dims, einsum and conv included,
  and every module gets multipliers != 1 after warmup inside nnx.Optimizer; base weights frozen."""
  x = jax.random.normal(jax.random.key(0), (2, 4, 4, 3))
  y = jax.random.normal(jax.random.key(1), (2, 16, 16))
  model = qwix.apply_lora_to_model(
      _Block(nnx.Rngs(0)),
      qwix.LoraProvider(module_path=".*", rank=4, alpha=4.0),
      x,
      rngs=nnx.Rngs(1),
  )
  lora = nnx.state(model, nnx.LoRAParam)
  ranks = {m.name: m.rank for m in anlr_jax.find_lora_modules(lora)}
  assert ranks == {"conv.kernel": 4, "q.kernel": 4, "up.kernel": 4, "out.kernel": 4}
  text = anlr_jax.describe(lora).splitlines()
  assert text[0] == "4 LoRA modules (per-rank multipliers), 0 leaves on plain AdamW"
  assert "  conv.kernel  A (3, 3, 3, 4)  B (4, 8)  rank 4" in text
  assert "  q.kernel  A (8, 4)  B (4, 2, 4)  rank 4" in text
  optimizer = nnx.Optimizer(model, anlr_jax.anlr(1e-2, warmup_steps=3), wrt=nnx.LoRAParam)
  frozen = nnx.state(model, nnx.Param)

  @nnx.jit
  def step(model, optimizer):
    loss = lambda m: jnp.mean((m(x) - y) ** 2)  # noqa: E731
    grads = nnx.grad(loss, argnums=nnx.DiffState(0, nnx.LoRAParam))(model)
    optimizer.update(model, grads)

  for _ in range(8):
    step(model, optimizer)
  s = anlr_jax.find_anlr_state(optimizer.opt_state)
  assert sorted(s.multipliers) == sorted(ranks)
  for name, mult in s.multipliers.items():
    assert np.ptp(np.asarray(mult[...])) > 1e-3, name
  chex.assert_trees_all_equal(nnx.state(model, nnx.Param), frozen)  # the base weights stay frozen


def test_peft_adapter_file_as_flat_dotted_dict():
  """The flat dict ``safetensors`` loads from a PEFT adapter (``...q_proj.lora_A.weight``) is found
  with no lora_dims, under PEFT's module names."""
  torch = pytest.importorskip("torch")
  peft = pytest.importorskip("peft")
  from safetensors.flax import load_file

  class Net(torch.nn.Module):

    def __init__(self):
      super().__init__()
      self.q_proj = torch.nn.Linear(6, 5)
      self.v_proj = torch.nn.Linear(6, 7)

    def forward(self, x):
      return self.q_proj(x) + self.v_proj(x)[..., :5]

  net = peft.get_peft_model(Net(), peft.LoraConfig(r=3, target_modules=["q_proj", "v_proj"]))
  import tempfile

  with tempfile.TemporaryDirectory() as tmp:
    net.save_pretrained(tmp)
    params = load_file(f"{tmp}/adapter_model.safetensors")
  modules = {m.name: m.rank for m in anlr_jax.find_lora_modules(params)}
  assert modules == {"base_model.model.q_proj": 3, "base_model.model.v_proj": 3}
  tx = anlr_jax.anlr(1e-2, warmup_steps=0)
  state = tx.init(params)
  grads = jax.tree.map(lambda p: jax.random.normal(jax.random.key(p.size), p.shape), params)
  updates, state = jax.jit(tx.update)(grads, state, params)
  assert all(np.ptp(np.asarray(s)) > 1e-4 for s in state.multipliers.values())


class _EqxLoraLinear(eqx.Module):
  weight: jax.Array
  lora_A: jax.Array  # (r, d_in), PEFT layout
  lora_B: jax.Array  # (d_out, r)

  def __call__(self, x):
    return x @ self.weight.T + (x @ self.lora_A.T) @ self.lora_B.T


def test_equinox_module_with_peft_fields_equals_the_flax_layout_run():
  """An Equinox module with ``lora_A``/``lora_B`` fields trains without lora_dims, exactly as the
  same factors transposed to the Flax layout."""
  k = jax.random.split(jax.random.key(0), 4)
  model = _EqxLoraLinear(
      jax.random.normal(k[0], (5, 6)),
      jax.random.normal(k[1], (3, 6)),
      0.1 * jax.random.normal(k[2], (5, 3)),
  )
  x, y = jax.random.normal(k[3], (8, 6)), jnp.ones((8, 5))
  lora_only = eqx.tree_at(lambda m: m.weight, model, replace=None)  # the trainable part
  tx = anlr_jax.anlr(1e-2, warmup_steps=2)
  state = tx.init(lora_only)

  def loss(lora, frozen):
    return jnp.mean((eqx.combine(lora, frozen)(x) - y) ** 2)

  frozen = eqx.tree_at(lambda m: (m.lora_A, m.lora_B), model, replace=(None, None))
  flax_params = {"lora_a": lora_only.lora_A.T, "lora_b": lora_only.lora_B.T}
  flax_tx = anlr_jax.anlr(1e-2, warmup_steps=2, lora_dims=anlr_jax.FLAX)
  flax_state = flax_tx.init(flax_params)

  @jax.jit
  def step(lora, state, flax_params, flax_state):
    grads = jax.grad(loss)(lora, frozen)
    updates, state = tx.update(grads, state, lora)
    flax_grads = {"lora_a": grads.lora_A.T, "lora_b": grads.lora_B.T}
    flax_updates, flax_state = flax_tx.update(flax_grads, flax_state, flax_params)
    return (
        eqx.apply_updates(lora, updates),
        state,
        optax.apply_updates(flax_params, flax_updates),
        flax_state,
    )

  for _ in range(6):
    lora_only, state, flax_params, flax_state = step(lora_only, state, flax_params, flax_state)
  np.testing.assert_allclose(lora_only.lora_A.T, flax_params["lora_a"], rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(lora_only.lora_B.T, flax_params["lora_b"], rtol=1e-5, atol=1e-7)
  (mult,) = state.multipliers.values()
  assert np.ptp(np.asarray(mult)) > 1e-3
  np.testing.assert_allclose(mult, flax_state.multipliers[""], rtol=1e-5)


class _EqxTorchLayoutLora(eqx.Module):
  """A LoRA layer in torch's layout under Flax's names: ``lora_a (r, d_in)``, ``lora_b (d_out, r)``."""

  weight: jax.Array | None
  lora_a: jax.Array
  lora_b: jax.Array

  def __call__(self, x):
    return x @ self.weight.T + (x @ self.lora_a.T) @ self.lora_b.T


def _spec_in(message: str):
  """The last ``lora_dims=...`` of an error or warning (the one it proposes), evaluated."""
  found = re.findall(r"lora_dims=(\[.*\]|anlr_jax\.\w+(?:\([^)]*\))?)", message)
  return eval(found[-1])


@pytest.mark.parametrize("stacked", [False, True], ids=["layer", "stacked"])
def test_square_layer_in_torch_layout_under_flax_names_is_refused_naming_peft(stacked):
  """A square 16x16 layer's rank-4 factors in torch's layout under ``lora_a``/``lora_b`` also fit
  Flax's layout, as rank 16 over 4 features: ``describe`` and ``init`` refuse, naming the module and
  PEFT's axes; the spec they propose pairs the rank-4 module."""
  k = jax.random.split(jax.random.key(0), 2)
  batch = (3,) if stacked else ()
  layer = _EqxTorchLayoutLora(
      None, jax.random.normal(k[0], batch + (4, 16)), jax.random.normal(k[1], batch + (16, 4))
  )
  params = {"blocks": [layer]}
  pattern = (
      r"LoRA module 'blocks\.0': lora_a \(.*4, 16\) and lora_b \(.*16, 4\) pair with rank 16 in the "
      r"layout of lora_dims=anlr_jax\.FLAX.*anlr_jax\.PEFT's axes"
  )
  with pytest.raises(ValueError, match=pattern):
    anlr_jax.describe(params)
  with pytest.raises(ValueError, match=pattern) as err:
    anlr_jax.anlr(1e-3).init(params)
  assert "\n" not in str(err.value)
  spec = _spec_in(str(err.value))
  assert spec == anlr_jax.LoraDims("lora_a", "lora_b", a_rank_axis=-2, b_rank_axis=-1)
  state = anlr_jax.anlr(1e-3, lora_dims=spec).init(params)
  assert {n: m.shape for n, m in state.multipliers.items()} == {"blocks.0": batch + (4,)}
  assert (
      anlr_jax.describe(params, spec)
      .splitlines()[1]
      .endswith("A (3, 4, 16)  B (3, 16, 4)  rank 4  x3 stacked" if stacked else "rank 4")
  )


def test_shapes_that_fit_both_layouts_are_read_by_their_low_rank():
  """Factors of a square layer fit both layouts; the one the names give is kept when it is the
  low-rank reading, refused when the other is, and a full-rank square module reads the same either
  way. Factors only one layout pairs are kept whatever their rank."""
  z = jnp.zeros
  flax_square = {"q": {"lora_a": z((16, 4)), "lora_b": z((4, 16))}}
  assert [m.rank for m in anlr_jax.find_lora_modules(flax_square)] == [4]
  peft_square = {"q": {"lora_A": z((4, 16)), "lora_B": z((16, 4))}}
  assert [m.rank for m in anlr_jax.find_lora_modules(peft_square)] == [4]
  full_rank = {"q": {"lora_a": z((4, 4)), "lora_b": z((4, 4))}}
  assert [m.rank for m in anlr_jax.find_lora_modules(full_rank)] == [4]
  wide = {"q": {"lora_a": z((7, 8)), "lora_b": z((8, 2))}}  # only Flax's axes pair these
  assert [m.rank for m in anlr_jax.find_lora_modules(wide)] == [8]
  flax_under_peft_names = {"q": {"lora_A": z((16, 4)), "lora_B": z((4, 16))}}
  with pytest.raises(ValueError, match=r"'q': lora_A \(16, 4\).*rank 16.*anlr_jax\.PEFT,") as err:
    anlr_jax.find_lora_modules(flax_under_peft_names)
  spec = _spec_in(str(err.value))
  assert spec == anlr_jax.LoraDims("lora_A", "lora_B", a_rank_axis=-1, b_rank_axis=-2)
  assert [m.rank for m in anlr_jax.find_lora_modules(flax_under_peft_names, spec)] == [4]
  qwix_square = {"q": {"kernel_lora_a": z((2, 8, 16)), "kernel_lora_b": z((2, 16, 8))}}
  with pytest.raises(ValueError, match=r"'q\.kernel'.*rank 16.*a_rank_axis=-2, b_rank_axis=-1"):
    anlr_jax.find_lora_modules(qwix_square)


@pytest.mark.parametrize(
    "make",
    [
        lambda **kw: anlr_jax.anlr(1e-3, **kw),
        lambda **kw: anlr_jax.scale_by_anlr(optax.adamw(1e-3), **kw),
        lambda **kw: anlr_jax.loraplus(1e-3, **kw),
    ],
    ids=["anlr", "scale_by_anlr", "loraplus"],
)
def test_factors_left_out_of_the_modules_found_warn_once_at_init(make):
  """A tree where Flax's ``lora_a``/``lora_b`` are found but ``lora_down``/``lora_up``,
  ``w_down``/``w_up`` and quax's ``a``/``b`` are not warns once at ``init``, naming those leaves and a
  ``lora_dims`` that pairs them all; with it, nothing is left out and nothing warns."""
  z = jnp.zeros
  params = {
      "q": {"lora_a": z((8, 2)), "lora_b": z((2, 8))},
      "k": {"lora_down": {"weight": z((2, 8))}, "lora_up": {"weight": z((8, 2))}},
      "v": {"w_down": z((8, 2)), "w_up": z((2, 8)), "bias": z(8)},
      "o": {"a": z((8, 2)), "b": z((2, 8))},
      "head": {"kernel": z((8, 8)), "bias": z(8)},
  }
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    make().init(params)
  (warning,) = [w for w in caught if issubclass(w.category, UnpairedFactorsWarning)]
  msg = str(warning.message)
  assert "\n" not in msg and "1 LoRA module found" in msg and "plain AdamW" in msg
  for leaf in ("k.lora_down.weight (2, 8)", "k.lora_up.weight (8, 2)", "v.w_down (8, 2)"):
    assert leaf in msg
  assert "o.a (8, 2)" in msg and "o.b (2, 8)" in msg
  assert "head" not in msg and "v.bias" not in msg
  spec = _spec_in(msg)
  assert spec == [
      anlr_jax.FLAX,
      anlr_jax.LoraDims("lora_down", "lora_up", a_rank_axis=-2, b_rank_axis=-1),
      anlr_jax.QUAX,
      anlr_jax.LoraDims("w_down", "w_up", a_rank_axis=-1, b_rank_axis=-2),
  ]
  with warnings.catch_warnings():
    warnings.simplefilter("error", UnpairedFactorsWarning)
    make(lora_dims=spec).init(params)
  assert {m.name: m.rank for m in anlr_jax.find_lora_modules(params, spec)} == {
      "q": 2,
      "k": 2,
      "v": 2,
      "o": 2,
  }


def test_lookalikes_no_preset_pairs_cleanly_warn_with_the_general_form():
  """A lone ``lora`` leaf, and quax's ``a``/``b`` next to a head whose bias is named ``b`` (where
  ``anlr_jax.QUAX`` would pair the bias too): the warning names them and the general form."""
  z = jnp.zeros
  params = {
      "q": {"lora_a": z((8, 2)), "lora_b": z((2, 8)), "lora_scale_table": z((2, 2))},
      "o": {"a": z((8, 2)), "b": z((2, 8))},
      "head": {"w": z((8, 8)), "b": z(8)},
  }
  with pytest.warns(UnpairedFactorsWarning) as record:
    anlr_jax.anlr(1e-3).init(params)
  msg = str(record[0].message)
  assert "o.a (8, 2), o.b (2, 8), q.lora_scale_table (2, 2);" in msg and "head" not in msg
  assert msg.endswith(
      "lora_dims=[anlr_jax.FLAX, anlr_jax.LoraDims(a_name, b_name, a_rank_axis, b_rank_axis)]), "
      "or a prefix pytree of LoraDims/None where names clash"
  )


def test_the_quickstart_model_and_nnx_lora_trees_warn_of_nothing():
  """The LoRA of the packaged model (q/k/v/up/down, DoRA's magnitudes too) and of ``nnx.LoRA``
  are found whole: no warning (this module turns one into an error)."""
  from anlr_jax import assets
  from anlr_jax.models import load_hf_model
  from anlr_jax.nn import inject_lora

  model, _ = load_hf_model(assets.quickstart_dir())
  inject_lora(model, rank=8, alpha=16.0, dropout=0.0, use_dora=True, rngs=nnx.Rngs(0))
  lora = nnx.state(model, nnx.LoRAParam)
  assert len(anlr_jax.anlr(1e-3).init(lora).multipliers) >= 5
  # the trainer's stacked layout: each magnitude is (layers, d_out), two axes, still not a factor
  stacked = stack_layers(nnx.to_pure_dict(lora))
  assert len(anlr_jax.anlr(1e-3).init(stacked).multipliers) == 5
  layer = nnx.LoRA(16, 4, 8, rngs=nnx.Rngs(0))
  assert len(anlr_jax.anlr(1e-3).init(nnx.state(layer, nnx.LoRAParam)).multipliers) == 1


def test_quax_lora_array_needs_the_preset_and_the_error_names_it():
  """quax's ``LoraArray`` (``a``, ``b``) is not guessed: init fails naming its leaves and
  ``lora_dims=anlr_jax.QUAX``, which then finds every adapted layer."""
  pytest.importorskip("quax")
  from quax.examples import lora as quax_lora

  mlp = eqx.nn.MLP(4, 3, 8, depth=2, key=jax.random.key(0))
  adapted = quax_lora.loraify(mlp, rank=2, key=jax.random.key(1))
  is_lora = lambda x: isinstance(x, quax_lora.LoraArray)  # noqa: E731
  params = jax.tree.map(
      lambda x: {"a": x.a, "b": x.b} if is_lora(x) else None, adapted, is_leaf=is_lora
  )
  with pytest.raises(
      ValueError, match=r"no LoRA module found.*layers\.0\.weight\.a.*anlr_jax\.QUAX \(3 modules\)"
  ):
    anlr_jax.anlr(1e-3).init(params)
  tx = anlr_jax.anlr(1e-3, lora_dims=anlr_jax.QUAX)
  assert len(tx.init(params).multipliers) == 3


@pytest.mark.parametrize(
    "make",
    [
        lambda **kw: anlr_jax.anlr(1e-3, **kw),
        lambda **kw: anlr_jax.scale_by_anlr(optax.adamw(1e-3), **kw),
        lambda **kw: anlr_jax.loraplus(1e-3, **kw),
    ],
    ids=["anlr", "scale_by_anlr", "loraplus"],
)
def test_no_lora_module_is_an_error_at_init_unless_opted_out(make):
  params = {
      "attn": {"q": {"kernel": jnp.ones((4, 4)), "lora_down": jnp.ones((2, 4))}},
      "head": jnp.ones((4, 2)),
  }
  with pytest.raises(ValueError) as err:
    make().init(params)
  msg = str(err.value)
  assert "\n" not in msg and "no LoRA module found" in msg and "plain AdamW" in msg
  assert "attn.q.lora_down (2, 4)" in msg and "require_lora=False" in msg
  assert "head" not in msg  # only the lookalikes are named
  state = make(require_lora=False).init(params)
  grads = jax.tree.map(jnp.ones_like, params)
  updates, _ = make(require_lora=False).update(grads, state, params)
  ref, _ = optax.adamw(1e-3, weight_decay=1e-4).update(
      grads, optax.adamw(1e-3).init(params), params
  )
  chex.assert_trees_all_close(updates, ref)  # no LoRA: exactly optax.adamw


def test_no_lora_and_no_lookalike_says_so():
  with pytest.raises(ValueError, match=r"no leaf looks like a LoRA factor \(2 leaves\).*LoraDims"):
    anlr_jax.anlr(1e-3).init({"w": jnp.ones((3, 3)), "b": jnp.ones(3)})


def test_describe_lists_modules_ranks_stacking_and_plain_leaves():
  params = {
      "layers": {"q": {"lora_a": jnp.zeros((2, 8, 4)), "lora_b": jnp.zeros((2, 4, 6))}},
      "mlp": {"kernel_lora_a": jnp.zeros((6, 3)), "kernel_lora_b": jnp.zeros((3, 5))},
      "head": {"kernel": jnp.zeros((6, 2)), "bias": jnp.zeros(2)},
  }
  assert anlr_jax.describe(params).splitlines() == [
      "2 LoRA modules (per-rank multipliers), 2 leaves on plain AdamW",
      "  layers.q  A (2, 8, 4)  B (2, 4, 6)  rank 4  x2 stacked",
      "  mlp.kernel  A (6, 3)  B (3, 5)  rank 3",
      "plain AdamW: head.bias (2,), head.kernel (6, 2)",
  ]


def _lora_and_head(seed):
  rng = np.random.default_rng(seed)
  f = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)  # noqa: E731
  return {
      "lora": {"q": {"lora_a": f(6, 4), "lora_b": 0.3 * f(4, 5)}},
      "head": {"kernel": f(5, 3), "bias": f(3)},
  }


@pytest.mark.parametrize("compose", ["multi_transform", "masked"])
def test_anlr_on_the_lora_subtree_another_optimizer_on_the_head(compose):
  """``optax.multi_transform`` / ``optax.masked`` with AnLR on the LoRA subtree and SGD on the
  head equal the two optimizers run apart on their subtrees."""
  params = _lora_and_head(0)
  anlr_tx, sgd = anlr_jax.anlr(1e-2, warmup_steps=2), optax.sgd(0.1)
  labels = {
      "lora": jax.tree.map(lambda _: "lora", params["lora"]),
      "head": {"kernel": "head", "bias": "head"},
  }
  if compose == "multi_transform":
    tx = optax.multi_transform({"lora": anlr_tx, "head": sgd}, labels)
  else:
    is_lora = jax.tree.map(lambda l: l == "lora", labels)
    tx = optax.chain(
        optax.masked(anlr_tx, is_lora), optax.masked(sgd, jax.tree.map(lambda m: not m, is_lora))
    )
  state = tx.init(params)
  ref_lora, ref_head = params["lora"], params["head"]
  ref_state, sgd_state = anlr_tx.init(ref_lora), sgd.init(ref_head)
  rng = np.random.default_rng(1)
  for _ in range(6):
    grads = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), x.dtype), params)
    updates, state = jax.jit(tx.update)(grads, state, params)
    params = optax.apply_updates(params, updates)
    u, ref_state = anlr_tx.update(grads["lora"], ref_state, ref_lora)
    ref_lora = optax.apply_updates(ref_lora, u)
    u, sgd_state = sgd.update(grads["head"], sgd_state, ref_head)
    ref_head = optax.apply_updates(ref_head, u)
  chex.assert_trees_all_close(params, {"lora": ref_lora, "head": ref_head}, rtol=1e-4, atol=1e-6)
  s = anlr_jax.find_anlr_state(state).multipliers["lora.q"]  # named from the whole tree
  np.testing.assert_allclose(s, ref_state.multipliers["q"], rtol=1e-5)
  assert np.ptp(np.asarray(s)) > 1e-3


def test_inject_hyperparams_learning_rate_changed_mid_run_equals_a_schedule():
  """``optax.inject_hyperparams(anlr)``: setting the learning rate in the state mid-run gives the
  same trajectory as anlr with the equivalent piecewise-constant schedule."""
  params = _lora_and_head(2)
  tx = optax.inject_hyperparams(anlr_jax.anlr)(learning_rate=1e-2, warmup_steps=2)
  ref_tx = anlr_jax.anlr(optax.piecewise_constant_schedule(1e-2, {5: 0.25}), warmup_steps=2)
  state, ref_state = tx.init(params), ref_tx.init(params)
  ref_params = params
  rng = np.random.default_rng(3)
  update, ref_update = jax.jit(tx.update), jax.jit(ref_tx.update)
  for step in range(10):
    if step == 5:
      state.hyperparams["learning_rate"] = jnp.asarray(2.5e-3)
    grads = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), x.dtype), params)
    updates, state = update(grads, state, params)
    params = optax.apply_updates(params, updates)
    u, ref_state = ref_update(grads, ref_state, ref_params)
    ref_params = optax.apply_updates(ref_params, u)
  chex.assert_trees_all_close(params, ref_params, rtol=1e-4, atol=1e-6)
  assert np.ptp(np.asarray(state.inner_state.multipliers["lora.q"])) > 1e-3


def test_rank_magnitudes_of_multi_axis_factors_equal_the_2d_reshape():
  rng = np.random.default_rng(5)
  tree = {
      n: {
          "w_lora_a": jnp.asarray(rng.normal(size=sa)),
          "w_lora_b": jnp.asarray(rng.normal(size=sb)),
      }
      for n, (sa, sb, _) in MULTI_AXIS.items()
  }
  got = anlr_jax.rank_magnitudes(tree)
  for n, (_, _, nb) in MULTI_AXIS.items():
    a = _to_2d(np.asarray(tree[n]["w_lora_a"]), nb, True)
    b = _to_2d(np.asarray(tree[n]["w_lora_b"]), nb, False)
    expected = np.linalg.norm(a, axis=-2) * np.linalg.norm(b, axis=-1)
    np.testing.assert_allclose(got[f"{n}.w"], expected, rtol=1e-5)


def test_multi_axis_step_compiles_to_no_more_copies_than_the_2d_one():
  """The statistics reduce over several feature axes in place: the compiled update of Qwix-shaped
  factors has no more copy / transpose (or other) instructions than the same factors stored 2-D."""

  def moves(tree):
    tx = anlr_jax.anlr(1e-3, warmup_steps=0)
    hlo = jax.jit(tx.update).lower(tree, tx.init(tree), tree).compile().as_text()
    ops = re.findall(r"= \S+ (\w+)\(", hlo)
    return ops.count("copy") + ops.count("transpose"), len(ops)

  rng = np.random.default_rng(6)
  multi, flat = {}, {}
  for n, (sa, sb, nb) in MULTI_AXIS.items():
    a, b = rng.normal(size=sa).astype(np.float32), rng.normal(size=sb).astype(np.float32)
    multi[n] = {"w_lora_a": a, "w_lora_b": b}
    flat[n] = {"w_lora_a": _to_2d(a, nb, True), "w_lora_b": _to_2d(b, nb, False)}
  (multi_moves, multi_ops), (flat_moves, flat_ops) = moves(multi), moves(flat)
  assert multi_moves <= flat_moves and multi_ops <= flat_ops


def test_describe_docstring_example_runs():
  import doctest

  from anlr_jax.optim import detect

  result = doctest.testmod(detect)
  assert result.attempted >= 3 and result.failed == 0
