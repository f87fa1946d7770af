"""Single-device train step: loss of the batch contract, LoRA-only AdamW update, gradient
accumulation, one compilation, schedule, dtypes, bad input (remat: tests/test_lean_loss.py)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from flax import nnx

from anlr_jax.train.schedule import linear_warmup_decay
from anlr_jax.train.trainer import Trainer, TrainerConfig
from tests.helpers.toy_lm import ONE_DEVICE, ToyBatches, make_toy_model, make_toy_trainer


def _trainer(tx=None, batches=None, log_dir=None, **overrides):
  """tx None: AnLR on the config's schedule, as a run of method anlr."""
  return make_toy_trainer(tx, batches=batches, log_dir=log_dir, one_device=True, **overrides)


def _numpy_loss(logits, batch):
  """Mean next-token cross-entropy over response tokens, from the batch contract, in float64."""
  z = np.asarray(logits, np.float64)[:, :-1]
  z = z - z.max(-1, keepdims=True)
  logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
  targets = batch['input_ids'][:, 1:]
  nll = -np.take_along_axis(logp, targets[..., None], -1)[..., 0]
  w = batch['loss_mask'][:, 1:]
  return (nll * w).sum() / w.sum()


@pytest.fixture(scope='module')
def adamw_reference():
  """The first batch's loss (float64 NumPy from the logits), the gradient of an independent loss
  (no scan, no mesh, log_softmax by hand) and optax.adamw's update from it: the same for either
  layout, so computed once, under jit (one program each, not op-by-op dispatch)."""
  tx = optax.adamw(1e-2, weight_decay=0.1)
  model = make_toy_model()
  batch = ToyBatches().get_batch(0)
  graphdef, lora, rest = nnx.split(model, nnx.LoRAParam, ...)
  lora = lora.to_pure_dict()
  forward = jax.jit(
      lambda lora, ids, mask: nnx.merge(graphdef, lora, rest)(ids, attention_mask=mask)
  )
  logits = forward(lora, batch['input_ids'], batch['attention_mask'])

  def ref_loss(lora):  # independent path: no scan, no mesh, log_softmax by hand
    logits = forward(lora, batch['input_ids'], batch['attention_mask'])
    logp = jax.nn.log_softmax(logits[:, :-1])
    nll = -jnp.take_along_axis(logp, batch['input_ids'][:, 1:, None], -1)[..., 0]
    w = batch['loss_mask'][:, 1:]
    return jnp.sum(nll * w) / jnp.sum(w)

  grads = jax.jit(jax.grad(ref_loss))(lora)
  updates, _ = jax.jit(tx.update)(grads, tx.init(lora), lora)
  expected = optax.apply_updates(lora, updates)
  return dict(
      loss=_numpy_loss(logits, batch),
      grad_norm=optax.tree.norm(grads),
      expected=jax.device_get(expected),
      batch=batch,
  )


@pytest.mark.parametrize('lora_layout', ['stacked', 'per-layer'])
def test_loss_and_adamw_update_match_reference(lora_layout, adamw_reference):
  ref, batch = adamw_reference, adamw_reference['batch']
  trainer = _trainer(optax.adamw(1e-2, weight_decay=0.1), ToyBatches(), lora_layout=lora_layout)
  frozen_before = jax.device_get(trainer.frozen)
  metrics = jax.device_get(trainer.train_step())
  np.testing.assert_allclose(metrics['loss'], ref['loss'], rtol=1e-5)
  np.testing.assert_allclose(metrics['grad_norm'], ref['grad_norm'], rtol=1e-5)
  assert metrics['loss_tokens'] == batch['loss_mask'][:, 1:].sum()
  assert metrics['tokens'] == batch['attention_mask'].sum()
  chex.assert_trees_all_close(
      jax.device_get(trainer.lora_params()), ref['expected'], atol=1e-6, rtol=1e-5
  )
  stacked = lora_layout == 'stacked'
  assert ('*' in trainer.state.lora['blocks']) == stacked, trainer.state.lora['blocks'].keys()
  chex.assert_trees_all_equal(jax.device_get(trainer.frozen), frozen_before)  # base frozen
  assert int(trainer.state.step) == 1


def test_gradient_accumulation_equals_one_big_batch():
  tx = optax.adamw(1e-2)
  big, accumulated = _trainer(tx), _trainer(tx, micro_batches=4)
  for _ in range(2):
    m_big, m_acc = big.train_step(), accumulated.train_step()
    np.testing.assert_allclose(m_acc['loss'], m_big['loss'], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(m_acc['grad_norm'], m_big['grad_norm'], rtol=1e-5, atol=1e-6)
  chex.assert_trees_all_close(
      jax.device_get(accumulated.state.lora), jax.device_get(big.state.lora), atol=1e-5, rtol=1e-5
  )


_COMPILES = {'count': 0, 'on': False}


def _count_compiles(event, duration, **kwargs):
  if _COMPILES['on'] and event == '/jax/core/compile/backend_compile_duration':
    _COMPILES['count'] += 1


jax.monitoring.register_event_duration_secs_listener(_count_compiles)


def test_step_compiles_once_over_steps():
  trainer = _trainer()
  losses = [float(trainer.train_step()['loss'])]
  _COMPILES.update(count=0, on=True)
  try:
    losses += [float(trainer.train_step()['loss']) for _ in range(3)]
  finally:
    _COMPILES['on'] = False
  assert trainer.step_traces == 1  # traced once over 4 steps
  assert _COMPILES['count'] == 0  # no XLA compilation at all after the first step
  assert all(np.isfinite(losses)) and trainer.step == 4


def test_schedule_matches_transformers_linear_schedule():
  total, warmup, peak = 20, 5, 3e-4
  param = torch.nn.Parameter(torch.zeros(1))
  opt = torch.optim.SGD([param], lr=peak)
  from transformers import get_linear_schedule_with_warmup

  torch_sched = get_linear_schedule_with_warmup(opt, warmup, total)
  expected = []
  for _ in range(total):
    expected.append(opt.param_groups[0]['lr'])
    opt.step()
    torch_sched.step()
  ours = [float(linear_warmup_decay(peak, total, warmup)(t)) for t in range(total)]
  np.testing.assert_allclose(ours, expected, rtol=1e-6, atol=1e-12)


def test_lr_metric_follows_the_default_schedule():
  trainer = _trainer(steps=6, lr_warmup_steps=2, learning_rate=1e-3)
  lrs = [float(trainer.train_step()['lr']) for _ in range(4)]
  np.testing.assert_allclose(lrs, [0.0, 5e-4, 1e-3, 7.5e-4], rtol=1e-6)


def test_bf16_compute_keeps_float32_params_and_state():
  f32 = _trainer(optax.adamw(1e-2))
  bf16 = _trainer(optax.adamw(1e-2), compute_dtype='bfloat16', base_dtype='bfloat16')
  loss32, loss16 = float(f32.train_step()['loss']), float(bf16.train_step()['loss'])
  assert abs(loss16 - loss32) < 3e-2 * abs(loss32)
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(bf16.state.lora))
  assert all(
      x.dtype == jnp.float32
      for x in jax.tree.leaves(bf16.state.opt_state)
      if jnp.issubdtype(x.dtype, jnp.floating)
  )
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(bf16.frozen))


class _MissingKey(ToyBatches):

  def get_batch(self, step, **kw):
    batch = super().get_batch(step, **kw)
    del batch['loss_mask']
    return batch


def test_bad_input_names_the_problem():
  with pytest.raises(KeyError, match='loss_mask'):
    _trainer(batches=_MissingKey()).train_step()
  with pytest.raises(ValueError, match='rows'):
    _trainer(global_batch=16).train_step()
  with pytest.raises(ValueError, match='micro_batches'):
    TrainerConfig(steps=1, global_batch=8, micro_batches=3)
  with pytest.raises(ValueError, match='compute_dtype'):
    TrainerConfig(steps=1, compute_dtype='float8')
  with pytest.raises(ValueError, match='nnx.LoRAParam'):
    Trainer(
        nnx.Linear(2, 2, rngs=nnx.Rngs(0)),
        ToyBatches(),
        TrainerConfig(steps=1, **ONE_DEVICE),
        optax.adamw(1e-2),
        devices=jax.devices()[:1],
    )


def test_run_writes_metrics_tensorboard_and_anlr_diagnostics(tmp_path):
  import csv
  import json

  run_dir = tmp_path / 'run'
  trainer = _trainer(
      steps=4,
      lr_warmup_steps=1,
      log_dir=str(run_dir),
      diag_every=2,
      log_every=2,
      learning_rate=1e-3,
  )
  rows = trainer.run()
  lines = [json.loads(l) for l in open(run_dir / 'metrics.jsonl')]
  assert [r['step'] for r in lines] == [2, 4] and lines == rows
  schedule = linear_warmup_decay(1e-3, 4, 1)
  np.testing.assert_allclose([r['lr'] for r in lines], [schedule(1), schedule(3)], rtol=1e-6)
  for row in lines:
    assert np.isfinite(row['loss']) and row['tokens_per_s'] > 0 and row['grad_norm'] > 0
    assert 'anlr/velocity_cv' in row and 'anlr/multiplier_max_min' in row
  with open(run_dir / 'metrics.csv') as f:
    table = list(csv.DictReader(f))
  assert [float(r['loss']) for r in table] == [r['loss'] for r in lines]
  assert list((run_dir / 'tensorboard').glob('events.out.tfevents.*'))
  diag = sorted((run_dir / 'diagnostics').glob('*.npz'))
  assert [d.name for d in diag] == ['step_00000002.npz', 'step_00000004.npz']
  arrays = np.load(diag[-1])
  multipliers = [k for k in arrays if 'multipliers' in k]
  assert multipliers and all(np.isclose(arrays[k].mean(), 1.0, atol=1e-5) for k in multipliers)
  # The per-rank contribution magnitudes |A_k| |B_k| of the LoRA params at that step (for analysis).
  from anlr_jax.analysis.logs import load_run

  logs = load_run(run_dir)
  assert logs.magnitudes and set(logs.magnitudes) == set(logs.nu_bar)
  lora = jax.device_get(trainer.lora_params())
  flat = {
      jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(lora)
  }
  a_keys = sorted(k for k in flat if k.endswith("['lora_a']"))
  assert a_keys
  for a_key in a_keys:
    a, b = flat[a_key], flat[a_key.replace('lora_a', 'lora_b')]
    want = np.linalg.norm(a, axis=-2) * np.linalg.norm(b, axis=-1)
    assert any(np.allclose(m[-1], want, rtol=1e-5) for m in logs.magnitudes.values())


def test_train_steps_dispatch_without_waiting_for_the_device(monkeypatch):
  """After the first read of the step counter, train_step never fetches from the device, so a
  training loop keeps the device queue full (host work overlaps the previous step)."""
  from anlr_jax.train import trainer as trainer_mod

  trainer = _trainer()
  trainer.train_step()
  fetched = []
  real_get = trainer_mod.jax.device_get
  monkeypatch.setattr(trainer_mod.jax, 'device_get', lambda x: fetched.append(x) or real_get(x))
  for _ in range(3):
    trainer.train_step()
  assert fetched == []
  monkeypatch.undo()
  assert trainer.step == 4 == int(jax.device_get(trainer.state.step))
