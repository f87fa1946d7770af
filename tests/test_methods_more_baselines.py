"""The paper's remaining baselines in the method table: adalora, lorapro, loradash, anlr+loradash.

What the table, the optimizer factory, the config sections, the train step's loss regulariser, the
LoRA-Dash launch hook and the adapter file do for them (the CLI end to end is in
``tests/test_cli_baselines.py``).
"""

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import anlr_jax
from anlr_jax.app.config import ConfigError, help_text, load_config
from anlr_jax.app.assemble import adalora_config, build_method, dash_launcher, method_hooks
from anlr_jax.methods import LAYERS, METHOD_NAMES, OPTIMIZERS, get_method, method_optimizer
from anlr_jax.models.config import ModelConfig
from anlr_jax.models.llama import LlamaForCausalLM
from anlr_jax.nn import DashDirections, inject_adalora, inject_loradash
from anlr_jax.optim.adalora import AdaLoRAConfig, AdaLoRAState, orth_regularization
from anlr_jax.optim.lorapro import LoraProState
from anlr_jax.app.model import load_lora_params, save_lora_params
from anlr_jax.app.identity import run_identity
from anlr_jax.train.trainer import Trainer, TrainerConfig
from tests.helpers.toy_lm import ONE_DEVICE, ToyBatches

BASELINES = ("adalora", "lorapro", "loradash", "anlr+loradash")
TARGETS = ("q_proj", "v_proj", "up_proj")


def _tiny_llama(seed=0):
  config = ModelConfig.preset(
      "tiny",
      vocab_size=32,
      hidden_size=16,
      intermediate_size=32,
      num_hidden_layers=2,
      num_attention_heads=2,
      num_key_value_heads=2,
      dtype=jnp.float32,
      param_dtype=jnp.float32,
  )
  return LlamaForCausalLM(config, rngs=nnx.Rngs(seed))


def _find(state, kind):
  found = [
      s
      for s in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, kind))
      if isinstance(s, kind)
  ]
  assert len(found) == 1, (kind, state)
  return found[0]


def _run_config(*overrides):
  return load_config(None, ["lora.rank=4", "lora.alpha=8", "lora.dropout=0", *overrides])


# ------------------------------------------------------------------------------- the table
def test_table_holds_the_baselines():
  assert set(BASELINES) <= set(METHOD_NAMES)
  ada, pro, dash, anlr_dash = (get_method(n) for n in BASELINES)
  assert (ada.layer, ada.optimizer) == ("adalora", "adalora") and ada.uses_adalora
  assert (pro.layer, pro.optimizer) == ("lora", "lorapro")
  assert (dash.layer, dash.optimizer) == ("loradash", "adamw") and dash.uses_loradash
  assert (anlr_dash.layer, anlr_dash.optimizer, anlr_dash.signal) == ("loradash", "anlr", "anlr")
  assert anlr_dash.uses_anlr and not dash.uses_anlr
  assert all(
      get_method(n).layer in LAYERS and get_method(n).optimizer in OPTIMIZERS for n in METHOD_NAMES
  )
  for name in BASELINES:  # the docstring table lists every method
    assert f"\n{name} " in anlr_jax.methods.__doc__, name


def test_method_optimizer_builds_each_baseline():
  params = {"q": {"lora_a": 0.1 * jnp.ones((6, 2)), "lora_b": jnp.zeros((2, 5))}}
  ada_params = {"q": {**params["q"], "lora_e": jnp.zeros((2,))}}
  config = AdaLoRAConfig(init_r=2, target_r=1, total_step=10)
  state = method_optimizer("adalora", 1e-3, adalora_config=config).init(ada_params)
  assert _find(state, AdaLoRAState).allocator.mask["q"].shape == (2,)
  state = method_optimizer("lorapro", 1e-3, lora_scale=2.0).init(params)
  assert _find(state, LoraProState).lora_mu["q"].shape == (6, 5)  # the paper's full-weight moments
  assert method_optimizer("lorapro", 1e-3, lora_scale=2.0, lorapro_mode="efficient").init(params)
  state = method_optimizer("anlr+loradash", 1e-3, dash_launch_step=5).init(params)
  assert set(anlr_jax.find_anlr_state(state).multipliers) == {"q"}
  with pytest.raises(ValueError, match="AnLRState"):
    anlr_jax.find_anlr_state(method_optimizer("loradash", 1e-3, dash_launch_step=5).init(params))
  with pytest.raises(ValueError, match="needs dash_launch_step"):
    method_optimizer("loradash", 1e-3)
  with pytest.raises(ValueError, match="needs adalora_config"):
    method_optimizer("adalora", 1e-3)
  with pytest.raises(ValueError, match="needs lora_scale"):
    method_optimizer("lorapro", 1e-3)


def test_adalora_clips_before_the_allocator():
  """PEFT clips the gradients in place before optimizer.step() and update_and_allocate: the
  allocator's sensitivities |θ g| see the clipped gradient."""
  p = {"q": {"lora_a": jnp.ones((3, 2)), "lora_e": jnp.ones((2,)), "lora_b": jnp.ones((2, 4))}}
  g = jax.tree.map(lambda x: 100.0 * jnp.ones_like(x), p)
  config = AdaLoRAConfig(init_r=2, target_r=1, total_step=10)
  tx = method_optimizer("adalora", 1e-3, adalora_config=config, clip_norm=1.0)
  _, state = tx.update(g, tx.init(p), p)
  ipt = _find(state, AdaLoRAState).allocator.exp_avg_ipt["q"]["lora_e"]
  clipped = 100.0 / optax.tree.norm(g)  # every entry of the clipped gradient
  theta = 1.0 - 1e-3  # the updated parameter (Adam's first step is lr * sign(g))
  np.testing.assert_allclose(ipt, (1 - config.beta1) * theta * clipped * np.ones(2), rtol=1e-5)


# ------------------------------------------------------------------------------ config keys
def test_config_sections_and_errors_name_the_key():
  config = _run_config("method=adalora", "adalora.target_r=2", "loradash.launch_step=3")
  assert config.adalora.target_r == 2 and config.loradash.launch_step == 3
  assert (config.loradash.num_directions, config.lorapro.mode) == (8, "full")
  assert (config.adalora.beta1, config.adalora.orth_reg_weight) == (0.85, 0.5)  # PEFT's
  assert _run_config("method=adalora").adalora.target_r is None  # lora.rank / 1.5
  cases = [
      (["method=adalora", "adalora.target_r=8"], "adalora.target_r=8 exceeds lora.rank=4"),
      (["compare=[lora,adalora]", "adalora.target_r=5"], "adalora.target_r=5 exceeds lora.rank=4"),
      (["adalora.beta1=1"], "adalora.beta1: 1.0 is not allowed"),
      (["adalora.delta_t=0"], "adalora.delta_t: 0 is not allowed"),
      (["adalora.init_r=4"], "unknown key 'adalora.init_r'"),
      (["lorapro.mode=fast"], "lorapro.mode: 'fast' is not allowed"),
      (["loradash.launch_step=-1"], "loradash.launch_step: -1 is not allowed"),
      (["loradash.num_directions=0"], "loradash.num_directions: 0 is not allowed"),
  ]
  for overrides, message in cases:
    with pytest.raises(ConfigError, match=message):
      _run_config(*overrides)
  _run_config("method=lora", "adalora.target_r=8")  # target_r > lora.rank matters only to adalora


def test_adalora_config_errors_name_the_key():
  config = _run_config("method=adalora", "adalora.target_r=2", "adalora.tinit=5")
  assert adalora_config(config, 10) == AdaLoRAConfig(
      init_r=4, target_r=2, tinit=5, total_step=10, beta1=0.85, beta2=0.85
  )
  with pytest.raises(ConfigError, match="adalora.tinit \\+ tfinal = 5 \\+ 0 must be < total_step"):
    adalora_config(config, 5)
  # by default the initial rank is 1.5 x the target, as in AdaLoRA's paper and PEFT (12 -> 8)
  for rank, target in ((12, 8), (32, 21), (4, 3), (1, 1)):
    assert adalora_config(_run_config(f"lora.rank={rank}"), 10).target_r == target


def test_help_lists_the_new_keys():
  text = help_text()
  for key in (
      "adalora.target_r",
      "adalora.tinit",
      "adalora.tfinal",
      "adalora.delta_t",
      "adalora.beta1",
      "adalora.beta2",
      "adalora.orth_reg_weight",
      "lorapro.mode",
      "loradash.num_directions",
      "loradash.launch_step",
  ):
    assert f"  {key} (" in text, key
  assert "adalora.init_r" not in text  # lora.rank is AdaLoRA's initial rank


def test_identity_holds_the_sections_of_the_method(tmp_path):
  data = tmp_path / "train.json"
  data.write_text("[]")
  config = _run_config("adalora.target_r=2")
  ids = {
      m: run_identity(
          dataclasses.replace(config, method=m),
          model_path=str(tmp_path),
          fingerprint="x",
          data_path=str(data),
      )
      for m in ("lora", *BASELINES)
  }
  assert (
      ids["adalora"]["adalora.target_r"] == 2 and ids["adalora"]["adalora.orth_reg_weight"] == 0.5
  )
  assert ids["lorapro"]["lorapro.mode"] == "full"
  for m in ("loradash", "anlr+loradash"):
    assert ids[m]["loradash.launch_step"] == 100 and ids[m]["loradash.num_directions"] == 8
  assert "anlr.kappa" in ids["anlr+loradash"] and "anlr.kappa" not in ids["loradash"]
  assert not any(k.split(".")[0] in ("adalora", "lorapro", "loradash") for k in ids["lora"])


def _adapt(model, config, method):
  """``model`` with ``method``'s adapter layers as ``anlr train`` builds them."""
  build_method(dataclasses.replace(config, method=method), model=model)
  return model


def test_build_method_builds_each_layer():
  config = _run_config("lora.targets=[q_proj,v_proj]", "loradash.num_directions=2")
  kinds = {
      "adalora": anlr_jax.nn.AdaLoRALinear,
      "lorapro": anlr_jax.nn.LoRALinear,
      "loradash": anlr_jax.nn.LoRADashLinear,
  }
  for method, kind in kinds.items():
    model = _adapt(_tiny_llama(), config, method)
    assert type(model.model.layers[0].self_attn.q_proj) is kind, method
  bad = _run_config("lora.targets=[q_proj]", "loradash.num_directions=17")  # min(16, 16) = 16
  with pytest.raises(ConfigError, match="loradash.num_directions=17: .*exceeds min"):
    _adapt(_tiny_llama(), bad, "loradash")


# ------------------------------------------------------------------------- adapter files
def test_lora_file_round_trips_adalora_and_dash_directions(tmp_path):
  """Every adapter variable is written and read back: AdaLoRA's lora_e, LoRA-Dash's dash_scale and
  its frozen DashDirections (dash_index as int32), so the reloaded model gives the same outputs."""
  ids = jnp.asarray(np.random.default_rng(0).integers(0, 32, (2, 7)))
  kw = dict(target_modules=TARGETS, rank=2, alpha=4.0, dropout=0.0)
  for inject in (inject_adalora, functools.partial(inject_loradash, num_directions=3)):
    model = inject(_tiny_llama(), rngs=nnx.Rngs(1), **kw)
    lora = nnx.state(model, nnx.LoRAParam)
    key = jax.random.key(3)
    nnx.update(model, jax.tree.map(lambda x: x + 0.05 * jax.random.normal(key, x.shape), lora))
    if inject is not inject_adalora:
      anlr_jax.nn.launch_dash(model)
      layer = model.model.layers[1].mlp.up_proj
      layer.dash_scale[...] = jnp.asarray([0.3, -0.2, 0.1])
    save_lora_params(model, tmp_path / "a.safetensors")
    fresh = inject(_tiny_llama(), rngs=nnx.Rngs(7), **kw)
    load_lora_params(fresh, tmp_path / "a.safetensors")
    chex.assert_trees_all_equal(nnx.state(fresh, nnx.LoRAParam), nnx.state(model, nnx.LoRAParam))
    chex.assert_trees_all_equal(nnx.state(fresh, DashDirections), nnx.state(model, DashDirections))
    forward = nnx.jit(lambda m: m(ids))  # one program per layer kind, not op-by-op dispatch
    np.testing.assert_allclose(forward(fresh), forward(model), rtol=1e-6, atol=1e-6)
    if inject is not inject_adalora:
      assert anlr_jax.nn.dash_launched(fresh)
      assert fresh.model.layers[0].self_attn.q_proj.dash_index[...].dtype == jnp.int32


# ------------------------------------------------------------------ trainer: regulariser
class _LlamaBatches(ToyBatches):

  def get_batch(self, step, **kw):
    batch = super().get_batch(step, **kw)
    batch["attention_mask"][:] = 1  # the LLaMA's attention sees every position
    return batch


def _adalora_model():
  return inject_adalora(
      _tiny_llama(), target_modules=TARGETS, rank=2, alpha=4.0, dropout=0.0, rngs=nnx.Rngs(1)
  )


_ORTH_WEIGHT = 0.5
_ORTH_BATCHES = functools.partial(_LlamaBatches, global_batch=4, seq_len=8, vocab=32)


def _orth_tx():
  ada = AdaLoRAConfig(init_r=2, target_r=1, total_step=4)
  return method_optimizer("adalora", 1e-2, adalora_config=ada, clip_norm=None)


@pytest.fixture(scope="module")
def orth_reference():
  """grad(CE) and grad(R) of the first batch computed apart, and one rank_allocator(adamw) update
  on their sum and on grad(CE) alone: the same for either layout, so computed once."""
  reg = functools.partial(orth_regularization, orth_reg_weight=_ORTH_WEIGHT)
  tx = _orth_tx()
  graphdef, lora, rest = nnx.split(_adalora_model(), nnx.LoRAParam, ...)
  lora = nnx.to_pure_dict(lora)
  batch = jax.tree.map(jnp.asarray, _ORTH_BATCHES().get_batch(0))

  def cross_entropy(lora):
    logits = nnx.merge(graphdef, lora, rest)(
        batch["input_ids"], attention_mask=batch["attention_mask"]
    )
    logp = jax.nn.log_softmax(logits[:, :-1])
    nll = -jnp.take_along_axis(logp, batch["input_ids"][:, 1:, None], -1)[..., 0]
    w = batch["loss_mask"][:, 1:]
    return jnp.sum(nll * w) / jnp.sum(w)

  # the reference under jit: one program each, not hundreds of op-by-op dispatches
  ce, grads = jax.jit(jax.value_and_grad(cross_entropy))(lora)
  r, reg_grads = jax.jit(jax.value_and_grad(reg))(lora)
  total = jax.tree.map(jnp.add, grads, reg_grads)
  update = jax.jit(lambda g: optax.apply_updates(lora, tx.update(g, tx.init(lora), lora)[0]))
  return jax.device_get(
      dict(ce=ce, r=r, total=total, expected=update(total), ce_only=update(grads))
  )


@pytest.mark.parametrize("lora_layout", ["stacked", "per-layer"])
def test_orth_regulariser_is_added_to_the_loss(lora_layout, orth_reference):
  """One AdaLoRA update equals rank_allocator(adamw) on grad(CE) + grad(R) computed apart; the
  `loss` metric is the cross-entropy alone and `regularizer` is R at the params of the step."""
  ref = orth_reference
  assert ref["r"] > 0.1  # N(0, 0.02) factors are far from orthonormal
  cfg = TrainerConfig(
      steps=4,
      global_batch=4,
      compute_dtype="float32",
      progress=False,
      lora_layout=lora_layout,
      **ONE_DEVICE,
  )
  reg = functools.partial(orth_regularization, orth_reg_weight=_ORTH_WEIGHT)
  trainer = Trainer(
      _adalora_model(),
      _ORTH_BATCHES(),
      cfg,
      _orth_tx(),
      loss_regularizer=reg,
      devices=jax.devices()[:1],
  )
  metrics = jax.device_get(trainer.train_step())
  np.testing.assert_allclose(metrics["loss"], ref["ce"], rtol=1e-5)
  np.testing.assert_allclose(metrics["regularizer"], ref["r"], rtol=1e-5)
  np.testing.assert_allclose(metrics["grad_norm"], optax.tree.norm(ref["total"]), rtol=1e-5)
  got = jax.device_get(trainer.lora_params())
  chex.assert_trees_all_close(got, ref["expected"], atol=1e-6, rtol=1e-5)
  diff = max(
      np.max(np.abs(a - b)) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref["ce_only"]))
  )
  assert diff > 1e-4  # without the regulariser the update differs
  trainer.close()


def test_method_hooks():
  ada = _run_config("method=adalora", "adalora.target_r=2")
  assert set(method_hooks(ada)) == {"loss_regularizer"}
  off = _run_config("method=adalora", "adalora.target_r=2", "adalora.orth_reg_weight=0")
  assert method_hooks(off) == {}
  assert set(method_hooks(_run_config("method=anlr+loradash"))) == {"on_step"}
  assert method_hooks(_run_config("method=lorapro")) == {}


# ------------------------------------------------------------------- trainer: dash launch
def _dash_trainer(launch_step, ckpt_dir=None, steps=4):
  model = inject_loradash(
      _tiny_llama(),
      target_modules=TARGETS,
      rank=2,
      alpha=4.0,
      num_directions=3,
      launch_step=launch_step,
      dropout=0.0,
      rngs=nnx.Rngs(1),
  )
  cfg = TrainerConfig(
      steps=steps,
      global_batch=4,
      compute_dtype="float32",
      progress=False,
      async_save=False,
      save_every=1,
      learning_rate=1e-2,
      **ONE_DEVICE,
  )
  tx = method_optimizer("loradash", 1e-2, dash_launch_step=launch_step)
  return Trainer(
      model,
      _LlamaBatches(global_batch=4, seq_len=8, vocab=32),
      cfg,
      tx,
      checkpoint_dir=ckpt_dir,
      on_step=dash_launcher(launch_step),
      devices=jax.devices()[:1],
  )


def _dash_state(trainer):
  model = trainer.updated_model()
  return (
      jax.device_get(nnx.to_pure_dict(nnx.state(model, DashDirections))),
      jax.device_get(nnx.to_pure_dict(nnx.state(model, nnx.LoRAParam))),
  )


@pytest.fixture(scope="module")
def dash_run(tmp_path_factory):
  """One run of 4 updates launched after update 2, checkpointed at every step: what the launch hook
  saw at each call, the directions a layer's ``task_directions`` picks from the state after update
  2 (before the hook launches), the ``dash_scale`` after update 3 and the final state."""
  ckpt = tmp_path_factory.mktemp("dash") / "ckpt"
  trainer = _dash_trainer(2, str(ckpt))
  seen, chosen, scales, launch = [], {}, {}, trainer.on_step

  def on_step(t, step):  # the launch hook, then whether the state's model is launched
    if step == 2:  # c A B after update 2, with W0's SVD, before the launch
      model = nnx.merge(t.graphdef, t.lora_params(), t.frozen, t.state.extra)
      chosen["up_proj"] = jax.device_get(model.model.layers[1].mlp.up_proj.task_directions())
    launch(t, step)
    model = nnx.merge(t.graphdef, t.lora_params(), t.frozen, t.state.extra)
    seen.append((step, anlr_jax.nn.dash_launched(model)))
    scales[step] = jax.device_get(nnx.to_pure_dict(nnx.state(model, nnx.LoRAParam)))

  trainer.on_step = on_step
  trainer.run()
  out = dict(
      ckpt=ckpt,
      seen=seen,
      traces=trainer.step_traces,
      state=_dash_state(trainer),
      chosen=chosen["up_proj"],
      lora_after=scales,
  )
  trainer.close()
  return out


def test_dash_launches_after_update_t_and_resumes_without_relaunch(dash_run, monkeypatch):
  assert dash_run["seen"] == [(0, False), (1, False), (2, True), (3, True), (4, True)]
  assert dash_run["traces"] == 1  # the launch does not recompile the step
  directions, lora = dash_run["state"]
  scale = lora["model"]["layers"][0]["self_attn"]["q_proj"]["dash_scale"]
  assert np.abs(scale).max() > 0  # trained for 2 updates after the launch

  # The directions are chosen from c A B after update 2, with W0's SVD.
  chosen = dash_run["chosen"]
  saved = directions["model"]["layers"][1]["mlp"]["up_proj"]
  np.testing.assert_array_equal(saved["dash_index"], chosen.index)
  np.testing.assert_allclose(np.abs(saved["dash_u"]), np.abs(chosen.u), atol=1e-5)

  # Resume from the checkpoint of update 3 (past t = 2): directions restored, never relaunched.
  import shutil

  shutil.rmtree(dash_run["ckpt"] / "4")
  calls = []
  monkeypatch.setattr(anlr_jax.nn, "launch_dash", lambda *a, **k: calls.append(1))
  resumed = _dash_trainer(2, str(dash_run["ckpt"]))
  assert resumed.step == 3
  resumed.run()
  assert calls == []
  chex.assert_trees_all_close(_dash_state(resumed), (directions, lora), atol=1e-6, rtol=1e-5)
  resumed.close()


def _q_proj(tree):
  return tree["model"]["layers"][0]["self_attn"]["q_proj"]


def test_dash_launch_at_zero_is_before_the_first_update():
  trainer = _dash_trainer(0, steps=1)
  seen, launch = [], trainer.on_step

  def on_step(t, step):
    launch(t, step)
    model = nnx.merge(t.graphdef, t.lora_params(), t.frozen, t.state.extra)
    seen.append((step, anlr_jax.nn.dash_launched(model)))

  trainer.on_step = on_step
  trainer.run()
  assert seen == [(0, True), (1, True)]  # launched by the call before update 1
  directions, lora = _dash_state(trainer)
  # B = 0 at the launch, so c A B = 0: every change rate is 0 and the top-s singular directions
  # are chosen (ties broken by index)
  np.testing.assert_array_equal(_q_proj(directions)["dash_index"], [0, 1, 2])
  np.testing.assert_array_equal(_q_proj(directions)["dash_change_rate"], np.zeros(3))
  # update 1 trained dash_scale with Adam's first step: |-lr g / (|g| + eps)| = lr (|g| >> eps)
  np.testing.assert_allclose(np.abs(_q_proj(lora)["dash_scale"]), 1e-2, rtol=1e-2)
  trainer.close()


def test_the_first_dash_update_is_adams_first_step_in_a_run(dash_run):
  """Launched after update 2 of a run, dash_scale's first update (update 3) is Adam's first step,
  ``-lr g / (|g| + eps)``, of size lr; a count started at update 1 would give 0.64 lr."""
  lora = dash_run["lora_after"][3]
  for layer in (0, 1):
    scale = lora["model"]["layers"][layer]["self_attn"]["q_proj"]["dash_scale"]
    np.testing.assert_allclose(np.abs(scale), 1e-2, rtol=1e-2)  # |g| >> eps


@pytest.mark.parametrize("method", ["loradash", "anlr+loradash"])
def test_dash_scale_adam_counts_from_the_launch(method):
  """dash_scale's Adam moments and step count start at the launch (update t + 1): its first update
  is the Adam formula with count 1, and every later one is optax.adamw's started at the launch on
  the run's schedule; the LoRA factors get the method's optimizer as if dash_scale were absent."""
  t, b1, b2, eps, wd = 5, 0.9, 0.999, 1e-8, 0.1
  schedule = optax.linear_schedule(1e-2, 2e-3, 20)
  adam = dict(b1=b1, b2=b2, eps=eps, weight_decay=wd)
  knobs = {"warmup_steps": 1}
  tx = method_optimizer(
      method, schedule, clip_norm=None, anlr_kwargs=knobs, dash_launch_step=t, **adam
  )
  factors_tx = method_optimizer(method.replace("loradash", "lora").replace("+lora", ""), schedule,
                                clip_norm=None, anlr_kwargs=knobs, **adam)  # fmt: skip
  dash_ref = optax.adamw(lambda c: schedule(c + t), **adam)  # started at the launch
  rng = np.random.default_rng(0)
  f32 = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # noqa: E731
  params = {"q": {"lora_a": f32(6, 2), "lora_b": f32(2, 5), "dash_scale": jnp.zeros(3)}}
  factors = {"q": {k: params["q"][k] for k in ("lora_a", "lora_b")}}
  state, factors_state = tx.init(params), factors_tx.init(factors)
  update, factors_update = jax.jit(tx.update), jax.jit(factors_tx.update)
  dash_update = jax.jit(dash_ref.update)  # the references under jit too: no op-by-op dispatch
  for n in range(1, 10):
    grads = {"q": {"lora_a": f32(6, 2), "lora_b": f32(2, 5), "dash_scale": f32(3)}}
    if n <= t:  # before the launch dash_scale's gradient is exactly zero
      grads["q"]["dash_scale"] = jnp.zeros(3)
    updates, new_state = update(grads, state, params)
    assert jax.tree.structure(new_state) == jax.tree.structure(state)
    state = new_state
    factor_grads = {"q": {k: grads["q"][k] for k in ("lora_a", "lora_b")}}
    factor_updates, factors_state = factors_update(factor_grads, factors_state, factors)
    chex.assert_trees_all_close(
        {"q": {k: updates["q"][k] for k in factors["q"]}}, factor_updates, rtol=1e-5, atol=1e-9
    )
    g, dash = np.asarray(grads["q"]["dash_scale"]), np.asarray(updates["q"]["dash_scale"])
    if n <= t:
      np.testing.assert_array_equal(dash, np.zeros(3))
    elif n == t + 1:  # Adam with count k = n - t = 1: m_hat = g, v_hat = g^2; dash_scale = 0
      want = -float(schedule(n - 1)) * g / (np.abs(g) + eps)
      np.testing.assert_allclose(dash, want, rtol=1e-5)
      dash_state = dash_ref.init(params["q"]["dash_scale"])
    if n > t:
      ref, dash_state = dash_update(grads["q"]["dash_scale"], dash_state, params["q"]["dash_scale"])
      np.testing.assert_allclose(dash, ref, rtol=1e-5, atol=1e-8)
    params = optax.apply_updates(params, updates)
    factors = {"q": {k: params["q"][k] for k in factors["q"]}}


def _key_data(x):
  return jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x


@pytest.mark.parametrize("method", ["adalora", "lorapro", "anlr+loradash"])
def test_stacked_layout_trains_like_per_layer(method):
  """Every baseline runs in the trainer's default stacked layout with the updates of the per-layer
  one (AdaLoRA's global budget, LoRA-Pro's per-module solves and the dash launch included)."""
  config = _run_config(
      "lora.rank=2",
      "adalora.target_r=1",
      "loradash.num_directions=2",
      "loradash.launch_step=1",
      "anlr.warmup_steps=1",
      f"lora.targets=[{','.join(TARGETS)}]",
  )
  out = {}
  for layout in ("stacked", "per-layer"):
    model = _adapt(_tiny_llama(), config, method)
    cfg = TrainerConfig(
        steps=3,
        global_batch=4,
        compute_dtype="float32",
        progress=False,
        lora_layout=layout,
        **ONE_DEVICE,
    )
    tx = method_optimizer(
        method,
        1e-2,
        adalora_config=adalora_config(config, 3),
        lora_scale=2.0 / 2,
        dash_launch_step=config.loradash.launch_step,
    )
    trainer = Trainer(
        model,
        _LlamaBatches(global_batch=4, seq_len=8, vocab=32),
        cfg,
        tx,
        devices=jax.devices()[:1],
        **method_hooks(dataclasses.replace(config, method=method)),
    )
    trainer.run()
    extra = jax.tree.map(_key_data, trainer.state.extra)  # the dash directions and RNG keys
    out[layout] = jax.device_get((trainer.lora_params(), extra))
    assert trainer.layout.stacked == (layout == "stacked")
    trainer.close()
  chex.assert_trees_all_close(out["stacked"], out["per-layer"], atol=1e-5, rtol=1e-5)
