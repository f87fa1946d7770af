r"""Continuous batching for ``anlr serve``: requests decoded together, each row on its own.

A :class:`BatchEngine` owns one thread and a key/value cache of up to ``max_batch`` rows (*slots*) of
``S`` positions. A request (:class:`Generation`) waits in a bounded queue until a slot is free; it
is then *admitted*: its prompt, left-padded to :func:`~anlr_jax.models.generation.prompt_width`
``W``, is run through the model (the prefill, one call for the prompts of one width admitted
together), which gives its first token, and its keys and values are copied into slots ``[0, W)``
of its row. A prompt that starts with the engine's ``prefix`` (the prompt template's shared
start, e.g. a chat template's default system prompt) is prefilled after it: the prefix's keys and
values, computed once, fill slots ``[0, P)`` of the row, and only the rest of the prompt,
left-padded to ``W``, runs through the model (into slots ``[P, P + W)``). From then on one jitted
*decode step* feeds the last token of every row at once and chooses each row's next one:

    token_{b, n+1} = argmax_v logits_{b, v}                       (temperature_b == 0)
                   ~ softmax(logits_b / temperature_b), key fold_in(key(seed_b), n)   (otherwise)

The step is the model's single-row decoding mapped over the rows (``jax.vmap``), so every row has
its own write index, RoPE position and key mask: a row's tokens are those it would get decoded
alone (same prompt padding, same positions, the other rows' keys never visible to it), and a
request joins or leaves the batch between any two steps. The cache has as many rows as the
requests being decoded, rounded up to a power of two (1, 2, 4, ... at most ``max_batch``): a step
costs what its rows cost, so two requests do not pay for ``max_batch`` rows. When requests end, the
rows above the smaller shape are moved down into the free ones and the cache shrinks. ``S`` grows
(doubling) when a row reaches its end and shrinks back when the engine is idle; each distinct shape
compiles once.

A generation ends at its stop token (``stop``), after ``max_tokens`` tokens (``length``), or when
its consumer cancels it (a client gone, a stop string seen): its slot is free for the next step.
Tokens are handed to the consumer as each step makes them (:meth:`Generation.tokens`).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import queue
import threading
from collections.abc import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from anlr_jax.models.generation import prompt_width
from anlr_jax.models.llama import KVCache, init_cache

MIN_LENGTH = 128
"""The smallest cache length ``S`` (positions per row)."""


class QueueFull(RuntimeError):
  """The engine's queue holds ``max_queue`` waiting requests: try again later."""


@dataclasses.dataclass(eq=False)
class Generation:
  """One request to the engine: a prompt's token ids and how to decode them.

  Attributes:
    ids: the prompt's token ids.
    max_tokens: new tokens at most.
    temperature: 0 for greedy decoding, else the sampling temperature.
    seed: the sampling seed.
    stop_id: the token that ends the reply (kept as its last token), or None.
  """

  ids: list[int]
  max_tokens: int
  temperature: float = 0.0
  seed: int = 0
  stop_id: int | None = None
  finish: str | None = None
  """``stop``, ``length``, ``cancelled`` or ``error: <reason>`` once it has ended."""
  _out: queue.SimpleQueue = dataclasses.field(default_factory=queue.SimpleQueue, repr=False)
  _cancelled: threading.Event = dataclasses.field(default_factory=threading.Event, repr=False)

  def cancel(self) -> None:
    """Ends the generation at the next step (its slot is freed)."""
    self._cancelled.set()

  @property
  def cancelled(self) -> bool:
    return self._cancelled.is_set()

  def tokens(self, timeout: float | None = None) -> Iterator[int]:
    """The new token ids as the engine makes them, until the generation ends (:attr:`finish`).

    Raises:
      TimeoutError: no token came within ``timeout`` seconds.
    """
    while True:
      try:
        item = self._out.get(timeout=timeout)
      except queue.Empty:
        raise TimeoutError(f"no token within {timeout}s") from None
      if item is None:
        return
      yield item

  def _emit(self, token: int) -> None:
    self._out.put(token)

  def _end(self, finish: str) -> None:
    if self.finish is None:
      self.finish = finish
      self._out.put(None)


def _choose(logits, seed, temperature, step):
  """The next token of one row from its logits ``(V,)``: greedy at temperature 0, else sampled."""
  greedy = jnp.argmax(logits, axis=-1)
  key = jax.random.fold_in(jax.random.key(seed), step)
  scaled = logits / jnp.where(temperature > 0, temperature, 1.0)
  sampled = jax.random.categorical(key, scaled, axis=-1)
  return jnp.where(temperature > 0, sampled, greedy).astype(jnp.int32)


class _Model:
  """The model's graph and the layout of its state's leaves, a static argument of the jitted
  functions. Its hash is computed once: hashing the graph of a many-layer model takes
  milliseconds, which the jitted call would otherwise pay at every decoding step."""

  def __init__(self, graphdef, treedef):
    self.graphdef, self.treedef = graphdef, treedef
    self._hash = hash((graphdef, treedef))

  def __hash__(self):
    return self._hash

  def __eq__(self, other):
    return isinstance(other, _Model) and (
        self is other or (self.graphdef, self.treedef) == (other.graphdef, other.treedef)
    )

  def merge(self, leaves):
    return nnx.merge(self.graphdef, jax.tree.unflatten(self.treedef, leaves))


@functools.partial(jax.jit, static_argnames=("model",))
def _prefill(model, leaves, prefix, ids, mask, seeds, temperatures):
  """The first new token of each left-padded prompt ``(n, W)`` and their per-layer keys/values
  ``(n, P + W, ...)``; ``prefix``: None (``P = 0``) or the keys/values ``(1, P, ...)`` of the
  tokens before the prompts (the prompts' positions follow them)."""
  model = model.merge(leaves)
  n, width = ids.shape
  length = width if prefix is None else prefix[0][0].shape[1] + width
  cache = init_cache(model.config, n, length)
  if prefix is not None:
    p = prefix[0][0].shape[1]
    put = lambda full, part: full.at[:, :p].set(jnp.broadcast_to(part, (n, *part.shape[1:])))
    cache = cache._replace(
        keys=tuple(map(put, cache.keys, prefix[0])),
        values=tuple(map(put, cache.values, prefix[1])),
        mask=cache.mask.at[:, :p].set(1),
        index=jnp.asarray(p, jnp.int32),
    )
  logits, cache = model(ids, attention_mask=mask, cache=cache, logits_to_keep=1)
  first = jax.vmap(_choose)(logits[:, -1], seeds, temperatures, jnp.zeros_like(seeds, jnp.int32))
  return first, cache.keys, cache.values


@functools.partial(jax.jit, donate_argnums=(0, 1, 2))
def _insert(keys, values, mask, row, new_keys, new_values, new_mask):
  """Writes one prefilled prompt into slots ``[0, W)`` of row ``row`` (its mask: the whole row)."""
  at = (row, 0, 0, 0)
  keys = tuple(
      jax.lax.dynamic_update_slice(k, n.astype(k.dtype), at) for k, n in zip(keys, new_keys)
  )
  values = tuple(
      jax.lax.dynamic_update_slice(v, n.astype(v.dtype), at) for v, n in zip(values, new_values)
  )
  return keys, values, jax.lax.dynamic_update_slice(mask, new_mask[None], (row, 0))


@functools.partial(jax.jit, donate_argnums=(0, 1, 2))
def _move(keys, values, mask, source, target):
  """Copies row ``source`` of the cache (keys, values, mask) into row ``target``."""

  def move(x):
    return jax.lax.dynamic_update_slice_in_dim(
        x, jax.lax.dynamic_slice_in_dim(x, source, 1, axis=0), target, axis=0
    )

  return tuple(map(move, keys)), tuple(map(move, values)), move(mask)


@functools.partial(jax.jit, static_argnames=("model",), donate_argnums=(2, 3, 4))
def _decode(model, leaves, keys, values, mask, tokens, positions, index, seeds, temps, steps):
  """One decoding step of every row (see the module doc); returns the cache and the next tokens."""

  def row(keys, values, mask, token, position, index):
    cache = KVCache(
        keys=tuple(k[None] for k in keys),
        values=tuple(v[None] for v in values),
        mask=mask[None],
        index=index,
    )
    logits, cache = model.merge(leaves)(
        token.reshape(1, 1),
        positions=position.reshape(1, 1),
        attention_mask=jnp.ones((1, 1), jnp.int32),
        cache=cache,
    )
    return (
        tuple(k[0] for k in cache.keys),
        tuple(v[0] for v in cache.values),
        cache.mask[0],
        logits[0, -1],
    )

  keys, values, mask, logits = jax.vmap(row)(keys, values, mask, tokens, positions, index)
  chosen = jax.lax.cond(  # all greedy (the usual batch): no random numbers drawn
      jnp.any(temps > 0),
      lambda: jax.vmap(_choose)(logits, seeds, temps, steps),
      lambda: jnp.argmax(logits, axis=-1).astype(jnp.int32),
  )
  return keys, values, mask, chosen


@dataclasses.dataclass
class _Slot:
  """A row of the cache and the generation decoding in it."""

  generation: Generation
  width: int  # the padded prompt width W
  made: int = 0  # new tokens made so far
  last: int = 0  # the last token made (fed at the next step)


class BatchEngine:
  """Decodes :class:`Generation` requests in one continuous batch (see the module doc).

  Args:
    model: the causal LM (eval mode); its keys/values are cached in its compute dtype.
    pad_id: the token id of prompt padding.
    max_batch: rows decoded together at most.
    max_queue: requests waiting for a row at most; :meth:`submit` refuses more (:class:`QueueFull`).
    prefix: token ids that many prompts start with (the prompt template's start): their keys and
      values are computed once, at the first prompt that starts with them and has more tokens,
      and reused by every such prompt (see the module doc). Empty: every prompt is prefilled
      whole.
  """

  def __init__(
      self,
      model,
      *,
      pad_id: int,
      max_batch: int = 8,
      max_queue: int = 64,
      prefix: Sequence[int] = (),
  ):
    if max_batch < 1 or max_queue < 0:
      raise ValueError(f"max_batch must be >= 1 and max_queue >= 0, got {max_batch}, {max_queue}")
    self.config = getattr(model.config, "text_config", model.config)
    graphdef, state = nnx.split(model)
    self._leaves, treedef = jax.tree.flatten(state)
    self._model = _Model(graphdef, treedef)
    self.prefix = [int(i) for i in prefix]
    self.prefix_passes = 0
    """Times the prefix's keys and values were computed (once while the engine runs)."""
    self.prefilled_tokens = 0
    """Prompt positions run through the model so far, padding included (the prefix's once)."""
    self._prefix_kv = None
    self.pad_id = int(pad_id)
    self.max_batch = max_batch
    self.max_queue = max_queue
    self.tokens_made = 0
    """New tokens made so far, every request together."""
    self.cancelled = 0
    """Requests ended by their consumer so far (:meth:`Generation.cancel`)."""
    self.step_hook: Callable[[], None] | None = None
    """Called by the engine's thread after each decoding step (tests pace the engine with it)."""
    self._waiting: collections.deque[Generation] = collections.deque()
    self._slots: list[_Slot | None] = [None] * max_batch
    self._cond = threading.Condition()
    self._closed = False
    self._cache = None
    self._thread = threading.Thread(target=self._run, name="anlr-batch-engine", daemon=True)
    self._thread.start()

  # ------------------------------------------------------------------------------ the public side
  def submit(self, generation: Generation) -> Generation:
    """Queues ``generation``; :class:`QueueFull` when ``max_queue`` requests already wait."""
    with self._cond:
      if self._closed:
        raise RuntimeError("the engine is closed")
      free = sum(slot is None for slot in self._slots)  # rows taken at the engine's next turn
      if len(self._waiting) >= free + self.max_queue:
        raise QueueFull(f"{len(self._waiting)} requests are waiting (the queue limit)")
      self._waiting.append(generation)
      self._cond.notify()
    return generation

  @property
  def active(self) -> int:
    """Requests being decoded now."""
    return sum(s is not None for s in self._slots)

  @property
  def waiting(self) -> int:
    """Requests waiting for a row."""
    return len(self._waiting)

  def close(self) -> None:
    """Stops the engine's thread; requests not finished end with ``cancelled``."""
    with self._cond:
      self._closed = True
      self._cond.notify()
    self._thread.join(timeout=60)

  # ------------------------------------------------------------------------------ the engine side
  def _run(self) -> None:
    while True:
      with self._cond:
        while not self._closed and not self._waiting and self.active == 0:
          self._cache = None  # idle: the cache shrinks back
          self._cond.wait()
        if self._closed:
          break
        admit = []
        for row, slot in enumerate(self._slots):
          if slot is None and self._waiting:
            admit.append((row, self._waiting.popleft()))
      try:
        self._admit_all(admit)
        if self.active:
          self._step()
      except Exception as err:  # noqa: BLE001  (every request gets the reason; the engine goes on)
        reason = " ".join(f"{type(err).__name__}: {err}".split())[:300]
        for row, slot in enumerate(self._slots):
          if slot is not None:
            slot.generation._end(f"error: {reason}")
            self._slots[row] = None
        for _, generation in admit:
          generation._end(f"error: {reason}")
        self._cache = None
      if self.step_hook is not None:
        self.step_hook()
    for slot in self._slots:
      if slot is not None:
        slot.generation._end("cancelled")
    for generation in self._waiting:
      generation._end("cancelled")

  def _rows(self, n: int) -> int:
    """The cache rows that hold ``n`` rows: ``n`` rounded up to a power of two, at most
    ``max_batch`` (a decoding program per shape)."""
    return min(1 << max(n - 1, 0).bit_length(), self.max_batch)

  def _compact(self) -> None:
    """Moves the requests decoded in rows at or above the shape their number needs into the free
    rows below it, so that the cache can shrink to that shape."""
    live = [row for row, slot in enumerate(self._slots) if slot is not None]
    rows = self._rows(len(live))
    free = [row for row in range(rows) if self._slots[row] is None]
    for source, target in zip((row for row in live if row >= rows), free):
      self._cache = _move(*self._cache, source, target)
      self._slots[target], self._slots[source] = self._slots[source], None

  def _ensure_shape(self, rows: int, length: int) -> None:
    """A cache of at least ``rows`` rows and ``length`` positions (:data:`MIN_LENGTH` times a
    power of two): the rows in use rounded up to a power of two (:meth:`_rows`); zeros where
    nothing was written. Rows and positions grow when a request needs them; rows shrink when the
    rows above are free."""
    used = max((row + 1 for row, slot in enumerate(self._slots) if slot is not None), default=0)
    rows = self._rows(max(rows, used))
    length = MIN_LENGTH * (1 << (max(1, -(-length // MIN_LENGTH)) - 1).bit_length())
    if self._cache is None:
      cache = init_cache(self.config, rows, length)
      self._cache = (cache.keys, cache.values, cache.mask)
      return
    keys, values, mask = self._cache
    have_rows, have_length = mask.shape
    if rows == have_rows and length <= have_length:
      return
    if rows > have_rows or length > have_length:
      rows, length = max(rows, have_rows), max(length, have_length)
    else:
      length = have_length

    def fit(x):
      x = x[:rows]
      pad = [(0, rows - x.shape[0]), (0, length - x.shape[1])] + [(0, 0)] * (x.ndim - 2)
      return jnp.pad(x, pad)

    self._cache = (tuple(map(fit, keys)), tuple(map(fit, values)), fit(mask))

  def _admit_all(self, admit: list[tuple[int, Generation]]) -> None:
    """Prefills the admitted requests, those with the same prefix use and padded width together
    (one call)."""
    groups: dict[tuple[int, int], list[tuple[int, Generation]]] = {}
    for row, generation in admit:
      if generation.cancelled:
        generation._end("cancelled")
        self.cancelled += 1
      else:
        skip = self._skip(generation.ids)
        key = (skip, prompt_width(len(generation.ids) - skip))
        groups.setdefault(key, []).append((row, generation))
    for (skip, width), group in groups.items():
      self._admit(skip, width, group)

  def _skip(self, ids: list[int]) -> int:
    """The prompt positions whose keys/values come from the prefix: ``len(prefix)`` when ``ids``
    starts with it and goes on after it, else 0."""
    p = len(self.prefix)
    return p if p and len(ids) > p and ids[:p] == self.prefix else 0

  def _prefix_cache(self):
    """The prefix's keys/values ``(1, P, ...)`` per layer, computed at the first call."""
    if self._prefix_kv is None:
      ids = np.asarray([self.prefix], np.int32)
      one = np.zeros(1, np.uint32), np.zeros(1, np.float32)
      _, keys, values = _prefill(self._model, self._leaves, None, ids, np.ones_like(ids), *one)
      self._prefix_kv = (keys, values)
      self.prefix_passes += 1
      self.prefilled_tokens += ids.shape[1]
    return self._prefix_kv

  def _admit(self, skip: int, width: int, group: list[tuple[int, Generation]]) -> None:
    """Prefills ``group`` (prompts of ``skip`` prefix tokens, the rest of padded width ``width``)
    in one call, rows padded to a power of two, and copies each prompt's keys/values into its
    row."""
    n = 1 << (len(group) - 1).bit_length()
    prompts = np.full((n, width), self.pad_id, np.int32)
    masks = np.zeros((n, width), np.int32)
    seeds, temps = np.zeros(n, np.uint32), np.zeros(n, np.float32)
    for i in range(n):
      generation = group[min(i, len(group) - 1)][1]  # padding rows repeat the last prompt
      ids = generation.ids[skip:]
      prompts[i, width - len(ids) :], masks[i, width - len(ids) :] = ids, 1
      seeds[i], temps[i] = generation.seed, generation.temperature
    prefix = self._prefix_cache() if skip else None
    tokens, new_keys, new_values = _prefill(
        self._model, self._leaves, prefix, prompts, masks, seeds, temps
    )
    self.prefilled_tokens += prompts.size
    tokens = np.asarray(tokens)
    width += skip  # the row's slots in use: the prefix, then the padded rest
    self._ensure_shape(max(row for row, _ in group) + 1, width + 1)
    for i, (row, generation) in enumerate(group):
      keys, values, cache_mask = self._cache
      row_mask = np.zeros(cache_mask.shape[1], np.int32)
      row_mask[:skip] = 1
      row_mask[skip:width] = masks[i]
      one = lambda arrays: tuple(a[i : i + 1] for a in arrays)
      self._cache = _insert(keys, values, cache_mask, row, one(new_keys), one(new_values), row_mask)
      slot = _Slot(generation, width)
      self._slots[row] = slot
      self._made(row, slot, int(tokens[i]))

  def _made(self, row: int, slot: _Slot, token: int) -> None:
    """Hands ``token`` to the row's generation; frees the row when the generation has ended."""
    generation = slot.generation
    slot.made += 1
    slot.last = token
    self.tokens_made += 1
    generation._emit(token)
    finish = None
    if generation.stop_id is not None and token == generation.stop_id:
      finish = "stop"
    elif slot.made >= generation.max_tokens:
      finish = "length"
    elif generation.cancelled:
      finish = "cancelled"
      self.cancelled += 1
    if finish is not None:
      generation._end(finish)
      self._slots[row] = None

  def _step(self) -> None:
    for row, slot in enumerate(self._slots):  # a consumer that went away frees its row now
      if slot is not None and slot.generation.cancelled:
        slot.generation._end("cancelled")
        self._slots[row] = None
        self.cancelled += 1
    live = [(row, slot) for row, slot in enumerate(self._slots) if slot is not None]
    if not live:
      return
    self._compact()
    live = [(row, slot) for row, slot in enumerate(self._slots) if slot is not None]
    self._ensure_shape(1, max(s.width + s.made for _, s in live))
    b = self._cache[2].shape[0]
    tokens, positions, index = (np.zeros(b, np.int32) for _ in range(3))
    seeds, steps, temps = np.zeros(b, np.uint32), np.zeros(b, np.int32), np.zeros(b, np.float32)
    for row, slot in live:
      g = slot.generation
      tokens[row] = slot.last
      positions[row] = len(g.ids) + slot.made - 1
      index[row] = slot.width + slot.made - 1
      seeds[row], temps[row], steps[row] = g.seed, g.temperature, slot.made
    keys, values, mask = self._cache
    keys, values, mask, chosen = _decode(
        self._model, self._leaves, keys, values, mask, tokens, positions, index, seeds, temps, steps
    )
    self._cache = (keys, values, mask)
    chosen = np.asarray(chosen)
    for row, slot in live:
      self._made(row, slot, int(chosen[row]))


__all__ = ["BatchEngine", "Generation", "QueueFull"]
