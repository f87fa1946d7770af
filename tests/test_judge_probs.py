"""The judge's own probability rating and verdict, against transformers' logits and NumPy; the
records keep the protocol's fields; the failure kinds; the maths of the choices."""

import numpy as np
import pytest
import torch
import transformers

from anlr_jax.evals import judge_probs
from anlr_jax.evals.judge_probs import (
    RATINGS,
    VERDICTS,
    chains,
    choice_logprobs_from,
    choice_tokens,
    greedy_loop,
    local_probes,
)
from anlr_jax.models.hf_io import load_hf_model
from tests.helpers.tiny_chat import CHATML
from tests.helpers.tiny_llama import save_tiny_llama
from tests.tiny_tokenizer import build_tiny_tokenizer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  """A tiny LLaMA, its torch twin, and two tokenizers: one writes ``10`` as ``1 0``, the other
  (an added token) as one token."""
  root = tmp_path_factory.mktemp("tiny")
  split = build_tiny_tokenizer()
  split.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
  split.chat_template = CHATML
  whole = build_tiny_tokenizer()
  whole.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
  whole.add_tokens(["10"])
  whole.chat_template = CHATML
  save_tiny_llama(root, len(whole), max_position_embeddings=512)
  model, _ = load_hf_model(root)
  model.eval()
  reference = transformers.LlamaForCausalLM.from_pretrained(root).eval()
  return model, reference, {"split": split, "whole": whole}


def prompt_of(tok):
  return lambda system, user: tok.apply_chat_template(
      [{"role": "system", "content": system}, {"role": "user", "content": user}],
      tokenize=False,
      add_generation_prompt=True,
  )


def numpy_choice_logprobs(reference, ctx, choices):
  """log P(s_k) from the torch model's logits on each whole sequence ``ctx + s_k`` (float64), the
  mass leading on to a longer choice taken out of a choice that begins it."""

  def logsoftmax(ids):
    with torch.no_grad():
      logits = reference(torch.tensor([ids])).logits[0].double().numpy()
    top = logits.max(-1, keepdims=True)
    return logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))

  out = []
  for c in choices:
    table = logsoftmax(ctx + c)
    total = sum(table[len(ctx) - 1 + i, t] for i, t in enumerate(c))
    onward = {d[len(c)] for d in choices if len(d) > len(c) and d[: len(c)] == c}
    if onward:
      after = table[len(ctx) - 1 + len(c)]
      total += np.log(1 - sum(np.exp(after[t]) for t in onward))
    out.append(total)
  return np.asarray(out)


def normalised(logprobs):
  p = np.exp(logprobs - logprobs.max())
  return p / p.sum()


JUDGMENTS = [
    ("You are a judge.", "Rate the answer: the fox jumps.", "The answer is fine. Rating: [[7]]"),
    ("You are a judge.", "Rate this one, please.", "It loops the loops the loops"),
    ("Judge.", "Which is better?", "Assistant A is better.\n\n"),
]


@pytest.mark.parametrize("which", ["split", "whole"])
def test_probability_rating_equals_numpy_from_the_models_logits(tiny, which):
  model, reference, toks = tiny
  tok = toks[which]
  ten = tok(RATINGS[-1], add_special_tokens=False).input_ids
  assert len(ten) == (2 if which == "split" else 1)
  probes = local_probes(model, tok, prompt_of(tok), batch_size=2, max_new_tokens=64)
  got = probes.choice_logprobs(JUDGMENTS, judge_probs.RATING_CUE, RATINGS)
  assert got.shape == (3, 10)
  for (system, user, reply), row in zip(JUDGMENTS, got):
    context = prompt_of(tok)(system, user) + reply.rstrip() + judge_probs.RATING_CUE
    ctx, choices = choice_tokens(tok, context, RATINGS)
    expected = numpy_choice_logprobs(reference, ctx, choices)
    np.testing.assert_allclose(row, expected, atol=1e-4, rtol=0)
    q = judge_probs.normalise(row)
    rating = judge_probs.expected_rating(q)
    assert rating == pytest.approx(float(np.dot(normalised(expected), np.arange(1, 11))), abs=1e-4)
    if which == "split":  # 1 counts only where no 0 follows: all of p(1) would double-count 10
      with torch.no_grad():
        logits = reference(torch.tensor([ctx])).logits[0, -1].double().numpy()
      all_of_one = (
          logits[choices[0][0]] - logits.max() - np.log(np.exp(logits - logits.max()).sum())
      )
      assert row[0] < all_of_one - 1e-3 and choices[9][:1] == choices[0]


def test_choices_that_branch_after_the_first_token_take_one_row_per_branch(tiny):
  model, reference, toks = tiny
  tok = toks["split"]
  choices = (" the fox", " the dog", " a cat", " the")
  probes = local_probes(model, tok, prompt_of(tok), batch_size=4, max_new_tokens=64)
  got = probes.choice_logprobs(JUDGMENTS[:2], "\n\nAnswer:", choices)
  for (system, user, reply), row in zip(JUDGMENTS[:2], got):
    ctx, tokens = choice_tokens(tok, prompt_of(tok)(system, user) + reply + "\n\nAnswer:", choices)
    assert len(chains(tokens)) == 3  # (the, f), (the, d), (a, c)
    np.testing.assert_allclose(row, numpy_choice_logprobs(reference, ctx, tokens), atol=1e-4)


def test_chains_and_the_prefix_correction_by_hand():
  assert chains([[5], [6, 7], [6, 8, 9], [4, 1]]) == [(4,), (6, 8)]
  assert chains([[1], [2], [3]]) == [()]
  assert chains([[1], [1, 0]]) == [(1,)]
  # vocabulary of 3 tokens: after the context p = (0.2, 0.5, 0.3); after token 1, p(0 | 1) = 0.25
  rows = {(1,): np.log(np.array([[0.2, 0.5, 0.3], [0.25, 0.25, 0.5]]))}
  got = np.exp(choice_logprobs_from(rows, [[1], [2], [1, 0]]))
  np.testing.assert_allclose(got, [0.5 * 0.75, 0.3, 0.5 * 0.25])


def test_expected_rating_and_normalise():
  q = judge_probs.normalise(np.log([1.0, 1.0, 2.0] + [1e-12] * 7))
  np.testing.assert_allclose(q[:3], [0.25, 0.25, 0.5], atol=1e-9)
  assert judge_probs.expected_rating(q) == pytest.approx(0.25 + 0.5 + 1.5, abs=1e-9)


SENTENCE = "The response is well-organized and provides a clear and concise account of the trip. "


def test_greedy_loop_finds_a_repeated_n_gram_at_the_end():
  words = len(SENTENCE.split())
  assert greedy_loop("Intro text here. " + SENTENCE * 5 + "The response is well") == words
  assert greedy_loop("yes " * 20) == 1
  assert greedy_loop("yes yes yes") is None  # three words: too short to be a loop
  assert greedy_loop(SENTENCE * 2) is None  # two copies are no loop
  assert greedy_loop("The answer is right and clear. " + "Rating: [[8]]") is None
  assert judge_probs.failure_kind(SENTENCE * 4, "length") == "loop"
  assert judge_probs.failure_kind("A long reply cut", "length") == "length"
  assert judge_probs.failure_kind("I cannot rate this.", "stop") == "stopped"
  assert judge_probs.failure_kind("I cannot rate this.", None) == "unknown"


def test_finish_reason_counts_the_reply_in_tokens(tiny):
  model, _, toks = tiny
  tok = toks["split"]
  probes = local_probes(model, tok, prompt_of(tok), batch_size=1, max_new_tokens=100)
  long = "ab " * 100
  assert len(tok(long, add_special_tokens=False).input_ids) >= 100
  assert probes.finish_reason(long) == "length"
  assert probes.finish_reason("A short reply. Rating: [[4]]") == "stop"


def test_the_probe_goes_on_from_the_replies_kv_cache(tiny, monkeypatch):
  """The judge's replies are generated with their cache held; the probe continues from it (no new
  prefill: ``chain_logprobs`` is not called) and gives the whole-sequence reference's values."""
  from anlr_jax import hostmem
  from anlr_jax.app.text_generation import make_generate_fn

  trims = []  # each batch's freed heap is handed back (hostmem.release_free_heap)
  monkeypatch.setattr(hostmem, "release_free_heap", lambda: trims.append(1) or True)
  model, reference, toks = tiny
  tok = toks["split"]
  fmt = prompt_of(tok)
  holder = judge_probs.ReplyHolder()
  generate = make_generate_fn(
      model,
      tok,
      max_new_tokens=6,
      batch_size=4,
      template="chat",
      prefill_chunk=16,
      hold=holder.hold,
  )
  prompts = [(s, u) for s, u, _ in JUDGMENTS]
  replies = generate([fmt(s, u) for s, u in prompts])
  assert len(trims) == 1
  judgments = [(s, u, r) for (s, u), r in zip(prompts, replies)][::-1]  # any order
  probes = local_probes(model, tok, fmt, batch_size=4, max_new_tokens=6, held=holder)
  fail = lambda *a, **k: pytest.fail("prefilled again")
  monkeypatch.setattr(judge_probs, "chain_logprobs", fail)
  got = probes.choice_logprobs(judgments, judge_probs.RATING_CUE, RATINGS)
  assert holder.take() is None  # taken, its memory let go
  assert len(trims) == 2
  for (system, user, reply), row in zip(judgments, got):
    context = fmt(system, user) + reply.rstrip() + judge_probs.RATING_CUE
    ctx, choices = choice_tokens(tok, context, RATINGS)
    np.testing.assert_allclose(row, numpy_choice_logprobs(reference, ctx, choices), atol=1e-4)


def test_a_held_batch_that_does_not_hold_the_prompts_is_prefilled_anew(tiny):
  """Prompts the held batch lacks (here: its replies were made for other prompts) go the
  prefill way, ``prefill_chunk`` columns at a time, with the same values."""
  from anlr_jax.app.text_generation import make_generate_fn

  model, reference, toks = tiny
  tok = toks["split"]
  fmt = prompt_of(tok)
  holder = judge_probs.ReplyHolder()
  generate = make_generate_fn(
      model, tok, max_new_tokens=4, batch_size=2, template="chat", hold=holder.hold
  )
  generate([fmt("Other.", "Another prompt.")])
  probes = local_probes(
      model, tok, fmt, batch_size=2, max_new_tokens=4, prefill_chunk=8, held=holder
  )
  got = probes.choice_logprobs(JUDGMENTS, judge_probs.VERDICT_CUE, VERDICTS)
  for (system, user, reply), row in zip(JUDGMENTS, got):
    context = fmt(system, user) + reply.rstrip() + judge_probs.VERDICT_CUE
    ctx, choices = choice_tokens(tok, context, VERDICTS)
    np.testing.assert_allclose(row, numpy_choice_logprobs(reference, ctx, choices), atol=1e-4)
