r"""The loss of the batch contract: next-token cross-entropy sums, whole or chunked.

With logits ``z`` of shape ``(B, T, V)``, token ids ``x`` and response mask ``m``, a batch gives
``(sum_{b,t<T-1} m_{b,t+1} CE(z_{b,t}, x_{b,t+1}), sum_{b,t} m_{b,t+1})`` in float32
(:func:`next_token_loss_sum`); the train step (:mod:`anlr_jax.train.step`) divides the summed
numerators by the summed counts once per update. :func:`chunked_next_token_loss_sum` computes the
same from the final hidden states and the output matrix without ever holding the ``(B, T, V)``
logits (``trainer.loss_chunk``), and :func:`model_loss_sum` chooses between the two for a model
and a batch, saying so when ``loss_chunk`` cannot apply (a batch with images, a model without an
output matrix).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import jax
import jax.numpy as jnp
import optax

logger = logging.getLogger(__name__)

LOSS_CHUNK = 1024
"""Default tokens per chunk of :func:`chunked_next_token_loss_sum` (the lean configs' setting)."""


def next_token_loss_sum(
    logits: jax.Array, input_ids: jax.Array, loss_mask: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """Returns ``(sum_t m[t+1] CE(logits[t], ids[t+1]), sum_t m[t+1])`` in float32.

  Targets are the ids shifted left by one with the last position weighted 0, so the ``(B, T, V)``
  logits are used whole: slicing off their last position would copy them (and pad their gradient)
  on every step.
  """
  targets, weights = _targets_and_weights(input_ids, loss_mask)
  nll = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
  return jnp.sum(nll * weights), jnp.sum(weights)


def _targets_and_weights(input_ids, loss_mask):
  targets = jnp.roll(input_ids, -1, axis=1)
  mask = loss_mask.astype(jnp.float32)
  return targets, jnp.concatenate([mask[:, 1:], jnp.zeros_like(mask[:, :1])], axis=1)


def _head_dims(w_axis: int, ndim: int):
  """``dot_general`` dimensions of ``h @ W`` (``w_axis`` = W's axis of size d), no batch axes."""
  return (((ndim - 1,), (w_axis,)), ((), ()))


def _chunk_logits(h, w, w_axis, matmul_dtype):
  """Float32 logits of one chunk, rounded as the model's head rounds them: operands in the
  ``matmul_dtype`` (else the compute dtype ``h.dtype``), result in ``h.dtype``, then float32."""
  op = matmul_dtype or h.dtype
  z = jax.lax.dot_general(
      h.astype(op), w.astype(op), _head_dims(w_axis, h.ndim), preferred_element_type=jnp.float32
  )
  return z.astype(h.dtype).astype(jnp.float32)


def _chunk_nll_and_grad(h, w, targets, weights, w_axis, matmul_dtype):
  """``(sum m CE, dCE/dlogits)`` of one chunk; the latter ``m (softmax - onehot)`` in float32."""
  z = _chunk_logits(h, w, w_axis, matmul_dtype)
  lse = jax.nn.logsumexp(z, axis=-1)
  picked = jnp.take_along_axis(z, targets[..., None], axis=-1)[..., 0]
  total = jnp.sum((lse - picked) * weights)
  onehot = jax.nn.one_hot(targets, z.shape[-1], dtype=jnp.float32)
  dz = (jnp.exp(z - lse[..., None]) - onehot) * weights[..., None]
  return total, dz


def _to_chunks(x, chunk):
  """``(B, T, ...)`` -> ``(n, B, chunk, ...)``, ``T`` zero-padded to ``n * chunk``."""
  b, t = x.shape[:2]
  n = -(-t // chunk)
  x = jnp.pad(x, [(0, 0), (0, n * chunk - t)] + [(0, 0)] * (x.ndim - 2))
  return x.reshape(b, n, chunk, *x.shape[2:]).swapaxes(0, 1)


def _from_chunks(x, t):
  """Inverse of :func:`_to_chunks`: ``(n, B, chunk, ...)`` -> ``(B, T, ...)``."""
  n, b, chunk = x.shape[:3]
  return x.swapaxes(0, 1).reshape(b, n * chunk, *x.shape[3:])[:, :t]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _chunked_loss(hidden, w, targets, weights, w_axis, matmul_dtype, chunk):
  return _chunked_loss_fwd(hidden, w, targets, weights, w_axis, matmul_dtype, chunk)[0]


def _chunked_loss_fwd(hidden, w, targets, weights, w_axis, matmul_dtype, chunk):
  # Each chunk's logits give its loss and, while they are at hand, the hidden states' gradient
  # (the backward pass then needs no second product with W): the residual is (B, T, d), not V wide.
  op = matmul_dtype or hidden.dtype

  def body(total, xs):
    h, tg, m = xs
    nll, dz = _chunk_nll_and_grad(h, w, tg, m, w_axis, matmul_dtype)
    g = dz.astype(h.dtype).astype(op)  # the cotangent's roundings in the model's head
    dh = jax.lax.dot_general(
        g, w.astype(op), _head_dims(1 - w_axis, g.ndim), preferred_element_type=jnp.float32
    )
    return total + nll, dh.astype(h.dtype)

  xs = (_to_chunks(hidden, chunk), _to_chunks(targets, chunk), _to_chunks(weights, chunk))
  total, dh = jax.lax.scan(body, jnp.zeros((), jnp.float32), xs)
  return total, (_from_chunks(dh, hidden.shape[1]), hidden, w, targets, weights)


def _chunked_loss_bwd(w_axis, matmul_dtype, chunk, residuals, ct):
  dh, hidden, w, targets, weights = residuals
  op = matmul_dtype or hidden.dtype

  # W's gradient, chunk by chunk (logits recomputed); dead code, removed by XLA, when W is frozen.
  def body(dw, xs):
    h, tg, m = xs
    _, dz = _chunk_nll_and_grad(h, w, tg, m, w_axis, matmul_dtype)
    g = dz.astype(h.dtype).astype(op)
    lead = tuple(range(h.ndim - 1))
    pair = (h.astype(op), g) if w_axis == 0 else (g, h.astype(op))
    dims = ((lead, lead), ((), ()))
    return dw + jax.lax.dot_general(*pair, dims, preferred_element_type=jnp.float32), None

  xs = (_to_chunks(hidden, chunk), _to_chunks(targets, chunk), _to_chunks(weights, chunk))
  dw, _ = jax.lax.scan(body, jnp.zeros(w.shape, jnp.float32), xs)
  ct = ct.astype(jnp.float32)
  return (
      (ct * dh.astype(jnp.float32)).astype(hidden.dtype),
      (ct * dw).astype(w.dtype),
      None,
      None,
  )


_chunked_loss.defvjp(_chunked_loss_fwd, _chunked_loss_bwd)


def chunked_next_token_loss_sum(
    hidden: jax.Array,
    w: jax.Array,
    input_ids: jax.Array,
    loss_mask: jax.Array,
    *,
    transposed: bool = False,
    matmul_dtype: Any = None,
    chunk_tokens: int = LOSS_CHUNK,
) -> tuple[jax.Array, jax.Array]:
  """:func:`next_token_loss_sum` of the logits ``hidden @ W`` (``W.T`` if ``transposed``), never
  holding them whole.

  ``hidden`` ``(B, T, d)`` (the final normed hidden states, in the compute dtype) is cut along the
  sequence into chunks of ``ceil(chunk_tokens / B)`` positions; each chunk's ``(B, c, V)`` float32
  logits give its share of the loss and, at once, its rows of the hidden states' gradient
  ``m (softmax(z) - onehot) W^T``, so no ``(B, T, V)`` array exists forward or backward (a custom
  VJP; ``W``'s own gradient recomputes the logits chunk by chunk, and is dropped by XLA when ``W``
  is frozen). The products round like the model's head: operands in ``matmul_dtype`` (else
  ``hidden``'s dtype), float32 sums, logits in ``hidden``'s dtype then float32.

  Returns ``(sum_t m[t+1] CE(z[t], ids[t+1]), sum_t m[t+1])`` in float32, as
  :func:`next_token_loss_sum` does.
  """
  if chunk_tokens < 1:
    raise ValueError(f'chunk_tokens={chunk_tokens} must be >= 1')
  targets, weights = _targets_and_weights(input_ids, loss_mask)
  b, t = input_ids.shape
  chunk = min(t, -(-chunk_tokens // b))
  op = None if matmul_dtype is None else jnp.dtype(matmul_dtype)
  total = _chunked_loss(hidden, w, targets, weights, 1 if transposed else 0, op, chunk)
  return total, jnp.sum(weights)


def model_loss_sum(
    model, batch: dict, kwargs: dict, images: dict, *, loss_chunk: int
) -> tuple[jax.Array, jax.Array]:
  """``(loss numerator, response tokens)`` of ``model`` on ``batch`` (forward keyword arguments
  ``kwargs``; ``images``: ``{pixel_values: ...}`` for a model that takes them, else empty).

  With ``loss_chunk > 0`` and a model that exposes ``hidden_states`` and ``output_matrix``
  (:class:`~anlr_jax.models.llama.LlamaForCausalLM`), :func:`chunked_next_token_loss_sum`;
  otherwise the model's whole logits and :func:`next_token_loss_sum`. A ``loss_chunk`` that cannot
  apply (a batch with images, whose features the LLaVA model merges into the embeddings inside its
  forward pass; a model without an output matrix) is not dropped silently: a warning says so when
  the step is traced (once per compiled shape).
  """
  if loss_chunk and (images or not hasattr(model, 'output_matrix')):
    why = (
        'a batch with images (LLaVA) has no chunked loss'
        if images
        else f'{type(model).__name__} exposes no output matrix'
    )
    logger.warning(
        'trainer.loss_chunk=%d does not apply: %s; the loss uses the whole (batch, length, vocab)'
        ' logits (trainer.loss_chunk=0 says so)',
        loss_chunk,
        why,
    )
  head = (
      model.output_matrix()
      if loss_chunk and not images and hasattr(model, 'output_matrix')
      else None
  )
  if head is not None:
    hidden = model.hidden_states(batch['input_ids'], **kwargs)
    return chunked_next_token_loss_sum(
        hidden,
        head[0],
        batch['input_ids'],
        batch['loss_mask'],
        transposed=head[1],
        matmul_dtype=getattr(getattr(model, 'config', None), 'matmul_dtype', None),
        chunk_tokens=loss_chunk,
    )
  logits = model(batch['input_ids'], **kwargs, **images)
  return next_token_loss_sum(logits, batch['input_ids'], batch['loss_mask'])


__all__ = ['LOSS_CHUNK', 'chunked_next_token_loss_sum', 'model_loss_sum', 'next_token_loss_sum']
