"""A tiny random LLaVA in the llava-hf layout (CLIP tower of 28-pixel images in 14-pixel patches,
4 image positions, a 2-layer LLaMA), saved with its tokenizer (``<image>`` one token)."""

import pathlib

import torch
import transformers

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
  text = transformers.LlamaConfig(
      vocab_size=len(tok),
      hidden_size=32,
      intermediate_size=48,
      num_hidden_layers=2,
      num_attention_heads=4,
      num_key_value_heads=2,
      max_position_embeddings=512,
      pad_token_id=0,
      bos_token_id=1,
      eos_token_id=2,
  )
  config = transformers.LlavaConfig(
      vision_config=vision,
      text_config=text,
      image_token_index=tok.convert_tokens_to_ids("<image>"),
      image_seq_length=4,
      pad_token_id=0,
  )
  transformers.LlavaForConditionalGeneration(config).save_pretrained(model_dir)
  return tok, text
