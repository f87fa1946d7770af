"""The shipped quickstart assets: model, tokenizer, task files, and their reproducibility.

References are independent of the code under test: transformers/torch for the model's logits and
fact recall, `anlr_jax.data` / `anlr_jax.evals` readers for the files, the world facts for the gold
answers, and the builder's pure data functions (re-run in memory, no pretraining) for determinism.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import re
import sys

import chex
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from anlr_jax import assets
from anlr_jax.data import read_examples
from anlr_jax.evals import get_task, load_eval_examples, parse_gold
from anlr_jax.models.hf_io import load_hf_model, load_tokenizer

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def builder():
  spec = importlib.util.spec_from_file_location(
      "build_quickstart", REPO / "scripts" / "build_quickstart.py"
  )
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # dataclasses resolve their module by name
  spec.loader.exec_module(module)
  return module


@pytest.fixture(scope="module")
def qdir() -> pathlib.Path:
  return assets.quickstart_dir()


@pytest.fixture(scope="module")
def world(qdir):
  return json.loads((qdir / assets.WORLD_FILE).read_text())


@pytest.fixture(scope="module")
def torch_model(qdir):
  model = transformers.LlamaForCausalLM.from_pretrained(qdir, dtype=torch.float32)
  return model.eval()


def _records(qdir, name):
  return json.loads((qdir / name).read_text())


def test_asset_files_exist_and_are_small(qdir):
  for name in (
      assets.CONFIG_FILE,
      assets.WEIGHTS_FILE,
      assets.TOKENIZER_FILE,
      assets.TOKENIZER_CONFIG_FILE,
      assets.WORLD_FILE,
      assets.TRAIN_FILE,
      assets.TEST_FILE,
      assets.BUILD_INFO_FILE,
  ):
    assert (qdir / name).is_file(), name
  total = sum(p.stat().st_size for p in qdir.iterdir())
  assert total < 8 * 2**20, f"quickstart assets take {total} bytes"


def test_model_loads_and_matches_transformers(qdir, torch_model, builder):
  model, config = load_hf_model(qdir, dtype=jnp.float32)
  tokenizer = load_tokenizer(qdir)
  assert config == builder.base_config(len(tokenizer))
  assert config.vocab_size == len(tokenizer)
  ids = np.array(
      [tokenizer("The colour of the lozaf is red . 3 plus 4 is 7 .").input_ids], np.int32
  )
  ours = np.asarray(model(jnp.asarray(ids)))
  with torch.no_grad():
    theirs = torch_model(torch.from_numpy(ids).long()).logits.numpy()
  chex.assert_trees_all_close(ours, theirs, atol=2e-4, rtol=2e-4)


def test_tokenizer_loads_and_covers_the_task(qdir):
  """Every word of every prompt and answer is in the fixed vocabulary; prompt + answer fit in 128."""
  tokenizer = transformers.AutoTokenizer.from_pretrained(qdir)
  assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
  assert 300 <= len(tokenizer) <= 1000
  from anlr_jax.evals import default_prompt

  vocab = tokenizer.get_vocab()
  for name in (assets.TRAIN_FILE, assets.TEST_FILE):
    for item in load_eval_examples(qdir / name):
      text = default_prompt(item) + item.answer
      assert set(re.findall(r"\w+|[^\w\s]+", text)) <= set(vocab), item.instruction
      ids = tokenizer(text, add_special_tokens=False).input_ids
      assert tokenizer.unk_token_id not in ids, item.instruction
      assert len(ids) + 2 <= 128  # bos and eos too
      assert len(tokenizer(item.answer, add_special_tokens=False).input_ids) == 1


def test_model_recalls_pretrained_facts(world, qdir, torch_model):
  """Argmax next token after a fact cue equals the world's value far above chance (1/8)."""
  tokenizer = load_tokenizer(qdir)
  cues = {
      "colour": "The colour of the {e} is",
      "town": "The {e} lives in",
      "owner": "The {e} belongs to",
      "food": "The {e} eats",
  }
  sample = world[::4]  # 40 animals, both fine-tune splits
  hits = []
  for attr, cue in cues.items():
    ids = [
        [
            tokenizer.bos_token_id,
            *tokenizer(cue.format(e=e["name"]), add_special_tokens=False).input_ids,
        ]
        for e in sample
    ]
    assert len({len(r) for r in ids}) == 1  # animal names are single tokens
    with torch.no_grad():
      logits = torch_model(torch.tensor(ids)).logits[:, -1]
    predicted = tokenizer.convert_ids_to_tokens(logits.argmax(-1).tolist())
    hits += [p == e[attr] for p, e in zip(predicted, sample)]
  assert np.mean(hits) > 0.6, f"fact recall {np.mean(hits):.2f}"


def test_task_files_parse(qdir):
  info = json.loads((qdir / assets.BUILD_INFO_FILE).read_text())
  assert info["task"] == assets.QUICKSTART_TASK == "exact_match"
  train = read_examples(qdir / assets.TRAIN_FILE)
  test = read_examples(qdir / assets.TEST_FILE)
  assert train.format == test.format == "commonsense"
  assert (len(train.examples), len(test.examples)) == (
      info["train_examples"],
      info["test_examples"],
  )
  assert 300 <= len(train.examples) <= 2000 and 150 <= len(test.examples) <= 300
  assert all(ex.prompt.endswith("### Response:\n") for ex in train.examples)
  assert all(
      ex.response == rec["answer"]
      for ex, rec in zip(train.examples, _records(qdir, assets.TRAIN_FILE))
  )
  task = get_task(assets.QUICKSTART_TASK)
  golds = [parse_gold(task, item.answer) for item in load_eval_examples(qdir / assets.TEST_FILE)]
  assert max(golds.count(g) for g in set(golds)) / len(golds) < 0.2  # no answer dominates


_ANIMAL = re.compile(r"\bthe (\w+)\?$")
_ATTRIBUTE_WORDS = (
    ("colour", "colour"),
    ("Where", "town"),
    ("Who", "owner"),
    ("eat", "food"),
    ("food", "food"),
)
"""First keyword of the question found here -> the attribute it asks about (independent of the
builder's templates)."""


def _asked(record, facts):
  """(animal record, attribute) a task record asks about, read from its instruction."""
  question = record["instruction"].split(": ", 1)[1]
  name = _ANIMAL.search(question) or re.search(r"\bthe (\w+) (?:live|eat)\?$", question)
  attr = next(a for word, a in _ATTRIBUTE_WORDS if re.search(rf"\b{word}\b", question))
  return facts[name.group(1)], attr


def test_gold_answers_agree_with_the_world(qdir, world):
  facts = {e["name"]: e for e in world}
  for name in (assets.TRAIN_FILE, assets.TEST_FILE):
    records = _records(qdir, name)
    for record in records:
      entity, attr = _asked(record, facts)
      assert record["answer"] == record["output"] == entity[attr], record
      assert record["input"] == ""
      assert get_task(assets.QUICKSTART_TASK).kind == "exact"
    # several phrasings per attribute
    questions = {re.sub(r"\b(%s)\b" % "|".join(facts), "X", r["instruction"]) for r in records}
    assert len(questions) >= (12 if name == assets.TRAIN_FILE else 8), questions


def test_train_and_test_are_disjoint(qdir, world):
  facts = {e["name"]: e for e in world}
  train, test = _records(qdir, assets.TRAIN_FILE), _records(qdir, assets.TEST_FILE)
  assert not {r["instruction"] for r in train} & {r["instruction"] for r in test}
  names = lambda rs: {_asked(r, facts)[0]["name"] for r in rs}  # noqa: E731
  split = {e["name"]: e["split"] for e in world}
  assert not names(train) & names(test)
  assert {split[n] for n in names(train)} == {"train"} and {split[n] for n in names(test)} == {
      "test"
  }
  # every (test animal, attribute) is asked
  asked = {(e["name"], a) for e, a in (_asked(r, facts) for r in test)}
  assert asked == {(n, a) for n in names(test) for a in ("colour", "town", "owner", "food")}
  assert len(names(test)) == sum(s == "test" for s in split.values())


def test_data_generation_is_deterministic(qdir, builder):
  seed = json.loads((qdir / assets.BUILD_INFO_FILE).read_text())["seed"]
  assert seed == assets.QUICKSTART_SEED
  world = builder.build_world(seed)
  train, test = builder.build_task(world, seed)
  assert builder.world_records(world) == _records(qdir, assets.WORLD_FILE)
  assert train == _records(qdir, assets.TRAIN_FILE)
  assert test == _records(qdir, assets.TEST_FILE)
  assert builder.build_tokenizer(world).get_vocab() == load_tokenizer(qdir).get_vocab()
  docs = builder.pretraining_documents(world, seed, 50)
  assert docs == builder.pretraining_documents(builder.build_world(seed), seed, 50)
  assert builder.build_task(builder.build_world(seed + 1), seed + 1)[1] != test
  assert builder.build_task(world, seed) == (train, test)  # pure: a second call agrees


def test_task_only_rewrites_identical_files_and_rejects_unknown_words(qdir, builder, tmp_path):
  """`--task-only` on a copy of the tokenizer reproduces the shipped task files byte for byte."""
  for name in (assets.TOKENIZER_FILE, assets.TOKENIZER_CONFIG_FILE):
    (tmp_path / name).write_bytes((qdir / name).read_bytes())
  builder.main(["--out", str(tmp_path), "--task-only"])
  for name in (assets.WORLD_FILE, assets.TRAIN_FILE, assets.TEST_FILE):
    assert (tmp_path / name).read_bytes() == (qdir / name).read_bytes(), name
  info = json.loads((tmp_path / assets.BUILD_INFO_FILE).read_text())
  shipped = json.loads((qdir / assets.BUILD_INFO_FILE).read_text())
  for key in ("task", "train_examples", "test_examples", "instruction", "question_templates"):
    assert info[key] == shipped[key], key
  tokenizer = load_tokenizer(qdir)
  bad = [
      {
          "instruction": "Please answer the question: What hue is the lozaf?",
          "input": "",
          "output": "red",
          "answer": "red",
      }
  ]
  with pytest.raises(ValueError, match=r"probe\[0\].*prompt.*vocabulary"):
    builder.check_task_vocabulary(bad, tokenizer, "probe")
  long = [dict(bad[0], instruction="What colour is the lozaf ?" * 20)]
  with pytest.raises(ValueError, match=r"probe\[0\].*context"):
    builder.check_task_vocabulary(long, tokenizer, "probe")


def test_builder_rejects_bad_arguments(builder):
  with pytest.raises(ValueError, match="num_test"):
    builder.build_world(0, num_entities=10, num_test=10)
  with pytest.raises(SystemExit):
    builder.main(["--out", "/nonexistent/never-written", "--steps", "0"])
  with pytest.raises(SystemExit):  # --task-only and --check-only exclude each other
    builder.main(["--out", "/nonexistent/never-written", "--task-only", "--check-only"])
  with pytest.raises(FileNotFoundError, match="tokenizer"):
    builder.main(["--out", "/nonexistent/never-written", "--task-only"])
