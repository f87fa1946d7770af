"""The stacked LoRA layout: ``stack_layers`` / ``unstack_layers`` and the train step over it.

With the layers' LoRA params stacked per projection, every optimizer module is one projection of
all layers (a leading batch axis, docs/method.md), so a step over the stacked layout must give exactly
the per-layer step's loss, parameters and AnLR multipliers (each slice is an independent module).
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import anlr_jax
from anlr_jax.train.step import (
    STACKED,
    init_train_state,
    make_train_step,
    stack_layers,
    unstack_layers,
)
from benchmarks.common import BenchConfig, build_jax_lora_model, jax_batch

CFG = BenchConfig(hidden=32, layers=2, heads=4, ffn=48, vocab=64, batch=2, seq=8, rank=4)


def test_stack_layers_round_trips_the_model_tree():
  _, lora, _, _ = build_jax_lora_model(CFG)
  stacked = stack_layers(lora)
  assert list(stacked['model']['layers']) == [STACKED]
  a = stacked['model']['layers'][STACKED]['self_attn']['q_proj']['lora_a']
  per_layer = [lora['model']['layers'][i]['self_attn']['q_proj']['lora_a'] for i in range(2)]
  assert a.shape == (2,) + per_layer[0].shape
  np.testing.assert_array_equal(a[1], per_layer[1])
  back = unstack_layers(stacked)
  assert jax.tree.structure(back) == jax.tree.structure(lora)
  chex.assert_trees_all_equal(back, lora)


def test_only_lists_of_identical_layers_are_stacked():
  x = jnp.ones((2, 3))
  tree = {
      'mixed': {0: {'w': x}, 1: {'w': jnp.ones((2, 4))}},  # shapes differ
      'gap': {0: {'w': x}, 2: {'w': x}},  # not 0 .. n-1
      'single': {0: {'w': x}},  # one layer: nothing to stack
      'named': {'a': {'w': x}, 'b': {'w': x}},  # not a layer list
      'pair': {0: {'w': x}, 1: {'w': 2 * x}},
  }
  out = stack_layers(tree)
  for key in ('mixed', 'gap', 'single', 'named'):
    assert jax.tree.structure(out[key]) == jax.tree.structure(tree[key]), key
  assert out['pair'][STACKED]['w'].shape == (2, 2, 3)
  chex.assert_trees_all_equal(unstack_layers(out), tree)


# 'anlr-batched' is the accelerator default (batch_modules=True): same-shaped modules (here q, k, v)
# stacked once more, over a leading layer axis in the stacked layout.
@pytest.mark.parametrize('optimizer', ['adamw', 'anlr', 'anlr-batched'])
def test_stacked_step_equals_the_per_layer_step(optimizer):
  graphdef, lora, frozen, extra = build_jax_lora_model(CFG)
  batch = jax_batch(CFG)
  results = {}
  for stacked in (False, True):
    if optimizer == 'adamw':
      tx = optax.adamw(1e-2, weight_decay=0.01)
    else:
      batch_modules = optimizer == 'anlr-batched'
      tx = anlr_jax.anlr(1e-2, weight_decay=0.01, warmup_steps=0, batch_modules=batch_modules)
    state = init_train_state(stack_layers(lora) if stacked else lora, extra, tx)
    step = jax.jit(make_train_step(graphdef, tx, stacked_layers=stacked))
    for _ in range(3):
      state, metrics = step(state, frozen, batch)
    results[stacked] = jax.device_get((state, metrics))
  (layered, m_layered), (stacked, m_stacked) = results[False], results[True]
  np.testing.assert_allclose(m_stacked['loss'], m_layered['loss'], rtol=1e-6)
  np.testing.assert_allclose(m_stacked['grad_norm'], m_layered['grad_norm'], rtol=1e-5)
  chex.assert_trees_all_close(unstack_layers(stacked.lora), layered.lora, rtol=1e-5, atol=1e-7)
  if optimizer != 'adamw':
    s_layered = anlr_jax.find_anlr_state(layered.opt_state).multipliers
    s_stacked = anlr_jax.find_anlr_state(stacked.opt_state).multipliers
    assert len(s_layered) == 5 * CFG.layers and len(s_stacked) == 5
    for name, s in s_stacked.items():
      assert s.shape == (CFG.layers, CFG.rank) and f'.{STACKED}.' in name
      for i in range(CFG.layers):
        np.testing.assert_allclose(s[i], s_layered[name.replace(STACKED, str(i))], rtol=1e-5)
    # the multipliers moved away from 1 (the comparison is not between two uniform updates)
    assert max(float(np.ptp(s)) for s in s_stacked.values()) > 1e-3


def test_trainer_layouts_give_the_same_run_and_per_layer_diagnostics():
  from anlr_jax.train.trainer import Trainer, TrainerConfig
  from tests.helpers.toy_lm import ToyBatches, make_toy_model, method_tx

  runs = {}
  for layout in ('stacked', 'per-layer'):
    config = TrainerConfig(
        steps=3,
        global_batch=8,
        compute_dtype='float32',
        progress=False,
        learning_rate=1e-2,
        mesh_fsdp=1,
        lora_layout=layout,
    )
    tx, schedule = method_tx(config)
    trainer = Trainer(
        make_toy_model(), ToyBatches(), config, tx, schedule=schedule, devices=jax.devices()[:1]
    )
    trainer.run()
    diag = jax.device_get(trainer.diagnostics_fn()(trainer.state.opt_state, trainer.state.lora))
    runs[layout] = (jax.device_get(trainer.lora_params()), diag)
  (lora_s, diag_s), (lora_p, diag_p) = runs['stacked'], runs['per-layer']
  chex.assert_trees_all_close(lora_s, lora_p, rtol=1e-5, atol=1e-7)
  assert set(diag_s['modules']) == set(diag_p['modules']) and '.0.' in next(iter(diag_p['modules']))
  chex.assert_trees_all_close(diag_s['modules'], diag_p['modules'], rtol=1e-4, atol=1e-6)
  chex.assert_trees_all_close(diag_s['magnitudes'], diag_p['magnitudes'], rtol=1e-5)
  with pytest.raises(ValueError, match='lora_layout'):
    TrainerConfig(steps=1, lora_layout='scan')
