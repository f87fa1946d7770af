"""Batched generation for the evaluations: prompts tokenised as in training, left-padded to a few
widths so decoding compiles a handful of programs (``anlr eval``, the MT-Bench answers and judge).
"""

from __future__ import annotations

import jax
import numpy as np

from anlr_jax import hostmem
from anlr_jax.data import end_of_turn_id
from anlr_jax.models import generate
from anlr_jax.models.generation import left_padded_batch, prompt_width

HOLD_RESERVE = 32
"""Free KV-cache slots kept after a batch's last token for ``make_generate_fn(hold=...)``."""


def make_generate_fn(
    model,
    tokenizer,
    *,
    max_new_tokens: int,
    batch_size: int,
    width_multiple: int = 16,
    template: str = "alpaca",
    exact_continuation: bool = False,
    seed: int = 0,
    prefill_chunk: int | None = None,
    hold=None,
    no_repeat_ngram: int = 0,
):
  """``prompts -> continuations`` by greedy decoding, with the training tokenisation of a prompt.

  A prompt is ``[bos] + tok(prompt)`` (as :mod:`anlr_jax.data.tokenize` builds it; with
  ``template="chat"`` no bos, and decoding stops at the chat template's end-of-turn token instead of
  eos), left-padded to :func:`prompt_width` (``width_multiple`` times a power of two); short batches
  are padded to ``batch_size`` rows. Decoding compiles once per width, so prompts of up to ``L``
  tokens compile at most ``log2(L / width_multiple) + 1`` programs. With ``exact_continuation``
  the continuation is ``decode(prompt + new)`` minus ``decode(prompt)``, which keeps the leading
  spaces that decoding the new tokens alone can drop (code indentation). The returned function
  takes an optional ``temperature`` (> 0: sampling, seeded by ``seed`` and the call's number).
  ``prefill_chunk``: prompts are prefilled that many columns at a time
  (:func:`anlr_jax.models.generate`). ``hold(rows, new_ids, cache, prompt_slots)``, when given, is
  called after each batch with the prompts' token ids, the ``(B, N)`` new ids and the KV cache
  (``HOLD_RESERVE`` free slots kept after the last token) for a caller that goes on from there.
  ``no_repeat_ngram``: ``n > 0`` keeps each reply free of repeated ``n``-grams of its own tokens
  (:func:`anlr_jax.models.generate`).
  """
  chat = template == "chat"
  bos = None if chat else tokenizer.bos_token_id
  stop = end_of_turn_id(tokenizer) if chat else tokenizer.eos_token_id
  pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

  def decode(rows, new):
    texts = tokenizer.batch_decode(new, skip_special_tokens=True)
    if not exact_continuation:
      return texts
    out = []
    for row, tokens, text in zip(rows, new, texts):
      head = tokenizer.decode(row, skip_special_tokens=True)
      whole = tokenizer.decode(list(row) + list(tokens), skip_special_tokens=True)
      out.append(whole[len(head) :] if whole.startswith(head) else text)
    return out

  calls = [0]

  def sampling(temperature):  # greedy calls pass no sampling arguments
    if not temperature:
      return {}
    return dict(temperature=temperature, rng=jax.random.fold_in(jax.random.key(seed), calls[0]))

  def generate_fn(prompts, temperature: float = 0.0):
    rows = [
        ([bos] if bos is not None else []) + tokenizer(p, add_special_tokens=False).input_ids
        for p in prompts
    ]
    ids, mask = left_padded_batch(rows, pad, batch_size=batch_size, width_multiple=width_multiple)
    out = generate(
        model,
        ids,
        mask,
        max_new_tokens=max_new_tokens,
        eos_token_id=stop,
        pad_token_id=int(pad),
        prefill_chunk=prefill_chunk,
        no_repeat_ngram=no_repeat_ngram,
        **sampling(temperature),
        **({} if hold is None else dict(cache_reserve=HOLD_RESERVE, return_cache=True)),
    )
    if hold is not None:
      out, cache, slots = out
      hold(rows, np.asarray(out), cache, slots)
    calls[0] += 1
    texts = decode(rows, np.asarray(out)[: len(rows)].tolist())
    hostmem.release_free_heap()  # the batch's scraps go back to the OS, not into the next peak
    return texts

  return generate_fn


__all__ = ["HOLD_RESERVE", "make_generate_fn", "prompt_width"]
