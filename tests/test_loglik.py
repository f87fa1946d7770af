"""The log-likelihood multiple-choice scorer against transformers (PyTorch) on a tiny random LLaMA."""

import numpy as np
import pytest
import torch
import transformers

from anlr_jax.data.benchmarks import ChoiceQuestion
from anlr_jax.evals import loglik
from anlr_jax.models.hf_io import load_hf_model
from tests.helpers.tiny_llama import save_tiny_llama
from tests.tiny_tokenizer import build_tiny_tokenizer

QUESTIONS = [
    ChoiceQuestion("shared", ("Question: what is 2 + 3?\nAnswer:",) * 3, (" 5", " 6", " a fox"), 0),
    ChoiceQuestion(  # WinoGrande-style: the contexts differ, the continuation is shared
        "blank",
        ("The fox jumps over the lazy dog. So the", "The fox jumps over the lazy cat. So the"),
        (" answer is 72 #### 72",) * 2,
        1,
    ),
    ChoiceQuestion("empty context", ("", ""), ("hello", " world and more text here"), 1),
    ChoiceQuestion("trailing space", ("The answer is ",) * 2, ("true", "false"), 1),
    ChoiceQuestion("long", ("x " * 60 + "Answer:",) * 2, (" a", " b c d e f g h i j"), 0),
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  root = tmp_path_factory.mktemp("tiny")
  tok = build_tiny_tokenizer(root)
  save_tiny_llama(root, len(tok))
  model, _ = load_hf_model(root)
  model.eval()
  reference = transformers.LlamaForCausalLM.from_pretrained(root).eval()
  return model, tok, reference


def torch_loglik(reference, ctx, cont) -> float:
  """One request the lm-evaluation-harness way: the whole sequence, continuation tokens summed."""
  with torch.no_grad():
    logits = reference(torch.tensor([ctx + cont])).logits.double()
  logprobs = torch.log_softmax(logits, -1)[0]
  return sum(logprobs[len(ctx) - 1 + t, token].item() for t, token in enumerate(cont))


@pytest.mark.parametrize("add_bos", [True, False])
def test_choice_logliks_equal_transformers(tiny, add_bos):
  model, tok, reference = tiny
  result = loglik.evaluate_choices(model, tok, QUESTIONS, "t", batch_size=2, add_bos=add_bos)
  for q, record in zip(QUESTIONS, result.records):
    expected = [
        torch_loglik(reference, *loglik.encode_pair(tok, c, x, add_bos=add_bos))
        for c, x in zip(q.contexts, q.continuations)
    ]
    np.testing.assert_allclose(record.logliks, expected, atol=1e-4, rtol=0)
    assert record.prediction("raw") == int(np.argmax(expected))
    assert record.num_chars == tuple(len(x) for x in q.continuations)


def test_normalisations_rank_as_defined():
  record = loglik.ChoiceRecord(0, "q", 1, (-4.0, -6.0), num_tokens=(1, 4), num_chars=(2, 12))
  assert record.prediction("raw") == 0  # -4 > -6
  assert record.prediction("token") == 1  # -4/1 < -6/4
  assert record.prediction("char") == 1  # -2 < -0.5
  result = loglik.LoglikResult("t", (record,), normalization="raw")
  assert result.accuracy == 0.0 and result.accuracies == {"raw": 0.0, "char": 1.0, "token": 1.0}


def test_char_and_token_normalisations_divide_by_their_own_counts():
  """Counts under which dividing by characters and by tokens pick different choices (and raw a
  third): ``char`` must not divide by tokens, nor ``token`` by characters."""
  record = loglik.ChoiceRecord(
      0, "q", 2, (-2.0, -6.0, -9.0), num_tokens=(1, 6, 3), num_chars=(2, 6, 36)
  )
  assert record.prediction("raw") == 0  # -2 > -6 > -9
  assert record.prediction("token") == 1  # -2/1, -6/6, -9/3: -1 is the largest
  assert record.prediction("char") == 2  # -2/2, -6/6, -9/36: -0.25 is the largest
  result = loglik.LoglikResult("t", (record,))
  assert result.accuracies == {"raw": 0.0, "char": 1.0, "token": 0.0}


# Continuations whose characters and tokens rank in opposite orders: a word in the tokenizer's
# vocabulary (many characters, one or two tokens) next to characters it never saw (one byte token
# each, few characters per token).
CHAR_VS_TOKEN = [
    ChoiceQuestion(f"counts {i}", ("Please choose the correct answer:",) * 3, choices, 0)
    for i, choices in enumerate(
        [
            (" appropriately", " ¿¡", " Natalia"),
            (" ¿¡ÿ", " instruction", " §"),
            (" response", " ØÞ", " the"),
            (" ÆÐ", " altogether", " ñ"),
        ]
    )
]


def test_char_and_token_normalisations_equal_the_reference_on_real_tokens(tiny):
  """Through ``evaluate_choices``: each normalisation's prediction is the argmax of transformers'
  log-likelihoods divided by the continuation's characters (``char``) or tokens (``token``), on
  questions where the two divisions pick different choices."""
  model, tok, reference = tiny
  result = loglik.evaluate_choices(model, tok, CHAR_VS_TOKEN, "t", batch_size=2)
  differ = 0
  for q, record in zip(CHAR_VS_TOKEN, result.records):
    pairs = [
        loglik.encode_pair(tok, c, x, add_bos=False) for c, x in zip(q.contexts, q.continuations)
    ]
    ll = np.asarray([torch_loglik(reference, *pair) for pair in pairs])
    chars = np.asarray([len(x) for x in q.continuations])
    tokens = np.asarray([len(cont) for _, cont in pairs])
    by_char, by_token = int(np.argmax(ll / chars)), int(np.argmax(ll / tokens))
    assert record.prediction("char") == by_char, q.id
    assert record.prediction("token") == by_token, q.id
    differ += by_char != by_token
  assert differ >= 2  # the questions tell the two divisions apart


def test_encode_pair_moves_trailing_space_and_splits_the_whole_text():
  tok = build_tiny_tokenizer()
  ctx, cont = loglik.encode_pair(tok, "The answer is ", "true", add_bos=False)
  assert ctx == tok("The answer is").input_ids
  assert ctx + cont == tok("The answer is true").input_ids
  assert loglik.encode_pair(tok, "", "true", add_bos=False)[0] == [tok.eos_token_id]
  assert loglik.encode_pair(tok, "", "true", add_bos=True)[0] == [tok.bos_token_id]


def test_one_program_per_length_bucket_not_per_batch(tiny):
  model, tok, _ = tiny
  questions = [
      ChoiceQuestion(str(i), (f"Question {i} about the fox?\nAnswer:",) * 2, (" yes", " no"), 0)
      for i in range(12)
  ]
  before = loglik.TRACE_COUNTS["score"]
  loglik.evaluate_choices(model, tok, questions, "t", batch_size=2)  # 6 batches, one bucket
  assert loglik.TRACE_COUNTS["score"] - before == 1
  loglik.evaluate_choices(model, tok, questions[:4], "t", batch_size=2)  # same shapes again
  assert loglik.TRACE_COUNTS["score"] - before == 1


def test_bucket_width_ladder():
  assert [loglik.bucket_width(n) for n in (1, 16, 17, 33, 49, 65, 100, 129, 300)] == [
      16,
      16,
      32,
      48,
      64,
      96,
      128,
      192,
      368,
  ]
  for n in range(1, 2000, 7):
    assert n <= loglik.bucket_width(n) <= max(16, 1.5 * n)


def test_bad_questions_name_the_problem(tiny):
  model, tok, _ = tiny
  empty = ChoiceQuestion("q7", ("Answer:",) * 2, (" yes", ""), 0)
  with pytest.raises(ValueError, match=r"question q7: choice 1 .* has no tokens"):
    loglik.evaluate_choices(model, tok, [empty], "t", batch_size=2)
  bad_gold = ChoiceQuestion("q8", ("Answer:",) * 2, (" yes", " no"), 2)
  with pytest.raises(ValueError, match="question q8: gold 2 out of range"):
    loglik.evaluate_choices(model, tok, [bad_gold], "t", batch_size=2)
  with pytest.raises(ValueError, match="normalization must be one of"):
    loglik.evaluate_choices(model, tok, QUESTIONS, "t", batch_size=2, normalization="byte")
