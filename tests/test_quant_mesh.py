"""A quantised base on a mesh: the packed arrays shard like the weights they replace (the linear
layers' kernels and the embedding table), and the sharded LoRA step on an nf4 base equals the
single-device one (8 fake CPU devices)."""

import chex
import jax
import numpy as np
import optax
from flax import nnx

import anlr_jax
from anlr_jax.models.config import ModelConfig
from anlr_jax.models.llama import LlamaForCausalLM
from anlr_jax.models.quantize import quantize_model
from anlr_jax.nn.inject import inject_lora
from anlr_jax.train.mesh import check_quantized_blocks, make_mesh
from anlr_jax.train.trainer import Trainer, TrainerConfig
from tests.helpers.toy_lm import ToyBatches

VOCAB = 512


def _run(mesh_sizes, devices, steps=2):
  model = LlamaForCausalLM(ModelConfig.preset("tiny", vocab_size=VOCAB), rngs=nnx.Rngs(0))
  model = inject_lora(model, rank=4, alpha=8.0, dropout=0.0, rngs=nnx.Rngs(1))
  quantize_model(model, "nf4")
  cfg = TrainerConfig(
      steps=steps,
      global_batch=8,
      compute_dtype="float32",
      progress=False,
      mesh_data=mesh_sizes[0],
      mesh_fsdp=mesh_sizes[1],
      mesh_tensor=mesh_sizes[2],
  )
  tx = anlr_jax.anlr(1e-2, warmup_steps=1)
  trainer = Trainer(model, ToyBatches(seq_len=16, vocab=VOCAB), cfg, tx, devices=devices)
  losses = [float(trainer.train_step()["loss"]) for _ in range(steps)]
  return trainer, losses


def test_an_nf4_base_shards_like_the_float_base_and_trains_like_one_device():
  single, single_losses = _run((1, 1, 1), jax.devices()[:1])
  sharded, sharded_losses = _run((4, 1, 2), jax.devices())
  np.testing.assert_allclose(sharded_losses, single_losses, rtol=1e-5, atol=1e-5)
  chex.assert_trees_all_close(
      jax.device_get(sharded.state.lora), jax.device_get(single.state.lora), atol=1e-5, rtol=1e-5
  )
  frozen = sharded.frozen["model"]
  # a linear layer's codes (d_in / 2, d_out) and absmax codes: the float kernel's spec
  # ('embed', 'mlp') -> ('fsdp', 'tensor')
  gate = frozen["layers"][0]["mlp"]["gate_proj"]
  for name in ("codes", "scales"):
    assert gate[name].sharding.spec == jax.P("fsdp", "tensor"), (name, gate[name].sharding)
    assert len({str(s.index) for s in gate[name].addressable_shards}) == 2
  # the table's codes (d / 2, V): the float table's ('tensor', 'fsdp') reversed
  table = frozen["embed_tokens"]
  for name in ("codes", "scales"):
    assert table[name].sharding.spec == jax.P("fsdp", "tensor"), (name, table[name].sharding)
    assert table[name].addressable_shards[0].data.shape[1] == VOCAB // 2
  assert sharded.step_traces == 1


def test_a_mesh_that_splits_the_tables_blocks_is_refused():
  # tiny: hidden 64, one block per table row; fsdp=2 would split it (the linear layers' inputs
  # too: the check names the first offender, so test the table alone)
  model = LlamaForCausalLM(ModelConfig.preset("tiny", vocab_size=VOCAB), rngs=nnx.Rngs(0))
  quantize_model(model, "nf4")
  for path, module in list(nnx.iter_modules(model)):
    if isinstance(module, anlr_jax.nn.quant.QuantLinear):
      module.in_features = 128  # stands for a layer the mesh does not split
  mesh = make_mesh(data=4, fsdp=2, tensor=1)
  try:
    check_quantized_blocks(model, mesh)
  except ValueError as err:
    assert "embed_tokens" in str(err) and "64-weight blocks" in str(err), err
  else:
    raise AssertionError("a mesh splitting the table's blocks was accepted")
