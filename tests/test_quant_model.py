"""A quantised base in the LLaMA / Qwen2 model: logits, LoRA gradients and AnLR steps equal those of
the same model built from the dequantised weights; loading quantises from safetensors and GGUF."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import transformers
from flax import nnx

from anlr_jax.models import ModelConfig, load_hf_model
from anlr_jax.models.hf_io import (
    hf_param_table,
    model_from_hf_tensors,
    save_hf_model,
    torch_layout_tensor,
)
from anlr_jax.models.llama import LlamaForCausalLM
from anlr_jax.nn import inject_lora, iter_lora_layers
from anlr_jax.models.quantize import quantize_model
from anlr_jax.nn.quant import QuantEmbed, QuantLinear, quantize_kernel
from anlr_jax.optim import anlr

TARGETS = ("q_proj", "v_proj", "up_proj", "down_proj")


def tiny_config(kind: str = "llama") -> ModelConfig:
  """The tiny preset with one decoder layer: every equality here holds layer by layer, and each
  layer more only lengthens the compiled programs."""
  extra = dict(model_type="qwen2", attention_bias=True) if kind == "qwen2" else {}
  return ModelConfig.preset(
      "tiny", vocab_size=96, tie_word_embeddings=False, num_hidden_layers=1, **extra
  )


def hf_tensors(model, config) -> dict[str, np.ndarray]:
  """The model's Hugging Face tensors (float32; quantised layers dequantised)."""
  return {
      e.hf_key: torch_layout_tensor(model, e, False, jnp.float32) for e in hf_param_table(config)
  }


@functools.cache
def _source_and_dequantised(mode: str, kind: str):
  """``(config.json dict, a random model's tensors, its quantised model's dequantised tensors)``,
  computed once per ``(mode, kind)``; the tests build their own models from them."""
  config = tiny_config(kind)
  source = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
  tensors = hf_tensors(source, config)
  hf = config.to_hf_config()
  quantised, _ = model_from_hf_tensors(hf, tensors, quantize=mode)
  return hf, tensors, hf_tensors(quantised, config)


def quantised_and_dequantised(mode: str, kind: str = "llama"):
  """``(model with a quantised base, the same model built from its dequantised weights)``."""
  hf, tensors, dequantised = _source_and_dequantised(mode, kind)
  quantised, _ = model_from_hf_tensors(hf, tensors, quantize=mode)
  plain, _ = model_from_hf_tensors(hf, dequantised)
  return quantised, plain


def batch(seed=0):
  ids = jax.random.randint(jax.random.key(seed), (2, 12), 0, 96)
  mask = jnp.ones_like(ids).at[1, :3].set(0)
  return ids, mask


def relative_error(a, b) -> float:
  return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


@pytest.mark.parametrize("mode,kind", [("nf4", "llama"), ("int8", "qwen2")])
def test_logits_equal_the_dequantised_model(mode, kind):
  quantised, plain = quantised_and_dequantised(mode, kind)
  linears = [m for _, m in nnx.iter_modules(quantised) if isinstance(m, nnx.Linear)]
  assert linears and all(isinstance(m, QuantLinear) for m in linears)  # lm_head too
  assert isinstance(quantised.model.embed_tokens, QuantEmbed)  # the table too
  ids, mask = batch()
  forward = nnx.jit(lambda m, ids, mask: m(ids, attention_mask=mask))
  assert relative_error(forward(quantised, ids, mask), forward(plain, ids, mask)) <= 1e-6


def lora_loss(model, ids, mask):
  logits = model(ids, attention_mask=mask)
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], ids[:, 1:]))


def with_lora(model, init="default", dora=False):
  inject_lora(
      model,
      target_modules=TARGETS,
      rank=4,
      alpha=8.0,
      init=init,
      use_dora=dora,
      dropout=0.0,
      rngs=nnx.Rngs(1),
  )
  for i, (_, layer) in enumerate(iter_lora_layers(model)):
    layer.lora_b[...] = 0.1 * jax.random.normal(jax.random.key(i), layer.lora_b.shape)
  return model


@pytest.mark.parametrize("dora", [False, True])
def test_lora_gradients_equal_the_dequantised_model(dora):
  quantised, plain = (with_lora(m, dora=dora) for m in quantised_and_dequantised("nf4"))
  ids, mask = batch(1)
  grad = nnx.jit(nnx.grad(lora_loss, argnums=nnx.DiffState(0, nnx.LoRAParam)))
  gq, gp = grad(quantised, ids, mask), grad(plain, ids, mask)
  leaves_q, leaves_p = jax.tree.leaves(gq), jax.tree.leaves(gp)
  layers = quantised.config.num_hidden_layers
  assert len(leaves_q) == len(leaves_p) == len(TARGETS) * layers * (3 if dora else 2)
  for a, b in zip(leaves_q, leaves_p):
    assert relative_error(a, b) <= 1e-6


def test_anlr_steps_equal_the_dequantised_model():
  models = [with_lora(m) for m in quantised_and_dequantised("nf4")]
  tx = anlr(1e-2, warmup_steps=1, weight_decay=0.0)
  optimizers = [nnx.Optimizer(m, tx, wrt=nnx.LoRAParam) for m in models]

  @nnx.jit
  def step(model, optimizer, ids, mask):
    loss, grads = nnx.value_and_grad(lora_loss, argnums=nnx.DiffState(0, nnx.LoRAParam))(
        model, ids, mask
    )
    optimizer.update(model, grads)
    return loss

  for t in range(4):
    ids, mask = batch(10 + t)
    losses = [step(m, o, ids, mask) for m, o in zip(models, optimizers)]
    assert abs(float(losses[0]) - float(losses[1])) <= 1e-6 * abs(float(losses[1]))
    for a, b in zip(*(jax.tree.leaves(nnx.state(m, nnx.LoRAParam)) for m in models)):
      assert relative_error(a, b) <= 1e-5, t


def test_pissa_takes_its_init_from_the_full_precision_weight():
  """As PEFT does: the SVD of the float weight, then the residual quantised (not the SVD of the
  quantised weight)."""
  config = tiny_config()
  model = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
  w = model.model.layers[0].self_attn.q_proj.kernel[...]
  with_pissa = quantize_model(
      inject_lora(
          model,
          target_modules=("q_proj",),
          rank=4,
          alpha=8.0,
          init="pissa",
          dropout=0.0,
          rngs=nnx.Rngs(1),
      ),
      "nf4",
  )
  layer = with_pissa.model.layers[0].self_attn.q_proj
  assert isinstance(layer.base, QuantLinear)
  u, s, vt = np.linalg.svd(np.asarray(w), full_matrices=False)
  residual = np.asarray(w) - (u[:, :4] * s[:4]) @ vt[:4]
  expected = quantize_kernel(jnp.asarray(residual), "nf4")["codes"]
  assert np.mean(np.asarray(layer.base.codes[...]) == np.asarray(expected)) > 0.99
  np.testing.assert_allclose(
      layer.scale * layer.lora_a[...] @ layer.lora_b[...], w - residual, atol=2e-5
  )


def test_quantise_on_load_from_safetensors_and_gguf(tmp_path):
  from tests.test_gguf import write_gguf

  config = tiny_config()
  source = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
  save_hf_model(source, config, tmp_path / "hf")
  loaded, _ = load_hf_model(tmp_path / "hf", quantize="nf4")
  in_memory = quantize_model(source, "nf4")
  for a, b in zip(
      jax.tree.leaves(nnx.state(loaded, nnx.Param)),
      jax.tree.leaves(nnx.state(in_memory, nnx.Param)),
  ):
    np.testing.assert_array_equal(a, b)

  hf_config = transformers.LlamaConfig(**tiny_config().to_hf_config())
  hf = transformers.LlamaForCausalLM(hf_config)
  expected = write_gguf(tmp_path / "tiny.gguf", hf, "Q8_0", None)
  from_gguf, _ = load_hf_model(tmp_path / "tiny.gguf", quantize="int8")
  layer = from_gguf.model.layers[0].mlp.down_proj
  want = quantize_kernel(jnp.asarray(expected["model.layers.0.mlp.down_proj.weight"].T), "int8")
  np.testing.assert_array_equal(layer.codes[...], want["codes"])


def test_bad_quantize_settings_are_one_line(tmp_path):
  config = dataclasses.replace(tiny_config(), intermediate_size=200)
  model = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"model.layers.0.mlp.down_proj has input width 200"):
    quantize_model(model, "nf4")
  with pytest.raises(ValueError, match=r"model.quantize='fp4' must be one of none, int8, nf4"):
    load_hf_model(tmp_path, quantize="fp4")
  with pytest.raises(ValueError, match=r"base is quantised"):
    layer = with_lora(quantised_and_dequantised("int8")[0])
    next(iter_lora_layers(layer))[1].merge()
