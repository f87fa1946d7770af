"""``anlr_jax.anlr`` as the optimizer of Tunix's ``PeftTrainer`` (examples/finetune_tunix.py): Qwix
LoRA on a Gemma's attention einsums and MLP, multipliers on every module, state kept by Tunix's
checkpoints; and the same on Qwix QLoRA (``weight_qtype="nf4"``), where the nf4 base stays untouched.
Needs the ``tunix`` extra (``pip install -e .[tunix]``)."""

import importlib.util
import os
import warnings

import chex
import numpy as np
import pytest

pytest.importorskip("tunix")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import qwix  # noqa: E402
from flax import nnx, traverse_util  # noqa: E402

import anlr_jax  # noqa: E402

pytestmark = pytest.mark.slow

_PATH = os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples", "finetune_tunix.py")
_spec = importlib.util.spec_from_file_location("finetune_tunix", _PATH)
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)


def _anlr_state(trainer):
  state = anlr_jax.find_anlr_state(trainer.optimizer.opt_state)
  return {
      field: {name: np.asarray(v[...]) for name, v in getattr(state, field).items()}
      for field in ("nu_bar", "snr", "multipliers")
  } | {"count": int(state.count[...])}


def test_peft_trainer_with_anlr_on_qwix_attention_and_mlp_and_checkpoint_restore(tmp_path):
  steps, warmup = 6, 2
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    model = example.tiny_gemma(seed=0)  # Qwix is given the rngs it initialises the factors with
    anlr_jax.anlr(1e-3).init(nnx.state(model, nnx.LoRAParam))  # every factor is found
  assert [str(w.message) for w in caught if issubclass(w.category, UserWarning)] == []
  names = {m.name for m in anlr_jax.find_lora_modules(nnx.state(model, nnx.LoRAParam))}
  assert len(names) == 12 and {n.rsplit(".", 1)[0].split(".")[-1] for n in names} == {
      "q_einsum",
      "kv_einsum",
      "attn_vec_einsum",
      "gate_proj",
      "up_proj",
      "down_proj",
  }
  before = example.loss(model)
  trainer = example.make_trainer(
      model, steps, learning_rate=1e-2, warmup_steps=warmup, checkpoint_dir=str(tmp_path)
  )
  trainer.train(example.batches(steps))
  trainer.close()
  state = _anlr_state(trainer)
  assert state["count"] == steps
  assert set(state["multipliers"]) == names
  for name, s in state["multipliers"].items():  # every module, attention included, is anisotropic
    assert np.ptp(s) > 1e-3, name
    np.testing.assert_allclose(s.mean(), 1.0, rtol=1e-5)
  assert example.loss(model) < before

  # a new trainer over the same directory restores the LoRA params and AnLR's per-rank state
  fresh = example.tiny_gemma(seed=0)
  restored = example.make_trainer(
      fresh, steps + 2, learning_rate=1e-2, warmup_steps=warmup, checkpoint_dir=str(tmp_path)
  )
  assert restored.train_steps == steps
  chex.assert_trees_all_equal(_anlr_state(restored), state)
  chex.assert_trees_all_equal(
      nnx.to_pure_dict(nnx.state(fresh, nnx.LoRAParam)),
      nnx.to_pure_dict(nnx.state(model, nnx.LoRAParam)),
  )
  restored.train(example.batches(steps + 2))  # and goes on from there
  restored.close()
  assert _anlr_state(restored)["count"] == steps + 2


def _flat(state):
  return {
      ".".join(map(str, path)): np.asarray(v)
      for path, v in traverse_util.flatten_dict(nnx.to_pure_dict(state)).items()
  }


def test_peft_trainer_with_anlr_on_qwix_qlora_nf4():
  steps, warmup = 5, 2
  model = example.tiny_gemma(seed=0, weight_qtype="nf4")
  lora = nnx.state(model, nnx.LoRAParam)
  names = {m.name for m in anlr_jax.find_lora_modules(lora)}
  assert len(names) == 12
  assert len(jax.tree.leaves(lora)) == 2 * len(names)  # every trainable leaf is a paired factor
  # each adapted weight is stored frozen as a Qwix nf4 QArray: uint4 codes and a float scale
  for name in names:
    *path, weight = name.split(".")
    module = model
    for part in path:
      module = module[int(part)] if part.isdigit() else getattr(module, part)
    quantized = getattr(module, weight).array
    assert isinstance(quantized, qwix.QArray) and quantized.qtype == "nf4", name
    assert quantized.qvalue.dtype == jnp.uint4 and quantized.scale.dtype == jnp.float32, name
  frozen_state = nnx.state(model, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam)))
  frozen = _flat(frozen_state)
  assert {k.rsplit(".array.", 1)[0] for k, v in frozen.items() if v.dtype == jnp.uint4} == names
  factors = _flat(lora)

  before = example.loss(model)
  trainer = example.make_trainer(model, steps, learning_rate=1e-2, warmup_steps=warmup)
  trainer.train(example.batches(steps))
  trainer.close()
  state = _anlr_state(trainer)
  assert state["count"] == steps and set(state["multipliers"]) == names
  for name, s in state["multipliers"].items():  # AnLR rescaled the ranks of every module
    assert np.ptp(s) > 1e-3, name
    np.testing.assert_allclose(s.mean(), 1.0, rtol=1e-5)
  assert example.loss(model) < before
  # the nf4 base (codes and scales) and the other frozen params are untouched, every factor moved
  chex.assert_trees_all_equal(
      _flat(nnx.state(model, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam)))), frozen
  )
  for key, value in _flat(nnx.state(model, nnx.LoRAParam)).items():
    assert not np.array_equal(value, factors[key]), key
