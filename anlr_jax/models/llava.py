r"""LLaVA-1.5 in Flax NNX: CLIP vision tower, two-layer GELU projector and the causal LM.

For a prompt whose ``input_ids`` hold, per image, ``num_image_tokens`` copies of
``image_token_index`` (the ``<image>`` placeholder expanded, as transformers' ``LlavaProcessor``
does), and ``pixel_values`` ``(num_images, 3, S, S)`` in order of appearance:

    F = h^(l)[:, 1:]                          vision features of layer l = vision_feature_layer
                                              (-2: the second-to-last; 'default' drops the CLS)
    P = linear_2(gelu(linear_1(F)))           (num_images, N, d) in the text width d
    x_t = P_j  at the j-th image token,  x_t = E[input_ids_t]  elsewhere

and the language model (:class:`~anlr_jax.models.llama.LlamaForCausalLM`'s forward pass) runs on
``x`` (transformers' ``masked_scatter``: image features fill the image tokens row by row, in order).
A list ``vision_feature_layer`` concatenates those layers' features along the width.

Naming contract: ``".".join(map(str, path))`` of every submodule equals the transformers 5 module
name of ``LlavaForConditionalGeneration``: ``model.vision_tower.encoder.layers.<i>.self_attn.q_proj``,
``model.multi_modal_projector.linear_1``, ``model.language_model.layers.<i>.mlp.up_proj``,
``lm_head``; so a LoRA adapter exported from it is what PEFT expects on transformers' model.

Its config is :mod:`anlr_jax.models.llava_config`'s, its checkpoint I/O
:mod:`anlr_jax.models.llava_io`'s and its image preprocessing :mod:`anlr_jax.models.llava_image`'s
(as LLaMA's are :mod:`~anlr_jax.models.config`, :mod:`~anlr_jax.models.llama` and
:mod:`~anlr_jax.models.hf_io`).
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from anlr_jax.models.clip import ClipVisionModel
from anlr_jax.models.llama import KVCache, LlamaForCausalLM, LlamaModel, make_linear
from anlr_jax.models.config import ModelConfig
from anlr_jax.models.llava_config import LlavaConfig

PROJECTOR_PATH = ("model", "multi_modal_projector")
"""Module path of the projector, which LLaVA's LoRA recipe trains in full next to the adapters."""


class MultiModalProjector(nnx.Module):
  """``linear_2(gelu(linear_1(F)))``: vision width (times the feature layers) to the text width."""

  def __init__(self, config: LlavaConfig, *, rngs: nnx.Rngs):
    text = config.text_config
    d_in = config.vision_config.hidden_size * len(config.feature_layers)
    bias = config.multimodal_projector_bias
    self.linear_1 = make_linear(text, d_in, text.hidden_size, (None, "embed"), bias, rngs)
    self.linear_2 = make_linear(
        text, text.hidden_size, text.hidden_size, (None, "embed"), bias, rngs
    )

  def __call__(self, features: jax.Array) -> jax.Array:
    h = features.reshape(-1, features.shape[-1])
    h = self.linear_2(jax.nn.gelu(self.linear_1(h), approximate=False))
    return h.reshape(*features.shape[:-1], h.shape[-1])


class LlavaModel(nnx.Module):
  """Vision tower, projector and the language model's decoder (transformers' ``model``)."""

  def __init__(self, config: LlavaConfig, *, rngs: nnx.Rngs):
    self.vision_tower = ClipVisionModel(config.vision_config, rngs=rngs)
    self.multi_modal_projector = MultiModalProjector(config, rngs=rngs)
    self.language_model = LlamaModel(config.text_config, rngs=rngs)


class _LanguageModelView(LlamaForCausalLM):
  """The LLaVA model's decoder and head seen as a :class:`LlamaForCausalLM` (shares them)."""

  def __init__(self, config: ModelConfig, model: LlamaModel, lm_head):
    self.config = config
    self.model = model
    if lm_head is not None:
      self.lm_head = lm_head


def _is_tracer(x) -> bool:
  return isinstance(x, jax.core.Tracer)


def check_image_tokens(input_ids, pixel_shape: tuple[int, ...], config: LlavaConfig) -> None:
  """ValueError unless the image tokens of ``input_ids`` fit ``pixel_values`` of ``pixel_shape``.

  ``(N, 3, S, S)``: the batch must hold exactly ``N * num_image_tokens`` image tokens.
  ``(B, K, 3, S, S)``: each row must hold a whole number of images, at most ``K``.
  Skipped under tracing (the data pipeline checks its batches)."""
  if _is_tracer(input_ids):
    return
  n = config.num_image_tokens
  counts = np.sum(np.asarray(input_ids) == config.image_token_index, axis=-1)
  size = config.vision_config.image_size
  if len(pixel_shape) == 4 and tuple(pixel_shape[1:]) == (3, size, size):
    found, expected = int(np.sum(counts)), pixel_shape[0] * n
    if found != expected:
      raise ValueError(
          f"input_ids hold {found} image tokens (id {config.image_token_index}) but the "
          f"{pixel_shape[0]} images of pixel_values need {expected} ({n} each): expand every "
          "<image> placeholder to num_image_tokens ids, one image per placeholder."
      )
  elif len(pixel_shape) == 5 and tuple(pixel_shape[2:]) == (3, size, size):
    rows, slots = pixel_shape[:2]
    if rows != len(counts):
      raise ValueError(f"pixel_values has {rows} rows of images, input_ids {len(counts)} rows.")
    bad = [int(r) for r in np.flatnonzero((counts % n != 0) | (counts > slots * n))]
    if bad:
      raise ValueError(
          f"row {bad[0]} of input_ids holds {int(counts[bad[0]])} image tokens: not a whole "
          f"number of images of {n} tokens, at most {slots} (pixel_values' image slots per row)."
      )
  else:
    raise ValueError(
        f"pixel_values must have shape (num_images, 3, {size}, {size}) or (batch, "
        f"images_per_row, 3, {size}, {size}), got {tuple(pixel_shape)}."
    )


def images_per_row(input_ids, pixel_values, config: LlavaConfig, *, image_mask=None) -> np.ndarray:
  """Packed images ``(N, 3, S, S)`` (in order of appearance, the real ones first: ``image_mask``
  1, then padding) as per-row slots ``(B, K, 3, S, S)`` with ``K = ceil(N / B)``, row ``b``'s images
  in its first slots (from its image tokens), the other slots zero. On the host (NumPy).

  Raises:
    ValueError: a row's image tokens are not a whole number of images, there are more or fewer
      real images than the image tokens need, or a row needs more than ``K`` slots.
  """
  ids, pixels = np.asarray(input_ids), np.asarray(pixel_values)
  n = config.num_image_tokens
  counts = np.sum(ids == config.image_token_index, axis=-1)
  if np.any(counts % n):
    row = int(np.flatnonzero(counts % n)[0])
    raise ValueError(f"row {row} holds {int(counts[row])} image tokens, not a multiple of {n}.")
  per_row = counts // n
  real = pixels if image_mask is None else pixels[np.asarray(image_mask) > 0]
  if int(per_row.sum()) != len(real):
    raise ValueError(
        f"the image tokens need {int(per_row.sum())} images, pixel_values holds {len(real)}."
    )
  slots = max(1, -(-len(pixels) // len(ids)))
  if per_row.max(initial=0) > slots:
    raise ValueError(f"a row holds {int(per_row.max())} images, more than {slots} slots.")
  out = np.zeros((len(ids), slots, *pixels.shape[1:]), np.float32)
  starts = np.concatenate([[0], np.cumsum(per_row)])
  for row, count in enumerate(per_row):
    out[row, :count] = real[starts[row] : starts[row] + count]
  return out


class LlavaForConditionalGeneration(nnx.Module):
  """LLaVA-1.5 (see the module docstring); takes ``pixel_values`` next to ``input_ids``."""

  # Adapters (anlr_jax.nn.inject) go into the language model only, never the vision tower.
  ADAPTER_SCOPE = ("model", "language_model")
  # Base weights LLaVA's LoRA recipe trains in full next to the adapters.
  PROJECTOR = PROJECTOR_PATH

  def __init__(self, config: LlavaConfig, *, rngs: nnx.Rngs):
    if not isinstance(config, LlavaConfig):
      raise TypeError(f"config must be a LlavaConfig, got {type(config).__name__}.")
    self.config = config
    self.model = LlavaModel(config, rngs=rngs)
    text = config.text_config
    if not text.tie_word_embeddings:
      self.lm_head = make_linear(
          text, text.hidden_size, text.vocab_size, ("embed", "vocab"), False, rngs
      )

  @property
  def text_config(self) -> ModelConfig:
    return self.config.text_config

  def check_image_tokens(self, input_ids, pixel_values) -> None:
    """ValueError unless the image tokens of ``input_ids`` match ``pixel_values``' images."""
    check_image_tokens(input_ids, tuple(np.shape(pixel_values)), self.config)

  def images_per_row(self, input_ids, pixel_values, image_mask=None) -> np.ndarray:
    """:func:`images_per_row` with this model's config (the trainer's batch layout)."""
    return images_per_row(input_ids, pixel_values, self.config, image_mask=image_mask)

  def get_image_features(self, pixel_values: jax.Array) -> jax.Array:
    """Projected image features ``(num_images, num_image_tokens, d)``."""
    layers = self.config.feature_layers
    states = self.model.vision_tower(pixel_values, num_layers=max(layers))
    features = jnp.concatenate([states[i] for i in layers], axis=-1)
    if self.config.vision_feature_select_strategy == "default":
      features = features[:, 1:]
    return self.model.multi_modal_projector(features.astype(self.text_config.dtype))

  def embed(self, input_ids: jax.Array, pixel_values: jax.Array | None = None) -> jax.Array:
    """Token embeddings with the image features at the image tokens, ``(B, T, d)``."""
    text = self.text_config
    embeds = self.model.language_model.embed_tokens(input_ids.astype(jnp.int32)).astype(text.dtype)
    if pixel_values is None:
      return embeds
    pixel_values = jnp.asarray(pixel_values)
    check_image_tokens(input_ids, pixel_values.shape, self.config)
    is_image = input_ids == self.config.image_token_index
    if pixel_values.ndim == 5:  # (B, K, 3, S, S): each row's image slots, in order
      b, k = pixel_values.shape[:2]
      features = self.get_image_features(pixel_values.reshape(b * k, *pixel_values.shape[2:]))
      features = features.reshape(b, -1, features.shape[-1]).astype(text.dtype)
      index = jnp.clip(jnp.cumsum(is_image, axis=1) - 1, 0, features.shape[1] - 1)
      gathered = jnp.take_along_axis(features, index[..., None], axis=1)
      return jnp.where(is_image[..., None], gathered, embeds)
    features = self.get_image_features(pixel_values).astype(text.dtype)
    features = features.reshape(-1, features.shape[-1])
    b, t, d = embeds.shape
    flat = is_image.reshape(-1)
    index = jnp.clip(jnp.cumsum(flat) - 1, 0, features.shape[0] - 1)
    merged = jnp.where(flat[:, None], features[index], embeds.reshape(-1, d))
    return merged.reshape(b, t, d)

  def __call__(
      self,
      input_ids: jax.Array,
      *,
      pixel_values: jax.Array | None = None,
      positions: jax.Array | None = None,
      attention_mask: jax.Array | None = None,
      cache: KVCache | None = None,
      remat: str | None = None,
      logits_to_keep: int = 0,
  ):
    """Logits ``(B, T, V)`` float32 (and the cache when given), as :class:`LlamaForCausalLM`
    (``remat``: the language model's per-decoder-layer rematerialisation; ``logits_to_keep``: the
    last positions' logits only; both as there).

    ``pixel_values``: ``(num_images, 3, S, S)``, the images of the batch in order of appearance of
    their image tokens (transformers' layout); or ``(B, K, 3, S, S)``, ``K`` image slots per row
    filled in order, the slots a row does not use ignored (the trainer's fixed-shape layout, which
    micro-batches split by rows). ValueError (outside jit) when the image tokens do not match.
    """
    if input_ids.ndim != 2:
      raise ValueError(f"input_ids must have shape (B, T), got {input_ids.shape}.")
    embeds = self.embed(input_ids, pixel_values)
    view = _LanguageModelView(
        self.text_config, self.model.language_model, getattr(self, "lm_head", None)
    )
    return view(
        input_ids,
        positions=positions,
        attention_mask=attention_mask,
        cache=cache,
        inputs_embeds=embeds,
        remat=remat,
        logits_to_keep=logits_to_keep,
    )


__all__ = [
    "PROJECTOR_PATH",
    "LlavaForConditionalGeneration",
    "LlavaModel",
    "MultiModalProjector",
    "check_image_tokens",
    "images_per_row",
]
