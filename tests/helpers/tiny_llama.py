"""A tiny random transformers LLaMA saved as a Hugging Face directory, for the tests that load one."""

import torch
import transformers


def save_tiny_llama(directory, vocab_size: int, **overrides) -> transformers.LlamaConfig:
  """Saves a 1-layer LLaMA (hidden 32, 4 query / 2 KV heads, torch seed 0) to ``directory``;
  ``overrides`` replace config fields. Returns its config."""
  fields = dict(
      vocab_size=vocab_size,
      hidden_size=32,
      intermediate_size=64,
      num_hidden_layers=1,
      num_attention_heads=4,
      num_key_value_heads=2,
      max_position_embeddings=256,
      pad_token_id=0,
      bos_token_id=1,
      eos_token_id=2,
  )
  config = transformers.LlamaConfig(**(fields | overrides))
  torch.manual_seed(0)
  transformers.LlamaForCausalLM(config).save_pretrained(directory)
  return config
