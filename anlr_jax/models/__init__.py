"""Flax NNX LLaMA / Qwen2 causal LMs, Hugging Face checkpoint I/O and generation."""

from anlr_jax.models.config import ModelConfig
from anlr_jax.models.generation import generate
from anlr_jax.models.hf_io import hf_param_table, load_hf_model, load_tokenizer, save_hf_model
from anlr_jax.models.llama import LOGICAL_AXES, KVCache, LlamaForCausalLM, init_cache

__all__ = [
    "LOGICAL_AXES",
    "KVCache",
    "LlamaForCausalLM",
    "ModelConfig",
    "generate",
    "hf_param_table",
    "init_cache",
    "load_hf_model",
    "load_tokenizer",
    "save_hf_model",
]
