r"""The config of a LLaVA model (:class:`LlavaConfig`): its CLIP vision tower's, its language
model's and how the two meet, read from and written to a Hugging Face ``config.json``.

The ``text_config`` / ``vision_config`` of a ``config.json`` may list only the fields that differ
from transformers' ``LlamaConfig`` / ``CLIPVisionConfig`` defaults (as ``llava-hf/llava-1.5-7b-hf``
does); the missing ones take those defaults. The model is :mod:`anlr_jax.models.llava`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

import jax.numpy as jnp

from anlr_jax.models.clip import ClipVisionConfig
from anlr_jax.models.config import ModelConfig
from anlr_jax.models.hf_files import CONFIG_FILE, read_hf_config

SELECT_STRATEGIES = ("default", "full")


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


__all__ = ["LlavaConfig", "PROJECTOR_ACTIVATIONS", "SELECT_STRATEGIES", "is_llava_config"]
