"""A tiny random LLaVA in the llava-hf layout (CLIP tower of 28-pixel images in 14-pixel patches,
4 image positions, a 2-layer LLaMA), saved with its tokenizer (``<image>`` one token); and the tiny
transformers LLaVA the model tests compare against, with its batches and forward passes."""

import pathlib

import jax.numpy as jnp
import numpy as np
import torch
import transformers
from flax import nnx

from tests.helpers.tiny_llama import tiny_llama_config
from tests.tiny_tokenizer import build_tiny_tokenizer


def save_tiny_llava(model_dir: pathlib.Path):
  """Saves the model and tokenizer to ``model_dir``; returns the tokenizer and the language model's
  ``LlamaConfig`` (for a text-only model of the same sizes)."""
  tok = build_tiny_tokenizer()
  tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
  tok.save_pretrained(model_dir)
  torch.manual_seed(0)
  vision = transformers.CLIPVisionConfig(
      hidden_size=32,
      intermediate_size=48,
      num_hidden_layers=2,
      num_attention_heads=4,
      image_size=28,
      patch_size=14,
  )
  text = tiny_llama_config(len(tok), max_position_embeddings=512, rms_norm_eps=1e-6)
  config = transformers.LlavaConfig(
      vision_config=vision,
      text_config=text,
      image_token_index=tok.convert_tokens_to_ids("<image>"),
      image_seq_length=4,
      pad_token_id=0,
  )
  transformers.LlavaForConditionalGeneration(config).save_pretrained(model_dir)
  return tok, text


VOCAB = 96


IMAGE_TOKEN = 95


PAD = 0


TOKENS_PER_IMAGE = 4  # (28 / 14)^2 patches, CLS dropped


def make_hf_llava(seed=0, *, hidden_act="quick_gelu", strategy="default", feature_layer=-2):
  """A tiny random transformers LLaVA with O(1) activations throughout."""
  torch.manual_seed(seed)
  vision = transformers.CLIPVisionConfig(
      hidden_size=32,
      intermediate_size=48,
      num_hidden_layers=2,
      num_attention_heads=4,
      image_size=28,
      patch_size=14,
      hidden_act=hidden_act,
      layer_norm_eps=1e-5,
  )
  text = tiny_llama_config(VOCAB, max_position_embeddings=128, eos_token_id=None, pad_token_id=PAD)
  config = transformers.LlavaConfig(
      vision_config=vision,
      text_config=text,
      image_token_index=IMAGE_TOKEN,
      vision_feature_layer=feature_layer,
      vision_feature_select_strategy=strategy,
      image_seq_length=TOKENS_PER_IMAGE,
      pad_token_id=PAD,
  )
  model = transformers.LlavaForConditionalGeneration(config)
  g = torch.Generator().manual_seed(seed + 1)
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=g)
      if "norm" in name and name.endswith("weight"):
        p.copy_(1.0 + 0.1 * noise)
      elif p.ndim >= 2 and "embed" not in name:
        p.copy_(noise / np.sqrt(np.prod(p.shape[1:])))
      else:
        p.copy_(0.5 * noise)
  return model.eval()


def image_ids(rows, length):
  """Right-aligned (left-padded) rows: each row a list of 'img' / token ids."""
  ids = np.full((len(rows), length), PAD, np.int64)
  mask = np.zeros_like(ids)
  for r, row in enumerate(rows):
    flat = []
    for item in row:
      flat += [IMAGE_TOKEN] * TOKENS_PER_IMAGE if item == "img" else [item]
    ids[r, length - len(flat) :] = flat
    mask[r, length - len(flat) :] = 1
  return ids, mask


def pixels(n, seed=0):
  return np.random.default_rng(seed).normal(size=(n, 3, 28, 28)).astype(np.float32)


def hf_logits(hf, ids, mask, px):
  positions = np.maximum(np.cumsum(mask, axis=-1) - 1, 0)
  with torch.no_grad():
    out = hf(
        input_ids=torch.tensor(ids),
        attention_mask=torch.tensor(mask),
        position_ids=torch.tensor(positions),
        pixel_values=None if px is None else torch.tensor(px),
    )
  return out.logits.float().numpy()


@nnx.jit
def forward(model, ids, mask, px):
  return model(ids, attention_mask=mask, pixel_values=px)


def ours_logits(model, ids, mask, px):
  """The model's logits, jitted (the image token count is checked eagerly first)."""
  model.check_image_tokens(ids, px)
  return np.asarray(forward(model, jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(px)))


def rel_err(a, b):
  return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))
