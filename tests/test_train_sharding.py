"""The sharded step on a (data=2, fsdp=2, tensor=2) mesh of 8 fake CPU devices equals the
single-device step (tiny LLaMA + injected LoRA, AnLR optimizer, LoRA dropout on)."""

import chex
import jax
import numpy as np
import optax
from flax import nnx

import anlr_jax
from anlr_jax.models.config import ModelConfig
from anlr_jax.models.llama import LlamaForCausalLM
from anlr_jax.nn.inject import inject_lora
from anlr_jax.train.mesh import make_mesh
from anlr_jax.train.trainer import Trainer, TrainerConfig, first_devices
from tests.helpers.toy_lm import ToyBatches

VOCAB = 512


def tiny_lora_llama(seed=0):
  model = LlamaForCausalLM(ModelConfig.preset('tiny', vocab_size=VOCAB), rngs=nnx.Rngs(seed))
  return inject_lora(model, rank=4, alpha=8.0, dropout=0.05, rngs=nnx.Rngs(seed + 1))


def _run(mesh_sizes, devices, steps=3):
  tx = optax.chain(optax.clip_by_global_norm(1.0), anlr_jax.anlr(1e-2, warmup_steps=1))
  cfg = TrainerConfig(
      steps=steps,
      global_batch=8,
      micro_batches=2,
      compute_dtype='float32',
      progress=False,
      mesh_data=mesh_sizes[0],
      mesh_fsdp=mesh_sizes[1],
      mesh_tensor=mesh_sizes[2],
  )
  trainer = Trainer(
      tiny_lora_llama(), ToyBatches(seq_len=16, vocab=VOCAB), cfg, tx, devices=devices
  )
  losses = [float(trainer.train_step()['loss']) for _ in range(steps)]
  return trainer, losses


def test_mesh_2x2x2_step_equals_single_device():
  single, single_losses = _run((1, 1, 1), jax.devices()[:1])
  sharded, sharded_losses = _run((2, 2, 2), jax.devices())
  np.testing.assert_allclose(sharded_losses, single_losses, rtol=1e-5, atol=1e-5)
  chex.assert_trees_all_close(
      jax.device_get(sharded.state.lora), jax.device_get(single.state.lora), atol=1e-5, rtol=1e-5
  )
  # AnLR per-rank state agrees too (the multipliers were anisotropic on step 2+)
  chex.assert_trees_all_close(
      jax.device_get(anlr_jax.find_anlr_state(sharded.state.opt_state)),
      jax.device_get(anlr_jax.find_anlr_state(single.state.opt_state)),
      atol=1e-5,
      rtol=1e-5,
  )
  # really sharded: base weights split over fsdp x tensor, batch over data x fsdp, one compile
  kernel = sharded.frozen['model']['layers'][0]['mlp']['gate_proj']['kernel']
  assert kernel.sharding.spec == jax.P('fsdp', 'tensor')
  assert len(kernel.addressable_shards) == 8 and kernel.addressable_shards[0].data.shape == (32, 96)
  assert sharded.global_batch(0)['input_ids'].sharding.spec == jax.P(('data', 'fsdp'))
  assert sharded.step_traces == 1 and single.step_traces == 1


def test_make_mesh_sizes_and_errors():
  mesh = make_mesh(data=2, fsdp=-1, tensor=2)
  assert dict(mesh.shape) == {'data': 2, 'fsdp': 2, 'tensor': 2}
  for bad, match in [
      (dict(data=3, fsdp=-1), 'divisible'),
      (dict(data=-1, fsdp=-1), 'only one'),
      (dict(data=2, fsdp=2, tensor=1), 'need 4 devices'),
      (dict(data=0), 'data=0'),
  ]:
    try:
      make_mesh(**bad)
    except ValueError as e:
      assert match in str(e), (bad, e)
    else:
      raise AssertionError(f'make_mesh({bad}) did not raise')


def test_trainer_devices_takes_the_first_n_devices_and_names_itself_when_too_many():
  """``trainer.devices: 2`` builds the default mesh over the first 2 of the 8 devices; the LoRA
  params and the batch live there; more devices than visible is a one-line error naming the key."""
  tx = anlr_jax.anlr(1e-2, warmup_steps=1)
  cfg = TrainerConfig(steps=1, global_batch=8, compute_dtype='float32', progress=False, devices=2)
  trainer = Trainer(tiny_lora_llama(), ToyBatches(seq_len=16, vocab=VOCAB), cfg, tx)
  assert list(trainer.mesh.devices.flat) == jax.devices()[:2]
  assert dict(trainer.mesh.shape) == {'data': 1, 'fsdp': 2, 'tensor': 1}
  batch = trainer.global_batch(0)['input_ids']
  assert batch.sharding.device_set == set(jax.devices()[:2])
  assert np.isfinite(float(trainer.train_step()['loss']))
  assert first_devices(8) == jax.devices()
  try:
    first_devices(9)
  except ValueError as e:
    assert 'trainer.devices=9' in str(e) and '8 devices' in str(e) and '\n' not in str(e)
  else:
    raise AssertionError('trainer.devices=9 on 8 devices did not raise')
