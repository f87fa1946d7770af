"""inject_lora on a toy NNX tree: nested modules, nnx.List, nnx.Dict, plain lists via nnx.data."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from anlr_jax.nn.inject import (
    PAPER_TARGET_MODULES,
    get_submodule,
    inject_lora,
    iter_lora_layers,
    lora_state,
    merge_all,
    unmerge_all,
)
from anlr_jax.nn.lora import LoRALinear

D = 8


class Attention(nnx.Module):

  def __init__(self, rngs):
    self.q_proj = nnx.Linear(D, D, rngs=rngs)
    self.k_proj = nnx.Linear(D, 4, use_bias=False, rngs=rngs)
    self.v_proj = nnx.Linear(D, 4, use_bias=False, rngs=rngs)
    self.o_proj = nnx.Linear(4, D, use_bias=False, rngs=rngs)

  def __call__(self, x):
    return self.o_proj(jax.nn.tanh(self.k_proj(x)) * self.v_proj(x)) + self.q_proj(x)


class MLP(nnx.Module):

  def __init__(self, rngs):
    self.up_proj = nnx.Linear(D, 12, use_bias=False, rngs=rngs)
    self.down_proj = nnx.Linear(12, D, use_bias=False, rngs=rngs)

  def __call__(self, x):
    return self.down_proj(jax.nn.gelu(self.up_proj(x)))


class Block(nnx.Module):

  def __init__(self, rngs):
    self.self_attn = Attention(rngs)
    self.mlp = MLP(rngs)
    self.norm = nnx.LayerNorm(D, rngs=rngs)

  def __call__(self, x):
    return x + self.mlp(self.norm(x + self.self_attn(x)))


class ToyModel(nnx.Module):

  def __init__(self, rngs, n_layers=2):
    self.layers = nnx.List([Block(rngs) for _ in range(n_layers)])
    self.extras = nnx.data([nnx.Linear(D, D, rngs=rngs)])  # plain list, attribute name is an index
    self.heads = nnx.Dict(q_proj=nnx.Linear(D, D, rngs=rngs))
    self.lm_head = nnx.Linear(D, 3, rngs=rngs)

  def __call__(self, x):
    for layer in self.layers:
      x = layer(x)
    return self.lm_head(self.extras[0](x) + self.heads["q_proj"](x))


def _x():
  return jax.random.normal(jax.random.key(0), (5, D))


def test_paper_target_modules():
  assert PAPER_TARGET_MODULES == ("q_proj", "k_proj", "v_proj", "up_proj", "down_proj")


def test_inject_replaces_exactly_the_targets_and_keeps_output():
  model = ToyModel(nnx.Rngs(0))
  y0 = model(_x())
  kernel_q0 = np.asarray(model.layers[1].self_attn.q_proj.kernel[...])
  returned = inject_lora(model, rank=2, alpha=4.0, rngs=nnx.Rngs(1))
  assert returned is model
  paths = [p for p, _ in iter_lora_layers(model)]
  expected = sorted(
      [f"layers.{i}.self_attn.{n}" for i in range(2) for n in ("q_proj", "k_proj", "v_proj")]
      + [f"layers.{i}.mlp.{n}" for i in range(2) for n in ("up_proj", "down_proj")]
      + ["heads.q_proj"]
  )
  assert paths == expected
  assert type(model.layers[0].self_attn.o_proj) is nnx.Linear
  assert type(model.lm_head) is nnx.Linear and type(model.extras[0]) is nnx.Linear
  layer = model.layers[1].self_attn.q_proj
  assert isinstance(layer, LoRALinear) and layer.scale == 2.0 and layer.dropout.rate == 0.05
  chex.assert_trees_all_equal(layer.base.kernel[...], kernel_q0)
  chex.assert_trees_all_close(model(_x()), y0, atol=1e-6)
  assert get_submodule(model, ("heads", "q_proj")) is model.heads["q_proj"]


def test_lora_state_contains_exactly_the_adapters():
  model = inject_lora(
      ToyModel(nnx.Rngs(0)),
      target_modules=("q_proj", "up_proj"),
      rank=3,
      alpha=3.0,
      use_dora=True,
      rngs=nnx.Rngs(1),
  )
  flat = {".".join(map(str, path)): v for path, v in nnx.to_flat_state(lora_state(model))}
  expected = set()
  for prefix in [
      "layers.0.self_attn.q_proj",
      "layers.1.self_attn.q_proj",
      "layers.0.mlp.up_proj",
      "layers.1.mlp.up_proj",
      "heads.q_proj",
  ]:
    expected |= {f"{prefix}.lora_a", f"{prefix}.lora_b", f"{prefix}.lora_magnitude"}
  assert set(flat) == expected
  assert all(isinstance(v, nnx.LoRAParam) for v in flat.values())
  assert flat["layers.0.mlp.up_proj.lora_a"].shape == (D, 3)
  assert flat["layers.0.mlp.up_proj.lora_b"].shape == (3, 12)
  # Base weights stay plain Params, outside the LoRA filter.
  non_lora = nnx.state(model, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam)))
  assert all(not isinstance(v, nnx.LoRAParam) for _, v in nnx.to_flat_state(non_lora))


def test_unknown_target_raises_naming_it():
  with pytest.raises(ValueError, match="gate_proj"):
    inject_lora(
        ToyModel(nnx.Rngs(0)),
        target_modules=("q_proj", "gate_proj"),
        rank=2,
        alpha=2.0,
        rngs=nnx.Rngs(1),
    )
  with pytest.raises(ValueError, match="norm"):  # a name that exists but is not an nnx.Linear
    inject_lora(
        ToyModel(nnx.Rngs(0)), target_modules=("norm",), rank=2, alpha=2.0, rngs=nnx.Rngs(1)
    )
  with pytest.raises(ValueError, match="string"):
    inject_lora(ToyModel(nnx.Rngs(0)), target_modules="q_proj", rank=2, alpha=2.0, rngs=nnx.Rngs(1))
  model = inject_lora(
      ToyModel(nnx.Rngs(0)), target_modules=("q_proj",), rank=2, alpha=2.0, rngs=nnx.Rngs(1)
  )
  with pytest.raises(ValueError, match="already holds a LoRALinear"):
    inject_lora(model, target_modules=("q_proj",), rank=2, alpha=2.0, rngs=nnx.Rngs(1))


@pytest.mark.parametrize("kind", ["lora", "loradash", "adalora"])
def test_every_injector_checks_its_targets_alike_and_shares_the_dropout_default(kind):
  """inject_lora, inject_loradash and inject_adalora validate target_modules in one place
  (target_linears) and default to the paper's dropout 0.05, the run config's lora.dropout."""
  import inspect

  from anlr_jax.app.config import RunConfig
  from anlr_jax.nn import inject_adalora, inject_loradash

  inject = {"lora": inject_lora, "loradash": inject_loradash, "adalora": inject_adalora}[kind]
  kwargs = dict(rank=2, alpha=2.0, rngs=nnx.Rngs(1))
  if kind == "loradash":
    kwargs.update(num_directions=2)
  for targets, message in [
      ("q_proj", "the string 'q_proj'"),
      ((), "target_modules is empty"),
      (("q_proj", "gate_proj"), r"\['gate_proj'\] match no nnx.Linear"),
  ]:
    with pytest.raises(ValueError, match=message):
      inject(ToyModel(nnx.Rngs(0)), target_modules=targets, **kwargs)
  model = inject(ToyModel(nnx.Rngs(0)), target_modules=("q_proj",), **kwargs)
  with pytest.raises(ValueError, match="already holds a .*injected once per model"):
    inject(model, target_modules=("q_proj",), **kwargs)
  default = inspect.signature(inject).parameters["dropout"].default
  assert default == RunConfig().lora.dropout == 0.05


def test_train_eval_modes_reach_injected_dropout():
  model = inject_lora(ToyModel(nnx.Rngs(0)), rank=2, alpha=2.0, dropout=0.5, rngs=nnx.Rngs(1))
  assert all(layer.dropout.deterministic for _, layer in iter_lora_layers(model))
  model.train()
  assert not any(layer.dropout.deterministic for _, layer in iter_lora_layers(model))
  model.eval()
  assert all(layer.dropout.deterministic for _, layer in iter_lora_layers(model))


def test_training_touches_only_adapters_and_merge_all_roundtrip():
  model = inject_lora(ToyModel(nnx.Rngs(0)), rank=2, alpha=4.0, use_dora=True, rngs=nnx.Rngs(1))
  frozen_before = nnx.state(model, nnx.Not(nnx.LoRAParam))
  optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.LoRAParam)
  x, target = _x(), jnp.ones((5, 3))

  @nnx.jit
  def step(model, optimizer):
    loss_fn = lambda m: jnp.mean((m(x) - target) ** 2)
    loss, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, nnx.LoRAParam))(model)
    optimizer.update(model, grads)
    return loss

  losses = [float(step(model, optimizer)) for _ in range(5)]
  assert losses[-1] < losses[0]
  chex.assert_trees_all_equal(nnx.state(model, nnx.Not(nnx.LoRAParam)), frozen_before)
  y = model(x)
  merge_all(model)
  chex.assert_trees_all_close(model(x), y, atol=1e-5, rtol=1e-5)
  unmerge_all(model)
  before = dict(nnx.to_flat_state(frozen_before))
  for path, layer in iter_lora_layers(model):
    key = tuple(int(p) if p.isdigit() else p for p in path.split(".")) + ("base", "kernel")
    chex.assert_trees_all_close(layer.base.kernel[...], before[key][...], atol=1e-6, rtol=1e-5)
