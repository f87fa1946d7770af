"""Hugging Face safetensors load/save against transformers (tiny random checkpoints, no network)."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors.numpy import load_file, save_file

from anlr_jax.models.config import ModelConfig
from anlr_jax.models.hf_io import hf_param_table, load_hf_model, load_tokenizer, save_hf_model
from anlr_jax.models.llama import LlamaForCausalLM
from anlr_jax.nn.inject import inject_lora
from tests.helpers.tiny_llama import forward, hf_logits, left_padded_batch, make_hf_model
from tests.tiny_tokenizer import build_tiny_tokenizer


def _max_err(a, b, mask):
  real = mask.astype(bool)
  return np.abs(np.asarray(a)[real] - np.asarray(b)[real]).max()


def test_sharded_checkpoint_loads_through_the_index(tmp_path):
  hf = make_hf_model("llama3")
  hf.save_pretrained(tmp_path, max_shard_size="20KB")
  assert (tmp_path / "model.safetensors.index.json").exists()
  assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 2
  model, config = load_hf_model(tmp_path)
  assert config.rope_scaling["rope_type"] == "llama3"
  ids, mask = left_padded_batch(config.vocab_size)
  assert (
      _max_err(forward(model, jnp.asarray(ids), jnp.asarray(mask)), hf_logits(hf, ids, mask), mask)
      <= 1e-4
  )


def test_loaded_params_equal_checkpoint_tensors(tmp_path):
  hf = make_hf_model("qwen2")
  hf.save_pretrained(tmp_path)
  model, _ = load_hf_model(tmp_path)
  q = model.model.layers[1].self_attn.q_proj
  np.testing.assert_array_equal(
      q.kernel[...], hf.model.layers[1].self_attn.q_proj.weight.detach().numpy().T
  )
  np.testing.assert_array_equal(
      q.bias[...], hf.model.layers[1].self_attn.q_proj.bias.detach().numpy()
  )
  assert model.model.layers[1].self_attn.o_proj.bias is None  # Qwen2 o_proj has no bias
  # Nothing left abstract (every variable was filled from the checkpoint).
  for _, var in nnx.to_flat_state(nnx.state(model)):
    assert isinstance(var.get_value(), jax.Array)


def test_bf16_checkpoint(tmp_path):
  hf = make_hf_model("qwen2")
  ids, mask = left_padded_batch(hf.config.vocab_size)
  reference = hf_logits(hf, ids, mask)
  hf.to(torch.bfloat16).save_pretrained(tmp_path)
  model, config = load_hf_model(tmp_path, dtype=jnp.bfloat16)
  assert config.dtype == config.param_dtype == jnp.bfloat16
  dtypes = {v.get_value().dtype for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
  assert dtypes == {jnp.dtype(jnp.bfloat16)}
  np.testing.assert_array_equal(  # bf16 bits preserved exactly
      np.asarray(model.model.embed_tokens.embedding[...].astype(jnp.float32)),
      hf.model.embed_tokens.weight.detach().float().numpy(),
  )
  got = forward(model, jnp.asarray(ids), jnp.asarray(mask))
  assert got.dtype == jnp.float32
  # Our bf16 rounding error is of the order of transformers' own bf16 error.
  hf_bf16_err = _max_err(hf_logits(hf, ids, mask), reference, mask)
  assert _max_err(got, reference, mask) <= 2 * hf_bf16_err
  # f32 params loaded from the bf16 file, f32 compute: exactly the upcast weights.
  model32, _ = load_hf_model(tmp_path, dtype=jnp.float32)
  assert model32.lm_head.kernel.dtype == jnp.float32


@pytest.mark.parametrize("kind,shard", [("llama", None), ("qwen2_tied", "30KB")])
def test_save_then_transformers_loads_same_logits(tmp_path, kind, shard):
  hf_src = make_hf_model(kind, seed=4)
  hf_src.save_pretrained(tmp_path / "src")
  model, config = load_hf_model(tmp_path / "src")
  names = save_hf_model(model, config, tmp_path / "out", max_shard_size=shard or "5GB")
  assert (len(names) > 1) == (shard is not None)
  assert (tmp_path / "out" / "model.safetensors.index.json").exists() == (shard is not None)
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
  assert type(reloaded).__name__ == type(hf_src).__name__
  ids, mask = left_padded_batch(config.vocab_size)
  ours = forward(model, jnp.asarray(ids), jnp.asarray(mask))
  assert _max_err(hf_logits(reloaded, ids, mask), ours, mask) <= 1e-4
  # And our loader reads our own files back bit for bit.
  again, again_config = load_hf_model(tmp_path / "out")
  assert again_config == config
  np.testing.assert_array_equal(
      again.model.layers[0].mlp.down_proj.kernel[...],
      model.model.layers[0].mlp.down_proj.kernel[...],
  )


def test_save_with_merged_lora(tmp_path):
  config = ModelConfig.preset("tiny", vocab_size=96, hidden_size=32, intermediate_size=48)
  model = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
  inject_lora(
      model,
      target_modules=("q_proj", "v_proj", "down_proj"),
      rank=2,
      alpha=4.0,
      dropout=0.0,
      rngs=nnx.Rngs(1),
  )
  layer = model.model.layers[0].self_attn.q_proj
  assert hasattr(layer, "lora_b")
  for lora_layer in (layer, model.model.layers[1].mlp.down_proj):
    lora_layer.lora_b[...] = 0.5 * jax.random.normal(jax.random.key(2), lora_layer.lora_b.shape)
  save_hf_model(model, config, tmp_path / "merged", merge_lora=True)
  save_hf_model(model, config, tmp_path / "base", merge_lora=False)
  ids, mask = left_padded_batch(config.vocab_size)
  ours = forward(model, jnp.asarray(ids), jnp.asarray(mask))
  merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
  assert _max_err(hf_logits(merged, ids, mask), ours, mask) <= 1e-4
  unmerged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval()
  assert _max_err(hf_logits(unmerged, ids, mask), ours, mask) > 1e-3  # the adapters matter
  base = load_file(str(tmp_path / "base" / "model.safetensors"))
  key = "model.layers.0.self_attn.q_proj.weight"
  np.testing.assert_array_equal(base[key], np.asarray(layer.base.kernel[...]).T)
  assert not np.allclose(load_file(str(tmp_path / "merged" / "model.safetensors"))[key], base[key])


# ------------------------------------------------------------------------------------------------
# Errors


@pytest.fixture
def saved_llama(tmp_path):
  make_hf_model("llama").save_pretrained(tmp_path)
  return tmp_path


def test_missing_files_raise_file_not_found(tmp_path, saved_llama):
  with pytest.raises(FileNotFoundError, match=str(tmp_path / "empty")):
    load_hf_model(tmp_path / "empty")
  os.remove(saved_llama / "model.safetensors")
  with pytest.raises(FileNotFoundError, match="model.safetensors"):
    load_hf_model(saved_llama)


def test_missing_shard_raises_file_not_found(tmp_path):
  make_hf_model("llama").save_pretrained(tmp_path, max_shard_size="20KB")
  shard = sorted(tmp_path.glob("model-*.safetensors"))[1]
  os.remove(shard)
  with pytest.raises(FileNotFoundError, match=shard.name):
    load_hf_model(tmp_path)


def test_missing_tensor_raises_key_error_naming_key_and_file(saved_llama):
  file = saved_llama / "model.safetensors"
  tensors = load_file(str(file))
  del tensors["model.layers.1.mlp.up_proj.weight"]
  save_file(tensors, str(file), metadata={"format": "pt"})
  with pytest.raises(KeyError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*model\.safetensors"):
    load_hf_model(saved_llama)


def test_shape_mismatch_raises_value_error_with_shapes(saved_llama):
  config = json.loads((saved_llama / "config.json").read_text())
  config["intermediate_size"] = 40
  (saved_llama / "config.json").write_text(json.dumps(config))
  with pytest.raises(ValueError, match=r"model\.safetensors.*gate_proj.*\(48, 32\).*\(40, 32\)"):
    load_hf_model(saved_llama)


def test_unexpected_tensors_and_model_type(saved_llama):
  config = json.loads((saved_llama / "config.json").read_text())
  config["num_hidden_layers"] = 1
  (saved_llama / "config.json").write_text(json.dumps(config))
  with pytest.raises(ValueError, match=r"model\.layers\.1\."):
    load_hf_model(saved_llama)
  config["model_type"] = "mistral"
  (saved_llama / "config.json").write_text(json.dumps(config))
  with pytest.raises(ValueError, match="mistral"):
    load_hf_model(saved_llama)


def test_bad_shard_size_is_rejected(tmp_path):
  config = ModelConfig.preset("tiny")
  model = nnx.eval_shape(lambda: LlamaForCausalLM(config, rngs=nnx.Rngs(0)))
  with pytest.raises(ValueError, match="max_shard_size"):
    save_hf_model(model, config, tmp_path, max_shard_size="lots")


def test_param_table_covers_every_model_param():
  for config in (
      ModelConfig.preset("tiny"),
      ModelConfig.preset("tiny", attention_bias=True, model_type="qwen2", tie_word_embeddings=True),
  ):
    model = nnx.eval_shape(lambda: LlamaForCausalLM(config, rngs=nnx.Rngs(0)))
    paths = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    table = {".".join(map(str, e.module_path + (e.attr,))) for e in hf_param_table(config)}
    assert paths == table


def test_load_tokenizer(tmp_path):
  with pytest.raises(FileNotFoundError, match=str(tmp_path)):
    load_tokenizer(tmp_path)
  build_tiny_tokenizer(tmp_path / "tok")
  tokenizer = load_tokenizer(tmp_path / "tok")
  assert tokenizer.decode(tokenizer("hello world").input_ids) == "hello world"


def test_load_under_a_mesh_shards_params_by_logical_axes(tmp_path):
  hf = make_hf_model("llama")
  hf.save_pretrained(tmp_path)
  mesh = jax.make_mesh(
      (2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 3
  )
  rules = (
      ("vocab", "tensor"),
      ("embed", "fsdp"),
      ("q_heads", "tensor"),
      ("kv_heads", "tensor"),
      ("mlp", "tensor"),
      ("norm", None),
  )
  ids, mask = left_padded_batch(hf.config.vocab_size)
  with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
    model, _ = load_hf_model(tmp_path)
    kernel = model.model.layers[0].mlp.down_proj.kernel.get_value()
    assert kernel.sharding.spec == jax.sharding.PartitionSpec("tensor", "fsdp")
    assert len(kernel.addressable_shards) == 8 and kernel.addressable_shards[0].data.shape == (
        24,
        16,
    )
    logits = forward(model, jnp.asarray(ids), jnp.asarray(mask))
  assert _max_err(logits, hf_logits(hf, ids, mask), mask) <= 1e-4


def test_a_plain_fast_tokenizer_loads_as_autotokenizer_would_without_importing_torch(tmp_path):
  """A tokenizer.json whose tokenizer_config names the plain fast class: the same tokenizer as
  ``AutoTokenizer`` (class, ids, special tokens, chat template), and no ``import torch`` on the way
  (transformers' auto classes import it: seconds at every start of the command line)."""
  import subprocess
  import sys

  build_tiny_tokenizer(tmp_path)
  config = json.loads((tmp_path / "tokenizer_config.json").read_text())
  config["chat_template"] = "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}"
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
  ours = load_tokenizer(tmp_path)
  auto = transformers.AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
  assert type(ours) is type(auto)
  text = "the cat sat on the mat, twice: 12 + 30 = 42"
  assert ours(text)["input_ids"] == auto(text)["input_ids"]
  assert (
      ours.all_special_tokens == auto.all_special_tokens and ours.pad_token_id == auto.pad_token_id
  )
  messages = [{"role": "user", "content": "hi"}]
  assert ours.apply_chat_template(messages, tokenize=False) == auto.apply_chat_template(
      messages, tokenize=False
  )
  code = (
      "import sys; from anlr_jax.models import load_tokenizer;"
      f" load_tokenizer({str(tmp_path)!r}); print('torch' in sys.modules)"
  )
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out = subprocess.run(
      [sys.executable, "-c", code], capture_output=True, text=True, cwd=repo, check=True
  )
  assert out.stdout.strip() == "False", out.stderr[-2000:]
