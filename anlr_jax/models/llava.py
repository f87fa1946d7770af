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

Checkpoints. Loading accepts the keys of the ``llava-hf`` checkpoints (``language_model.model.*``,
``language_model.lm_head.weight``, ``vision_tower.vision_model.*``, ``multi_modal_projector.*``),
of transformers 5's ``save_pretrained`` (the same without ``vision_model.``) and of transformers'
in-memory layout (``model.language_model.*``, ``model.vision_tower.*``, ``lm_head.*``), in one or
several safetensors files. Saving writes the ``llava-hf`` layout, which every transformers version
and the LLaVA serving stacks read. The ``text_config`` / ``vision_config`` of a ``config.json`` may
list only the fields that differ from transformers' ``LlamaConfig`` / ``CLIPVisionConfig``
defaults (as ``llava-hf/llava-1.5-7b-hf`` does); the missing ones take those defaults.

Images are prepared by :func:`preprocess_image` exactly as transformers' ``CLIPImageProcessor``
(PIL backend) does.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open

from anlr_jax.models.clip import ClipVisionConfig, ClipVisionModel
from anlr_jax.models.config import ModelConfig
from anlr_jax.models.hf_files import CONFIG_FILE, read_hf_config
from anlr_jax.models.hf_io import (
    IGNORED_KEY,
    ParamEntry,
    check_filled,
    check_shape,
    set_tensor,
    shard_weight_map,
    hf_param_table,
    write_param_table,
)
from anlr_jax.models.llama import KVCache, LlamaForCausalLM, LlamaModel, make_linear

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
SELECT_STRATEGIES = ("default", "full")
PROJECTOR_PATH = ("model", "multi_modal_projector")
"""Module path of the projector, which LLaVA's LoRA recipe trains in full next to the adapters."""
PROJECTOR_ACTIVATIONS = ("gelu",)

# transformers' LlamaConfig defaults, for a sparse text_config (llava-hf/llava-1.5-7b-hf lists only
# vocab_size, rms_norm_eps and max_position_embeddings).
_LLAMA_DEFAULTS = dict(
    model_type="llama",
    vocab_size=32000,
    hidden_size=4096,
    intermediate_size=11008,
    num_hidden_layers=32,
    num_attention_heads=32,
    rms_norm_eps=1e-6,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)


@dataclasses.dataclass(frozen=True)
class LlavaConfig:
  """A LLaVA model: its vision tower, its language model and how the two meet.

  Attributes:
    vision_config: the CLIP tower.
    text_config: the causal LM.
    image_token_index: the token id of an image placeholder in ``input_ids``.
    vision_feature_layer: index into the tower's hidden states ``[h^(0), ..., h^(L)]`` (negative
      counts from the end; LLaVA-1.5: -2), or a tuple of them (features concatenated).
    vision_feature_select_strategy: ``'default'`` drops the CLS token, ``'full'`` keeps it.
    projector_hidden_act: the projector's activation (``'gelu'``, exact).
    multimodal_projector_bias: the projector's linears carry biases.
    image_seq_length: image tokens per image the processor writes (informative).
  """

  vision_config: ClipVisionConfig
  text_config: ModelConfig
  image_token_index: int = 32000
  vision_feature_layer: int | tuple[int, ...] = -2
  vision_feature_select_strategy: str = "default"
  projector_hidden_act: str = "gelu"
  multimodal_projector_bias: bool = True
  image_seq_length: int = 576

  def __post_init__(self):
    if not isinstance(self.vision_config, ClipVisionConfig):
      raise TypeError("LlavaConfig.vision_config must be a ClipVisionConfig.")
    if not isinstance(self.text_config, ModelConfig):
      raise TypeError("LlavaConfig.text_config must be a ModelConfig.")
    layers = self.vision_feature_layer
    if isinstance(layers, (list, tuple)):
      object.__setattr__(self, "vision_feature_layer", tuple(int(i) for i in layers))
    depth = self.vision_config.num_hidden_layers
    for i in self.feature_layers:
      if not -(depth + 1) <= i <= depth:
        raise ValueError(
            f"vision_feature_layer={self.vision_feature_layer!r} is outside the tower's "
            f"{depth + 1} hidden states."
        )
    if self.vision_feature_select_strategy not in SELECT_STRATEGIES:
      raise ValueError(
          f"vision_feature_select_strategy={self.vision_feature_select_strategy!r} is not one "
          f"of {SELECT_STRATEGIES}."
      )
    if self.projector_hidden_act not in PROJECTOR_ACTIVATIONS:
      raise ValueError(
          f"projector_hidden_act={self.projector_hidden_act!r} is not supported; supported: "
          f"{PROJECTOR_ACTIVATIONS}."
      )
    if not 0 <= self.image_token_index < self.text_config.vocab_size:
      raise ValueError(
          f"image_token_index={self.image_token_index} is outside the text vocabulary "
          f"(vocab_size={self.text_config.vocab_size})."
      )

  @property
  def feature_layers(self) -> tuple[int, ...]:
    """The hidden-state indices the features come from, non-negative."""
    layers = self.vision_feature_layer
    layers = layers if isinstance(layers, tuple) else (layers,)
    total = self.vision_config.num_hidden_layers + 1
    return tuple(i % total for i in layers)

  @property
  def vocab_size(self) -> int:
    """The language model's vocabulary size (what the data checks token ids against)."""
    return self.text_config.vocab_size

  @property
  def num_image_tokens(self) -> int:
    """Image tokens per image: the patches, plus the CLS token with the ``'full'`` strategy."""
    return self.vision_config.num_patches + (self.vision_feature_select_strategy == "full")

  @classmethod
  def llava1_5_7b(cls, *, dtype=jnp.float32, compute_dtype=None) -> "LlavaConfig":
    """LLaVA-1.5-7B (``llava-hf/llava-1.5-7b-hf``): CLIP ViT-L/14 at 336 px, Vicuna-7B."""
    compute = dtype if compute_dtype is None else compute_dtype
    return cls(
        vision_config=ClipVisionConfig(
            hidden_size=1024,
            intermediate_size=4096,
            num_hidden_layers=24,
            num_attention_heads=16,
            image_size=336,
            patch_size=14,
            dtype=compute,
            param_dtype=dtype,
        ),
        text_config=ModelConfig.preset(
            "llama2_7b", vocab_size=32064, dtype=compute, param_dtype=dtype
        ),
        image_token_index=32000,
    )

  @classmethod
  def from_hf_config(
      cls, hf_config: Mapping[str, Any], *, dtype=jnp.float32, compute_dtype=None, **text_overrides
  ) -> "LlavaConfig":
    """From a LLaVA ``config.json`` dict; ``text_overrides`` replace :class:`ModelConfig` fields."""
    if not isinstance(hf_config, Mapping):
      raise ValueError(f"config.json must hold a dict, got {type(hf_config).__name__}.")
    if hf_config.get("model_type") != "llava":
      raise ValueError(f"model_type={hf_config.get('model_type')!r} is not 'llava'.")
    text = dict(hf_config.get("text_config") or {})
    if text.get("model_type", "llama") == "llama":
      text = {**_LLAMA_DEFAULTS, **text}
    compute = dtype if compute_dtype is None else compute_dtype
    text_config = ModelConfig.from_hf_config(
        text, param_dtype=dtype, dtype=compute, **text_overrides
    )
    vision_config = ClipVisionConfig.from_hf_config(
        hf_config.get("vision_config") or {}, param_dtype=dtype, dtype=compute
    )
    image_token = hf_config.get("image_token_index", hf_config.get("image_token_id", 32000))
    return cls(
        vision_config=vision_config,
        text_config=text_config,
        image_token_index=int(image_token),
        vision_feature_layer=hf_config.get("vision_feature_layer", -2),
        vision_feature_select_strategy=hf_config.get("vision_feature_select_strategy", "default"),
        projector_hidden_act=hf_config.get("projector_hidden_act", "gelu"),
        multimodal_projector_bias=bool(hf_config.get("multimodal_projector_bias", True)),
        image_seq_length=int(hf_config.get("image_seq_length", 576)),
    )

  @classmethod
  def from_pretrained(cls, path: str | os.PathLike, **kwargs) -> "LlavaConfig":
    """Reads ``<path>/config.json``; ``kwargs`` as in :meth:`from_hf_config`."""
    return cls.from_hf_config(read_hf_config(os.path.join(os.fspath(path), CONFIG_FILE)), **kwargs)

  def to_hf_config(self) -> dict[str, Any]:
    """The ``config.json`` dict transformers reads back into ``LlavaForConditionalGeneration``."""
    text = self.text_config.to_hf_config()
    text.pop("architectures", None)
    layer = self.vision_feature_layer
    dtype = str(jnp.dtype(self.text_config.param_dtype))
    return dict(
        architectures=["LlavaForConditionalGeneration"],
        model_type="llava",
        text_config=text,
        vision_config=self.vision_config.to_hf_config(),
        image_token_index=self.image_token_index,
        vision_feature_layer=list(layer) if isinstance(layer, tuple) else layer,
        vision_feature_select_strategy=self.vision_feature_select_strategy,
        projector_hidden_act=self.projector_hidden_act,
        multimodal_projector_bias=self.multimodal_projector_bias,
        image_seq_length=self.image_seq_length,
        tie_word_embeddings=self.text_config.tie_word_embeddings,
        torch_dtype=dtype,
        dtype=dtype,
    )


def is_llava_config(path: str | os.PathLike) -> bool:
  """Whether ``<path>/config.json`` exists and says ``model_type: llava``."""
  try:
    return read_hf_config(os.path.join(os.fspath(path), CONFIG_FILE)).get("model_type") == "llava"
  except (OSError, ValueError):
    return False


# --------------------------------------------------------------------------------------------------
# The model


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
  ):
    """Logits ``(B, T, V)`` float32 (and the cache when given), as :class:`LlamaForCausalLM`
    (``remat``: the language model's per-decoder-layer rematerialisation, as there).

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
    )


# --------------------------------------------------------------------------------------------------
# Checkpoints


def _vision_entries(config: ClipVisionConfig) -> list[ParamEntry]:
  d, f = config.hidden_size, config.intermediate_size
  c, p = config.num_channels, config.patch_size
  root, key = ("model", "vision_tower"), "vision_tower.vision_model"
  emb = (*root, "embeddings")
  entries = [
      ParamEntry(f"{key}.embeddings.class_embedding", emb, "class_embedding", (d,), False),
      ParamEntry(
          f"{key}.embeddings.patch_embedding.weight",
          (*emb, "patch_embedding"),
          "weight",
          (d, c, p, p),
          False,
      ),
      ParamEntry(
          f"{key}.embeddings.position_embedding.weight",
          (*emb, "position_embedding"),
          "embedding",
          (config.num_patches + 1, d),
          False,
      ),
  ]

  def norm(name, path):
    return [
        ParamEntry(f"{key}.{name}.weight", path, "weight", (d,), False),
        ParamEntry(f"{key}.{name}.bias", path, "bias", (d,), False),
    ]

  entries += norm("pre_layrnorm", (*root, "pre_layrnorm"))
  linears = {
      "self_attn.q_proj": (d, d),
      "self_attn.k_proj": (d, d),
      "self_attn.v_proj": (d, d),
      "self_attn.out_proj": (d, d),
      "mlp.fc1": (f, d),
      "mlp.fc2": (d, f),
  }
  for i in range(config.num_hidden_layers):
    layer = (*root, "encoder", "layers", i)
    for name, shape in linears.items():
      path, hf = (*layer, *name.split(".")), f"{key}.encoder.layers.{i}.{name}"
      entries.append(ParamEntry(f"{hf}.weight", path, "kernel", shape, True))
      entries.append(ParamEntry(f"{hf}.bias", path, "bias", (shape[0],), False))
    for name in ("layer_norm1", "layer_norm2"):
      entries += norm(f"encoder.layers.{i}.{name}", (*layer, name))
  entries += norm("post_layernorm", (*root, "post_layernorm"))
  return entries


def llava_param_table(config: LlavaConfig) -> list[ParamEntry]:
  """Every tensor of a ``llava-hf`` checkpoint of ``config`` and where it lives in the model."""
  entries = _vision_entries(config.vision_config)
  text = config.text_config
  d_in = config.vision_config.hidden_size * len(config.feature_layers)
  for name, shape in (
      ("linear_1", (text.hidden_size, d_in)),
      ("linear_2", (text.hidden_size,) * 2),
  ):
    path = ("model", "multi_modal_projector", name)
    entries.append(ParamEntry(f"multi_modal_projector.{name}.weight", path, "kernel", shape, True))
    if config.multimodal_projector_bias:
      entries.append(
          ParamEntry(f"multi_modal_projector.{name}.bias", path, "bias", (shape[0],), False)
      )
  for entry in hf_param_table(text):
    if entry.hf_key.startswith("model."):
      path = ("model", "language_model", *entry.module_path[1:])
    else:  # lm_head
      path = entry.module_path
    entries.append(
        dataclasses.replace(entry, hf_key=f"language_model.{entry.hf_key}", module_path=path)
    )
  return entries


def canonical_key(key: str) -> str:
  """A LLaVA checkpoint key in any supported layout, as the ``llava-hf`` layout names it."""
  for old, new in (
      ("model.language_model.", "language_model.model."),
      ("lm_head.", "language_model.lm_head."),
      ("model.vision_tower.", "vision_tower."),
      ("model.multi_modal_projector.", "multi_modal_projector."),
  ):
    if key.startswith(old):
      key = new + key[len(old) :]
      break
  if key.startswith("vision_tower.") and not key.startswith("vision_tower.vision_model."):
    key = "vision_tower.vision_model." + key[len("vision_tower.") :]
  return key


def load_llava_model(
    path: str | os.PathLike, *, dtype=jnp.float32, compute_dtype=None, **text_overrides
) -> tuple[LlavaForConditionalGeneration, LlavaConfig]:
  """Loads a local LLaVA checkpoint (``config.json`` + safetensors, one file or sharded).

  Args:
    path: the checkpoint directory.
    dtype: parameter dtype; compute_dtype: activation dtype (default ``dtype``).
    **text_overrides: other :class:`ModelConfig` fields of the language model (``remat=True``,
      ``attention_impl=...``).

  Returns:
    ``(model, config)``.

  Raises:
    FileNotFoundError: a file is missing. KeyError: a tensor is missing. ValueError: a tensor has
    the wrong shape, an unknown tensor is present, or the config is not a supported LLaVA.
  """
  path = os.fspath(path)
  config = LlavaConfig.from_pretrained(
      path, dtype=dtype, compute_dtype=compute_dtype, **text_overrides
  )
  by_key: dict[str, tuple[str, str]] = {}
  for key, file in shard_weight_map(path).items():
    if IGNORED_KEY.match(key):
      continue
    canonical = canonical_key(key)
    if canonical in by_key:
      raise ValueError(f"{path}: tensors {by_key[canonical][1]!r} and {key!r} are the same weight.")
    by_key[canonical] = (file, key)
  table = llava_param_table(config)
  expected = {e.hf_key for e in table}
  tied = config.text_config.tie_word_embeddings
  unexpected = sorted(
      by_key[k][1]
      for k in by_key
      if k not in expected and not (tied and k.endswith("lm_head.weight"))
  )
  if unexpected:
    raise ValueError(
        f"Checkpoint {path} holds tensors the LLaVA architecture of its config.json does not have:"
        f" {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}."
    )
  model = nnx.eval_shape(lambda: LlavaForConditionalGeneration(config, rngs=nnx.Rngs(0)))
  by_file: dict[str, list[tuple[ParamEntry, str]]] = {}
  for entry in table:
    if entry.hf_key not in by_key:
      raise KeyError(f"Tensor {entry.hf_key!r} (any LLaVA key layout) not found in {path}.")
    file, key = by_key[entry.hf_key]
    by_file.setdefault(file, []).append((entry, key))
  for file, entries in by_file.items():
    file_path = os.path.join(path, file)
    with safe_open(file_path, framework="numpy") as f:
      for entry, key in entries:
        check_shape(entry, tuple(f.get_slice(key).get_shape()), file_path)
        set_tensor(model, entry, f.get_tensor(key), dtype)
  check_filled(model)
  return model, config


def save_llava_model(
    model: LlavaForConditionalGeneration,
    config: LlavaConfig,
    out_dir: str | os.PathLike,
    *,
    max_shard_size: int | str = "5GB",
    merge_lora: bool = True,
    dtype=None,
) -> list[str]:
  """Writes ``config.json`` and ``llava-hf``-layout safetensors (sharded above ``max_shard_size``).

  LoRA-wrapped projections are saved merged (``merge_lora=True``) or as their base weights; see
  :func:`anlr_jax.models.hf_io.save_hf_model` for the other arguments. Returns the file names.
  """
  return write_param_table(
      model, config, llava_param_table(config), out_dir, max_shard_size, merge_lora, dtype
  )


# --------------------------------------------------------------------------------------------------
# Images


def preprocess_image(
    image,
    config: LlavaConfig | ClipVisionConfig | int,
    *,
    mean: Sequence[float] = OPENAI_CLIP_MEAN,
    std: Sequence[float] = OPENAI_CLIP_STD,
) -> np.ndarray:
  r"""An image as the vision tower's input, float32 ``(3, S, S)``, like ``CLIPImageProcessor``.

  Steps (those of transformers' ``CLIPImageProcessor`` with ``size={'shortest_edge': S}``,
  ``crop_size=S``, PIL backend): convert to RGB; resize with PIL's bicubic filter so the shorter
  side is ``S`` and the longer ``int(S * long / short)``; crop the centre ``S x S`` (top/left offset
  ``(side - S) // 2``; a side shorter than ``S`` is zero-padded around the centre); scale by
  ``1/255``; normalise ``(x - mean) / std`` per channel; channels first.

  Args:
    image: a PIL image, or an ``(H, W, 3)`` / ``(H, W)`` uint8 array.
    config: the model's config (``S`` = ``vision_config.image_size``) or ``S`` itself.
    mean, std: per-channel statistics (OpenAI CLIP's by default, as LLaVA-1.5 uses).
  """
  from PIL import Image

  if isinstance(config, LlavaConfig):
    config = config.vision_config
  size = config.image_size if isinstance(config, ClipVisionConfig) else int(config)
  if isinstance(image, np.ndarray):
    if image.dtype != np.uint8:
      raise ValueError(f"an image array must be uint8 (H, W[, 3]), got {image.dtype}.")
    image = Image.fromarray(image)
  if not isinstance(image, Image.Image):
    raise TypeError(f"image must be a PIL image or a uint8 array, got {type(image).__name__}.")
  image = image.convert("RGB")
  width, height = image.size
  short, long = (width, height) if width <= height else (height, width)
  new_short, new_long = size, int(size * long / short)
  new_w, new_h = (new_short, new_long) if width <= height else (new_long, new_short)
  pixels = np.asarray(image.resize((new_w, new_h), resample=Image.Resampling.BICUBIC))
  pixels = pixels.transpose(2, 0, 1)  # (3, H, W)
  if new_h < size or new_w < size:
    padded = np.zeros((3, max(size, new_h), max(size, new_w)), pixels.dtype)
    top, left = math.ceil((padded.shape[1] - new_h) / 2), math.ceil((padded.shape[2] - new_w) / 2)
    padded[:, top : top + new_h, left : left + new_w] = pixels
    pixels = padded
  top, left = (pixels.shape[1] - size) // 2, (pixels.shape[2] - size) // 2
  pixels = pixels[:, top : top + size, left : left + size]
  scaled = (pixels.astype(np.float64) * (1 / 255)).astype(np.float32)
  mean = np.asarray(mean, np.float32)[:, None, None]
  std = np.asarray(std, np.float32)[:, None, None]
  return np.ascontiguousarray((scaled - mean) / std)
