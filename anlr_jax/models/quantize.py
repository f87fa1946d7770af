"""A model's frozen base quantised in place (:func:`quantize_model`): every linear layer of a LLaMA /
Qwen2 model, adapter layers' bases included, becomes a :class:`~anlr_jax.nn.quant.QuantLinear`, and
the embedding table a :class:`~anlr_jax.nn.quant.QuantEmbed`."""

from __future__ import annotations

from flax import nnx

from anlr_jax.models.llama import LlamaForCausalLM
from anlr_jax.nn.inject import get_submodule, path_str, set_submodule
from anlr_jax.nn.quant import QuantEmbed, QuantLinear, check_mode, is_quantized


def quantize_model(model: nnx.Module, mode: str) -> nnx.Module:
  """Replaces every ``nnx.Linear`` of ``model`` (adapter layers' bases included) by a
  :class:`QuantLinear` of ``mode`` and the embedding table by a :class:`QuantEmbed`, in place;
  ``none`` and quantised layers are left as they are.

  Raises:
    ValueError: ``mode`` unknown, a model type with no quantised path (only the LLaMA / Qwen2
      models have one), or a layer that cannot be quantised (:class:`QuantLinear`).
  """
  check_mode(mode)
  if mode == "none":
    return model
  if not isinstance(model, LlamaForCausalLM):
    raise ValueError(
        f"model.quantize={mode}: {type(model).__name__} has no quantised path (LLaMA / Qwen2 only)"
    )
  paths = [
      p for p, m in nnx.iter_modules(model) if isinstance(m, nnx.Linear) and not is_quantized(m)
  ]
  for path in paths:
    linear = get_submodule(model, path)
    set_submodule(model, path, QuantLinear(linear, mode, name=path_str(path)))
  embed = model.model.embed_tokens
  if not isinstance(embed, QuantEmbed):
    model.model.embed_tokens = QuantEmbed(embed, mode)
  return model


__all__ = ["quantize_model"]
