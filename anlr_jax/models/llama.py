r"""LLaMA-2 / LLaMA-3 / Qwen2 causal language model in Flax NNX, laid out like Hugging Face.

Per decoder layer, with ``x`` the residual stream:

    h = x + o_proj(Attn(RoPE(q_proj(n1)), RoPE(k_proj(n1)), v_proj(n1))),   n1 = RMSNorm_1(x)
    y = h + down_proj(silu(gate_proj(n2)) * up_proj(n2)),                     n2 = RMSNorm_2(h)

``RMSNorm(x) = w * x / sqrt(mean(x^2) + eps)`` computed in float32 (the normalised value is cast
to the compute dtype before the weight multiplies it, as transformers does). RoPE rotates the two
halves of each head: ``q' = q cos(p f) + rotate_half(q) sin(p f)`` with ``rotate_half([a, b]) =
[-b, a]`` and ``f`` from :meth:`ModelConfig.rope_inv_freq`. Attention is causal, grouped-query
(``H / H_kv`` query heads share a key/value head), ``softmax(q k^T / sqrt(D) + mask)`` with the
softmax in float32; ``attention_mask`` (1 = token, 0 = pad) hides padded keys. Logits are
``RMSNorm(x_L) @ W_head`` or, with tied embeddings, ``RMSNorm(x_L) @ E^T``; returned in float32.

Naming contract: ``".".join(map(str, path))`` of every submodule equals its Hugging Face module name
(``model.embed_tokens``, ``model.layers.<i>.self_attn.q_proj``, ``model.layers.<i>.mlp.up_proj``,
``model.norm``, ``lm_head``, ...). Projections are ``nnx.Linear`` (kernel ``(in, out)``) looked up as
attributes at call time, so a LoRA wrapper with the same ``__call__(x)`` can replace any of them.

Logical axis names carried by every parameter (``out_sharding`` metadata, read with
``nnx.get_partition_spec``), for mesh rules to map onto mesh axes:

    vocab    vocabulary axis of embed_tokens.embedding (V, d) and lm_head.kernel (d, V)
    embed    the residual width d
    q_heads  flattened query heads H * D (q_proj output, o_proj input, q bias)
    kv_heads flattened key/value heads H_kv * D (k_proj / v_proj output and bias)
    mlp      the SwiGLU width d_ff
    norm     RMSNorm weights (d,)

Variables are created unsharded unless a mesh is active (``jax.set_mesh``), in which case flax
shards them eagerly through the logical rules in force (``nnx.logical_axis_rules``). The forward
pass is written for meshes with ``AxisType.Auto`` axes (XLA propagates activation shardings); it
gives no ``out_sharding`` hints, so fully ``Explicit`` meshes are not supported.

Decoding uses a :class:`KVCache` of fixed length: one ``(B, S, H_kv, D)`` key and value array per
layer, a ``(B, S)`` slot mask and the next write index, so a jitted step keeps one shape.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from anlr_jax.models.config import ModelConfig
from anlr_jax.models.matmul import lowp_dot_general, lowp_matmul

AXIS_VOCAB = "vocab"
AXIS_EMBED = "embed"
AXIS_Q_HEADS = "q_heads"
AXIS_KV_HEADS = "kv_heads"
AXIS_MLP = "mlp"
AXIS_NORM = "norm"
LOGICAL_AXES = (AXIS_VOCAB, AXIS_EMBED, AXIS_Q_HEADS, AXIS_KV_HEADS, AXIS_MLP, AXIS_NORM)

_INIT_STD = 0.02  # transformers' initializer_range

REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}
"""Per-decoder-layer rematerialisation (``ModelConfig.remat``, ``trainer.remat``): the
``jax.checkpoint`` policy of each layer's region; ``'none'``: no region."""


def logical_axes(*names: str) -> dict:
  """Variable metadata for logical ``names``; eager sharding only when a mesh is active."""
  return {"out_sharding": names, "eager_sharding": not jax.sharding.get_abstract_mesh().empty}


def make_linear(
    config: ModelConfig, d_in: int, d_out: int, axes: tuple[str, str], bias: bool, rngs: nnx.Rngs
) -> nnx.Linear:
  extra = (
      {} if config.matmul_dtype is None else {"dot_general": lowp_dot_general(config.matmul_dtype)}
  )
  return nnx.Linear(
      d_in,
      d_out,
      use_bias=bias,
      dtype=config.dtype,
      param_dtype=config.param_dtype,
      **extra,
      kernel_init=nnx.initializers.normal(_INIT_STD),
      bias_init=nnx.initializers.zeros_init(),
      kernel_metadata=logical_axes(*axes),
      bias_metadata=logical_axes(axes[1]),
      rngs=rngs,
  )


class KVCache(NamedTuple):
  """Fixed-size key/value cache: per-layer ``(B, S, H_kv, D)`` arrays, slot mask, write index.

  A call with ``T`` new tokens writes slots ``[index, index + T)``; the caller must keep
  ``index + T <= S`` (``lax.dynamic_update_slice`` would clamp the write, not fail, under jit).
  """

  keys: tuple[jax.Array, ...]
  values: tuple[jax.Array, ...]
  mask: jax.Array  # (B, S) int32: 1 where a slot holds a real (non-pad) token
  index: jax.Array  # int32 scalar: the next slot to write

  @property
  def max_length(self) -> int:
    return self.mask.shape[1]


def init_cache(config: ModelConfig, batch_size: int, max_length: int, dtype=None) -> KVCache:
  """An empty :class:`KVCache` for ``batch_size`` rows of up to ``max_length`` tokens.

  ``config``: the model's :class:`ModelConfig`, or a config holding it as ``text_config`` (LLaVA).
  """
  config = getattr(config, "text_config", config)
  if batch_size <= 0 or max_length <= 0:
    raise ValueError(f"batch_size and max_length must be positive, got {batch_size}, {max_length}.")
  dtype = config.dtype if dtype is None else dtype
  shape = (batch_size, max_length, config.num_key_value_heads, config.head_dim)
  layers = range(config.num_hidden_layers)
  return KVCache(
      keys=tuple(jnp.zeros(shape, dtype) for _ in layers),
      values=tuple(jnp.zeros(shape, dtype) for _ in layers),
      mask=jnp.zeros((batch_size, max_length), jnp.int32),
      index=jnp.zeros((), jnp.int32),
  )


class RMSNorm(nnx.Module):
  """``w * x / sqrt(mean(x^2) + eps)``, statistics in float32, result in the compute dtype."""

  def __init__(self, dim: int, eps: float, *, dtype, param_dtype):
    self.weight = nnx.Param(jnp.ones((dim,), param_dtype), **logical_axes(AXIS_NORM))
    self.eps = eps
    self.dtype = dtype

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return self.weight[...].astype(self.dtype) * normed.astype(self.dtype)


def rope_cos_sin(inv_freq: np.ndarray, positions: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
  """``cos(p f), sin(p f)`` duplicated over both halves: ``(B, T, D)`` each, in ``dtype``."""
  freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)[None, None, :]
  emb = jnp.concatenate([freqs, freqs], axis=-1)
  return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """``x cos + rotate_half(x) sin`` for ``x`` of shape ``(B, T, heads, D)``."""
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]


def grouped_attention(q, k, v, allowed, dtype) -> jax.Array:
  """Masked softmax attention with grouped-query heads, as batched 4-D matmuls.

  ``q`` (B, T, H, D); ``k``, ``v`` (B, S, K, D) with ``H = K * G``: key/value head ``j`` serves
  query heads ``j*G .. j*G + G - 1``; ``allowed`` (B, T, S) bool. Returns (B, T, H, D).

  The ``G`` query heads of a key/value head are stacked along the query axis, so each of the
  ``B * K`` score matmuls is ``(G*T, D) x (D, S)`` and the keys and values are never repeated
  ``G`` times. On XLA CPU this takes SmolLM2-135M's train step (9 query / 3 KV heads) from about
  4.6 to 4.1 s against repeating the keys (docs/benchmarks.md); grouped 5-D einsums were slower
  still.
  """
  b, t, h, d = q.shape
  kv_heads = k.shape[2]
  groups = h // kv_heads
  q = q.reshape(b, t, kv_heads, groups, d).transpose(0, 2, 3, 1, 4).reshape(b, kv_heads, -1, d)
  k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # (B, K, S, D)
  scores = jnp.einsum("bkmd,bksd->bkms", q, k) * (d**-0.5)
  scores = scores.astype(jnp.float32)
  allowed = jnp.tile(allowed, (1, groups, 1))  # row g*T + t is query t of group member g
  scores = jnp.where(allowed[:, None], scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
  out = jnp.einsum("bkms,bksd->bkmd", probs, v).reshape(b, kv_heads, groups, t, d)
  return out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, d)


def resolve_attention_impl(config: ModelConfig) -> str:
  """``config.attention_impl`` with ``'auto'`` resolved for the current default backend."""
  impl = config.attention_impl
  half = jnp.dtype(config.dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
  backend = jax.default_backend()
  if impl == "auto":
    impl = "cudnn" if half and backend == "gpu" else "einsum"
  elif impl == "cudnn" and (backend != "gpu" or not half):
    raise ValueError(
        f"ModelConfig.attention_impl='cudnn' (cuDNN flash attention) needs the GPU backend and a "
        f"bfloat16/float16 compute dtype; got backend {backend!r} and dtype {config.dtype}. "
        "Use 'auto' (cudnn where it applies, einsum elsewhere), 'einsum' or 'xla'."
    )
  return impl


class Attention(nnx.Module):
  """Grouped-query causal self-attention with RoPE and an optional fixed-size KV cache."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    d, dh = config.hidden_size, config.head_dim
    q_dim, kv_dim = config.num_attention_heads * dh, config.num_key_value_heads * dh
    bias = config.attention_bias
    self.q_proj = make_linear(config, d, q_dim, (AXIS_EMBED, AXIS_Q_HEADS), bias, rngs)
    self.k_proj = make_linear(config, d, kv_dim, (AXIS_EMBED, AXIS_KV_HEADS), bias, rngs)
    self.v_proj = make_linear(config, d, kv_dim, (AXIS_EMBED, AXIS_KV_HEADS), bias, rngs)
    # LLaMA's attention_bias also covers o_proj; Qwen2 never has an o_proj bias.
    o_bias = bias and config.model_type == "llama"
    self.o_proj = make_linear(config, q_dim, d, (AXIS_Q_HEADS, AXIS_EMBED), o_bias, rngs)
    self.num_heads = config.num_attention_heads
    self.num_kv_heads = config.num_key_value_heads
    self.head_dim = dh
    self.dtype = config.dtype
    self.attention_impl = resolve_attention_impl(config)

  def __call__(self, x, cos, sin, allowed, kv=None, index=None, lengths=None):
    """``x`` (B, T, d); ``allowed`` (B, T, S) bool; ``kv`` the layer's cached (k, v) or None.

    ``lengths`` (B,) int32 real tokens per row, used instead of ``allowed`` by the fused
    attention implementations (``config.attention_impl`` other than ``'einsum'``).

    Returns the attention output (B, T, d) and the updated ``(k, v)`` (None without a cache).
    """
    b, t, d = x.shape
    x = x.reshape(b * t, d)  # 2-D GEMMs (see MLP)
    q = self.q_proj(x).reshape(b, t, self.num_heads, self.head_dim)
    k = self.k_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
    v = self.v_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    k, v = k.astype(self.dtype), v.astype(self.dtype)
    new_kv = None
    if kv is not None:
      k = jax.lax.dynamic_update_slice(kv[0], k.astype(kv[0].dtype), (0, index, 0, 0))
      v = jax.lax.dynamic_update_slice(kv[1], v.astype(kv[1].dtype), (0, index, 0, 0))
      new_kv = (k, v)
      k, v = k.astype(self.dtype), v.astype(self.dtype)
    if kv is None and self.attention_impl != "einsum":
      # Causal attention over each row's first ``lengths`` keys (right padding): the fused kernel
      # handles GQA itself. Pad queries still see real keys, so no row is fully masked.
      out = jax.nn.dot_product_attention(
          q,
          k,
          v,
          is_causal=True,
          key_value_seq_lengths=lengths,
          implementation=self.attention_impl,
      ).reshape(b * t, self.num_heads * self.head_dim)
      return self.o_proj(out).reshape(b, t, -1), new_kv
    out = grouped_attention(q, k, v, allowed, self.dtype)
    return self.o_proj(out.reshape(b * t, -1)).reshape(b, t, -1), new_kv


class MLP(nnx.Module):
  """SwiGLU: ``down_proj(silu(gate_proj(x)) * up_proj(x))``."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    d, f = config.hidden_size, config.intermediate_size
    self.gate_proj = make_linear(config, d, f, (AXIS_EMBED, AXIS_MLP), False, rngs)
    self.up_proj = make_linear(config, d, f, (AXIS_EMBED, AXIS_MLP), False, rngs)
    self.down_proj = make_linear(config, f, d, (AXIS_MLP, AXIS_EMBED), False, rngs)

  def __call__(self, x):
    # Projections on (tokens, features): XLA CPU runs 2-D GEMMs faster than (B, T, d) ones, more so
    # in the backward pass (see docs/benchmarks.md).
    h = x.reshape(-1, x.shape[-1])
    h = self.down_proj(jax.nn.silu(self.gate_proj(h)) * self.up_proj(h))
    return h.reshape(*x.shape[:-1], h.shape[-1])


class DecoderLayer(nnx.Module):
  """Pre-norm decoder block: attention then SwiGLU, each with a residual connection."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    norm_kw = dict(dtype=config.dtype, param_dtype=config.param_dtype)
    self.self_attn = Attention(config, rngs=rngs)
    self.mlp = MLP(config, rngs=rngs)
    self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **norm_kw)
    self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **norm_kw)

  def __call__(self, x, cos, sin, allowed, kv=None, index=None, lengths=None):
    attn, new_kv = self.self_attn(self.input_layernorm(x), cos, sin, allowed, kv, index, lengths)
    h = x + attn
    return h + self.mlp(self.post_attention_layernorm(h)), new_kv


def _layer_forward(layer: DecoderLayer, x, cos, sin, allowed, lengths):
  """Cache-free layer application; module-level so ``nnx.remat`` can wrap it."""
  return layer(x, cos, sin, allowed, lengths=lengths)[0]


def _after_cotangent(fun: Callable, policy) -> Callable:
  """``jax.checkpoint(fun, policy=policy)`` whose backward pass recomputes only once the
  cotangent of ``fun``'s first output has arrived.

  The saved residuals pass through ``r + 0 * g`` (``g`` one element of that cotangent) before the
  recomputation reads them (integers and PRNG keys too: LoRA dropout's masks come from a key). Without this data dependency nothing orders the recomputation after
  the layers above it: XLA's CPU backend drops ``jax.checkpoint``'s optimisation barriers and merges
  the recomputation with the forward pass, so every activation stays alive (no memory saved).
  A non-finite ``g`` makes the layer's gradients NaN, as they would be anyway.
  """

  @jax.custom_vjp
  def wrapped(*args):
    return fun(*args)

  def fwd(*args):
    return jax.vjp(jax.checkpoint(fun, policy=policy), *args)

  def bwd(vjp_fn, ct):
    g = jax.tree.leaves(ct)[0]
    zero = 0 * g.reshape(-1)[0].astype(jnp.float32)

    def tie(r):
      dtype = getattr(r, "dtype", None)
      if dtype is None or dtype == jnp.bool_:
        return r
      if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):  # LoRA dropout's key: its masks
        data = jax.random.key_data(r)  # would be CSE'd with the forward's and kept alive
        return jax.random.wrap_key_data(data + zero.astype(data.dtype), impl=jax.random.key_impl(r))
      if jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer):
        return r + zero.astype(dtype)
      return r

    return jax.tree.map(tie, vjp_fn)(ct)

  wrapped.defvjp(fwd, bwd)
  return wrapped


def _remat_layer_forward(policy, layer: DecoderLayer, x, cos, sin, allowed, lengths):
  """:func:`_layer_forward` as one rematerialised region (:func:`_after_cotangent`); the layer's
  non-parameter state (LoRA dropout's RNG counts) is carried out of the region and updated."""
  graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

  def pure(params, rest, x, cos, sin, allowed, lengths):
    module = nnx.merge(graphdef, params, rest)
    y = _layer_forward(module, x, cos, sin, allowed, lengths)
    return y, nnx.state(module, nnx.Not(nnx.Param))

  y, new_rest = _after_cotangent(pure, policy)(params, rest, x, cos, sin, allowed, lengths)
  nnx.update(layer, new_rest)
  return y


class LlamaModel(nnx.Module):
  """Embedding, decoder stack and final norm (Hugging Face's ``model`` submodule)."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    self.embed_tokens = nnx.Embed(
        config.vocab_size,
        config.hidden_size,
        dtype=config.dtype,
        param_dtype=config.param_dtype,
        embedding_init=nnx.initializers.normal(_INIT_STD),
        embedding_metadata=logical_axes(AXIS_VOCAB, AXIS_EMBED),
        rngs=rngs,
    )
    self.layers = nnx.List(
        [DecoderLayer(config, rngs=rngs) for _ in range(config.num_hidden_layers)]
    )
    self.norm = RMSNorm(
        config.hidden_size, config.rms_norm_eps, dtype=config.dtype, param_dtype=config.param_dtype
    )


class LlamaForCausalLM(nnx.Module):
  """Causal LM serving LLaMA-2, LLaMA-3 and Qwen2/2.5 checkpoints (see the module docstring)."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    if not isinstance(config, ModelConfig):
      raise TypeError(f"config must be a ModelConfig, got {type(config).__name__}.")
    self.config = config
    self.model = LlamaModel(config, rngs=rngs)
    if not config.tie_word_embeddings:
      self.lm_head = make_linear(
          config, config.hidden_size, config.vocab_size, (AXIS_EMBED, AXIS_VOCAB), False, rngs
      )

  def __call__(
      self,
      input_ids: jax.Array,
      *,
      positions: jax.Array | None = None,
      attention_mask: jax.Array | None = None,
      cache: KVCache | None = None,
      inputs_embeds: jax.Array | None = None,
      remat: str | None = None,
      logits_to_keep: int = 0,
  ):
    """Logits ``(B, T, V)`` float32 for ``input_ids`` ``(B, T)``.

    Args:
      input_ids: int token ids ``(B, T)``.
      positions: RoPE positions ``(B, T)``; by default each row counts its real tokens, i.e.
        ``cumsum(attention_mask) - 1`` (plus the real tokens already in ``cache``), so a
        left-padded row gets the same positions as the unpadded one.
      attention_mask: ``(B, T)``, 1 = token, 0 = pad; None means all tokens are real.
      cache: a :class:`KVCache`; the new keys/values are written at ``cache.index``.
      inputs_embeds: ``(B, T, d)`` input embeddings used instead of looking ``input_ids`` up
        (LLaVA puts image features at its image tokens); ``input_ids`` still gives the shape.
      remat: per-layer rematerialisation of the cache-free pass, ``'none'``, ``'full'`` or
        ``'dots'`` (:data:`REMAT_POLICIES`); None: ``config.remat``.
      logits_to_keep: ``k > 0`` computes the logits of the last ``k`` positions only,
        ``(B, k, V)`` (a prefill that samples one token: the output matrix multiplies ``k`` rows
        instead of ``T``, and no ``(B, T, V)`` array is made); 0: every position.

    Returns:
      ``logits`` or, when ``cache`` is given, ``(logits, updated_cache)``.
    """
    if logits_to_keep < 0:
      raise ValueError(f"logits_to_keep={logits_to_keep} must be >= 0.")
    h, new_cache = self._forward(input_ids, positions, attention_mask, cache, remat, inputs_embeds)
    if logits_to_keep:
      h = h[:, -logits_to_keep:]
    logits = self.logits(h)
    return logits if cache is None else (logits, new_cache)

  def hidden_states(
      self,
      input_ids: jax.Array,
      *,
      positions: jax.Array | None = None,
      attention_mask: jax.Array | None = None,
      inputs_embeds: jax.Array | None = None,
      remat: str | None = None,
  ) -> jax.Array:
    """The final normed hidden states ``RMSNorm(x_L)`` ``(B, T, d)`` in the compute dtype: what the
    output matrix (:meth:`output_matrix`) multiplies into the logits. Arguments as ``__call__``."""
    return self._forward(input_ids, positions, attention_mask, None, remat, inputs_embeds)[0]

  def output_matrix(self) -> tuple[jax.Array, bool] | None:
    """``(W, transposed)`` with ``logits = h @ W`` (``lm_head.kernel``, ``(d, V)``) or, tied,
    ``h @ W.T`` (``embed_tokens.embedding``, ``(V, d)``), both in the compute dtype before the
    product (:meth:`logits`; ``config.matmul_dtype`` rounds the operands further). None when the
    head is not a plain ``nnx.Linear`` (e.g. an adapter wraps ``lm_head``): then only
    :meth:`logits` computes it."""
    if self.config.tie_word_embeddings:
      return self.model.embed_tokens.embedding[...], True
    if type(self.lm_head) is not nnx.Linear:
      return None
    return self.lm_head.kernel[...], False

  def logits(self, h: jax.Array) -> jax.Array:
    """Float32 logits ``(..., V)`` of the final normed hidden states ``h`` ``(..., d)``."""
    config = self.config
    flat = h.reshape(-1, h.shape[-1])  # 2-D GEMM (see MLP)
    if config.tie_word_embeddings and config.matmul_dtype is not None:
      embedding = self.model.embed_tokens.embedding[...].astype(config.dtype)
      logits = lowp_matmul(flat, embedding, config.matmul_dtype, transpose_w=True)
    elif config.tie_word_embeddings:
      logits = self.model.embed_tokens.attend(flat)
    else:
      logits = self.lm_head(flat)
    return logits.reshape(*h.shape[:-1], logits.shape[-1]).astype(jnp.float32)

  def _forward(self, input_ids, positions, attention_mask, cache, remat, inputs_embeds=None):
    """``(RMSNorm(x_L), updated cache or None)``."""
    config = self.config
    remat = config.remat if remat is None else remat
    if remat not in REMAT_POLICIES:
      raise ValueError(f"remat={remat!r} must be one of {tuple(REMAT_POLICIES)}.")
    if input_ids.ndim != 2:
      raise ValueError(f"input_ids must have shape (B, T), got {input_ids.shape}.")
    b, t = input_ids.shape
    if attention_mask is None:
      attention_mask = jnp.ones((b, t), jnp.int32)
    elif attention_mask.shape != (b, t):
      raise ValueError(f"attention_mask shape {attention_mask.shape} != input_ids shape {(b, t)}.")
    attention_mask = attention_mask.astype(jnp.int32)
    if positions is None:
      offset = 0 if cache is None else jnp.sum(cache.mask, axis=-1, keepdims=True)
      positions = jnp.maximum(offset + jnp.cumsum(attention_mask, axis=-1) - 1, 0)
    elif positions.shape != (b, t):
      raise ValueError(f"positions shape {positions.shape} != input_ids shape {(b, t)}.")

    if cache is None:
      key_mask, query_slots = attention_mask, jnp.arange(t)
    else:
      if cache.mask.shape[0] != b:
        raise ValueError(f"cache batch size {cache.mask.shape[0]} != input batch size {b}.")
      key_mask = jax.lax.dynamic_update_slice(cache.mask, attention_mask, (0, cache.index))
      query_slots = cache.index + jnp.arange(t)
    key_slots = jnp.arange(key_mask.shape[1])
    allowed = (key_slots[None, :] <= query_slots[:, None])[None] & (key_mask[:, None, :] > 0)
    lengths = None
    if cache is None and resolve_attention_impl(config) != "einsum":
      # Fused attention: causal + per-row key lengths, exact for right-padded rows.
      allowed, lengths = None, jnp.maximum(jnp.sum(attention_mask, axis=-1), 1).astype(jnp.int32)

    if inputs_embeds is None:
      h = self.model.embed_tokens(input_ids.astype(jnp.int32)).astype(config.dtype)
    elif inputs_embeds.shape != (b, t, config.hidden_size):
      raise ValueError(
          f"inputs_embeds shape {inputs_embeds.shape} != {(b, t, config.hidden_size)}."
      )
    else:
      h = inputs_embeds.astype(config.dtype)
    cos, sin = rope_cos_sin(config.rope_inv_freq(), positions, config.dtype)
    forward = _layer_forward
    if remat != "none":  # one rematerialised region per decoder layer
      forward = functools.partial(_remat_layer_forward, REMAT_POLICIES[remat])
    new_keys, new_values = [], []
    for i, layer in enumerate(self.model.layers):
      if cache is None:
        h = forward(layer, h, cos, sin, allowed, lengths)
      else:
        h, (k, v) = layer(h, cos, sin, allowed, (cache.keys[i], cache.values[i]), cache.index)
        new_keys.append(k)
        new_values.append(v)
    h = self.model.norm(h)
    if cache is None:
      return h, None
    new_cache = KVCache(
        keys=tuple(new_keys), values=tuple(new_values), mask=key_mask, index=cache.index + t
    )
    return h, new_cache
