r"""Log-likelihood multiple-choice scoring (rank classification), as lm-evaluation-harness and OLMES.

A question has choices ``j = 1..n``, each a context ``c_j`` and a continuation ``x_j`` (for most sets
one shared context; for WinoGrande the option fills the blank, so the contexts differ). The score of
a choice is the summed log-probability of its continuation's tokens given the context,

    ll_j = \sum_{t=1}^{|x_j|} \log p(x_{j,t} | c_j, x_{j,<t}),

and the prediction is ``argmax_j`` of one of three normalisations:

* ``raw``: ``ll_j``;
* ``char``: ``ll_j / len(x_j)`` (characters of the continuation string; lm-eval's ``acc_norm``,
  OLMES' ``acc_per_char``);
* ``token``: ``ll_j / |x_j|`` (tokens).

Tokenisation follows lm-eval's ``_encode_pair``: whitespace at the end of the context moves to the
front of the continuation, ``whole = tok(c + x)``, ``ctx = tok(c)``, and the continuation's tokens
are ``whole[len(ctx):]`` (so a word split differently at the boundary is scored as the tokenizer sees
the whole text). With ``add_bos`` the bos token is put before the context (as training prompts
are); an empty context is the eos token alone. A continuation that tokenises to nothing is an error.

**Batching.** The contexts of a question are run once and shared by its choices through the KV
cache: a jitted program prefills ``R`` left-padded contexts (all but their last token) into a cache,
copies each context's cache rows to its choices, and runs the choices' tokens (the context's last
token, then the continuation but its last token) against them, ``R * k`` rows for at most ``k``
choices per context. Contexts are sorted by length and cut into batches of ``batch_size``; widths
are rounded up to :func:`bucket_width` (a geometric ladder, at most ~41 % padding), so a run compiles
one program per (context bucket, continuation bucket) pair, never one per batch.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import tqdm
from flax import nnx

from anlr_jax import fileio
from anlr_jax.data.benchmarks import ChoiceQuestion
from anlr_jax.models.llama import init_cache

NORMALIZATIONS = ("raw", "char", "token")
"""How choice log-likelihoods are compared (see the module docstring)."""

TRACE_COUNTS = {"score": 0}
"""How many times the scoring program was traced (compiled): one per length-bucket pair."""


def bucket_width(length: int, multiple: int = 16) -> int:
  """The smallest width ``>= length`` on the ladder ``multiple * 2**(j/2)`` (rounded up to a
  multiple of ``multiple``): 16, 32, 48, 64, 96, 128, 192, 256, 368, 512, ... for 16."""
  length = max(1, int(length))
  j = 0
  while True:
    width = multiple * math.ceil(2 ** (j / 2))
    if width >= length:
      return width
    j += 1


def encode_pair(
    tokenizer, context: str, continuation: str, *, add_bos: bool
) -> tuple[list[int], list[int]]:
  """``(context ids, continuation ids)`` as lm-evaluation-harness splits them (module docstring)."""
  spaces = len(context) - len(context.rstrip())
  if spaces:
    context, continuation = context[:-spaces], context[-spaces:] + continuation
  whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
  ctx_len = len(tokenizer(context, add_special_tokens=False).input_ids)
  ctx, cont = list(whole[:ctx_len]), list(whole[ctx_len:])
  if add_bos and tokenizer.bos_token_id is not None:
    ctx = [tokenizer.bos_token_id] + ctx
  if not ctx:
    ctx = [tokenizer.eos_token_id]
  return ctx, cont


@dataclasses.dataclass(frozen=True)
class ChoiceRecord:
  """One question's scores: per choice the log-likelihood, its tokens and characters."""

  index: int
  id: str
  gold: int
  logliks: tuple[float, ...]
  num_tokens: tuple[int, ...]
  num_chars: tuple[int, ...]

  def prediction(self, normalization: str) -> int:
    ll = np.asarray(self.logliks)
    if normalization == "char":
      ll = ll / np.maximum(np.asarray(self.num_chars), 1)
    elif normalization == "token":
      ll = ll / np.asarray(self.num_tokens)
    return int(np.argmax(ll))


@dataclasses.dataclass(frozen=True)
class LoglikResult:
  """Per-question records of a task; ``accuracy`` under ``normalization``, all three in
  ``accuracies``."""

  task: str
  records: tuple[ChoiceRecord, ...]
  normalization: str = "char"
  shots: int = 0

  @property
  def total(self) -> int:
    return len(self.records)

  def correct_under(self, normalization: str) -> int:
    return sum(r.prediction(normalization) == r.gold for r in self.records)

  @property
  def correct(self) -> int:
    return self.correct_under(self.normalization)

  @property
  def accuracy(self) -> float:
    return self.correct / self.total if self.records else 0.0

  @property
  def accuracies(self) -> dict[str, float]:
    return {n: self.correct_under(n) / max(self.total, 1) for n in NORMALIZATIONS}

  def save_records(self, path: str | os.PathLike[str]) -> None:
    """One JSON object per question (JSONL), with its predictions under each normalisation."""
    with fileio.atomic_write(path, "w", encoding="utf-8") as f:
      for r in self.records:
        predictions = {n: r.prediction(n) for n in NORMALIZATIONS}
        extra = {"task": self.task, "shots": self.shots, "predictions": predictions}
        f.write(json.dumps(dataclasses.asdict(r) | extra) + "\n")


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _score(state, graphdef, ctx_ids, ctx_mask, rows, cont_ids, cont_targets, cont_mask):
  """``(sum of target log-probs, all targets greedy)`` per continuation row."""
  TRACE_COUNTS["score"] += 1
  model = nnx.merge(graphdef, state)
  r, lc = ctx_ids.shape
  cache = init_cache(model.config, r, lc + cont_ids.shape[1])
  _, cache = model(ctx_ids, attention_mask=ctx_mask, cache=cache)  # logits unused: not computed
  cache = cache._replace(
      keys=tuple(k[rows] for k in cache.keys),
      values=tuple(v[rows] for v in cache.values),
      mask=cache.mask[rows],
  )
  logits, _ = model(cont_ids, attention_mask=cont_mask, cache=cache)
  target = jnp.take_along_axis(logits, cont_targets[..., None], axis=-1)[..., 0]
  logprob = target - jax.nn.logsumexp(logits, axis=-1)
  greedy = (jnp.argmax(logits, axis=-1) == cont_targets) | (cont_mask == 0)
  return jnp.sum(logprob * cont_mask, axis=-1), jnp.all(greedy, axis=-1)


def score_requests(
    model,
    requests: Sequence[tuple[Sequence[int], Sequence[Sequence[int]]]],
    *,
    batch_size: int,
    pad_id: int = 0,
    progress: bool | None = None,
    desc: str = "loglik",
) -> list[list[float]]:
  """Log-likelihoods of token continuations given token contexts.

  Args:
    model: a causal LM of :mod:`anlr_jax.models` (in eval mode).
    requests: ``(context ids, [continuation ids, ...])`` pairs; every context has at least one
      token and every continuation at least one.
    batch_size: contexts per program call (their continuations run together).
    pad_id: the token id used for padding (masked out).
    progress: a tqdm bar of the contexts scored (default: when there is more than one batch).

  Returns:
    Per request, the summed log-probability of each continuation.
  """
  if not isinstance(batch_size, int) or batch_size < 1:
    raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
  for i, (ctx, conts) in enumerate(requests):
    if not len(ctx) or not conts or any(not len(c) for c in conts):
      raise ValueError(f"request {i}: empty context or continuation")
  graphdef, state = nnx.split(model)
  width = max(len(conts) for _, conts in requests)
  order = sorted(range(len(requests)), key=lambda i: -len(requests[i][0]))
  out: list[list[float]] = [[] for _ in requests]
  show = len(requests) > batch_size if progress is None else progress
  with tqdm.tqdm(total=len(requests), disable=not show, desc=desc, unit="ctx", leave=False) as bar:
    for start in range(0, len(order), batch_size):
      batch = order[start : start + batch_size]
      lc = bucket_width(max(len(requests[i][0]) - 1 for i in batch))
      lk = bucket_width(max(len(c) for i in batch for c in requests[i][1]))
      ctx_ids = np.full((batch_size, lc), pad_id, np.int32)
      ctx_mask = np.zeros((batch_size, lc), np.int32)
      n = batch_size * width
      rows = np.zeros((n,), np.int32)
      cont_ids = np.full((n, lk), pad_id, np.int32)
      cont_targets = np.zeros((n, lk), np.int32)
      cont_mask = np.zeros((n, lk), np.float32)
      slot = 0
      for r, i in enumerate(batch):
        ctx, conts = requests[i]
        head = list(ctx[:-1])
        if head:
          ctx_ids[r, lc - len(head) :], ctx_mask[r, lc - len(head) :] = head, 1
        for cont in conts:
          rows[slot] = r
          cont_ids[slot, : len(cont)] = [ctx[-1], *cont[:-1]]
          cont_targets[slot, : len(cont)] = cont
          cont_mask[slot, : len(cont)] = 1
          slot += 1
      sums, _ = _score(state, graphdef, ctx_ids, ctx_mask, rows, cont_ids, cont_targets, cont_mask)
      sums = np.asarray(sums)
      slot = 0
      for i in batch:
        out[i] = [float(s) for s in sums[slot : slot + len(requests[i][1])]]
        slot += len(requests[i][1])
      bar.update(len(batch))
  return out


def evaluate_choices(
    model,
    tokenizer,
    questions: Sequence[ChoiceQuestion],
    task: str,
    *,
    batch_size: int,
    normalization: str = "char",
    add_bos: bool = False,
    shots: int = 0,
    progress: bool | None = None,
) -> LoglikResult:
  """Scores every choice of every question and ranks them (see the module docstring).

  Args:
    model: a causal LM of :mod:`anlr_jax.models`.
    tokenizer: its Hugging Face tokenizer.
    questions: :class:`~anlr_jax.data.benchmarks.ChoiceQuestion`\\ s.
    task: the name the result carries.
    batch_size: distinct contexts per program call.
    normalization: the one ``accuracy`` uses: ``raw``, ``char`` or ``token``.
    add_bos: put the tokenizer's bos token before every context.
    shots: recorded with the result (the questions' contexts already hold the examples).
    progress: a tqdm bar (default: when there is more than one batch).

  Returns:
    A :class:`LoglikResult`.
  """
  if normalization not in NORMALIZATIONS:
    raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got {normalization!r}")
  if not questions:
    raise ValueError(f"{task}: no questions to score")
  requests, slots, tokens = [], [], []
  for q_index, q in enumerate(questions):
    if not 0 <= q.gold < q.num_choices:
      raise ValueError(f"{task}: question {q.id}: gold {q.gold} out of range ({q.num_choices})")
    groups: dict[tuple[int, ...], list[int]] = {}
    encoded = []
    for j, (context, continuation) in enumerate(zip(q.contexts, q.continuations)):
      ctx, cont = encode_pair(tokenizer, context, continuation, add_bos=add_bos)
      if not cont:
        raise ValueError(f"{task}: question {q.id}: choice {j} ({continuation!r}) has no tokens")
      groups.setdefault(tuple(ctx), []).append(j)
      encoded.append(cont)
    for ctx, choices in groups.items():
      requests.append((ctx, [encoded[j] for j in choices]))
      slots.append((q_index, choices))
    tokens.append(tuple(len(c) for c in encoded))
  pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
  scored = score_requests(
      model, requests, batch_size=batch_size, pad_id=int(pad), progress=progress, desc=task
  )
  logliks = [[0.0] * q.num_choices for q in questions]
  for (q_index, choices), values in zip(slots, scored):
    for j, value in zip(choices, values):
      logliks[q_index][j] = value
  records = tuple(
      ChoiceRecord(
          index=i,
          id=q.id,
          gold=q.gold,
          logliks=tuple(logliks[i]),
          num_tokens=tokens[i],
          num_chars=tuple(len(c) for c in q.continuations),
      )
      for i, q in enumerate(questions)
  )
  return LoglikResult(task=task, records=records, normalization=normalization, shots=shots)


__all__ = [
    "NORMALIZATIONS",
    "TRACE_COUNTS",
    "ChoiceRecord",
    "LoglikResult",
    "bucket_width",
    "encode_pair",
    "evaluate_choices",
    "score_requests",
]
