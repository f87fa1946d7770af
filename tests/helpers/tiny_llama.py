"""Tiny random transformers LLaMA / Qwen2 models (saved as Hugging Face directories or built in
memory), their left-padded batches and forward passes, for the tests that compare against them."""

import numpy as np
import torch
import transformers
from flax import nnx

TINY_LLAMA = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
"""The tests' tiny LLaMA: width 32, FFN 48, 2 layers, 4 query / 2 KV heads (grouped-query)."""


def tiny_llama_config(vocab_size: int, **overrides) -> transformers.LlamaConfig:
  """The one tiny transformers ``LlamaConfig`` of the tests (:data:`TINY_LLAMA`, ``vocab_size``);
  ``overrides`` replace fields (a test that needs other sizes says which)."""
  return transformers.LlamaConfig(**(TINY_LLAMA | dict(vocab_size=vocab_size) | overrides))


def save_tiny_llama(directory, vocab_size: int, **overrides) -> transformers.LlamaConfig:
  """Saves a 1-layer LLaMA (hidden 32, 4 query / 2 KV heads, torch seed 0) to ``directory``;
  ``overrides`` replace config fields. Returns its config."""
  fields = dict(intermediate_size=64, num_hidden_layers=1, rms_norm_eps=1e-6)
  config = tiny_llama_config(vocab_size, **(fields | overrides))
  torch.manual_seed(0)
  transformers.LlamaForCausalLM(config).save_pretrained(directory)
  return config


TINY = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def make_hf_model(kind: str, seed: int = 0):
  """A tiny random HF causal LM with O(1) activations, so attention and RoPE matter.

  kind: 'llama' (GQA 4/2), 'llama3' (GQA + llama3 RoPE scaling), 'qwen2' (qkv bias),
  'qwen2_tied' (qkv bias + tied embeddings).
  """
  torch.manual_seed(seed)
  if kind.startswith("llama"):
    config = transformers.LlamaConfig(
        **TINY,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        bos_token_id=1,
        eos_token_id=None,
        pad_token_id=0,
        rope_scaling=dict(LLAMA3_ROPE) if kind == "llama3" else None,
    )
    model = transformers.LlamaForCausalLM(config)
  else:
    config = transformers.Qwen2Config(
        **TINY,
        rms_norm_eps=1e-6,
        rope_theta=1000.0,
        tie_word_embeddings=kind == "qwen2_tied",
        bos_token_id=1,
        eos_token_id=None,
        pad_token_id=0,
    )
    model = transformers.Qwen2ForCausalLM(config)
  g = torch.Generator().manual_seed(seed + 1)
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=g)
      p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.25 * noise)
  return model.eval()


def left_padded_batch(vocab: int, seed: int = 0, length: int = 24):
  """Token ids (3, length) and a mask with 0 / 5 / 11 leading pads."""
  rng = np.random.default_rng(seed)
  ids = rng.integers(1, vocab, size=(3, length))
  mask = np.ones_like(ids)
  for row, pads in enumerate((0, 5, 11)):
    mask[row, :pads] = 0
    ids[row, :pads] = 0
  return ids, mask


@nnx.jit
def forward(model, ids, mask):
  """Jitted forward: one compile per shape instead of one per eager op (keeps tests fast)."""
  return model(ids, attention_mask=mask)


def hf_logits(model, ids, mask):
  """HF logits with the same positions as ours: cumsum(mask) - 1 (what HF generate uses)."""
  ids_t, mask_t = torch.tensor(ids), torch.tensor(mask)
  pos = (mask_t.cumsum(-1) - 1).clamp(min=0)
  with torch.no_grad():
    return model(ids_t, attention_mask=mask_t, position_ids=pos).logits.float().numpy()


# transformers adds rope_theta to a rope_scaling dict in place: always pass a copy.
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
