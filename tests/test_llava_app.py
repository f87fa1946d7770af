"""LLaVA in ``anlr train``'s assembly: the model found from config.json, the projector trained at
``model.projector_lr`` and saved with the adapters, and ``--dry_run`` of the shipped config."""

import dataclasses
import os

import jax
import numpy as np
import pytest
from flax import nnx

from anlr_jax import assets
from anlr_jax.app.config import load_config
from anlr_jax.app.dryrun import estimate
from anlr_jax.app.assemble import build_method
from anlr_jax.app.model import load_base, load_lora_params, save_lora_params
from anlr_jax.settings import ConfigError
from anlr_jax.models import LlavaForConditionalGeneration
from anlr_jax.nn import FullParam, iter_lora_layers
from tests.helpers.tiny_llava import make_hf_llava

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
  path = tmp_path_factory.mktemp("llava_app")
  make_hf_llava(seed=21).save_pretrained(path)
  return str(path)


def _config(path, *overrides):
  return load_config(
      None,
      [
          f"model.path={path}",
          f"model.tokenizer={assets.quickstart_dir()}",  # any tokenizer: none is used here
          "lora.rank=2",
          "lora.alpha=4",
          "lora.dropout=0.0",
          "anlr.warmup_steps=1",
          *overrides,
      ],
  )


def _leaf(tree, *path):
  for key in path:
    tree = tree[key]
  return np.asarray(tree)


def test_projector_lr_trains_the_projector_and_is_saved(llava_dir, tmp_path):
  config = _config(llava_dir, "model.projector_lr=1e-3")
  model, _, _ = load_base(config)
  assert isinstance(model, LlavaForConditionalGeneration)
  build_method(dataclasses.replace(config, method="anlr"), model=model)
  assert all(n.startswith("model.language_model.") for n, _ in iter_lora_layers(model))
  full = nnx.to_flat_state(nnx.state(model, FullParam))
  assert sorted(".".join(map(str, p)) for p, _ in full) == [
      f"model.multi_modal_projector.linear_{i}.{a}" for i in (1, 2) for a in ("bias", "kernel")
  ]
  # Adam's first step moves every leaf by its learning rate: 1e-2 (adapters), 1e-3 (projector).
  built = build_method(
      dataclasses.replace(config, method="anlr"), total_steps=4, learning_rate=1e-2
  )
  params = nnx.to_pure_dict(nnx.state(model, nnx.LoRAParam))
  grads = jax.tree.map(lambda x: np.full(x.shape, 0.5, np.float32), params)
  updates, _ = built.tx.update(grads, built.tx.init(params), params)
  projector = ("model", "multi_modal_projector", "linear_1", "kernel")
  q_a = ("model", "language_model", "layers", 0, "self_attn", "q_proj", "lora_a")
  np.testing.assert_allclose(_leaf(updates, *projector), -1e-3, rtol=1e-4)
  np.testing.assert_allclose(_leaf(updates, *q_a), -1e-2, rtol=1e-4)

  # lora_final.safetensors holds the trained projector next to the adapters.
  nnx.update(model, jax.tree.map(lambda p, u: p + u, params, updates))
  keys = save_lora_params(model, tmp_path / "lora.safetensors")
  assert "model.multi_modal_projector.linear_1/kernel" in keys
  fresh, _, _ = load_base(config)
  build_method(dataclasses.replace(config, method="anlr"), model=fresh)
  load_lora_params(fresh, tmp_path / "lora.safetensors")
  mine = {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))}
  theirs = {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(fresh, nnx.LoRAParam))}
  assert mine.keys() == theirs.keys()
  for p in mine:
    np.testing.assert_array_equal(theirs[p], mine[p])


def test_projector_frozen_by_default_and_refused_on_text_models(llava_dir):
  config = _config(llava_dir)
  model, _, _ = load_base(config)
  build_method(dataclasses.replace(config, method="lora"), model=model)
  assert not nnx.to_flat_state(nnx.state(model, FullParam))
  text = load_config(None, [f"model.path={assets.quickstart_dir()}", "model.projector_lr=1e-3"])
  base, _, _ = load_base(text)
  with pytest.raises(ConfigError, match="model.projector_lr=0.001: LlamaForCausalLM has no"):
    build_method(dataclasses.replace(text, method="lora"), model=base)


def test_dry_run_of_the_shipped_llava_config():
  """7B LLaVA-1.5's parameter count equals transformers' (built on the meta device)."""
  import torch
  import transformers

  config = load_config(os.path.join(REPO, "configs", "visual_llava1_5_7b.yaml"), [])
  assert (config.lora.rank, config.lora.alpha, config.trainer.learning_rate) == (128, 256.0, 2e-4)
  result = estimate(config, devices=8, preset="llava1_5_7b")
  vision = transformers.CLIPVisionConfig(
      hidden_size=1024,
      intermediate_size=4096,
      num_hidden_layers=24,
      num_attention_heads=16,
      image_size=336,
      patch_size=14,
      projection_dim=768,
  )
  text = transformers.LlamaConfig(vocab_size=32064, rms_norm_eps=1e-5, max_position_embeddings=4096)
  hf_config = transformers.LlavaConfig(vision_config=vision, text_config=text)
  with torch.device("meta"):
    hf = transformers.LlavaForConditionalGeneration(hf_config)
  hf_total = sum(p.numel() for p in hf.parameters())
  projector = sum(p.numel() for p in hf.model.multi_modal_projector.parameters())
  lora = 32 * 128 * (3 * (4096 + 4096) + 2 * (4096 + 11008))
  assert result["base_params"] == hf_total - projector  # the projector trains: not a base param
  assert result["lora_params"] == lora + projector
  assert 0 < result["activation_bytes"] < 16 * 2**30
  # bf16 base weights sharded over the 8 devices, the vision tower included (the few replicated
  # ones: norms, the position table, biases)
  assert result["base_bytes"] == pytest.approx(2 * result["base_params"] / 8, rel=0.01)


@pytest.mark.parametrize("method", ["adalora", "lorapro", "anlr+loradash"])
def test_every_layer_and_optimizer_family_trains_with_the_projector(llava_dir, method):
  """The projector's AdamW sits next to each optimizer family (a masked subtree for it)."""
  config = _config(
      llava_dir,
      "model.projector_lr=1e-3",
      "loradash.launch_step=1",
      "adalora.tinit=1",
      "adalora.tfinal=1",
  )
  model, _, _ = load_base(config)
  config = dataclasses.replace(config, method=method)
  built = build_method(config, total_steps=5, model=model, learning_rate=1e-2)
  params = nnx.to_pure_dict(nnx.state(model, nnx.LoRAParam))
  grads = jax.tree.map(lambda x: np.full(x.shape, 0.1, np.float32), params)
  updates, _ = built.tx.update(grads, built.tx.init(params), params)
  for name in ("linear_1", "linear_2"):
    projector = _leaf(updates, "model", "multi_modal_projector", name, "kernel")
    np.testing.assert_allclose(projector, -1e-3, rtol=1e-4)
  assert all(np.isfinite(np.asarray(u)).all() for u in jax.tree.leaves(updates))
