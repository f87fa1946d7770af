r"""Autoregressive generation for :class:`~anlr_jax.models.llama.LlamaForCausalLM`.

For a left-padded prompt batch ``x`` (``B, P``) with mask ``m``, one prefill pass writes the prompt
keys/values into a :class:`~anlr_jax.models.llama.KVCache` of fixed length ``P + N`` and yields the
first token (with ``prefill_chunk``, the prompt goes in chunks of that many columns, those that are
padding in every row skipped, so a long prompt's activations are one chunk's); then a jitted
single-token step is called ``N - 1`` times. Token ``y_{n+1}`` is drawn from

    greedy (temperature == 0):  argmax_v logits_v
    sampling:                   softmax(logits / temperature) restricted to the top_k largest
                                logits and to the smallest set whose probability reaches top_p

and once a row has produced ``eos_token_id`` every later token of that row is ``pad_token_id``.
With ``no_repeat_ngram = n > 0`` a token that would make the last ``n`` tokens of a row's reply an
``n``-gram the reply already holds is never chosen (its logit is set to the minimum first): a
greedy reply cannot loop. Only the new tokens count, not the prompt.
Both jitted functions live at module level, keyed only on the model's graph definition and greedy vs
sampling (temperature, top_k, top_p, eos and pad ids are traced), so the step compiles once
per prompt/cache shape and is reused across tokens and calls.

:func:`left_padded_batch` lays token-id prompts out as such a batch, left-padded to
:func:`prompt_width` (a few widths, so decoding compiles a handful of programs); the evaluations'
text generation and the visual tasks both batch their prompts with it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from anlr_jax.models.llama import KVCache, LlamaForCausalLM, init_cache

# Python-side trace counters (incremented only while tracing), for compile-once checks.
TRACE_COUNTS = {"prefill": 0, "prefill_chunk": 0, "decode_step": 0}


class SamplingParams(NamedTuple):
  """Traced (non-static) decoding settings, so changing them does not recompile."""

  temperature: jax.Array  # float32 scalar, > 0 when sampling
  top_k: jax.Array  # int32 scalar; 0 keeps every token
  top_p: jax.Array  # float32 scalar in (0, 1]; 1 keeps every token
  eos_token_id: jax.Array  # int32 scalar; -1 means no end-of-sequence token
  pad_token_id: jax.Array  # int32 scalar


def filter_logits(logits: jax.Array, top_k, top_p) -> jax.Array:
  """Sets logits outside the top-k / nucleus (top-p) set to the dtype minimum; ``(B, V)``.

  ``top_k`` keeps the ``k`` largest logits (ties at the k-th value stay); ``k <= 0`` or None keeps
  all. The nucleus keeps, in decreasing probability order, every token whose preceding probability
  mass (after top-k) is below ``top_p``, so the most likely token always stays; ``top_p >= 1`` or
  None keeps all. Both may be traced scalars.
  """
  neg_inf = jnp.finfo(logits.dtype).min
  vocab = logits.shape[-1]
  sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]
  if top_k is not None:
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth = jnp.take(sorted_logits, k - 1, axis=-1)[..., None]
    sorted_logits = jnp.where(sorted_logits < kth, neg_inf, sorted_logits)
    logits = jnp.where(logits < kth, neg_inf, logits)
  if top_p is not None:
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = (mass_before < top_p) | (top_p >= 1.0)
    threshold = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
    logits = jnp.where(logits < threshold, neg_inf, logits)
  return logits


def _next_token(logits, done, rng, step, params: SamplingParams, *, greedy):
  """Chooses the next token of each row from its last logits ``(B, V)``; updates ``done``."""
  if greedy:
    token = jnp.argmax(logits, axis=-1)
  else:
    scaled = filter_logits(logits / params.temperature, params.top_k, params.top_p)
    token = jax.random.categorical(jax.random.fold_in(rng, step), scaled, axis=-1)
  token = jnp.where(done, params.pad_token_id, token).astype(jnp.int32)
  done = done | ((token == params.eos_token_id) & (params.eos_token_id >= 0))
  return token, done


_STATIC = ("graphdef", "greedy")


def ban_repeated_ngrams(logits, history, step, n: int):
  """``logits`` ``(B, V)`` with each token that would repeat an ``n``-gram of its row set to the
  dtype minimum: the tokens that followed an earlier occurrence of the row's last ``n - 1`` tokens.
  ``history`` ``(B, N)``: the tokens chosen so far in ``[:, :step]`` (``step`` may be traced)."""
  batch, length = history.shape
  starts = length - n + 1  # the windows of n tokens that fit
  if starts <= 0:  # a reply shorter than n tokens repeats none
    return logits
  last = jax.lax.dynamic_slice_in_dim(history, jnp.maximum(step - (n - 1), 0), n - 1, axis=1)
  match = (jnp.arange(starts) + n - 1 < step)[None] & (step >= n - 1)  # window ends before step
  for k in range(n - 1):
    match = match & (history[:, k : k + starts] == last[:, k : k + 1])
  banned = jnp.where(match, history[:, n - 1 :], logits.shape[-1])  # out of range: dropped
  rows = jnp.arange(batch)[:, None]
  return logits.at[rows, banned].set(jnp.finfo(logits.dtype).min, mode="drop")


@functools.partial(jax.jit, static_argnames=_STATIC)
def _prefill(
    graphdef, state, prompt_ids, prompt_mask, cache, rng, params, pixel_values=None, *, greedy
):
  """Runs the prompt through the model; returns the first new token, cache, done flags, position.

  ``pixel_values`` (a model taking images, e.g. LLaVA) go with the prompt only."""
  TRACE_COUNTS["prefill"] += 1
  model = nnx.merge(graphdef, state)
  images = {} if pixel_values is None else {"pixel_values": pixel_values}
  logits, cache = model(
      prompt_ids, attention_mask=prompt_mask, cache=cache, logits_to_keep=1, **images
  )
  done = jnp.zeros(prompt_ids.shape[:1], bool)
  token, done = _next_token(logits[:, -1], done, rng, 0, params, greedy=greedy)
  last_position = jnp.sum(cache.mask, axis=-1) - 1  # the prompt's real tokens, all chunks
  return token, cache, done, last_position


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("cache",))
def _prefill_chunk(graphdef, state, ids, mask, cache):
  """Writes one chunk of a prompt batch into ``cache`` (no logits are computed)."""
  TRACE_COUNTS["prefill_chunk"] += 1
  model = nnx.merge(graphdef, state)
  _, cache = model(ids, attention_mask=mask, cache=cache, logits_to_keep=1)
  return cache


def chunk_layout(prompt_mask, chunk: int | None) -> tuple[int, int]:
  """``(start, n)``: a left-padded prompt batch of width ``P`` with mask ``prompt_mask`` is
  prefilled as its columns ``[start, P)`` in ``n`` chunks of ``chunk`` columns (``start < 0``:
  ``-start`` pad columns added on the left). Leading columns that are padding in every row are
  skipped. ``chunk`` None or ``>= P``: one pass over all ``P`` columns, ``(0, 1)``."""
  width = prompt_mask.shape[1]
  if not chunk or chunk >= width:
    return 0, 1
  real = np.flatnonzero(np.asarray(prompt_mask).any(axis=0))
  span = width - (int(real[0]) if real.size else width - 1)
  n = max(1, math.ceil(span / chunk))
  return width - n * chunk, n


def chunked_columns(array, start: int, pad_value: int) -> np.ndarray:
  """``array[:, start:]``, or ``array`` with ``-start`` columns of ``pad_value`` on the left."""
  array = np.asarray(array)
  if start >= 0:
    return array[:, start:]
  return np.pad(array, ((0, 0), (-start, 0)), constant_values=pad_value)


def prefill_cache(model, ids, mask, cache: KVCache, *, chunk: int | None) -> KVCache:
  """``cache`` (donated) with the left-padded batch ``ids`` / ``mask`` written into it, ``chunk``
  columns at a time (:func:`chunk_layout`; None: one pass). The cache needs room for the
  ``n * chunk`` columns of the layout after its index."""
  start, n = chunk_layout(mask, chunk)
  width = np.asarray(ids).shape[1] - start
  ids, mask = chunked_columns(ids, start, 0), chunked_columns(mask, start, 0)
  graphdef, state = nnx.split(model)
  step = width // n
  for i in range(n):
    cols = slice(i * step, (i + 1) * step)
    cache = _prefill_chunk(graphdef, state, ids[:, cols], mask[:, cols], cache)
  return cache


@functools.partial(
    jax.jit, static_argnames=_STATIC + ("no_repeat_ngram",), donate_argnames=("cache", "history")
)
def _decode_step(
    graphdef,
    state,
    token,
    cache: KVCache,
    done,
    position,
    rng,
    step,
    params,
    history=None,
    *,
    greedy,
    no_repeat_ngram=0,
):
  """Feeds one token per row at ``position + 1`` and chooses the following one; with
  ``no_repeat_ngram``, among those that repeat no ``n``-gram of ``history`` (updated)."""
  TRACE_COUNTS["decode_step"] += 1
  model = nnx.merge(graphdef, state)
  position = position + 1
  logits, cache = model(
      token[:, None],
      positions=position[:, None],
      attention_mask=jnp.ones_like(token)[:, None],
      cache=cache,
  )
  logits = logits[:, -1]
  if no_repeat_ngram:
    logits = ban_repeated_ngrams(logits, history, step, no_repeat_ngram)
  token, done = _next_token(logits, done, rng, step, params, greedy=greedy)
  if no_repeat_ngram:
    history = jax.lax.dynamic_update_slice_in_dim(history, token[:, None], step, axis=1)
  return token, cache, done, position, history


def generate(
    model: LlamaForCausalLM,
    prompt_ids: jax.Array,
    prompt_mask: jax.Array,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | None = None,
    pad_token_id: int = 0,
    rng: jax.Array | None = None,
    pixel_values: jax.Array | None = None,
    prefill_chunk: int | None = None,
    cache_reserve: int = 0,
    return_cache: bool = False,
    no_repeat_ngram: int = 0,
) -> jax.Array | tuple[jax.Array, KVCache, int]:
  """Generates ``max_new_tokens`` tokens after a left-padded prompt batch.

  Args:
    model: the causal LM.
    prompt_ids: ``(B, P)`` int token ids, left-padded.
    prompt_mask: ``(B, P)``, 1 = token, 0 = pad (pads must come before every token of a row).
    max_new_tokens: number of tokens ``N`` to produce per row.
    temperature: 0 for greedy decoding, > 0 to sample from ``softmax(logits / temperature)``.
    top_k: sample only among the ``top_k`` most likely tokens.
    top_p: sample only from the smallest set of tokens whose probability reaches ``top_p``.
    eos_token_id: after this token a row only emits ``pad_token_id``.
    pad_token_id: filler after end of sequence.
    rng: PRNG key for sampling (required when ``temperature > 0``).
    pixel_values: ``(num_images, 3, S, S)`` images of the prompts, in order of their image
      tokens, for a model that takes images (:class:`~anlr_jax.models.llava.LlavaForConditionalGeneration`).
    prefill_chunk: prefill the prompt ``prefill_chunk`` columns at a time (:func:`chunk_layout`:
      columns that are padding in every row are skipped), so a long prompt batch needs the
      activations of one chunk, not of the whole prompt; None: one pass. Not with images.
    cache_reserve: free cache slots kept after the last token (for a caller that goes on).
    return_cache: also return the cache and the number of slots the prompt takes in it.
    no_repeat_ngram: ``n > 0``: no row's new tokens hold the same ``n``-gram twice (see the module
      doc); 0: off.

  Returns:
    ``(B, N)`` int32 new token ids; with ``return_cache``, ``(tokens, cache, prompt_slots)``:
    new token ``j`` of a row sits in slot ``prompt_slots + j`` for ``j < cache.index -
    prompt_slots`` (the last token chosen is not written).
  """
  prompt_ids = jnp.asarray(prompt_ids, jnp.int32)
  prompt_mask = jnp.asarray(prompt_mask, jnp.int32)
  if prompt_ids.ndim != 2 or prompt_mask.shape != prompt_ids.shape:
    raise ValueError(
        f"prompt_ids {prompt_ids.shape} and prompt_mask {prompt_mask.shape} must "
        "share one (B, P) shape."
    )
  if not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
    raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}.")
  if temperature < 0:
    raise ValueError(f"temperature must be >= 0, got {temperature}.")
  if top_k is not None and (not isinstance(top_k, int) or top_k <= 0):
    raise ValueError(f"top_k must be a positive int or None, got {top_k!r}.")
  if top_p is not None and not 0.0 < top_p <= 1.0:
    raise ValueError(f"top_p must be in (0, 1] or None, got {top_p!r}.")
  if temperature > 0 and rng is None:
    raise ValueError("rng is required when temperature > 0.")
  rng = jax.random.key(0) if rng is None else rng
  if pixel_values is not None:
    if not hasattr(model, "get_image_features"):
      raise ValueError(f"pixel_values given, but {type(model).__name__} takes no images.")
    pixel_values = jnp.asarray(pixel_values, jnp.float32)
    model.check_image_tokens(prompt_ids, pixel_values)

  if prefill_chunk is not None and (not isinstance(prefill_chunk, int) or prefill_chunk <= 0):
    raise ValueError(f"prefill_chunk must be a positive int or None, got {prefill_chunk!r}.")
  if not isinstance(no_repeat_ngram, int) or no_repeat_ngram < 0:
    raise ValueError(f"no_repeat_ngram must be an int >= 0, got {no_repeat_ngram!r}.")
  if not isinstance(cache_reserve, int) or cache_reserve < 0:
    raise ValueError(f"cache_reserve must be an int >= 0, got {cache_reserve!r}.")
  if prefill_chunk is not None and pixel_values is not None:
    raise ValueError("prefill_chunk does not go with pixel_values: images are prefilled whole.")

  batch, prompt_len = prompt_ids.shape
  start, n_chunks = chunk_layout(prompt_mask, prefill_chunk)
  slots = prompt_len - start  # cache slots of the prompt (the skipped or added pad columns)
  static = dict(greedy=temperature == 0)
  params = SamplingParams(
      temperature=jnp.asarray(temperature if temperature > 0 else 1.0, jnp.float32),
      top_k=jnp.asarray(0 if top_k is None else top_k, jnp.int32),
      top_p=jnp.asarray(1.0 if top_p is None else top_p, jnp.float32),
      eos_token_id=jnp.asarray(-1 if eos_token_id is None else eos_token_id, jnp.int32),
      pad_token_id=jnp.asarray(pad_token_id, jnp.int32),
  )
  cache = init_cache(model.config, batch, max(prompt_len, slots) + max_new_tokens + cache_reserve)
  if n_chunks > 1:  # all chunks but the last into the cache; the last picks the first token
    chunk = slots // n_chunks
    ids, mask = (chunked_columns(a, start, 0) for a in (prompt_ids, prompt_mask))
    cache = prefill_cache(model, ids[:, :-chunk], mask[:, :-chunk], cache, chunk=chunk)
    prompt_ids, prompt_mask = ids[:, -chunk:], mask[:, -chunk:]
  graphdef, state = nnx.split(model)
  token, cache, done, position = _prefill(
      graphdef=graphdef,
      state=state,
      prompt_ids=jnp.asarray(prompt_ids),
      prompt_mask=jnp.asarray(prompt_mask),
      cache=cache,
      rng=rng,
      params=params,
      pixel_values=pixel_values,
      **static,
  )
  tokens = [token]
  history = None
  if no_repeat_ngram:
    history = jnp.full((batch, max_new_tokens), -1, jnp.int32).at[:, 0].set(token)
  for step in range(1, max_new_tokens):
    # Stop early once every row has ended; checked every 16 steps to keep dispatch asynchronous.
    if eos_token_id is not None and step % 16 == 0 and bool(jnp.all(done)):
      tokens.append(jnp.full((batch, max_new_tokens - step), pad_token_id, jnp.int32))
      break
    token, cache, done, position, history = _decode_step(
        graphdef=graphdef,
        state=state,
        token=token,
        cache=cache,
        done=done,
        position=position,
        rng=rng,
        step=jnp.asarray(step, jnp.int32),
        params=params,
        history=history,
        no_repeat_ngram=no_repeat_ngram,
        **static,
    )
    tokens.append(token)
  tokens = jnp.concatenate([t if t.ndim == 2 else t[:, None] for t in tokens], axis=1)
  return (tokens, cache, slots) if return_cache else tokens


def prompt_width(length: int, multiple: int = 16) -> int:
  """The padded width of a prompt batch whose longest prompt has ``length`` tokens: the smallest
  ``multiple * 2**j`` (``j >= 0``) that holds it. Widths grow geometrically, so the number of
  distinct shapes (compiled programs) grows with ``log(length)``, not with ``length / multiple``;
  the padding costs at most 2x the prefill (decoding, the bulk of the work, is per token)."""
  blocks = max(1, math.ceil(length / multiple))
  return multiple * (1 << (blocks - 1).bit_length())


def left_padded_batch(
    rows: Sequence[Sequence[int]], pad_token_id: int, *, batch_size: int, width_multiple: int = 16
) -> tuple[np.ndarray, np.ndarray]:
  """``(input_ids, attention_mask)`` int32 ``(max(batch_size, len(rows)), W)`` of the prompts
  ``rows`` (token ids), ``W = prompt_width(longest row, width_multiple)``: each row right-aligned,
  left-padded with ``pad_token_id`` (mask 0 there); a short batch is filled up to ``batch_size``
  rows with copies of its last row (one compiled shape per width)."""
  if not rows:
    raise ValueError("a prompt batch needs at least one row")
  width = prompt_width(max(len(r) for r in rows), width_multiple)
  n = max(batch_size, len(rows))
  ids = np.full((n, width), pad_token_id, np.int32)
  mask = np.zeros((n, width), np.int32)
  for i, row in enumerate(list(rows) + [rows[-1]] * (n - len(rows))):
    ids[i, width - len(row) :], mask[i, width - len(row) :] = row, 1
  return ids, mask
