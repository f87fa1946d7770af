"""Tests for anlr_jax.data: formats/templates, response-only loss masks, truncation, errors, batching."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from anlr_jax.data import (
    BatchSource,
    DataFormatError,
    LengthBucketedSource,
    make_source,
    read_examples,
    tokenize_examples,
)
from tests.helpers.tiny_llama import tiny_llama_config
from tests.tiny_tokenizer import build_tiny_tokenizer

PRE = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
)
PRE_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further "
    "context. Write a response that appropriately completes the request.\n\n"
)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
  return build_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


def write_jsonl(path, records):
  path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")
  return path


def masked_and_unmasked(tok, ids, mask):
  """Decodes the loss-masked tokens and the prompt tokens (everything else after bos)."""
  ids, mask = np.asarray(ids), np.asarray(mask)
  assert ids[0] == tok.bos_token_id and mask[0] == 0
  return tok.decode(ids[mask == 1].tolist()), tok.decode(ids[1:][mask[1:] == 0].tolist())


# (record, expected format, expected prompt, expected response)
SINGLE_TURN_CASES = [
    (
        {
            "instruction": "Is the sky blue?",
            "input": "",
            "output": "the correct answer is true",
            "answer": "true",
        },
        "commonsense",
        PRE + "### Instruction:\nIs the sky blue?\n\n### Response:\n",
        "the correct answer is true",
    ),
    (
        {"query": "What is 2+3?", "response": "2+3=5. The answer is: 5", "type": "GSM_Rephrased"},
        "metamath",
        PRE + "### Instruction:\nWhat is 2+3?\n\n### Response:\n",
        "2+3=5. The answer is: 5",
    ),
    (
        {"instruction": "Translate.", "input": "bonjour", "output": "hello"},
        "alpaca",
        PRE_INPUT + "### Instruction:\nTranslate.\n\n### Input:\nbonjour\n\n### Response:\n",
        "hello",
    ),
    (
        {"instruction": "Say hi.", "output": "Hi there!"},
        "alpaca",
        PRE + "### Instruction:\nSay hi.\n\n### Response:\n",
        "Hi there!",
    ),
    ({"prompt": "Q: 1+1=\nA:", "completion": " 2"}, "completion", "Q: 1+1=\nA:", " 2"),
]


@pytest.mark.parametrize(
    "record,fmt,prompt,response", SINGLE_TURN_CASES, ids=[c[1] for c in SINGLE_TURN_CASES]
)
def test_single_turn_template_and_loss_mask(tmp_path, tok, record, fmt, prompt, response):
  read = read_examples(write_jsonl(tmp_path / "d.jsonl", [record]))
  assert read.format == fmt and read.skipped == 0
  (example,) = read.examples
  assert example.turns == ((prompt, response),)
  tokenized = tokenize_examples(read.examples, tok, max_length=512)
  masked, unmasked = masked_and_unmasked(tok, tokenized.input_ids[0], tokenized.loss_mask[0])
  assert masked == response + tok.eos_token
  assert unmasked == prompt
  assert tokenized.input_ids[0].dtype == np.int32 and tokenized.loss_mask[0].dtype == np.float32


def test_code_feedback_multi_turn_loss_on_every_assistant_turn(tmp_path, tok):
  record = {
      "id": 7,
      "messages": [
          {"role": "system", "content": "You are a coder."},
          {"role": "user", "content": "Write add."},
          {"role": "assistant", "content": "def add(a, b):\n    return a + b"},
          {"role": "user", "content": "Now test it."},
          {"role": "assistant", "content": "assert add(1, 2) == 3"},
          {"role": "user", "content": "trailing question without an answer"},
      ],
  }
  read = read_examples(write_jsonl(tmp_path / "cf.jsonl", [record]))
  assert read.format == "messages"
  assert read.examples[0].turns == (
      (
          "You are a coder.\n\n### Instruction:\nWrite add.\n\n### Response:\n",
          "def add(a, b):\n    return a + b",
      ),
      ("### Instruction:\nNow test it.\n\n### Response:\n", "assert add(1, 2) == 3"),
  )
  t = tokenize_examples(read.examples, tok, max_length=512)
  ids, mask = t.input_ids[0], t.loss_mask[0]
  masked, unmasked = masked_and_unmasked(tok, ids, mask)
  assert masked == "def add(a, b):\n    return a + b</s>assert add(1, 2) == 3</s>"
  assert "trailing question" not in tok.decode(ids.tolist())
  # two masked spans, each ending in eos
  assert np.sum(np.diff(np.concatenate([[0], mask])) == 1) == 2
  assert np.all(ids[mask == 1][[-1]] == tok.eos_token_id)
  assert np.sum(ids == tok.eos_token_id) == 2


def test_sharegpt_and_explicit_format(tmp_path, tok):
  path = write_jsonl(
      tmp_path / "w.jsonl",
      [{"conversations": [{"from": "human", "value": "Hello?"}, {"from": "gpt", "value": "Hi."}]}],
  )
  read = read_examples(path)
  assert read.format == "sharegpt"
  assert read.examples[0].turns == ((PRE + "### Instruction:\nHello?\n\n### Response:\n", "Hi."),)
  # a commonsense record read as plain alpaca gives the same turns; an incompatible format names the key
  cs = write_jsonl(tmp_path / "cs.jsonl", [SINGLE_TURN_CASES[0][0]])
  assert read_examples(cs, format="alpaca").examples == read_examples(cs).examples
  with pytest.raises(DataFormatError, match=r"cs\.jsonl:1: missing key 'query'"):
    read_examples(cs, format="metamath")
  with pytest.raises(ValueError, match="format must be one of"):
    read_examples(cs, format="nope")


def test_json_list_file_reports_line_of_the_bad_record(tmp_path):
  good = {"instruction": "a", "output": "b"}
  text = "[\n" + json.dumps(good) + ",\n" + json.dumps(good) + ',\n{"instruction": "c"}\n]\n'
  path = tmp_path / "list.json"
  path.write_text(text)
  with pytest.raises(DataFormatError, match=r"list\.json:4: missing key 'output'"):
    read_examples(path)
  result = read_examples(path, on_error="skip")
  assert len(result.examples) == 2 and result.skipped == 1 and result.skipped_records[0][0] == 4
  assert [e.source_line for e in result.examples] == [2, 3]
  path.write_text("[\n" + json.dumps(good) + ',\n{"instruction": "c",,}\n]')
  with pytest.raises(DataFormatError, match=r"list\.json:3: invalid JSON"):
    read_examples(path, on_error="skip")


def test_malformed_jsonl_lines_raise_with_file_and_line_or_are_counted(tmp_path):
  good = {"instruction": "q", "output": "a"}
  path = write_jsonl(
      tmp_path / "bad.jsonl",
      [
          good,
          "{not json",
          good,
          {"instruction": "q", "output": 3},
          "",  # blank lines are ignored, but still counted in line numbers
          "[1, 2]",
          {"instruction": "q", "output": "   "},
          good,
      ],
  )
  with pytest.raises(DataFormatError, match=r"bad\.jsonl:2: invalid JSON"):
    read_examples(path)
  result = read_examples(path, on_error="skip")
  assert result.skipped == 4
  assert [line for line, _ in result.skipped_records] == [2, 4, 6, 7]
  assert "must be a string" in result.skipped_records[1][1]
  assert "must be a JSON object" in result.skipped_records[2][1]
  assert "is empty" in result.skipped_records[3][1]
  assert [e.source_line for e in result.examples] == [1, 3, 8]
  with pytest.raises(
      DataFormatError, match=r"x\.jsonl:1: cannot detect the format from keys \['foo'\]"
  ):
    read_examples(write_jsonl(tmp_path / "x.jsonl", [{"foo": 1}]))
  with pytest.raises(DataFormatError, match=r"m\.jsonl:1: messages\[1\]\.role is 'bot'"):
    read_examples(
        write_jsonl(
            tmp_path / "m.jsonl",
            [{"messages": [{"role": "user", "content": "x"}, {"role": "bot", "content": "y"}]}],
        )
    )
  with pytest.raises(ValueError, match="on_error"):
    read_examples(path, on_error="ignore")
  with pytest.raises(FileNotFoundError, match="missing.jsonl"):
    read_examples(tmp_path / "missing.jsonl")


def test_truncation_keeps_prompt_start_and_drops_fully_cut_responses(tmp_path, tok):
  records = [
      {"instruction": "Say hi.", "output": "Hi there, how are you today?"},
      {"instruction": "word " * 200, "output": "lost"},
  ]
  read = read_examples(write_jsonl(tmp_path / "t.jsonl", records))
  full = tokenize_examples(read.examples[:1], tok, max_length=4096)
  n_prompt = int(np.argmax(full.loss_mask[0] == 1))
  limit = n_prompt + 3
  cut = tokenize_examples(read.examples, tok, max_length=limit)
  assert (cut.truncated, cut.dropped, len(cut)) == (2, 1, 1)
  np.testing.assert_array_equal(cut.input_ids[0], full.input_ids[0][:limit])
  np.testing.assert_array_equal(cut.loss_mask[0], full.loss_mask[0][:limit])
  assert cut.loss_mask[0].sum() == 3 and cut.input_ids[0][-1] != tok.eos_token_id
  with pytest.raises(ValueError, match="max_length"):
    tokenize_examples(read.examples, tok, max_length=1)


def make_varied_file(path, n, seed=0):
  rng = random.Random(seed)
  words = ["alpha", "beta", "gamma", "delta", "the", "answer", "is", "7", "clips"]
  records = [
      {
          "instruction": f"item {i}: " + " ".join(rng.choices(words, k=rng.randint(1, 40))),
          "output": " ".join(rng.choices(words, k=rng.randint(1, 20))),
      }
      for i in range(n)
  ]
  return write_jsonl(path, records)


@pytest.fixture(scope="module")
def varied_path(tmp_path_factory):
  return make_varied_file(tmp_path_factory.mktemp("data") / "varied.jsonl", 45)


def source(path, tok, **kw):
  kw = {"max_length": 256, "global_batch": 8, "seed": 3, "pad_multiple": 8, "pool_batches": 4} | kw
  return make_source(path, tok, **kw)


def test_batch_contract_shapes_dtypes_and_masks(varied_path, tok):
  src = source(varied_path, tok)
  assert isinstance(src, BatchSource) and len(src) == 6  # ceil(45 / 8)
  for step in range(len(src)):
    batch = src.get_batch(step)
    assert set(batch) == {"input_ids", "attention_mask", "loss_mask"}
    assert batch["input_ids"].dtype == np.int32 and batch["attention_mask"].dtype == np.int32
    assert batch["loss_mask"].dtype == np.float32
    b, t = batch["input_ids"].shape
    assert b == 8 and t % 8 == 0
    ids = src.batch_example_ids(step)
    lengths = src.examples.lengths[np.where(ids >= 0, ids, ids[0])]
    assert t == -(-lengths.max() // 8) * 8
    np.testing.assert_array_equal(batch["attention_mask"].sum(1), lengths)
    # right padding: mask is 1...1 0...0; pad id where mask is 0; no loss on padding
    am = batch["attention_mask"]
    assert np.all(np.diff(am, axis=1) <= 0)
    assert np.all(batch["input_ids"][am == 0] == tok.pad_token_id)
    assert np.all(batch["loss_mask"][am == 0] == 0)
    for r, example in enumerate(ids):
      if example >= 0:
        np.testing.assert_array_equal(
            batch["input_ids"][r, : lengths[r]], src.examples.input_ids[example]
        )
        np.testing.assert_array_equal(
            batch["loss_mask"][r, : lengths[r]], src.examples.loss_mask[example]
        )
      else:  # filler row: a real sequence that carries no loss
        assert batch["loss_mask"][r].sum() == 0 and am[r].sum() > 0


def test_every_example_once_per_epoch_deterministic_and_resumable(varied_path, tok):
  src = source(varied_path, tok)
  n, steps = src.num_examples, len(src)
  epochs = []
  for epoch in range(3):
    ids = np.concatenate([src.batch_example_ids(epoch * steps + k) for k in range(steps)])
    assert np.count_nonzero(ids < 0) == steps * 8 - n
    np.testing.assert_array_equal(np.sort(ids[ids >= 0]), np.arange(n))
    epochs.append(ids)
  assert not np.array_equal(epochs[0], epochs[1]) and not np.array_equal(epochs[1], epochs[2])
  # a fresh source resumes at any step from the step number alone
  fresh = source(varied_path, tok)
  for step in (13, 2, steps * 2 + 1):
    for key, value in src.get_batch(step).items():
      np.testing.assert_array_equal(fresh.get_batch(step)[key], value)
  other_seed = source(varied_path, tok, seed=4)
  assert not np.array_equal(other_seed.epoch_plan(0), src.epoch_plan(0))


def test_rows_split_across_processes(varied_path, tok):
  src = source(varied_path, tok)
  for step in (0, 5, 7):
    whole = src.get_batch(step)
    for count in (2, 4, 8):
      parts = [src.get_batch(step, process_index=p, process_count=count) for p in range(count)]
      for key in whole:
        assert parts[0][key].shape == (8 // count, whole[key].shape[1])
        np.testing.assert_array_equal(np.concatenate([p[key] for p in parts]), whole[key])
  with pytest.raises(ValueError, match="process_count=3"):
    src.get_batch(0, process_count=3)
  with pytest.raises(ValueError, match="process_index"):
    src.get_batch(0, process_index=2, process_count=2)
  with pytest.raises(ValueError, match="step"):
    src.get_batch(-1)


def test_length_bucketing_reduces_padding(tmp_path, tok):
  path = make_varied_file(tmp_path / "many.jsonl", 160, seed=1)

  def padding_fraction(src):
    real = total = 0
    for step in range(len(src)):
      am = src.get_batch(step)["attention_mask"]
      real, total = real + am.sum(), total + am.size
    return 1 - real / total

  unbucketed = padding_fraction(source(path, tok, pool_batches=1, pad_multiple=1))
  bucketed = padding_fraction(source(path, tok, pool_batches=20, pad_multiple=1))
  assert bucketed < 0.5 * unbucketed


def test_bad_source_arguments(varied_path, tok):
  with pytest.raises(ValueError, match="global_batch"):
    source(varied_path, tok, global_batch=0)
  with pytest.raises(ValueError, match="seed"):
    source(varied_path, tok, seed=-1)
  tokenized = source(varied_path, tok).examples
  with pytest.raises(ValueError, match="max_length=4"):
    LengthBucketedSource(tokenized, global_batch=2, seed=0, pad_id=0, max_length=4)


def test_loss_mask_matches_hf_labels_loss(varied_path, tok):
  """The contract's loss (logits[:, :-1] vs input_ids[:, 1:], weighted by loss_mask[:, 1:]) equals the
  transformers loss with labels = input_ids on response tokens and -100 elsewhere."""
  import torch
  import transformers

  torch.manual_seed(0)
  config = tiny_llama_config(  # smaller still, transformers' default norm eps and special ids
      len(tok),
      hidden_size=16,
      intermediate_size=32,
      num_hidden_layers=1,
      num_attention_heads=2,
      num_key_value_heads=1,
      rms_norm_eps=1e-6,
      pad_token_id=None,
  )
  model = transformers.LlamaForCausalLM(config).eval()
  batch = source(varied_path, tok, global_batch=4).get_batch(1)
  ids = torch.tensor(batch["input_ids"], dtype=torch.long)
  attention = torch.tensor(batch["attention_mask"])
  labels = torch.where(torch.tensor(batch["loss_mask"]) == 1, ids, torch.full_like(ids, -100))
  with torch.no_grad():
    out = model(input_ids=ids, attention_mask=attention, labels=labels)
  logits = out.logits.double().numpy()
  logp = (
      logits
      - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
      - logits.max(-1, keepdims=True)
  )
  target = batch["input_ids"][:, 1:]
  nll = -np.take_along_axis(logp[:, :-1], target[..., None], axis=-1)[..., 0]
  weights = batch["loss_mask"][:, 1:]
  np.testing.assert_allclose(float(out.loss), (nll * weights).sum() / weights.sum(), rtol=1e-5)
