"""AdaLoRA (layer, rank allocator, orthogonal regulariser, adapter I/O) against PEFT + torch.

A tiny two-layer model exists twice, in torch (wrapped by ``peft.get_peft_model`` with an
``AdaLoraConfig``) and in Flax NNX (``inject_adalora``), with the same base and adapter weights.
The schedule (total_step=20, tinit=2, tfinal=5, deltaT=2) covers the warm-up, the cubic
budget decrease, the final masking at t = 15 and the final phase.
"""

import copy
import doctest
import json
import math
import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import peft
import pytest
import torch
from flax import nnx
from safetensors.numpy import load_file

from anlr_jax.nn.adalora import (
    AdaLoRALinear,
    export_adalora_adapter,
    import_adalora_adapter,
    inject_adalora,
    iter_adalora_layers,
)
from anlr_jax.nn import adalora as nn_adalora
from anlr_jax.optim import adalora as ada

D_IN, D_HID, D_OUT, R, TARGET_R, ALPHA, ORTH = 8, 6, 5, 4, 2, 8, 0.3
CFG = ada.AdaLoRAConfig(
    init_r=R, target_r=TARGET_R, tinit=2, tfinal=5, deltaT=2, total_step=20, orth_reg_weight=ORTH
)
NAMES = ("lin1", "lin2")
TOL = dict(rtol=1e-5, atol=1e-5)


class TorchTiny(torch.nn.Module):

  def __init__(self):
    super().__init__()
    self.lin1 = torch.nn.Linear(D_IN, D_HID)
    self.lin2 = torch.nn.Linear(D_HID, D_OUT)

  def forward(self, x, y=None):
    out = self.lin2(torch.tanh(self.lin1(x)))
    loss = None if y is None else ((out - y) ** 2).mean()
    return types.SimpleNamespace(out=out, loss=loss)


class NnxTiny(nnx.Module):

  def __init__(self, rngs):
    self.lin1 = nnx.Linear(D_IN, D_HID, rngs=rngs)
    self.lin2 = nnx.Linear(D_HID, D_OUT, rngs=rngs)

  def __call__(self, x):
    return self.lin2(jnp.tanh(self.lin1(x)))


def peft_config(**kw):
  kw = (
      dict(
          init_r=R,
          target_r=TARGET_R,
          tinit=CFG.tinit,
          tfinal=CFG.tfinal,
          deltaT=CFG.deltaT,
          total_step=CFG.total_step,
          orth_reg_weight=ORTH,
          lora_alpha=ALPHA,
          lora_dropout=0.0,
          target_modules=list(NAMES),
      )
      | kw
  )
  return peft.AdaLoraConfig(**kw)


def torch_factors(pm, grad=False):
  """PEFT's adapter tensors (or their .grad) in the Flax layout: {name: {lora_a, lora_e, ...}}."""
  out = {}
  for name in NAMES:
    layer = getattr(pm.base_model.model, name)
    get = (lambda p: p.grad) if grad else (lambda p: p)
    a, e, b = (
        get(getattr(layer, f)["default"]).detach().numpy() for f in ("lora_A", "lora_E", "lora_B")
    )
    out[name] = {"lora_a": a.T.copy(), "lora_e": e[:, 0].copy(), "lora_b": b.T.copy()}
  return out


def set_torch_factors(pm, params):
  with torch.no_grad():
    for name in NAMES:
      layer = getattr(pm.base_model.model, name)
      p = {k: np.asarray(v) for k, v in params[name].items()}
      layer.lora_A["default"].copy_(torch.from_numpy(p["lora_a"].T.copy()))
      layer.lora_E["default"].copy_(torch.from_numpy(p["lora_e"][:, None].copy()))
      layer.lora_B["default"].copy_(torch.from_numpy(p["lora_b"].T.copy()))


def set_jax_factors(model, params):
  for name in NAMES:
    layer = getattr(model, name)
    for f, v in params[name].items():
      getattr(layer, f)[...] = jnp.asarray(v)


def twins(seed=0, random_e=True):
  """``(torch base model, peft model, nnx model)`` with equal base and adapter weights."""
  torch.manual_seed(seed)
  base = TorchTiny()
  torch_base = copy.deepcopy(base)
  pm = peft.get_peft_model(base, peft_config())
  if random_e:
    with torch.no_grad():
      for name in NAMES:
        getattr(pm.base_model.model, name).lora_E["default"].normal_(0.0, 1.0)
  model = NnxTiny(nnx.Rngs(seed))
  for name in NAMES:
    lin = getattr(torch_base, name)
    getattr(model, name).kernel[...] = jnp.asarray(lin.weight.detach().numpy().T)
    getattr(model, name).bias[...] = jnp.asarray(lin.bias.detach().numpy())
  inject_adalora(
      model, target_modules=NAMES, rank=R, alpha=ALPHA, dropout=0.0, rngs=nnx.Rngs(seed + 1)
  )
  set_jax_factors(model, torch_factors(pm))
  return torch_base, pm, model


def data(seed=0, n=7):
  rng = np.random.default_rng(seed)
  return rng.normal(size=(n, D_IN)).astype(np.float32), rng.normal(size=(n, D_OUT)).astype(
      np.float32
  )


def loss_fn(model, x, y):
  return jnp.mean((model(x) - y) ** 2) + ada.orth_regularization(
      nnx.state(model, nnx.LoRAParam), ORTH
  )


def pure(tree):
  return {n: {f: np.asarray(v) for f, v in d.items()} for n, d in tree.items()}


def lora_dict(model):
  return {
      n: {f: np.asarray(getattr(getattr(model, n), f)[...]) for f in ada.FACTOR_NAMES}
      for n in NAMES
  }


# ---------------------------------------------------------------------------- the layer
def test_layer_init_and_forward_match_peft():
  _, pm, model = twins(random_e=False)
  x, _ = data()
  layer = model.lin1
  assert (
      layer.lora_a.shape == (D_IN, R)
      and layer.lora_e.shape == (R,)
      and layer.lora_b.shape == (R, D_HID)
  )
  assert all(isinstance(getattr(layer, f), nnx.LoRAParam) for f in ada.FACTOR_NAMES)
  assert all(getattr(layer, f).dtype == jnp.float32 for f in ada.FACTOR_NAMES)
  # PEFT's init: E = 0 (output unchanged), A and B ~ N(0, 0.02^2); ours has the same law
  fresh = AdaLoRALinear(nnx.Linear(256, 128, rngs=nnx.Rngs(0)), 16, ALPHA, rngs=nnx.Rngs(3))
  assert np.all(np.asarray(fresh.lora_e[...]) == 0)
  for f in ("lora_a", "lora_b"):
    assert abs(float(jnp.std(getattr(fresh, f)[...])) - 0.02) < 1e-3
    assert abs(float(jnp.mean(getattr(fresh, f)[...]))) < 1e-3
  with torch.no_grad():
    ref = pm(torch.from_numpy(x)).out.numpy()
  np.testing.assert_allclose(np.asarray(model(jnp.asarray(x))), ref, **TOL)
  # non-zero E: the SVD-form update, scaled by alpha / (r + 1e-5)
  _, pm, model = twins(seed=1)
  with torch.no_grad():
    ref = pm(torch.from_numpy(x)).out.numpy()
    delta = pm.base_model.model.lin1.get_delta_weight("default").numpy()
  np.testing.assert_allclose(np.asarray(model(jnp.asarray(x))), ref, **TOL)
  np.testing.assert_allclose(np.asarray(model.lin1.delta_kernel()), delta.T, **TOL)
  assert np.abs(delta).max() > 1e-3


def test_layer_errors_and_injection():
  base = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="rank"):
    AdaLoRALinear(base, 0, 8.0, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="alpha"):
    AdaLoRALinear(base, 2, 0.0, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="dropout"):
    AdaLoRALinear(base, 2, 1.0, 1.0, rngs=nnx.Rngs(0))
  model = NnxTiny(nnx.Rngs(0))
  with pytest.raises(ValueError, match="nope"):
    inject_adalora(model, target_modules=("lin1", "nope"), rank=2, alpha=1.0, rngs=nnx.Rngs(0))
  inject_adalora(model, target_modules=("lin2",), rank=2, alpha=1.0, rngs=nnx.Rngs(0))
  assert [p for p, _ in iter_adalora_layers(model)] == ["lin2"]
  assert type(model.lin1) is nnx.Linear


# ---------------------------------------------------------------------------- config, schedule
@pytest.mark.parametrize(
    "kw, key",
    [
        (dict(init_r=4, target_r=5), "target_r"),
        (dict(tinit=10, tfinal=10, total_step=20), "tinit"),
        (dict(tinit=0, tfinal=20, total_step=20), "tfinal"),
        (dict(deltaT=0), "deltaT"),
        (dict(deltaT=-2), "deltaT"),
        (dict(beta1=1.0), "beta1"),
        (dict(beta1=0.0), "beta1"),
        (dict(beta2=1.5), "beta2"),
        (dict(total_step=0), "total_step"),
        (dict(total_step=None), "total_step"),
        (dict(init_r=0), "init_r"),
        (dict(orth_reg_weight=-1.0), "orth_reg_weight"),
    ],
)
def test_config_errors_name_the_key(kw, key):
  with pytest.raises(ValueError, match=key):
    ada.AdaLoRAConfig(**({"total_step": 20} | kw))


def paper_budget(t, b0, bT, ti, tf, T):
  """Zhang et al. (2023), Eq. (12): b(0) in the warm-up, b(T) at the end, cubic decrease between."""
  if t < ti:
    return b0
  if t >= T - tf:
    return bT
  return math.floor(bT + (b0 - bT) * (1 - (t - ti) / (T - ti - tf)) ** 3)


@pytest.mark.parametrize(
    "init_r, target_r, tinit, tfinal, total",
    [
        (4, 2, 2, 5, 20),
        (12, 8, 0, 0, 1000),
        (12, 4, 100, 300, 3000),
        (8, 0, 5, 1, 97),
        (8, 8, 1, 1, 10),
    ],
)
def test_budget_schedule_matches_paper_formula_and_peft(init_r, target_r, tinit, tfinal, total):
  cfg = ada.AdaLoRAConfig(
      init_r=init_r, target_r=target_r, tinit=tinit, tfinal=tfinal, total_step=total
  )
  modules = 3
  b0, bT = init_r * modules, target_r * modules
  steps = range(-1, total + 3)
  ours = [ada.budget_schedule(t, b0, bT, cfg)[0] for t in steps]
  assert ours == [paper_budget(t, b0, bT, tinit, tfinal, total) for t in steps]
  assert all(a >= b for a, b in zip(ours, ours[1:]))  # non-increasing
  # PEFT's RankAllocator on the same budgets (its _set_budget_scheduler needs a model)
  allocator = peft.tuners.adalora.RankAllocator.__new__(peft.tuners.adalora.RankAllocator)
  allocator.peft_config = types.SimpleNamespace(
      tinit=tinit, tfinal=tfinal, total_step=total, deltaT=cfg.deltaT
  )
  allocator.init_bgt, allocator.target_bgt = b0, bT
  for t in range(0, total + 3):
    assert ada.budget_schedule(t, b0, bT, cfg) == allocator.budget_schedule(t)
  # the traced table lookup used inside update_and_allocate
  table = jax.jit(lambda s: ada.budget_at(s, b0, bT, cfg))
  assert [int(table(t)) for t in range(0, total + 3, max(1, total // 50))] == [
      ours[t + 1] for t in range(0, total + 3, max(1, total // 50))
  ]


# ---------------------------------------------------------------------------- orth regulariser
def test_orth_regularization_matches_peft():
  _, pm, model = twins(seed=2)
  x, y = data(2)
  out = pm.base_model(torch.from_numpy(x), torch.from_numpy(y))
  raw = ((out.out - torch.from_numpy(y)) ** 2).mean()
  peft_reg = float((out.loss - raw).detach())
  ours = float(ada.orth_regularization(nnx.state(model, nnx.LoRAParam), ORTH))
  np.testing.assert_allclose(ours, peft_reg, rtol=1e-5)
  # stacked modules count one per slice
  tree = pure(torch_factors(pm))
  stacked = {"s": {f: np.stack([tree["lin1"][f], tree["lin1"][f] * 0.5]) for f in ada.FACTOR_NAMES}}
  split = {"a": tree["lin1"], "b": {f: v * 0.5 for f, v in tree["lin1"].items()}}
  np.testing.assert_allclose(
      float(ada.orth_regularization(stacked, 1.0)),
      float(ada.orth_regularization(split, 1.0)),
      rtol=1e-6,
  )
  g = jax.grad(lambda p: ada.orth_regularization(p))(stacked)
  assert all(np.all(np.isfinite(v)) for v in jax.tree.leaves(g))


# ---------------------------------------------------------------------------- the allocator
def test_allocator_lockstep_with_peft():
  """Identical parameters and gradients every step: same EMAs, budgets, masks and outputs."""
  _, pm, model = twins(seed=3)
  x, y = data(3)
  tx, ty = torch.from_numpy(x), torch.from_numpy(y)
  opt = torch.optim.SGD([p for p in pm.parameters() if p.requires_grad], lr=0.2)
  graphdef, lora, rest = nnx.split(model, nnx.LoRAParam, ...)
  grad_fn = jax.jit(jax.value_and_grad(lambda l: loss_fn(nnx.merge(graphdef, l, rest), x, y)))
  allocate = jax.jit(ada.update_and_allocate, static_argnums=4)
  state = ada.rank_allocator_init(lora_dict(model), CFG)
  ranker = pm.base_model.rankallocator
  budgets, pruned_at = [], {}
  final_start = CFG.total_step - CFG.tfinal
  for step in range(CFG.total_step):
    out = pm.base_model(tx, ty)
    out.loss.backward()
    loss, grads = grad_fn(nnx.state(model, nnx.LoRAParam))
    np.testing.assert_allclose(float(loss), float(out.loss.detach()), rtol=1e-5)
    torch_grads = torch_factors(pm, grad=True)
    for n in NAMES:
      for f in ada.FACTOR_NAMES:
        np.testing.assert_allclose(np.asarray(grads[n][f][...]), torch_grads[n][f], **TOL)
    opt.step()
    updated = torch_factors(pm)  # after the optimizer, before the allocator (PEFT's order)
    params, state, budget = allocate(updated, torch_grads, state, step, CFG)
    pm.base_model.update_and_allocate(step)
    opt.zero_grad()
    after = torch_factors(pm)
    assert int(budget) == ranker.budget_schedule(step)[0]
    budgets.append(int(budget))
    for n in NAMES:
      key = f"{n}.%s.default"
      for f, torch_name in zip(ada.FACTOR_NAMES, ("lora_A", "lora_E", "lora_B")):
        np.testing.assert_allclose(np.asarray(params[n][f]), after[n][f], **TOL)
        if step < final_start:
          p_key = key % torch_name
          ipt = ranker.ipt[p_key].numpy()
          to_flax = (lambda v: v.T) if f != "lora_e" else (lambda v: v[:, 0])
          np.testing.assert_allclose(
              np.asarray(ada.sensitivity(updated[n][f], torch_grads[n][f])), to_flax(ipt), **TOL
          )
          np.testing.assert_allclose(
              np.asarray(state.exp_avg_ipt[n][f]), to_flax(ranker.exp_avg_ipt[p_key].numpy()), **TOL
          )
          np.testing.assert_allclose(
              np.asarray(state.exp_avg_unc[n][f]), to_flax(ranker.exp_avg_unc[p_key].numpy()), **TOL
          )
        else:  # PEFT's reset_ipt() at t = T - tfinal
          assert not ranker.exp_avg_ipt and not np.any(np.asarray(state.exp_avg_ipt[n][f]))
      zero = np.asarray(params[n]["lora_e"]) == 0
      np.testing.assert_array_equal(zero, after[n]["lora_e"] == 0)
      pruned_at[step] = pruned_at.get(step, 0) + int(zero.sum())
      pattern = pm.peft_config["default"].rank_pattern
      if pattern is not None and step >= final_start:
        np.testing.assert_array_equal(np.asarray(state.mask[n]), pattern[f"{n}.lora_E.default"])
    set_jax_factors(model, params)
    with torch.no_grad():
      np.testing.assert_allclose(np.asarray(model(jnp.asarray(x))), pm(tx).out.numpy(), **TOL)
  # every phase was exercised: warm-up, the decrease with masking every deltaT, the final phase
  assert budgets[: CFG.tinit + 1] == [2 * R] * (CFG.tinit + 1)
  assert budgets[final_start:] == [2 * TARGET_R] * CFG.tfinal
  assert len(set(budgets)) > 3
  assert all(pruned_at[t] == 0 for t in range(CFG.tinit + 1))
  assert pruned_at[4] > 0 and all(
      pruned_at[t] == 2 * (R - TARGET_R) for t in range(final_start, 20)
  )
  assert ada.rank_pattern(state) == {
      n: v for n, v in ((n, list(map(bool, np.asarray(state.mask[n])))) for n in NAMES)
  }


# PEFT warns that the AdaLoRA rank_pattern keys ("<module>.lora_E") match no module when it loads
# its own AdaLoRA adapters too (a LoRA-level check); AdaLoRA then resizes the modules by them.
@pytest.mark.filterwarnings("ignore:The following rank_pattern keys:RuntimeWarning")
def test_rank_allocator_transform_end_to_end_matches_peft(tmp_path):
  """Independent trajectories: torch SGD + PEFT vs nnx.Optimizer(rank_allocator(sgd)) in one jit."""
  torch_base, pm, model = twins(seed=4)
  x, y = data(4)
  tx, ty = torch.from_numpy(x), torch.from_numpy(y)
  opt = torch.optim.SGD([p for p in pm.parameters() if p.requires_grad], lr=0.2)
  optimizer = nnx.Optimizer(model, ada.rank_allocator(optax.sgd(0.2), CFG), wrt=nnx.LoRAParam)
  traces = []

  @nnx.jit
  def train_step(model, optimizer):
    traces.append(1)
    grads = nnx.grad(loss_fn)(model, jnp.asarray(x), jnp.asarray(y))
    optimizer.update(model, grads)

  for step in range(CFG.total_step):
    pm.base_model(tx, ty).loss.backward()
    opt.step()
    pm.base_model.update_and_allocate(step)
    opt.zero_grad()
    train_step(model, optimizer)
    ours, ref = lora_dict(model), torch_factors(pm)
    for n in NAMES:
      for f in ada.FACTOR_NAMES:
        np.testing.assert_allclose(ours[n][f], ref[n][f], **TOL)
      np.testing.assert_array_equal(ours[n]["lora_e"] == 0, ref[n]["lora_e"] == 0)
    assert int(optimizer.opt_state.budget) == pm.base_model.rankallocator.budget_schedule(step)[0]
    with torch.no_grad():
      np.testing.assert_allclose(np.asarray(model(jnp.asarray(x))), pm(tx).out.numpy(), **TOL)
  assert len(traces) == 1  # one compiled step for all phases
  assert int(optimizer.opt_state.count) == CFG.total_step
  assert sum(int(np.sum(lora_dict(model)[n]["lora_e"] == 0)) for n in NAMES) == 2 * (R - TARGET_R)

  # export: PEFT's own save and ours hold the same tensors and rank pattern, and load the same
  pattern = ada.rank_pattern(optimizer.opt_state)
  ours_dir, peft_dir = tmp_path / "ours", tmp_path / "peft"
  export_adalora_adapter(model, ours_dir, config=CFG, rank_pattern=pattern, task_type=None)
  pm.save_pretrained(peft_dir)
  ours_t, peft_t = load_file(ours_dir / "adapter_model.safetensors"), load_file(
      peft_dir / "adapter_model.safetensors"
  )
  assert sorted(ours_t) == sorted(peft_t)
  for k in peft_t:
    np.testing.assert_allclose(ours_t[k], peft_t[k], **TOL)
  ours_cfg = json.loads((ours_dir / "adapter_config.json").read_text())
  peft_cfg = json.loads((peft_dir / "adapter_config.json").read_text())
  assert ours_cfg["rank_pattern"] == peft_cfg["rank_pattern"]
  for k in (
      "peft_type",
      "init_r",
      "target_r",
      "tinit",
      "tfinal",
      "deltaT",
      "total_step",
      "lora_alpha",
  ):
    assert ours_cfg[k] == peft_cfg[k], k
  loaded = peft.PeftModel.from_pretrained(copy.deepcopy(torch_base), str(ours_dir))
  assert loaded.base_model.model.lin1.lora_A["default"].shape[0] == sum(pattern["lin1"])
  with torch.no_grad():
    np.testing.assert_allclose(loaded(tx).out.numpy(), np.asarray(model(jnp.asarray(x))), **TOL)
  # import back: same factors (pruned triplets as zero rows), same outputs
  fresh = NnxTiny(nnx.Rngs(0))
  for n in NAMES:
    getattr(fresh, n).kernel[...] = getattr(model, n).base.kernel[...]
    getattr(fresh, n).bias[...] = getattr(model, n).base.bias[...]
  cfg = import_adalora_adapter(fresh, ours_dir)
  assert cfg == CFG
  np.testing.assert_array_equal(
      np.asarray(fresh(jnp.asarray(x))), np.asarray(model(jnp.asarray(x)))
  )
  for n in NAMES:
    keep = np.asarray(pattern[n])
    for f in ada.FACTOR_NAMES:
      got, want = lora_dict(fresh)[n][f], lora_dict(model)[n][f]
      if f == "lora_a":
        got, want = got[:, keep], want[:, keep]
      else:
        got, want = got[keep], want[keep]
      np.testing.assert_array_equal(got, want)
    assert not np.any(lora_dict(fresh)[n]["lora_e"][~keep])


def test_export_without_rank_pattern_loads_in_peft(tmp_path):
  torch_base, pm, model = twins(seed=5)
  x, _ = data(5)
  export_adalora_adapter(model, tmp_path, config=CFG, task_type=None)
  config = json.loads((tmp_path / "adapter_config.json").read_text())
  assert config["rank_pattern"] is None and config["target_modules"] == list(NAMES)
  loaded = peft.PeftModel.from_pretrained(copy.deepcopy(torch_base), str(tmp_path))
  with torch.no_grad():
    np.testing.assert_allclose(
        loaded(torch.from_numpy(x)).out.numpy(), np.asarray(model(jnp.asarray(x))), **TOL
    )
  with pytest.raises(ValueError, match="init_r"):
    export_adalora_adapter(
        model, tmp_path, config=ada.AdaLoRAConfig(init_r=R + 1, target_r=1, total_step=10)
    )
  with pytest.raises(ValueError, match="rank_pattern"):
    export_adalora_adapter(model, tmp_path, config=CFG, rank_pattern={"lin9": [True] * R})


def test_allocator_jit_stacked_and_errors():
  rng = np.random.default_rng(6)

  def module(lead=()):
    return {
        "lora_a": rng.normal(size=lead + (5, R)).astype(np.float32),
        "lora_e": rng.normal(size=lead + (R,)).astype(np.float32),
        "lora_b": rng.normal(size=lead + (R, 3)).astype(np.float32),
    }

  stacked = {"layers": module((3,)), "head": module()}
  split = {f"layers{i}": {f: v[i] for f, v in stacked["layers"].items()} for i in range(3)}
  split["head"] = stacked["head"]
  grads_s = {"layers": module((3,)), "head": module()}
  grads_u = {f"layers{i}": {f: v[i] for f, v in grads_s["layers"].items()} for i in range(3)}
  grads_u["head"] = grads_s["head"]
  traces = []

  def counted(*args):
    traces.append(1)
    return ada.update_and_allocate(*args)

  step_fn = jax.jit(counted, static_argnums=4)
  s_state, u_state = ada.rank_allocator_init(stacked, CFG), ada.rank_allocator_init(split, CFG)
  for t in range(CFG.total_step):
    stacked, s_state, b_s = step_fn(stacked, grads_s, s_state, t, CFG)
    split, u_state, b_u = step_fn(split, grads_u, u_state, t, CFG)
    assert int(b_s) == int(b_u)
    for i in range(3):
      np.testing.assert_array_equal(
          np.asarray(stacked["layers"]["lora_e"][i]), np.asarray(split[f"layers{i}"]["lora_e"])
      )
  assert int(b_s) == 4 * TARGET_R
  assert (
      int(np.sum(np.asarray(stacked["layers"]["lora_e"]) != 0))
      + int(np.sum(np.asarray(stacked["head"]["lora_e"]) != 0))
      == 4 * TARGET_R
  )
  assert len(traces) == 2  # one trace per tree structure, whatever the step

  with pytest.raises(ValueError, match="init_r"):
    ada.rank_allocator_init(split, ada.AdaLoRAConfig(init_r=R + 1, target_r=1, total_step=10))
  with pytest.raises(ValueError, match="lora_b"):
    ada.rank_allocator_init({"m": {"lora_a": np.ones((5, R)), "lora_e": np.ones(R)}}, CFG)
  with pytest.raises(ValueError, match="no AdaLoRA module"):
    ada.orth_regularization({"w": np.ones(3)})
  with pytest.raises(ValueError, match="stacked"):
    ada.rank_pattern(s_state)


@pytest.mark.parametrize("module", [nn_adalora, ada], ids=["nn", "optim"])
def test_docstring_examples(module):
  result = doctest.testmod(module)
  assert result.attempted > 0 and result.failed == 0
