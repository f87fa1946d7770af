"""ModelConfig and LlamaForCausalLM against transformers/torch (tiny random models, CPU, no network)."""

import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from anlr_jax.models.config import ModelConfig
from anlr_jax.models.hf_io import load_hf_model
from anlr_jax.models.llama import LOGICAL_AXES, LlamaForCausalLM, init_cache
from tests.helpers.cim_torch import torch_one_thread  # noqa: F401  (autouse)
from tests.helpers.tiny_llama import (
    LLAMA3_ROPE,
    TINY,
    forward,
    hf_logits,
    left_padded_batch,
    make_hf_model,
)


@pytest.fixture(scope="module", params=["llama", "llama3", "qwen2", "qwen2_tied"])
def hf_and_flax(request, tmp_path_factory):
  hf = make_hf_model(request.param)
  path = tmp_path_factory.mktemp(request.param)
  hf.save_pretrained(path)
  model, config = load_hf_model(path)
  return request.param, hf, model, config


# ------------------------------------------------------------------------------------------------
# ModelConfig


@pytest.mark.parametrize(
    "preset,billions",
    [("llama2_7b", 6.738), ("llama3_8b", 8.030), ("qwen2_5_7b", 7.616), ("qwen2_5_14b", 14.770)],
)
def test_preset_parameter_counts_match_published_sizes(preset, billions):
  config = ModelConfig.preset(preset)
  assert abs(config.num_params() / 1e9 - billions) < 0.01 * billions


def test_tiny_preset_is_a_few_hundred_k_params():
  config = ModelConfig.preset("tiny")
  model = nnx.eval_shape(lambda: LlamaForCausalLM(config, rngs=nnx.Rngs(0)))
  n = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  assert n == config.num_params()
  assert 50_000 < n < 1_000_000


def test_from_hf_config_reads_transformers_configs():
  hf = transformers.LlamaConfig(**TINY, rope_scaling=dict(LLAMA3_ROPE), rope_theta=5e5).to_dict()
  config = ModelConfig.from_hf_config(hf)
  assert (config.num_key_value_heads, config.head_dim, config.rope_theta) == (2, 8, 5e5)
  assert config.rope_scaling["rope_type"] == "llama3" and not config.attention_bias
  qwen = ModelConfig.from_hf_config(
      transformers.Qwen2Config(**TINY, tie_word_embeddings=True).to_dict()
  )
  assert qwen.attention_bias and qwen.tie_word_embeddings and qwen.model_type == "qwen2"
  # transformers 4.x layout: top-level rope_theta and legacy {"type": ...}.
  legacy = dict(
      model_type="llama",
      **TINY,
      rope_theta=123.0,
      rope_scaling={"type": "llama3", **{k: v for k, v in LLAMA3_ROPE.items() if k != "rope_type"}},
  )
  old = ModelConfig.from_hf_config(legacy)
  assert old.rope_theta == 123.0 and old.rope_scaling["rope_type"] == "llama3"
  assert hash(old) == hash(ModelConfig.from_hf_config(legacy))


def test_from_pretrained_and_round_trip_through_transformers(tmp_path):
  config = ModelConfig.preset("tiny", rope_scaling=dict(LLAMA3_ROPE))
  (tmp_path / "config.json").write_text(json.dumps(config.to_hf_config()))
  assert ModelConfig.from_pretrained(tmp_path) == config
  hf = transformers.AutoConfig.from_pretrained(tmp_path)
  assert hf.num_key_value_heads == 2 and hf.rope_parameters["rope_type"] == "llama3"


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(model_type="mistral"), r"mistral.*llama.*qwen2"),
        (dict(num_attention_heads=5), "num_attention_heads"),
        (dict(num_key_value_heads=3), "num_key_value_heads"),
        (dict(vocab_size=0), "vocab_size"),
        (dict(rope_scaling={"rope_type": "yarn", "factor": 2.0}), "yarn"),
        (dict(rope_scaling={"rope_type": "llama3", "factor": 2.0}), "low_freq_factor"),
        (dict(dtype=jnp.int32), "dtype"),
        (dict(attention_impl="flash"), "attention_impl"),
    ],
)
def test_invalid_config_names_the_field(kwargs, match):
  with pytest.raises(ValueError, match=match):
    ModelConfig.preset("tiny", **kwargs)


def test_from_pretrained_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="config.json"):
    ModelConfig.from_pretrained(tmp_path)
  (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", **TINY}))
  with pytest.raises(ValueError, match="gpt2"):
    ModelConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize("rope_scaling", [None, LLAMA3_ROPE])
def test_rope_inv_freq_matches_transformers(rope_scaling):
  hf = transformers.LlamaConfig(**TINY, rope_theta=500.0, rope_scaling=rope_scaling)
  expected, _ = (
      ROPE_INIT_FUNCTIONS["llama3"](hf)
      if rope_scaling
      else (1.0 / (500.0 ** (torch.arange(0, 8, 2).float() / 8)), 1.0)
  )
  ours = ModelConfig.from_hf_config(hf.to_dict()).rope_inv_freq()
  np.testing.assert_allclose(ours, expected.numpy(), rtol=1e-6)
  if rope_scaling:  # the scaling really changes the low frequencies
    assert not np.allclose(ours, ModelConfig.preset("tiny", head_dim=8).rope_inv_freq())


# ------------------------------------------------------------------------------------------------
# Module tree: HF names and logical axes


@pytest.mark.parametrize("kind", ["llama", "qwen2_tied"])
def test_module_paths_mirror_hugging_face_names(kind):
  hf = make_hf_model(kind)
  config = ModelConfig.from_hf_config(hf.config.to_dict())
  ours = nnx.eval_shape(lambda: LlamaForCausalLM(config, rngs=nnx.Rngs(0)))
  ours_names = {".".join(map(str, p)) for p, _ in nnx.iter_modules(ours) if p}
  hf_names = {
      n
      for n, m in hf.named_modules()
      if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)) or "norm" in n.split(".")[-1]
  }
  if kind == "qwen2_tied":  # HF keeps an lm_head sharing the embedding; ours has none
    hf_names.discard("lm_head")
  assert hf_names <= ours_names
  assert ("lm_head" in ours_names) == (kind != "qwen2_tied")
  for name, param in hf.named_parameters():
    module_name, leaf = name.rsplit(".", 1)
    node = ours
    for part in module_name.split("."):
      node = node[int(part)] if part.isdigit() else getattr(node, part)
    ours_leaf = {
        "weight": "kernel"
        if isinstance(node, nnx.Linear)
        else ("embedding" if isinstance(node, nnx.Embed) else "weight"),
        "bias": "bias",
    }[leaf]
    shape = getattr(node, ours_leaf).shape
    assert shape == (
        tuple(param.shape)[::-1] if ours_leaf == "kernel" else tuple(param.shape)
    ), name


def test_every_param_has_logical_axes():
  config = ModelConfig.preset("tiny", attention_bias=True)
  model = nnx.eval_shape(lambda: LlamaForCausalLM(config, rngs=nnx.Rngs(0)))
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    names = var.get_metadata()["out_sharding"]
    assert len(names) == var.ndim and set(names) <= set(LOGICAL_AXES), path
  spec = nnx.get_partition_spec(nnx.state(model))
  assert tuple(spec["model"]["layers"][0]["self_attn"]["k_proj"]["kernel"].get_value()) == (
      "embed",
      "kv_heads",
  )
  assert tuple(spec["lm_head"]["kernel"].get_value()) == ("embed", "vocab")


# ------------------------------------------------------------------------------------------------
# Forward parity with transformers


def test_logits_match_transformers_with_left_padding(hf_and_flax):
  kind, hf, model, config = hf_and_flax
  ids, mask = left_padded_batch(config.vocab_size)
  expected = hf_logits(hf, ids, mask)
  got = np.asarray(forward(model, jnp.asarray(ids), jnp.asarray(mask)))
  assert got.dtype == np.float32 and got.shape == expected.shape
  real = mask.astype(bool)
  assert np.abs(expected[real]).max() > 0.5  # non-trivial logits
  np.testing.assert_allclose(got[real], expected[real], atol=1e-4, rtol=0)


def test_left_padded_row_equals_unpadded_row(hf_and_flax):
  _, _, model, config = hf_and_flax
  ids, mask = left_padded_batch(config.vocab_size)
  batch = forward(model, jnp.asarray(ids), jnp.asarray(mask))
  alone = forward(model, jnp.asarray(ids[2:, 11:]), jnp.ones((1, ids.shape[1] - 11), jnp.int32))
  chex.assert_trees_all_close(batch[2, 11:], alone[0], atol=1e-5)


def test_cached_decoding_matches_full_forward(hf_and_flax):
  _, _, model, config = hf_and_flax
  ids, mask = left_padded_batch(config.vocab_size, length=12)
  full = forward(model, jnp.asarray(ids), jnp.asarray(mask))
  cache = init_cache(config, 3, 16)
  step = nnx.jit(lambda m, x, x_mask, c: m(x, attention_mask=x_mask, cache=c))
  logits, cache = step(model, jnp.asarray(ids[:, :8]), jnp.asarray(mask[:, :8]), cache)
  pieces = [logits]
  for t in range(8, 12):
    logits, cache = step(
        model, jnp.asarray(ids[:, t : t + 1]), jnp.asarray(mask[:, t : t + 1]), cache
    )
    pieces.append(logits)
  assert int(cache.index) == 12
  real = mask.astype(bool)
  np.testing.assert_allclose(np.concatenate(pieces, 1)[real], np.asarray(full)[real], atol=1e-5)


def test_fused_attention_path_matches_einsum_on_right_padded_rows():
  """'xla' runs jax.nn.dot_product_attention with the arguments 'cudnn' gets (causal + key lengths).

  On right-padded rows (what anlr_jax.data produces) it must give the einsum path's logits on every
  real token and the same LoRA-free gradients of a loss masked to real tokens.
  """
  kw = dict(num_hidden_layers=2, vocab_size=64, num_attention_heads=4, num_key_value_heads=2)
  einsum = LlamaForCausalLM(ModelConfig.preset("tiny", **kw), rngs=nnx.Rngs(5))
  fused = LlamaForCausalLM(ModelConfig.preset("tiny", attention_impl="xla", **kw), rngs=nnx.Rngs(5))
  rng = np.random.default_rng(1)
  ids = jnp.asarray(rng.integers(0, 64, (3, 9)))
  mask = jnp.asarray((np.arange(9)[None, :] < np.array([[9], [5], [1]])).astype(np.int32))
  real = np.asarray(mask).astype(bool)

  def loss(m):
    logits = m(ids, attention_mask=mask)
    logp = jax.nn.log_softmax(logits)[..., 0]
    return jnp.sum(logp * mask) / jnp.sum(mask), logits

  # logits and gradients from one compiled program per model (eager dispatch is slow)
  logits_and_grad = nnx.jit(lambda m: nnx.grad(loss, has_aux=True)(m)[::-1])
  a, grad_einsum = logits_and_grad(einsum)
  b, grad_fused = logits_and_grad(fused)
  assert np.all(np.isfinite(np.asarray(b)))
  np.testing.assert_allclose(np.asarray(b)[real], np.asarray(a)[real], atol=2e-5)
  chex.assert_trees_all_close(grad_einsum, grad_fused, atol=2e-5)


def test_remat_gives_same_logits_and_gradients():
  config = ModelConfig.preset("tiny", num_hidden_layers=1, vocab_size=64)
  ids = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 6)))
  plain = LlamaForCausalLM(config, rngs=nnx.Rngs(3))
  remat = LlamaForCausalLM(
      ModelConfig.preset("tiny", num_hidden_layers=1, vocab_size=64, remat=True), rngs=nnx.Rngs(3)
  )
  loss = lambda m: jnp.mean(jax.nn.log_softmax(m(ids))[..., 0])
  grad = nnx.jit(nnx.grad(loss))
  chex.assert_trees_all_close(grad(plain), grad(remat), atol=1e-6)


def test_bf16_compute_dtype(tmp_path):
  hf = make_hf_model("llama3")
  hf.save_pretrained(tmp_path)
  model, config = load_hf_model(tmp_path, compute_dtype=jnp.bfloat16)
  assert config.dtype == jnp.bfloat16 and config.param_dtype == jnp.float32
  assert model.model.layers[0].mlp.up_proj.kernel.dtype == jnp.float32
  ids, mask = left_padded_batch(config.vocab_size)
  got = np.asarray(forward(model, jnp.asarray(ids), jnp.asarray(mask)))
  expected = hf_logits(hf, ids, mask)
  real = mask.astype(bool)
  err = np.abs(got[real] - expected[real]).max()
  assert got.dtype == np.float32 and 1e-4 < err < 0.1 * np.abs(expected[real]).max()


def test_auto_attention_resolves_by_backend_and_dtype(monkeypatch):
  from anlr_jax.models import llama

  bf16 = ModelConfig.preset("tiny", attention_impl="auto", dtype=jnp.bfloat16)
  f32 = ModelConfig.preset("tiny", attention_impl="auto")
  assert llama.resolve_attention_impl(bf16) == "einsum"  # CPU backend here
  monkeypatch.setattr(llama.jax, "default_backend", lambda: "gpu")
  assert llama.resolve_attention_impl(bf16) == "cudnn"
  assert llama.resolve_attention_impl(f32) == "einsum"  # cuDNN flash attention needs 16-bit
  assert llama.resolve_attention_impl(ModelConfig.preset("tiny", attention_impl="xla")) == "xla"
  with pytest.raises(ValueError, match="attention_impl='cudnn'.*float32"):
    llama.resolve_attention_impl(ModelConfig.preset("tiny", attention_impl="cudnn"))
  monkeypatch.undo()
  with pytest.raises(ValueError, match="attention_impl='cudnn'.*backend 'cpu'"):
    LlamaForCausalLM(
        ModelConfig.preset("tiny", attention_impl="cudnn", dtype=jnp.bfloat16), rngs=nnx.Rngs(0)
    )


@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (6, 3), (4, 4)])
def test_grouped_attention_matches_numpy_per_head(heads, kv_heads):
  """Query head h reads key/value head h // (heads / kv_heads), under an arbitrary mask, in the
  order the grouped matmuls stack the heads (written per head, from the equations)."""
  from anlr_jax.models.llama import grouped_attention

  b, t, s, d = 2, 5, 7, 4
  rng = np.random.default_rng(0)
  q = rng.normal(size=(b, t, heads, d)).astype(np.float32)
  k = rng.normal(size=(b, s, kv_heads, d)).astype(np.float32)
  v = rng.normal(size=(b, s, kv_heads, d)).astype(np.float32)
  allowed = rng.random((b, t, s)) < 0.6
  allowed[..., 0] = True  # every query sees at least one key
  out = np.asarray(grouped_attention(q, k, v, jnp.asarray(allowed), jnp.float32))
  want = np.zeros_like(out)
  for i in range(b):
    for h in range(heads):
      j = h // (heads // kv_heads)
      scores = q[i, :, h] @ k[i, :, j].T / np.sqrt(d)
      scores = np.where(allowed[i], scores, -np.inf)
      p = np.exp(scores - scores.max(-1, keepdims=True))
      want[i, :, h] = (p / p.sum(-1, keepdims=True)) @ v[i, :, j]
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
