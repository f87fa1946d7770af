r"""The judge's own probabilities of its verdict, and what stopped a reply that gave none.

**Probability rating** (as G-Eval weights scores by token probability). After the judge's reply
``r`` to prompt ``x`` (its chat template, as it answered), the cue ``c`` is appended — ``Rating: [[``
for single grading, ``Final verdict: [[`` for a pair, each after a blank line — and the judge's
next-token probabilities are read for each choice ``s_k`` (``1`` ... ``10``, or ``A``, ``B``,
``C``), tokenised as it follows the cue, ``s_k = (t_1 .. t_m)``:

    P(s_k) = \prod_{i=1}^{m} p(t_i | x, r, c, t_{<i})

A choice whose tokens begin another choice's (``1`` before ``10`` when ``10`` is the two tokens
``1``, ``0``) counts only the text that stops there: ``P(1) = p(1) (1 - p(0 | 1))``, the mass of
every next token that leads on to a longer choice taken out, so the ten events are disjoint. The
probabilities are normalised over the choices, ``q_k = P(s_k) / \sum_j P(s_j)``; the rating is
``\sum_k k q_k`` and the verdict ``argmax_k q_k``. It needs one forward pass per judgment (more
only for a tokenizer whose choices branch after their first token), over a few positions: a local
judge's generation keeps the KV cache of the batch of replies it just wrote
(:class:`ReplyHolder`), and the pass keeps the cached tokens ``x, r, c`` tokenised afresh begins
with and runs only the rest of the context and the chain of tokens the choices share
(:func:`continue_held`). Otherwise the context is prefilled into a new cache, a chunk of columns
at a time, widths rounded to :func:`anlr_jax.evals.loglik.bucket_width` so that a run compiles one
program per context width bucket (:func:`chain_logprobs`).

**Failures.** A reply without the protocol's verdict is a *greedy loop* when it ends in at least
three back-to-back copies of one word n-gram (:func:`greedy_loop`: decoding went round in a circle
the token limit stopped), *cut by the token limit* when it used (within 2 %, counted by the judge's
tokenizer) all of ``max_new_tokens`` without looping, *stopped* when the judge ended it itself, and
*unknown* when the judge reports no length (an endpoint).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from anlr_jax import hostmem
from anlr_jax.evals.loglik import bucket_width
from anlr_jax.models.generation import chunk_layout, prefill_cache
from anlr_jax.models.llama import init_cache

RATING_CUE = "\n\nRating: [["
"""Appended after a single-grading reply (FastChat's prompts ask for ``Rating: [[5]]``)."""

RATINGS = tuple(str(k) for k in range(1, 11))
"""The choices of a single-grading probability rating."""

VERDICT_CUE = "\n\nFinal verdict: [["
"""Appended after a pairwise reply (FastChat's prompts ask for ``[[A]]``, ``[[B]]`` or ``[[C]]``)."""

VERDICTS = ("A", "B", "C")
"""The choices of a pairwise probability verdict (``C``: a tie)."""

FAILURE_KINDS = ("loop", "length", "stopped", "unknown")
"""What stopped a reply without a verdict (module doc)."""

ChoiceLogprobFn = Callable[[Sequence[tuple[str, str, str]], str, Sequence[str]], np.ndarray]
"""``(prompts as (system, user, reply), cue, choices) -> (n, len(choices))`` log-probabilities of
each choice after the reply and cue, unnormalised (module doc)."""


@dataclasses.dataclass(frozen=True)
class JudgeProbes:
  """What a local judge's model tells beyond its replies: ``choice_logprobs``
  (:data:`ChoiceLogprobFn`) and ``finish_reason`` (a reply -> ``length`` or ``stop``)."""

  choice_logprobs: ChoiceLogprobFn
  finish_reason: Callable[[str], str]


# ------------------------------------------------------------------------------------- maths
def normalise(logprobs: np.ndarray) -> np.ndarray:
  """``q_k = P(s_k) / sum_j P(s_j)`` from log-probabilities, along the last axis."""
  logprobs = np.asarray(logprobs, np.float64)
  shifted = np.exp(logprobs - logprobs.max(axis=-1, keepdims=True))
  return shifted / shifted.sum(axis=-1, keepdims=True)


def expected_rating(probs: Sequence[float]) -> float:
  """``sum_k k q_k`` over the ratings 1..10."""
  return float(np.dot(np.asarray(probs, np.float64), np.arange(1, len(probs) + 1)))


def choice_tokens(tokenizer, context: str, choices: Sequence[str]) -> tuple[list, list[list]]:
  """``(context ids, [ids of each choice as it follows the context])``: the choice's tokens are
  those of ``tok(context + choice)`` after the context's, or ``tok(choice)`` where the two texts
  tokenise differently at the boundary."""
  encode = lambda text: tokenizer(text, add_special_tokens=False).input_ids
  ctx = list(encode(context))
  out = []
  for choice in choices:
    whole = list(encode(context + choice))
    tail = whole[len(ctx) :] if whole[: len(ctx)] == ctx else []
    out.append(tail or list(encode(choice)))
  return ctx, out


def chains(choices: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
  """The token paths to run after the context so that every choice's every token has its
  conditional probability: the longest proper prefixes of the choices (one for most tokenizers:
  ``(1,)`` for ``1`` ... ``10`` with ``10`` as ``1 0``; ``()`` when each choice is one token)."""
  prefixes = {tuple(c[:i]) for c in choices for i in range(len(c))}
  longest = [p for p in prefixes if not any(len(q) > len(p) and q[: len(p)] == p for q in prefixes)]
  return sorted(longest)


def choice_logprobs_from(
    rows: dict[tuple[int, ...], np.ndarray], choices: Sequence[Sequence[int]]
) -> np.ndarray:
  """Log ``P(s_k)`` of each choice (module doc) from ``rows``: for each chain, the log-softmax
  ``(len(chain) + 1, V)`` after the context and after each of its tokens."""

  def logp(prefix: tuple[int, ...]) -> np.ndarray:  # log p(. | context, prefix)
    for chain, table in rows.items():
      if chain[: len(prefix)] == prefix:
        return table[len(prefix)]
    raise KeyError(prefix)

  out = []
  for c in map(tuple, choices):
    total = sum(float(logp(c[:i])[c[i]]) for i in range(len(c)))
    onward = {d[len(c)] for d in map(tuple, choices) if len(d) > len(c) and d[: len(c)] == c}
    if onward:  # only the text that stops here: the mass leading on to a longer choice goes
      rest = 1.0 - float(np.sum(np.exp(logp(c)[sorted(onward)].astype(np.float64))))
      total += float(np.log(max(rest, 1e-300)))
    out.append(total)
  return np.asarray(out)


# ------------------------------------------------------------------------------ the local judge
TRACE_COUNTS = {"tail": 0}
"""Python-side trace count of the probe's tail program (for compile checks)."""


@functools.partial(jax.jit, static_argnames=("graphdef", "keep"))
def _tail_logprobs(state, graphdef, cache, key_mask, tail_ids, tail_mask, *, keep):
  """Log-softmax ``(R, keep, V)`` at the last ``keep`` positions of each tail, the tails run
  after ``cache.index`` against the cached slots that ``key_mask`` marks (the cache is read, not
  returned). Only those ``R * keep`` rows meet the output matrix: for a few rows a quantised
  head is multiplied a chunk of columns at a time, with no whole float32 copy of it."""
  TRACE_COUNTS["tail"] += 1
  model = nnx.merge(graphdef, state)
  cache = cache._replace(mask=key_mask)
  logits, _ = model(tail_ids, attention_mask=tail_mask, cache=cache, logits_to_keep=keep)
  return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)


def _run_tails(model, cache, key_mask, tails, chains_, pad_id: int) -> list[np.ndarray]:
  """The log-softmax ``(len(chain) + 1, V)`` after each ``(row, tail)``'s context (the tail's
  first ``len(tail) - len(chain)`` tokens) and after each token of its ``chain``. The tails are
  left-padded to a :func:`~anlr_jax.evals.loglik.bucket_width` (multiple 8), so each ends in the
  last column and the logits needed are those of the last positions."""
  width = bucket_width(max(len(t) for _, t in tails), multiple=8)
  ids = np.full((key_mask.shape[0], width), pad_id, np.int32)
  mask = np.zeros(ids.shape, np.int32)
  for r, tail in tails:
    ids[r, width - len(tail) :], mask[r, width - len(tail) :] = tail, 1
  if int(cache.index) + width > cache.max_length:
    raise ValueError("the tails do not fit in the cache")
  keep = max(len(c) for c in chains_) + 1
  graphdef, state = nnx.split(model)
  logp = np.asarray(_tail_logprobs(state, graphdef, cache, key_mask, ids, mask, keep=keep))
  return [logp[r, keep - len(c) - 1 :] for (r, _), c in zip(tails, chains_)]


def chain_logprobs(
    model,
    requests: Sequence[tuple[Sequence[int], Sequence[int]]],
    *,
    batch_size: int,
    pad_id: int,
    prefill_chunk: int | None = None,
) -> list[np.ndarray]:
  """For each ``(context ids, chain ids)``, the log-softmax ``(len(chain) + 1, V)`` of the next
  token after the context and after each chain token. Contexts are left-padded to a
  :func:`~anlr_jax.evals.loglik.bucket_width` (all but their last token, which opens the tail) and
  prefilled ``prefill_chunk`` columns at a time (None: one pass), tails right-padded to 8;
  batches of ``batch_size`` rows, longest first."""
  graphdef, state = nnx.split(model)
  order = sorted(range(len(requests)), key=lambda i: -len(requests[i][0]))
  out: list[np.ndarray] = [np.empty(0)] * len(requests)
  for start in range(0, len(order), batch_size):
    batch = order[start : start + batch_size]
    lc = bucket_width(max(len(requests[i][0]) - 1 for i in batch))
    ctx_ids = np.full((batch_size, lc), pad_id, np.int32)
    ctx_mask = np.zeros((batch_size, lc), np.int32)
    tails = []
    for r, i in enumerate(batch):
      ctx, chain = requests[i]
      head = list(ctx[:-1])
      if head:
        ctx_ids[r, lc - len(head) :], ctx_mask[r, lc - len(head) :] = head, 1
      tails.append((r, [ctx[-1], *chain]))
    slots = lc - chunk_layout(ctx_mask, prefill_chunk)[0]
    tail_width = bucket_width(max(len(t) for _, t in tails), multiple=8)
    cache = init_cache(model.config, batch_size, max(lc, slots) + tail_width)
    cache = prefill_cache(model, ctx_ids, ctx_mask, cache, chunk=prefill_chunk)
    chains_ = [requests[i][1] for i in batch]
    for i, table in zip(batch, _run_tails(model, cache, cache.mask, tails, chains_, pad_id)):
      out[i] = table
  return out


@dataclasses.dataclass
class HeldReplies:
  """The KV cache of the judge's last batch of replies (``make_generate_fn(hold=...)``), so that
  the probe goes on from the reply instead of prefilling prompt and reply again. ``rows``: the
  prompts' token ids; ``new``: the ``(B, N)`` generated ids; ``slots``: the cache slots of the
  prompt region (row ``r``'s prompt ends there, its reply follows)."""

  rows: list[list[int]]
  new: np.ndarray
  cache: object
  slots: int

  def tokens(self, r: int) -> list[int]:
    """Row ``r``'s tokens in the cache, in order: its prompt, then the reply tokens written."""
    written = int(self.cache.index) - self.slots
    return list(self.rows[r]) + self.new[r, :written].tolist()


class ReplyHolder:
  """Keeps the last :class:`HeldReplies` (``hold``) until the probe takes it (``take``)."""

  def __init__(self):
    self._held: HeldReplies | None = None

  def hold(self, rows, new, cache, slots) -> None:
    self._held = HeldReplies([list(r) for r in rows], np.asarray(new), cache, int(slots))

  def take(self) -> HeldReplies | None:
    held, self._held = self._held, None
    return held


def _common(a: Sequence[int], b: Sequence[int]) -> int:
  n = 0
  for x, y in zip(a, b):
    if x != y:
      break
    n += 1
  return n


def continue_held(
    model,
    held: HeldReplies,
    requests: Sequence[tuple[Sequence[int], Sequence[int], Sequence[int]]],
    *,
    pad_id: int,
) -> list[np.ndarray] | None:
  """:func:`chain_logprobs` of ``(prompt ids, context ids, chain ids)`` requests from the held
  cache: row ``r`` of the prompt keeps the cached tokens its context starts with (prompt and the
  reply's tokens, as far as the context's own tokenisation agrees with them), and the rest of the
  context and the chain are run after them in one pass. None when the held batch cannot serve
  them all (a prompt it does not hold, two requests for one row, or tails longer than the free
  slots): the caller prefills instead."""
  where = {tuple(row): r for r, row in enumerate(held.rows)}
  cache = held.cache
  key_mask = np.zeros(cache.mask.shape, np.int32)
  tails, used = [], {}
  for prompt, ctx, chain in requests:
    r = where.get(tuple(prompt))
    if r is None:
      return None
    cached = held.tokens(r)
    keep = min(_common(cached, ctx), len(ctx) - 1)  # the context's last token opens the tail
    tail = [*ctx[keep:], *chain]
    if used.setdefault(r, tail) != tail:
      return None
    first = held.slots - len(held.rows[r])  # the slot of the row's first token
    key_mask[r, first : first + keep] = 1
    tails.append((r, tail))
  width = bucket_width(max(len(t) for _, t in tails), multiple=8)
  if int(cache.index) + width > cache.max_length:
    return None
  return _run_tails(model, cache, key_mask, tails, [c for *_, c in requests], pad_id)


def local_probes(
    model,
    tokenizer,
    format_prompt: Callable[[str, str], str],
    *,
    batch_size: int,
    max_new_tokens: int,
    prefill_chunk: int | None = None,
    held: ReplyHolder | None = None,
) -> JudgeProbes:
  """The :class:`JudgeProbes` of a local judge: ``format_prompt(system, user)`` is the prompt text
  it answered (its chat template, generation prompt included); ``max_new_tokens`` its reply
  limit. With ``held`` (the :class:`ReplyHolder` its generation fills), a batch of probes goes on
  from the cache of the batch of replies just judged (:func:`continue_held`); otherwise, or when
  that cannot serve them, prompt, reply and cue are prefilled anew (:func:`chain_logprobs`,
  ``prefill_chunk`` columns at a time)."""
  pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
  encode = lambda text: list(tokenizer(text, add_special_tokens=False).input_ids)

  def choice_logprobs(prompts, cue, choices):
    encoded, requests, where = [], [], []
    for system, user, reply in prompts:
      prompt = format_prompt(system, user)
      ctx, tokens = choice_tokens(tokenizer, prompt + reply.rstrip() + cue, choices)
      paths = chains(tokens)
      encoded.append((prompt, ctx, tokens, paths))
      where.append((len(requests), paths))
      requests += [(ctx, path) for path in paths]
    last = held.take() if held is not None else None
    tables = None
    if last is not None and all(len(paths) == 1 for *_, paths in encoded):
      tables = continue_held(
          model, last, [(encode(p), ctx, paths[0]) for p, ctx, _, paths in encoded], pad_id=int(pad)
      )
    del last  # the cache's memory goes before a prefill needs its own
    if tables is None:
      tables = chain_logprobs(
          model, requests, batch_size=batch_size, pad_id=int(pad), prefill_chunk=prefill_chunk
      )
    rows = []
    for (at, paths), (*_, tokens, _) in zip(where, encoded):
      rows.append(choice_logprobs_from(dict(zip(paths, tables[at : at + len(paths)])), tokens))
    hostmem.release_free_heap()  # the batch's caches and scraps go back to the OS
    return np.stack(rows) if rows else np.zeros((0, len(choices)))

  slack = max(1, max_new_tokens // 50)

  def finish_reason(reply: str) -> str:
    used = len(tokenizer(reply, add_special_tokens=False).input_ids)
    return "length" if used >= max_new_tokens - slack else "stop"

  return JudgeProbes(choice_logprobs, finish_reason)


# ------------------------------------------------------------------------------------ failures
def greedy_loop(text: str, *, copies: int = 3, min_words: int = 12) -> int | None:
  """The length ``n`` (in words) of the shortest word n-gram of which ``text`` ends in at least
  ``copies`` back-to-back copies (the last may be cut short, also inside a word) covering at least
  ``min_words`` words; None when there is none."""
  words = text.split()
  for n in range(1, len(words) // copies + 1):
    run = 1 if words[-1 - n].startswith(words[-1]) else 0  # trailing words equal to those n before
    while run and run < len(words) - n and words[-1 - run] == words[-1 - run - n]:
      run += 1
    if run + n >= max(copies * n, min_words):
      return n
  return None


def failure_kind(judgment: str, finish_reason: str | None) -> str:
  """What stopped a reply without a verdict: one of :data:`FAILURE_KINDS` (module doc)."""
  if greedy_loop(judgment) is not None:
    return "loop"
  return {"length": "length", "stop": "stopped"}.get(finish_reason, "unknown")


__all__ = [
    "FAILURE_KINDS",
    "RATINGS",
    "RATING_CUE",
    "VERDICTS",
    "VERDICT_CUE",
    "ChoiceLogprobFn",
    "HeldReplies",
    "JudgeProbes",
    "ReplyHolder",
    "chain_logprobs",
    "chains",
    "choice_logprobs_from",
    "choice_tokens",
    "continue_held",
    "expected_rating",
    "failure_kind",
    "greedy_loop",
    "local_probes",
    "normalise",
]
