r"""CLIP ViT vision tower in Flax NNX (the image encoder of LLaVA), laid out like transformers.

An image ``x`` (``3, H, W``, ``H = W = image_size``) is cut into ``N = (H / P)^2`` patches of
``P x P`` pixels, row by row. With ``D`` the width:

    e_0 = c,  e_i = W_patch vec(patch_i)   (a stride-P convolution without bias, i = 1..N)
    h^(0) = LN_pre(e + E_pos),              E_pos (N + 1, D) learned positions
    u = h + out_proj(Attn(q_proj(LN_1(h)), k_proj(LN_1(h)), v_proj(LN_1(h))))
    h' = u + fc2(act(fc1(LN_2(u))))         one encoder layer (``h^(l) -> h^(l+1)``)

``c`` is the class embedding; attention is bidirectional, ``softmax(q k^T / sqrt(d_head))`` over
all ``N + 1`` tokens; ``act`` is ``quick_gelu`` (``x sigmoid(1.702 x)``, OpenAI CLIP) or the exact
``gelu``; ``LN(x) = w (x - mean(x)) / sqrt(var(x) + eps) + b`` in float32. The tower returns every
``h^(l)``, ``l = 0..L`` (transformers' ``hidden_states``); ``post_layernorm`` is loaded and saved
but unused, as in LLaVA, which reads an inner layer.

Naming contract: ``".".join(map(str, path))`` of every submodule equals the transformers (5.x)
module name below ``vision_tower``: ``embeddings.patch_embedding``, ``embeddings.position_embedding``,
``pre_layrnorm``, ``encoder.layers.<i>.self_attn.q_proj``, ``encoder.layers.<i>.mlp.fc1``,
``encoder.layers.<i>.layer_norm1``, ``post_layernorm``. Linear layers are ``nnx.Linear`` (kernel
``(in, out)``); the patch convolution keeps the torch layout ``(D, 3, P, P)``. Parameters carry the
logical axis names of :mod:`anlr_jax.models.llama` (``embed``, ``q_heads``, ``mlp``, ``norm``), so a
mesh shards the tower as it shards the language model.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from anlr_jax.models.llama import AXIS_EMBED, AXIS_MLP, AXIS_NORM, AXIS_Q_HEADS, logical_axes

ACTIVATIONS = ("quick_gelu", "gelu")

# transformers' CLIPVisionConfig defaults: a config.json lists only the fields that differ.
HF_DEFAULTS = dict(
    hidden_size=768,
    intermediate_size=3072,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_channels=3,
    image_size=224,
    patch_size=32,
    hidden_act="quick_gelu",
    layer_norm_eps=1e-5,
)


@dataclasses.dataclass(frozen=True)
class ClipVisionConfig:
  """Hyperparameters of a CLIP ViT vision tower (transformers' ``CLIPVisionConfig`` fields).

  Attributes:
    hidden_size: width ``D``.
    intermediate_size: MLP width.
    num_hidden_layers: encoder layers ``L``.
    num_attention_heads: attention heads (divides ``D``).
    image_size: side of the square input in pixels.
    patch_size: side ``P`` of a patch (divides ``image_size``).
    num_channels: input channels (3).
    hidden_act: ``'quick_gelu'`` or ``'gelu'``.
    layer_norm_eps: LayerNorm ``eps``.
    dtype: compute dtype. param_dtype: storage dtype of the parameters.
  """

  hidden_size: int = 768
  intermediate_size: int = 3072
  num_hidden_layers: int = 12
  num_attention_heads: int = 12
  image_size: int = 224
  patch_size: int = 32
  num_channels: int = 3
  hidden_act: str = "quick_gelu"
  layer_norm_eps: float = 1e-5
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32

  def __post_init__(self):
    for name in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "image_size",
        "patch_size",
        "num_channels",
    ):
      value = getattr(self, name)
      if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"vision_config.{name} must be a positive int, got {value!r}.")
    if self.hidden_size % self.num_attention_heads:
      raise ValueError(
          f"vision_config.num_attention_heads={self.num_attention_heads} must divide "
          f"hidden_size={self.hidden_size}."
      )
    if self.image_size % self.patch_size:
      raise ValueError(
          f"vision_config.patch_size={self.patch_size} must divide image_size={self.image_size}."
      )
    if self.hidden_act not in ACTIVATIONS:
      raise ValueError(
          f"vision_config.hidden_act={self.hidden_act!r} is not supported; supported: "
          f"{ACTIVATIONS}."
      )
    if not self.layer_norm_eps > 0:
      raise ValueError(f"vision_config.layer_norm_eps must be > 0, got {self.layer_norm_eps!r}.")
    for name in ("dtype", "param_dtype"):
      object.__setattr__(self, name, jnp.dtype(getattr(self, name)))

  @property
  def head_dim(self) -> int:
    return self.hidden_size // self.num_attention_heads

  @property
  def num_patches(self) -> int:
    return (self.image_size // self.patch_size) ** 2

  @classmethod
  def from_hf_config(cls, hf_config: Mapping[str, Any], **overrides) -> "ClipVisionConfig":
    """From a ``vision_config`` dict of a LLaVA ``config.json`` (missing fields: CLIP defaults)."""
    if not isinstance(hf_config, Mapping):
      raise ValueError(f"vision_config must be a dict, got {type(hf_config).__name__}.")
    model_type = hf_config.get("model_type", "clip_vision_model")
    if model_type != "clip_vision_model":
      raise ValueError(
          f"vision_config.model_type={model_type!r} is not supported; only 'clip_vision_model'."
      )
    fields = {k: hf_config.get(k, v) for k, v in HF_DEFAULTS.items()}
    fields.update(overrides)
    return cls(**fields)

  def to_hf_config(self) -> dict[str, Any]:
    """The ``vision_config`` dict transformers reads back (``CLIPVisionConfig``)."""
    return dict(
        model_type="clip_vision_model",
        **{k: getattr(self, k) for k in HF_DEFAULTS},
    )


class LayerNorm(nnx.Module):
  """``w (x - mean) / sqrt(var + eps) + b`` over the last axis, statistics in float32."""

  def __init__(self, dim: int, eps: float, *, dtype, param_dtype):
    self.weight = nnx.Param(jnp.ones((dim,), param_dtype), **logical_axes(AXIS_NORM))
    self.bias = nnx.Param(jnp.zeros((dim,), param_dtype), **logical_axes(AXIS_NORM))
    self.eps = eps
    self.dtype = dtype

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    centred = x32 - mean
    var = jnp.mean(centred * centred, axis=-1, keepdims=True)
    normed = centred * jax.lax.rsqrt(var + self.eps)
    out = normed * self.weight[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)
    return out.astype(self.dtype)


def _linear(
    config: ClipVisionConfig, d_in: int, d_out: int, axes: tuple[str, str], rngs: nnx.Rngs
) -> nnx.Linear:
  return nnx.Linear(
      d_in,
      d_out,
      use_bias=True,
      dtype=config.dtype,
      param_dtype=config.param_dtype,
      kernel_init=nnx.initializers.normal(0.02),
      kernel_metadata=logical_axes(*axes),
      bias_metadata=logical_axes(axes[1]),
      rngs=rngs,
  )


def activation(name: str, x: jax.Array) -> jax.Array:
  """``quick_gelu``: ``x sigmoid(1.702 x)``; ``gelu``: the exact (erf) GELU."""
  if name == "quick_gelu":
    return x * jax.nn.sigmoid(1.702 * x)
  return jax.nn.gelu(x, approximate=False)


class PatchEmbedding(nnx.Module):
  """Stride-``P`` ``P x P`` convolution without bias, weight in torch layout ``(D, C, P, P)``."""

  def __init__(self, config: ClipVisionConfig, *, rngs: nnx.Rngs):
    p, c, d = config.patch_size, config.num_channels, config.hidden_size
    self.weight = nnx.Param(
        nnx.initializers.normal(0.02)(rngs.params(), (d, c, p, p), config.param_dtype),
        **logical_axes(AXIS_EMBED, None, None, None),
    )
    self.patch_size = p
    self.dtype = config.dtype

  def __call__(self, pixels: jax.Array) -> jax.Array:
    """``pixels`` (B, C, H, W) -> patch embeddings (B, N, D), patches row by row."""
    b, c, h, w = pixels.shape
    p = self.patch_size
    patches = pixels.reshape(b, c, h // p, p, w // p, p).transpose(0, 2, 4, 1, 3, 5)
    patches = patches.reshape(b * (h // p) * (w // p), c * p * p).astype(self.dtype)
    kernel = self.weight[...].reshape(self.weight.shape[0], -1).astype(self.dtype)
    return (patches @ kernel.T).reshape(b, (h // p) * (w // p), -1)


class VisionEmbeddings(nnx.Module):
  """Class token + patch embeddings + learned position embeddings."""

  def __init__(self, config: ClipVisionConfig, *, rngs: nnx.Rngs):
    d = config.hidden_size
    self.class_embedding = nnx.Param(
        nnx.initializers.normal(0.02)(rngs.params(), (d,), config.param_dtype),
        **logical_axes(AXIS_EMBED),
    )
    self.patch_embedding = PatchEmbedding(config, rngs=rngs)
    self.position_embedding = nnx.Embed(
        config.num_patches + 1,
        d,
        dtype=config.dtype,
        param_dtype=config.param_dtype,
        embedding_init=nnx.initializers.normal(0.02),
        embedding_metadata=logical_axes(None, AXIS_EMBED),
        rngs=rngs,
    )
    self.image_size = config.image_size
    self.dtype = config.dtype

  def __call__(self, pixels: jax.Array) -> jax.Array:
    if pixels.ndim != 4 or pixels.shape[2:] != (self.image_size, self.image_size):
      raise ValueError(
          f"pixel_values must have shape (num_images, 3, {self.image_size}, {self.image_size}) "
          f"(vision_config.image_size), got {pixels.shape}."
      )
    patches = self.patch_embedding(pixels)
    cls = jnp.broadcast_to(
        self.class_embedding[...].astype(self.dtype), (patches.shape[0], 1, patches.shape[-1])
    )
    return jnp.concatenate([cls, patches], axis=1) + self.position_embedding.embedding[...].astype(
        self.dtype
    )


class VisionAttention(nnx.Module):
  """Bidirectional multi-head attention with q/k/v/out projections (all with bias)."""

  def __init__(self, config: ClipVisionConfig, *, rngs: nnx.Rngs):
    d = config.hidden_size
    self.q_proj = _linear(config, d, d, (AXIS_EMBED, AXIS_Q_HEADS), rngs)
    self.k_proj = _linear(config, d, d, (AXIS_EMBED, AXIS_Q_HEADS), rngs)
    self.v_proj = _linear(config, d, d, (AXIS_EMBED, AXIS_Q_HEADS), rngs)
    self.out_proj = _linear(config, d, d, (AXIS_Q_HEADS, AXIS_EMBED), rngs)
    self.num_heads = config.num_attention_heads
    self.head_dim = config.head_dim
    self.dtype = config.dtype

  def __call__(self, x: jax.Array) -> jax.Array:
    b, t, d = x.shape
    flat = x.reshape(b * t, d)
    q = self.q_proj(flat).reshape(b, t, self.num_heads, self.head_dim)
    k = self.k_proj(flat).reshape(b, t, self.num_heads, self.head_dim)
    v = self.v_proj(flat).reshape(b, t, self.num_heads, self.head_dim)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * (self.head_dim**-0.5)
    probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(self.dtype)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b * t, d)
    return self.out_proj(out).reshape(b, t, d)


class VisionMLP(nnx.Module):
  """``fc2(act(fc1(x)))``."""

  def __init__(self, config: ClipVisionConfig, *, rngs: nnx.Rngs):
    self.fc1 = _linear(
        config, config.hidden_size, config.intermediate_size, (AXIS_EMBED, AXIS_MLP), rngs
    )
    self.fc2 = _linear(
        config, config.intermediate_size, config.hidden_size, (AXIS_MLP, AXIS_EMBED), rngs
    )
    self.act = config.hidden_act

  def __call__(self, x: jax.Array) -> jax.Array:
    h = x.reshape(-1, x.shape[-1])
    h = self.fc2(activation(self.act, self.fc1(h)))
    return h.reshape(*x.shape[:-1], h.shape[-1])


class VisionEncoderLayer(nnx.Module):
  """Pre-norm encoder block: attention then MLP, each with a residual connection."""

  def __init__(self, config: ClipVisionConfig, *, rngs: nnx.Rngs):
    norm = dict(dtype=config.dtype, param_dtype=config.param_dtype)
    self.self_attn = VisionAttention(config, rngs=rngs)
    self.layer_norm1 = LayerNorm(config.hidden_size, config.layer_norm_eps, **norm)
    self.mlp = VisionMLP(config, rngs=rngs)
    self.layer_norm2 = LayerNorm(config.hidden_size, config.layer_norm_eps, **norm)

  def __call__(self, x: jax.Array) -> jax.Array:
    h = x + self.self_attn(self.layer_norm1(x))
    return h + self.mlp(self.layer_norm2(h))


class VisionEncoder(nnx.Module):

  def __init__(self, config: ClipVisionConfig, *, rngs: nnx.Rngs):
    self.layers = nnx.List(
        [VisionEncoderLayer(config, rngs=rngs) for _ in range(config.num_hidden_layers)]
    )


class ClipVisionModel(nnx.Module):
  """CLIP ViT image encoder (transformers' ``CLIPVisionModel``); see the module docstring."""

  def __init__(self, config: ClipVisionConfig, *, rngs: nnx.Rngs):
    if not isinstance(config, ClipVisionConfig):
      raise TypeError(f"config must be a ClipVisionConfig, got {type(config).__name__}.")
    norm = dict(dtype=config.dtype, param_dtype=config.param_dtype)
    self.config = config
    self.embeddings = VisionEmbeddings(config, rngs=rngs)
    self.pre_layrnorm = LayerNorm(config.hidden_size, config.layer_norm_eps, **norm)
    self.encoder = VisionEncoder(config, rngs=rngs)
    self.post_layernorm = LayerNorm(config.hidden_size, config.layer_norm_eps, **norm)

  def __call__(self, pixel_values: jax.Array, *, num_layers: int | None = None) -> list[jax.Array]:
    """Hidden states ``[h^(0), ..., h^(num_layers)]``, each ``(B, N + 1, D)``.

    ``num_layers`` (default: all ``L``) stops the encoder early: LLaVA reads ``h^(L-1)`` and never
    needs the last layer.
    """
    layers = self.encoder.layers
    num_layers = len(layers) if num_layers is None else num_layers
    if not 0 <= num_layers <= len(layers):
      raise ValueError(f"num_layers={num_layers} is outside 0..{len(layers)}.")
    h = self.pre_layrnorm(self.embeddings(pixel_values))
    states = [h]
    for layer in list(layers)[:num_layers]:
      h = layer(h)
      states.append(h)
    return states
