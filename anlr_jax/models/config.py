r"""Configuration of the decoder-only causal LMs served by :mod:`anlr_jax.models.llama`.

One frozen dataclass, :class:`ModelConfig`, describes LLaMA-2, LLaMA-3 (grouped-query attention,
``llama3`` RoPE scaling) and Qwen2 / Qwen2.5 (q/k/v bias, optionally tied embeddings). The shapes it
fixes are

    embed_tokens: (vocab_size, hidden_size)
    q_proj: (hidden_size, num_attention_heads * head_dim)    (+ bias when attention_bias)
    k_proj, v_proj: (hidden_size, num_key_value_heads * head_dim)   (+ bias when attention_bias)
    o_proj: (num_attention_heads * head_dim, hidden_size)
    gate_proj, up_proj: (hidden_size, intermediate_size);  down_proj: (intermediate_size, hidden_size)

and the rotary frequencies are ``inv_freq_i = rope_theta^{-2i / head_dim}`` for
``i = 0 .. head_dim/2 - 1``, rescaled per ``rope_scaling`` (see :meth:`ModelConfig.rope_inv_freq`).

Named presets follow the public Hugging Face ``config.json`` of each model;
``ModelConfig.preset("tiny")`` is a ~160K-parameter model for tests.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Mapping

import jax.numpy as jnp
import numpy as np

from anlr_jax.models.hf_files import read_hf_config

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "llama3")
ATTENTION_IMPLS = ("einsum", "xla", "cudnn", "auto")
REMAT_MODES = ("none", "full", "dots")
"""Per-decoder-layer rematerialisation: none, everything recomputed, or only matmul outputs kept."""
_LLAMA3_ROPE_KEYS = (
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
)


def _canonical_rope_scaling(rope_scaling: Mapping[str, Any] | None) -> dict[str, Any] | None:
  """Returns ``rope_scaling`` as a plain dict with ``rope_type`` set, or None for plain RoPE.

  Accepts both the legacy ``{"type": ...}`` and the current ``{"rope_type": ...}`` spellings.
  """
  if rope_scaling is None:
    return None
  if not isinstance(rope_scaling, Mapping):
    raise ValueError(f"rope_scaling must be None or a dict, got {type(rope_scaling).__name__}.")
  scaling = {k: v for k, v in rope_scaling.items() if k not in ("type", "rope_theta")}
  rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
  scaling["rope_type"] = rope_type
  if rope_type not in SUPPORTED_ROPE_TYPES:
    raise ValueError(
        f"rope_scaling.rope_type={rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}."
    )
  if rope_type == "default":
    return None
  missing = [k for k in _LLAMA3_ROPE_KEYS if k not in scaling]
  if missing:
    raise ValueError(f"rope_scaling of type 'llama3' is missing keys {missing}.")
  if scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
    raise ValueError("rope_scaling.high_freq_factor must exceed rope_scaling.low_freq_factor.")
  return scaling


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  r"""Hyperparameters of a LLaMA / Qwen2 causal LM.

  Attributes:
    vocab_size: number of token ids ``V``.
    hidden_size: residual width ``d``.
    intermediate_size: SwiGLU width ``d_ff``.
    num_hidden_layers: number of decoder layers ``L``.
    num_attention_heads: query heads ``H``.
    num_key_value_heads: key/value heads ``H_kv`` (``H_kv`` divides ``H``; GQA when smaller).
    head_dim: per-head width; None means ``hidden_size // num_attention_heads``.
    rms_norm_eps: ``eps`` in ``x / sqrt(mean(x^2) + eps)``.
    rope_theta: RoPE base.
    rope_scaling: None, or a dict with ``rope_type='llama3'`` and ``factor``, ``low_freq_factor``,
      ``high_freq_factor``, ``original_max_position_embeddings``.
    max_position_embeddings: longest context the model was trained for (informative; caches may
      be any length).
    tie_word_embeddings: logits use the embedding matrix and there is no ``lm_head``.
    attention_bias: q/k/v projections carry a bias (Qwen2).
    model_type: ``'llama'`` or ``'qwen2'``.
    dtype: compute dtype (activations, matmuls); float32 or bfloat16.
    param_dtype: storage dtype of the parameters.
    remat: per-decoder-layer rematerialisation of the cache-free forward pass (each layer wrapped
      in ``nnx.remat``: its activations are recomputed in the backward pass): ``'none'``,
      ``'full'`` (only the layer's input is kept) or ``'dots'`` (matmul outputs are kept too);
      ``True``/``False`` mean ``'full'``/``'none'``. The trainer's ``trainer.remat`` overrides it
      for training (the forward's ``remat=`` argument).
    attention_impl: how the cache-free forward pass (training, scoring) computes attention:
      ``'einsum'`` (explicit scores and mask; fastest on CPU), ``'xla'`` or ``'cudnn'``
      (``jax.nn.dot_product_attention`` with a causal mask and per-row key lengths; ``'cudnn'`` is
      the fused flash-attention kernel on NVIDIA GPUs). The last two assume right padding (every
      row's real tokens first), which is what :mod:`anlr_jax.data` produces. ``'auto'``: ``'cudnn'``
      on the GPU backend with a bfloat16/float16 compute dtype, else ``'einsum'``. Decoding with a
      :class:`~anlr_jax.models.llama.KVCache` always uses ``'einsum'``.
    matmul_dtype: None, or a dtype (``bfloat16``) in which the projection and head GEMMs take their
      operands, forward and backward, summing in float32 while everything else stays in ``dtype``
      (:mod:`anlr_jax.models.matmul`). About twice as fast as float32 on CPUs with bfloat16 dot
      instructions, where an all-bfloat16 ``dtype`` is not.
  """

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_hidden_layers: int
  num_attention_heads: int
  num_key_value_heads: int
  head_dim: int | None = None
  rms_norm_eps: float = 1e-6
  rope_theta: float = 10000.0
  rope_scaling: Mapping[str, Any] | None = None
  max_position_embeddings: int = 4096
  tie_word_embeddings: bool = False
  attention_bias: bool = False
  model_type: str = "llama"
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  remat: str = "none"
  attention_impl: str = "einsum"
  matmul_dtype: Any = None

  def __post_init__(self):
    for name in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
    ):
      value = getattr(self, name)
      if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}.")
    if self.model_type not in SUPPORTED_MODEL_TYPES:
      raise ValueError(
          f"Unsupported model_type {self.model_type!r}; supported: {SUPPORTED_MODEL_TYPES}."
      )
    if self.num_attention_heads % self.num_key_value_heads:
      raise ValueError(
          f"ModelConfig.num_key_value_heads={self.num_key_value_heads} must divide "
          f"num_attention_heads={self.num_attention_heads}."
      )
    if self.head_dim is None:
      if self.hidden_size % self.num_attention_heads:
        raise ValueError(
            f"ModelConfig.num_attention_heads={self.num_attention_heads} must divide "
            f"hidden_size={self.hidden_size} when head_dim is None."
        )
      object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
    if not isinstance(self.head_dim, (int, np.integer)) or self.head_dim <= 0 or self.head_dim % 2:
      raise ValueError(f"ModelConfig.head_dim must be a positive even int, got {self.head_dim!r}.")
    if not self.rms_norm_eps > 0:
      raise ValueError(f"ModelConfig.rms_norm_eps must be > 0, got {self.rms_norm_eps!r}.")
    if not self.rope_theta > 0:
      raise ValueError(f"ModelConfig.rope_theta must be > 0, got {self.rope_theta!r}.")
    if isinstance(self.remat, (bool, np.bool_)):
      object.__setattr__(self, "remat", "full" if self.remat else "none")
    if self.remat not in REMAT_MODES:
      raise ValueError(f"ModelConfig.remat={self.remat!r} must be one of {REMAT_MODES} or a bool.")
    if self.attention_impl not in ATTENTION_IMPLS:
      raise ValueError(
          f"ModelConfig.attention_impl={self.attention_impl!r} must be one of {ATTENTION_IMPLS}."
      )
    object.__setattr__(self, "rope_scaling", _canonical_rope_scaling(self.rope_scaling))
    for name in ("dtype", "param_dtype", "matmul_dtype"):
      if name == "matmul_dtype" and self.matmul_dtype is None:
        continue
      try:
        dtype = jnp.dtype(getattr(self, name))
      except TypeError as e:
        raise ValueError(f"ModelConfig.{name}={getattr(self, name)!r} is not a dtype.") from e
      if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"ModelConfig.{name} must be a floating dtype, got {dtype}.")
      object.__setattr__(self, name, dtype)

  def __hash__(self):
    # rope_scaling is a dict; hash its sorted items so configs can sit in static jit arguments.
    fields = tuple(
        tuple(sorted(v.items())) if isinstance(v, Mapping) else v
        for v in (getattr(self, f.name) for f in dataclasses.fields(self))
    )
    return hash(fields)

  # ----------------------------------------------------------------------------------------------
  # Derived quantities

  @property
  def num_query_groups(self) -> int:
    """``H / H_kv``: query heads sharing one key/value head."""
    return self.num_attention_heads // self.num_key_value_heads

  def rope_inv_freq(self) -> np.ndarray:
    r"""Rotary inverse frequencies, float32 array of shape ``(head_dim // 2,)``.

    Plain RoPE: ``f_i = theta^{-2i/D}``. With ``llama3`` scaling (factor ``s``, low/high frequency
    factors ``l, h``, original context ``C``), wavelength ``w_i = 2 pi / f_i``:
    ``f_i`` is kept when ``w_i < C/h``, divided by ``s`` when ``w_i > C/l``, and in between
    interpolated as ``(1 - m) f_i / s + m f_i`` with ``m = (C / w_i - l) / (h - l)``.
    """
    dim = self.head_dim
    inv_freq = 1.0 / (self.rope_theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    inv_freq = inv_freq.astype(np.float32)
    if self.rope_scaling is None:
      return inv_freq
    s = self.rope_scaling
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    context = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= context / high) & (wavelen <= context / low)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)

  def num_params(self) -> int:
    """Number of parameters of the model this config describes."""
    d, q, kv = (
        self.hidden_size,
        self.num_attention_heads * self.head_dim,
        (self.num_key_value_heads * self.head_dim),
    )
    attn = d * q + 2 * d * kv + q * d + (q + 2 * kv if self.attention_bias else 0)
    layer = attn + 3 * d * self.intermediate_size + 2 * d
    head = 0 if self.tie_word_embeddings else self.vocab_size * d
    return self.vocab_size * d + self.num_hidden_layers * layer + d + head

  # ----------------------------------------------------------------------------------------------
  # Presets

  @classmethod
  def preset(cls, name: str, **overrides) -> "ModelConfig":
    """The architecture of a published model (:data:`PRESETS`), or ``"tiny"`` for tests; fields
    in ``overrides`` (``dtype``, ``num_hidden_layers``, ...) replace the preset's.

    Raises:
      ValueError: an unknown name (the message lists the presets).
    """
    if name not in PRESETS:
      raise ValueError(f"unknown model preset {name!r}; presets: {', '.join(PRESETS)}")
    return dataclasses.replace(cls(**PRESETS[name]), **overrides)

  # ----------------------------------------------------------------------------------------------
  # Hugging Face config.json

  @classmethod
  def from_hf_config(cls, hf_config: Mapping[str, Any], **overrides) -> "ModelConfig":
    """Builds a config from a Hugging Face ``config.json`` dict (transformers 4.x or 5.x layout).

    ``overrides`` (e.g. ``dtype=jnp.bfloat16``) replace fields after reading.
    """
    if not isinstance(hf_config, Mapping):
      raise ValueError(f"hf_config must be a dict, got {type(hf_config).__name__}.")
    model_type = hf_config.get("model_type")
    if model_type == "llava":
      raise ValueError(
          "model_type 'llava' is a LLaVA checkpoint (a vision tower, a projector and a language"
          " model): load it with anlr_jax.models.load_llava_model (LlavaConfig.from_pretrained for"
          f" its config); this reads the language models {SUPPORTED_MODEL_TYPES}."
      )
    if model_type not in SUPPORTED_MODEL_TYPES:
      raise ValueError(
          f"Unsupported model_type {model_type!r}; supported: {SUPPORTED_MODEL_TYPES}."
      )
    required = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
    )
    missing = [k for k in required if k not in hf_config]
    if missing:
      raise KeyError(f"config.json is missing required keys {missing}.")
    act = hf_config.get("hidden_act", "silu")
    if act != "silu":
      raise ValueError(f"hidden_act={act!r} is not supported; only 'silu' (SwiGLU).")
    if hf_config.get("mlp_bias", False):
      raise ValueError("mlp_bias=True is not supported.")
    if hf_config.get("use_sliding_window", False):
      raise ValueError("use_sliding_window=True is not supported.")
    # transformers 5 keeps theta and scaling in `rope_parameters`; 4.x in rope_theta/rope_scaling.
    rope_parameters = hf_config.get("rope_parameters") or {}
    rope_scaling = hf_config.get("rope_scaling") or rope_parameters or None
    rope_theta = rope_parameters.get("rope_theta", hf_config.get("rope_theta", 10000.0))
    fields = dict(
        vocab_size=hf_config["vocab_size"],
        hidden_size=hf_config["hidden_size"],
        intermediate_size=hf_config["intermediate_size"],
        num_hidden_layers=hf_config["num_hidden_layers"],
        num_attention_heads=hf_config["num_attention_heads"],
        num_key_value_heads=hf_config.get("num_key_value_heads")
        or hf_config["num_attention_heads"],
        head_dim=hf_config.get("head_dim"),
        rms_norm_eps=hf_config.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope_theta),
        rope_scaling=rope_scaling,
        max_position_embeddings=hf_config.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
        attention_bias=bool(hf_config.get("attention_bias", model_type == "qwen2")),
        model_type=model_type,
    )
    fields.update(overrides)
    return cls(**fields)

  @classmethod
  def from_pretrained(cls, path: str | os.PathLike, **overrides) -> "ModelConfig":
    """Reads ``<path>/config.json`` (or ``path`` itself when it is a file)."""
    return cls.from_hf_config(read_hf_config(path), **overrides)

  def to_hf_config(self) -> dict[str, Any]:
    """The ``config.json`` dict that transformers reads back into this architecture."""
    architectures = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[self.model_type]
    rope_parameters = {
        "rope_type": "default",
        **(self.rope_scaling or {}),
        "rope_theta": self.rope_theta,
    }
    out = dict(
        architectures=[architectures],
        model_type=self.model_type,
        vocab_size=self.vocab_size,
        hidden_size=self.hidden_size,
        intermediate_size=self.intermediate_size,
        num_hidden_layers=self.num_hidden_layers,
        num_attention_heads=self.num_attention_heads,
        num_key_value_heads=self.num_key_value_heads,
        head_dim=self.head_dim,
        hidden_act="silu",
        rms_norm_eps=self.rms_norm_eps,
        rope_theta=self.rope_theta,
        rope_scaling=dict(self.rope_scaling) if self.rope_scaling else None,
        rope_parameters=rope_parameters,
        max_position_embeddings=self.max_position_embeddings,
        tie_word_embeddings=self.tie_word_embeddings,
        torch_dtype=str(jnp.dtype(self.param_dtype)),
        dtype=str(jnp.dtype(self.param_dtype)),
    )
    if self.model_type == "llama":
      out.update(attention_bias=self.attention_bias, mlp_bias=False)
    elif not self.attention_bias:
      raise ValueError(
          "Qwen2 checkpoints always have q/k/v bias; attention_bias=False can't be saved."
      )
    return out


PRESETS: dict[str, dict[str, Any]] = {
    # LLaMA-2-7B (meta-llama/Llama-2-7b-hf)
    "llama2_7b": dict(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=4096,
        model_type="llama",
    ),
    # LLaMA-3-8B (meta-llama/Meta-Llama-3-8B): GQA with 8 key/value heads
    "llama3_8b": dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=8192,
        model_type="llama",
    ),
    # Qwen2.5-7B (Qwen/Qwen2.5-7B): q/k/v bias, 4 key/value heads, untied head
    "qwen2_5_7b": dict(
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=131072,
        attention_bias=True,
        model_type="qwen2",
    ),
    # Qwen2.5-14B (Qwen/Qwen2.5-14B): q/k/v bias, 8 key/value heads, untied head
    "qwen2_5_14b": dict(
        vocab_size=152064,
        hidden_size=5120,
        intermediate_size=13824,
        num_hidden_layers=48,
        num_attention_heads=40,
        num_key_value_heads=8,
        rms_norm_eps=1e-5,
        rope_theta=1000000.0,
        max_position_embeddings=131072,
        attention_bias=True,
        model_type="qwen2",
    ),
    # SmolLM2-135M (HuggingFaceTB/SmolLM2-135M): GQA with 3 key/value heads, tied embeddings
    "smollm2_135m": dict(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        model_type="llama",
    ),
    # a ~160K-parameter LLaMA-style model with GQA (4 query / 2 key-value heads) for tests
    "tiny": dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=256,
        model_type="llama",
    ),
}
"""Preset name -> :class:`ModelConfig` fields (:meth:`ModelConfig.preset`)."""
