"""Flax NNX LLaMA / Qwen2 causal LMs and LLaVA, Hugging Face and GGUF checkpoint I/O, generation."""

from anlr_jax.models.config import ModelConfig
from anlr_jax.models.generation import generate
from anlr_jax.models.gguf import convert_gguf, load_gguf_tokenizer, read_gguf
from anlr_jax.models.hf_io import (
    hf_param_table,
    load_hf_model,
    load_tokenizer,
    model_from_hf_tensors,
    save_hf_model,
)
from anlr_jax.models.llama import LOGICAL_AXES, KVCache, LlamaForCausalLM, init_cache
from anlr_jax.models.llava import LlavaForConditionalGeneration
from anlr_jax.models.llava_config import LlavaConfig
from anlr_jax.models.llava_image import preprocess_image
from anlr_jax.models.llava_io import load_llava_model, save_llava_model

__all__ = [
    "LOGICAL_AXES",
    "KVCache",
    "LlamaForCausalLM",
    "LlavaConfig",
    "LlavaForConditionalGeneration",
    "ModelConfig",
    "convert_gguf",
    "generate",
    "hf_param_table",
    "init_cache",
    "load_gguf_tokenizer",
    "load_hf_model",
    "load_llava_model",
    "load_tokenizer",
    "model_from_hf_tensors",
    "preprocess_image",
    "read_gguf",
    "save_hf_model",
    "save_llava_model",
]
