r"""Projection GEMMs with low-precision operands and float32 accumulation (``matmul_dtype``).

For ``y = x W`` (``x`` of shape ``(..., k)``; ``W`` of shape ``(k, n)``, or ``(n, k)`` for the tied
head ``x E^T``) the forward and both backward products take their operands rounded to ``dtype``
(bfloat16) and accumulate in float32:

    y  = dot(bf16(x), bf16(W))              -> float32, cast to x's dtype
    dx = dot(bf16(g), bf16(W)^T)            -> float32, cast to x's dtype
    dW = dot(bf16(x)^T, bf16(g))            -> float32, cast to W's dtype

where ``g`` is the incoming cotangent. Everything else (norms, RoPE, attention, softmax, the loss,
the LoRA factors and their products) stays in the model's compute dtype. This is what mixed
precision does on accelerators (and PyTorch's bfloat16 autocast does for matmuls), applied only
where the work is: on CPUs with native bfloat16 dot instructions (AVX512-BF16, AMX) XLA runs these
GEMMs about twice as fast as float32 ones, while a model computed entirely in bfloat16 is slower
than float32 on XLA's CPU backend (its elementwise work in bfloat16 is not vectorised as well).

``jax.custom_vjp`` makes the backward products low precision too: differentiating the forward's
casts would give float32 x bfloat16 products, which XLA computes in float32. When ``W``'s gradient
is not needed (a frozen base weight) its product is dead code and XLA removes it.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax


def _dims(x_ndim: int, w_axis: int):
  """Contract ``x``'s last axis with ``W``'s ``w_axis``, no batch axes."""
  return (((x_ndim - 1,), (w_axis,)), ((), ()))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _lowp_matmul(x: jax.Array, w: jax.Array, w_axis: int, dtype: Any) -> jax.Array:
  return _lowp_matmul_fwd(x, w, w_axis, dtype)[0]


def _lowp_matmul_fwd(x, w, w_axis, dtype):
  xl, wl = x.astype(dtype), w.astype(dtype)
  y = lax.dot_general(xl, wl, _dims(x.ndim, w_axis), preferred_element_type=jnp.float32)
  # zero-size arrays carry the input dtypes to the backward pass (residuals must be arrays)
  return y.astype(x.dtype), (xl, wl, jnp.zeros((0,), x.dtype), jnp.zeros((0,), w.dtype))


def _lowp_matmul_bwd(w_axis, dtype, residuals, g):
  xl, wl, x_like, w_like = residuals
  gl = g.astype(dtype)
  lead = tuple(range(g.ndim - 1))
  # dx: contract g's last axis (n) with W's n axis; dW: contract the leading (token) axes
  dx = lax.dot_general(gl, wl, _dims(g.ndim, 1 - w_axis), preferred_element_type=jnp.float32)
  pair = (xl, gl) if w_axis == 0 else (gl, xl)
  dw = lax.dot_general(*pair, ((lead, lead), ((), ())), preferred_element_type=jnp.float32)
  return dx.astype(x_like.dtype), dw.astype(w_like.dtype)


_lowp_matmul.defvjp(_lowp_matmul_fwd, _lowp_matmul_bwd)


def lowp_matmul(x: jax.Array, w: jax.Array, dtype: Any, *, transpose_w: bool = False) -> jax.Array:
  """``x @ w`` (or ``x @ w.T`` with ``transpose_w``) with ``dtype`` operands and float32 sums in
  the forward and backward products (module doc); the result has ``x``'s dtype.

  Raises:
    ValueError: ``w`` is not 2-D, or the contracted sizes differ.
  """
  if w.ndim != 2:
    raise ValueError(f"lowp_matmul: w must be 2-D, got shape {w.shape}")
  w_axis = 1 if transpose_w else 0
  if x.shape[-1] != w.shape[w_axis]:
    raise ValueError(f"lowp_matmul: x {x.shape} and w {w.shape} do not contract")
  return _lowp_matmul(x, w, w_axis, jnp.dtype(dtype))


def lowp_dot_general(dtype: Any):
  """A ``dot_general`` for ``nnx.Linear(..., dot_general=...)``: its product ``inputs @ kernel`` by
  :func:`lowp_matmul` with ``dtype`` operands. One function per dtype (cached), so models built
  with the same setting have equal graph definitions.

  Raises:
    ValueError: called with another contraction, a ``precision``, ``preferred_element_type`` or
      ``out_sharding`` (which nnx.Linear passes only when they are set).
  """
  return _lowp_dot_general(jnp.dtype(dtype))


@functools.lru_cache(maxsize=None)
def _lowp_dot_general(dtype: jnp.dtype):

  def dot_general(
      lhs,
      rhs,
      dimension_numbers,
      precision=None,
      preferred_element_type=None,
      out_sharding=None,
  ):
    linear = rhs.ndim == 2 and tuple(map(tuple, dimension_numbers[0])) == ((lhs.ndim - 1,), (0,))
    if not linear or dimension_numbers[1] != ((), ()):
      raise ValueError(f"matmul_dtype={dtype}: unsupported contraction {dimension_numbers}")
    for name, value in (
        ("precision", precision),
        ("preferred_element_type", preferred_element_type),
        ("out_sharding", out_sharding),
    ):
      if value is not None:
        raise ValueError(f"matmul_dtype={dtype}: nnx.Linear's {name}={value!r} is not supported")
    return lowp_matmul(lhs, rhs, dtype)

  dot_general.__name__ = dot_general.__qualname__ = f"lowp_dot_general_{dtype}"
  dot_general.matmul_dtype = dtype  # read by a quantised layer (anlr_jax.nn.quant) to do the same
  return dot_general


__all__ = ["lowp_dot_general", "lowp_matmul"]
