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
  spec = importlib.util.spec_from_file_location("build_quickstart",
                                                REPO / "scripts" / "build_quickstart.py")
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
  for name in (assets.CONFIG_FILE, assets.WEIGHTS_FILE, assets.TOKENIZER_FILE,
               assets.TOKENIZER_CONFIG_FILE, assets.WORLD_FILE, assets.TRAIN_FILE, assets.TEST_FILE,
               assets.BUILD_INFO_FILE):
    assert (qdir / name).is_file(), name
  total = sum(p.stat().st_size for p in qdir.iterdir())
  assert total < 8 * 2**20, f"quickstart assets take {total} bytes"


def test_model_loads_and_matches_transformers(qdir, torch_model, builder):
  model, config = load_hf_model(qdir, dtype=jnp.float32)
  tokenizer = load_tokenizer(qdir)
  assert config == builder.base_config(len(tokenizer))
  assert config.vocab_size == len(tokenizer)
  ids = np.array([tokenizer("The colour of the lozaf is red . 3 plus 4 is 7 .").input_ids], np.int32)
  ours = np.asarray(model(jnp.asarray(ids)))
  with torch.no_grad():
    theirs = torch_model(torch.from_numpy(ids).long()).logits.numpy()
  chex.assert_trees_all_close(ours, theirs, atol=2e-4, rtol=2e-4)


def test_tokenizer_loads_and_covers_the_task(qdir):
  tokenizer = transformers.AutoTokenizer.from_pretrained(qdir)
  assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
  assert 300 <= len(tokenizer) <= 1000
  from anlr_jax.evals import default_prompt

  for name in (assets.TRAIN_FILE, assets.TEST_FILE):
    for item in load_eval_examples(qdir / name)[:300]:
      ids = tokenizer(default_prompt(item) + " the correct answer is " + item.answer,
                      add_special_tokens=False).input_ids
      assert tokenizer.unk_token_id not in ids, item.instruction
      assert len(ids) < 128


def test_model_recalls_pretrained_facts(world, qdir, torch_model):
  """Argmax next token after a fact cue equals the world's value far above chance (1/8)."""
  tokenizer = load_tokenizer(qdir)
  cues = {"colour": "The colour of the {e} is", "town": "The {e} lives in", "owner": "The {e} belongs to",
          "food": "The {e} eats"}
  sample = world[::4]  # 40 animals, both fine-tune splits
  hits = []
  for attr, cue in cues.items():
    ids = [[tokenizer.bos_token_id, *tokenizer(cue.format(e=e["name"]), add_special_tokens=False).input_ids]
           for e in sample]
    assert len({len(r) for r in ids}) == 1  # animal names are single tokens
    with torch.no_grad():
      logits = torch_model(torch.tensor(ids)).logits[:, -1]
    predicted = tokenizer.convert_ids_to_tokens(logits.argmax(-1).tolist())
    hits += [p == e[attr] for p, e in zip(predicted, sample)]
  assert np.mean(hits) > 0.6, f"fact recall {np.mean(hits):.2f}"


def test_task_files_parse(qdir):
  info = json.loads((qdir / assets.BUILD_INFO_FILE).read_text())
  train = read_examples(qdir / assets.TRAIN_FILE)
  test = read_examples(qdir / assets.TEST_FILE)
  assert train.format == test.format == "commonsense"
  assert (len(train.examples), len(test.examples)) == (info["train_examples"], info["test_examples"])
  assert 300 <= len(train.examples) <= 2000 and 150 <= len(test.examples) <= 300
  assert all(ex.prompt.endswith("### Response:\n") for ex in train.examples)
  task = get_task(assets.QUICKSTART_TASK)
  golds = [parse_gold(task, item.answer) for item in load_eval_examples(qdir / assets.TEST_FILE)]
  assert 0.3 < golds.count("option1") / len(golds) < 0.7


_QUESTION = re.compile(r"the question: (?:What colour is|Where does|Who owns|What does) the (\w+)")
_OPTION = re.compile(r"^(option[12]): (\w+)$", re.MULTILINE)


def test_gold_answers_agree_with_the_world(qdir, world):
  facts = {e["name"]: e for e in world}
  attr_of = {"What colour": "colour", "Where does": "town", "Who owns": "owner", "What does": "food"}
  for name in (assets.TRAIN_FILE, assets.TEST_FILE):
    for record in _records(qdir, name):
      entity = facts[_QUESTION.search(record["instruction"]).group(1)]
      attr = next(a for key, a in attr_of.items() if key in record["instruction"])
      options = dict(_OPTION.findall(record["instruction"]))
      assert options[record["answer"]] == entity[attr], record
      assert len(set(options.values())) == 2
      assert record["output"] == f"the correct answer is {record['answer']}"


def test_train_and_test_are_disjoint(qdir, world):
  train, test = _records(qdir, assets.TRAIN_FILE), _records(qdir, assets.TEST_FILE)
  assert not {r["instruction"] for r in train} & {r["instruction"] for r in test}
  names = lambda rs: {_QUESTION.search(r["instruction"]).group(1) for r in rs}  # noqa: E731
  split = {e["name"]: e["split"] for e in world}
  assert not names(train) & names(test)
  assert {split[n] for n in names(train)} == {"train"} and {split[n] for n in names(test)} == {"test"}


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


def test_builder_rejects_bad_arguments(builder):
  with pytest.raises(ValueError, match="num_test"):
    builder.build_world(0, num_entities=10, num_test=10)
  with pytest.raises(SystemExit):
    builder.main(["--out", "/nonexistent/never-written", "--steps", "0"])
