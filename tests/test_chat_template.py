"""`data.template: chat`: training turns, loss masks and eval prompts in the tokenizer's chat
template, the end-of-turn token as the loss target and the decoding stop; on a tiny ChatML tokenizer
(built here) and a tiny random LLaMA through `anlr_jax.app.train.train_run`."""

import json

import numpy as np
import pytest
import yaml

import anlr_jax.app.evaluate
from anlr_jax.app.config import ConfigError, load_config
from anlr_jax.data import (
    chat_prompt,
    chat_turns,
    end_of_turn_id,
    make_source,
    read_examples,
    tokenize_examples,
)
from anlr_jax.evals import EvalExample, template_prompt_fn
from anlr_jax.app.evaluate import eval_run, generate_text, make_generate_fn
from anlr_jax.app.train import train_run
from tests.helpers.tiny_llama import save_tiny_llama
from tests.helpers.tiny_chat import CHATML, chat_tokenizer
from tests.tiny_tokenizer import build_tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
  return chat_tokenizer()


def enc(tok, text):
  return tok(text, add_special_tokens=False).input_ids


def test_end_of_turn_is_the_templates_special_token_not_eos(tok):
  start, end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
  assert (start, end) == (400, 401) and tok.eos_token_id == 2
  assert end_of_turn_id(tok) == end
  plain = build_tiny_tokenizer()  # a template that writes no special token after the answer
  plain.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
  assert end_of_turn_id(plain) == plain.eos_token_id


def test_single_turn_ids_and_loss_mask_are_exact(tok, tmp_path):
  record = {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"}
  (tmp_path / "a.json").write_text(json.dumps([record]))
  (example,) = read_examples(tmp_path / "a.json").examples
  assert example.messages == (("user", "Add the numbers.\n\n2 and 3"), ("assistant", "5"))
  (turn,) = chat_turns(tok, example.messages)
  assert turn == (
      "<|im_start|>user\nAdd the numbers.\n\n2 and 3<|im_end|>\n<|im_start|>assistant\n",
      "5",
  )
  tokenized = tokenize_examples([example], tok, max_length=64, template="chat")
  S, E = 400, 401
  prompt = [S] + enc(tok, "user\nAdd the numbers.\n\n2 and 3") + [E] + enc(tok, "\n")
  prompt += [S] + enc(tok, "assistant\n")
  target = enc(tok, "5") + [E]  # the answer, then <|im_end|> (not eos </s>, no bos <s> first)
  assert tokenized.input_ids[0].tolist() == prompt + target
  assert tokenized.loss_mask[0].tolist() == [0.0] * len(prompt) + [1.0] * len(target)
  # the Alpaca path of the same example is unchanged: bos, Alpaca prompt, answer, eos
  alpaca = tokenize_examples([example], tok, max_length=128)
  assert alpaca.input_ids[0].tolist() == [1] + enc(tok, example.turns[0][0]) + enc(tok, "5") + [2]


def test_multi_turn_messages_with_a_system_message(tok, tmp_path):
  record = {
      "messages": [
          {"role": "system", "content": "Be brief."},
          {"role": "user", "content": "1+2?"},
          {"role": "assistant", "content": "3"},
          {"role": "user", "content": "and"},
          {"role": "user", "content": "2+2?"},
          {"role": "assistant", "content": "4"},
          {"role": "user", "content": "dropped: no answer follows"},
      ]
  }
  (tmp_path / "m.jsonl").write_text(json.dumps(record) + "\n")
  (example,) = read_examples(tmp_path / "m.jsonl").examples
  assert example.messages == (
      ("system", "Be brief."),
      ("user", "1+2?"),
      ("assistant", "3"),
      ("user", "and\n\n2+2?"),
      ("assistant", "4"),
  )
  turns = chat_turns(tok, example.messages)
  assert turns == (
      (
          "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n1+2?<|im_end|>\n"
          "<|im_start|>assistant\n",
          "3",
      ),
      ("\n<|im_start|>user\nand\n\n2+2?<|im_end|>\n<|im_start|>assistant\n", "4"),
  )
  ids = tokenize_examples([example], tok, max_length=128, template="chat")
  x, mask = ids.input_ids[0].tolist(), ids.loss_mask[0].tolist()
  E = 401
  # exactly the two answers and their end-of-turn tokens carry loss; the "\n" after <|im_end|> not
  assert [t for t, m in zip(x, mask) if m] == enc(tok, "3") + [E] + enc(tok, "4") + [E]
  assert tok.decode(x) == "".join(p + r + "<|im_end|>" for p, r in turns)


def test_eval_prompt_is_the_training_prompt_and_decoding_stops_at_end_of_turn(
    tok, monkeypatch, tmp_path
):
  example = EvalExample("Add the numbers.", "5", "2 and 3")
  prompt = template_prompt_fn("chat", tok)(example)
  assert prompt == chat_prompt(tok, "Add the numbers.\n\n2 and 3")
  assert template_prompt_fn("alpaca")(example).startswith("Below is an instruction")
  record = {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"}
  (tmp_path / "a.json").write_text(json.dumps([record]))
  train = tokenize_examples(
      read_examples(tmp_path / "a.json").examples, tok, max_length=64, template="chat"
  )
  n_prompt = int(np.argmax(train.loss_mask[0]))
  seen = {}

  def fake_generate(model, ids, mask, *, max_new_tokens, eos_token_id, pad_token_id, **kw):
    seen.update(ids=np.asarray(ids), mask=np.asarray(mask), eos=eos_token_id)
    return np.tile(np.asarray(enc(tok, "5") + [401, 0, 0]), (ids.shape[0], 1))

  monkeypatch.setattr(anlr_jax.app.text_generation, "generate", fake_generate)
  generate_fn = make_generate_fn(None, tok, max_new_tokens=4, batch_size=2, template="chat")
  assert generate_fn([prompt]) == ["5"]
  row = seen["ids"][0][seen["mask"][0] == 1].tolist()
  assert row == train.input_ids[0][:n_prompt].tolist()  # no bos, the training prompt's tokens
  assert seen["eos"] == 401  # <|im_end|>
  make_generate_fn(None, tok, max_new_tokens=4, batch_size=2)([prompt])
  assert seen["eos"] == 2 and seen["ids"][0][seen["mask"][0] == 1][0] == 1  # alpaca: bos, eos


def test_errors_name_the_problem(tok, tmp_path):
  no_template = build_tiny_tokenizer()
  with pytest.raises(ValueError, match="no chat template"):
    end_of_turn_id(no_template)
  rewriting = chat_tokenizer()
  rewriting.chat_template = CHATML.replace("m['content']", "m['content'] | upper")
  with pytest.raises(ValueError, match="verbatim"):
    chat_turns(rewriting, (("user", "a"), ("assistant", "b")))
  with pytest.raises(ValueError, match="template must be one of"):
    tokenize_examples([], tok, max_length=8, template="llama")
  (tmp_path / "t.json").write_text(json.dumps([{"instruction": "x", "output": "y"}]))
  with pytest.raises(ValueError, match=r"t\.json: .*no chat template"):
    make_source(
        tmp_path / "t.json", no_template, max_length=64, global_batch=1, seed=0, template="chat"
    )
  assert load_config(None, ["data.template=chat"]).data.template == "chat"
  with pytest.raises(ConfigError, match="data.template: 'llama' is not allowed"):
    load_config(None, ["data.template=llama"])


def test_train_run_with_the_chat_template(tmp_path):
  tok = chat_tokenizer(tmp_path / "model")
  save_tiny_llama(tmp_path / "model", len(tok))
  records = [{"query": f"What is {i} + 1?", "response": f"#### {i + 1}"} for i in range(8)]
  (tmp_path / "train.json").write_text(json.dumps(records))
  tests = [{"instruction": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(4)]
  (tmp_path / "test.json").write_text(json.dumps(tests))
  config = {
      "method": "lora",
      "run_dir": str(tmp_path / "run"),
      "model": {"path": str(tmp_path / "model")},
      "lora": {"rank": 2, "alpha": 4, "dropout": 0.0},
      "data": {"train": str(tmp_path / "train.json"), "max_length": 64, "template": "chat"},
      "trainer": {"steps": 2, "global_batch": 8, "compute_dtype": "float32", "progress": False},
      "eval": {"tasks": {"gsm8k": str(tmp_path / "test.json")}, "batch_size": 4},
  }
  config["eval"]["max_new_tokens"] = 3
  (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
  out = train_run(load_config(tmp_path / "c.yaml"), log=lambda _: None)
  results = json.loads((tmp_path / "run" / "results.json").read_text())
  assert results["identity"]["data.template"] == "chat" and 0 <= out["runs"][0]["avg"] <= 1
  records = [
      json.loads(l) for l in (tmp_path / "run" / "eval_gsm8k.jsonl").read_text().splitlines()
  ]
  assert records[0]["prompt"] == chat_prompt(tok, "What is 0 + 1?")
  # `anlr generate` with the run directory takes the run's template: the eval's generation
  text = generate_text(
      str(tmp_path / "model"), "What is 0 + 1?", adapter=str(tmp_path / "run"), max_new_tokens=3
  )
  assert text == records[0]["generation"]
  # `anlr eval` of the run directory with a config that says alpaca: the run's chat template wins
  config["data"]["template"] = "alpaca"
  lines = []
  evaluated, _ = eval_run(
      load_config(None, base=config),
      str(tmp_path / "run"),
      out_dir=str(tmp_path / "ev"),
      log=lines.append,
  )
  assert "data.template: chat (the run's), not alpaca (--config)" in lines
  again = [json.loads(l) for l in (tmp_path / "ev" / "eval_gsm8k.jsonl").read_text().splitlines()]
  assert [r["prompt"] for r in again] == [r["prompt"] for r in records]
  assert evaluated.accuracy == results["accuracy"]


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
  """A run trained with every default (ChatML tokenizer, alpaca template), its checkpoint kept."""
  from anlr_jax.app import cli

  root = tmp_path_factory.mktemp("default_run")
  tok = chat_tokenizer(root / "model")
  save_tiny_llama(root / "model", len(tok))
  records = [{"query": f"What is {i} + 1?", "response": f"#### {i + 1}"} for i in range(8)]
  (root / "train.json").write_text(json.dumps(records))
  config = {
      "method": "lora",
      "run_dir": str(root / "run"),
      "model": {"path": str(root / "model")},
      "lora": {"rank": 2, "alpha": 4, "dropout": 0.0},
      "data": {"train": str(root / "train.json"), "max_length": 64},
      "trainer": {"steps": 2, "global_batch": 8, "compute_dtype": "float32", "progress": False},
      "eval": {"tasks": {}},
  }
  (root / "c.yaml").write_text(yaml.safe_dump(config))
  assert cli.main(["train", "--config", str(root / "c.yaml")]) == 0
  return root


@pytest.mark.parametrize(
    "override", ["data.template=chat", "model.matmul_dtype=bfloat16"], ids=["template", "matmul"]
)
def test_a_default_run_resumed_with_a_key_it_never_stored_is_refused(
    default_run, tmp_path, capsys, override
):
  """``data.template`` and ``model.matmul_dtype`` enter a run's identity only when not the default,
  so a checkpoint saved with the defaults lacks them: resuming it with either set is refused, the
  key named (``<unset>`` in the checkpoint), exactly as for a key it stored."""
  from anlr_jax.app import cli

  capsys.readouterr()
  key, value = override.split("=")
  argv = ["train", "--config", str(default_run / "c.yaml"), f"run_dir={tmp_path / 'again'}"]
  argv += [f"trainer.ckpt_dir={default_run / 'run' / 'checkpoints'}", override]
  assert cli.main(argv) == 2
  err = capsys.readouterr().err
  assert f"{key}: '<unset>' -> '{value}'" in err and "belongs to a run with other settings" in err
  assert len(err.strip().splitlines()) == 1, err


def test_prompt_batches_pad_to_power_of_two_widths(monkeypatch):
  """Eval prompt batches share a few widths (16 * 2**j), so decoding compiles a handful of
  programs however the prompt lengths vary, and every prompt still fits."""
  from anlr_jax.models.generation import prompt_width

  assert [prompt_width(n) for n in (1, 16, 17, 32, 33, 48, 64, 65, 200)] == [
      16,
      16,
      32,
      32,
      64,
      64,
      64,
      128,
      256,
  ]
  assert prompt_width(5, multiple=8) == 8 and prompt_width(9, multiple=8) == 16
  tok = build_tiny_tokenizer()
  widths = []

  def fake_generate(model, ids, mask, *, max_new_tokens, eos_token_id, pad_token_id, **kw):
    widths.append(ids.shape[1])
    assert (np.asarray(mask).sum(axis=1) <= ids.shape[1]).all()
    return np.zeros((ids.shape[0], max_new_tokens), np.int32)

  monkeypatch.setattr(anlr_jax.app.text_generation, "generate", fake_generate)
  generate_fn = make_generate_fn(None, tok, max_new_tokens=2, batch_size=1)
  lengths = [
      len(tok(" ".join(["word"] * n), add_special_tokens=False).input_ids) for n in (8, 10, 12)
  ]
  assert len(set(lengths)) == 3 and all(33 <= n + 1 <= 64 for n in lengths), lengths
  for n in (8, 10, 12):
    generate_fn([" ".join(["word"] * n)])
  assert widths == [64, 64, 64]  # a multiple of 16 would have been 48, 64, 64


def test_the_training_source_of_a_run_follows_its_data_section(tok, tmp_path):
  """`anlr train` and the mesh example build their batches with `training_source`: the data
  section's template, max_length and pad_multiple, trainer.global_batch and the seed all apply."""
  from anlr_jax.app.train import training_source

  records = [{"instruction": f"Add {i} and {i}.", "output": str(2 * i)} for i in range(6)]
  (tmp_path / "a.json").write_text(json.dumps(records))
  path = str(tmp_path / "a.json")
  base = ["trainer.global_batch=2", "data.max_length=256", "data.pad_multiple=16"]
  chat = training_source(load_config(None, [*base, "data.template=chat"]), path, tok)
  alpaca = training_source(load_config(None, base), path, tok)
  expected = tokenize_examples(read_examples(path).examples, tok, max_length=256, template="chat")
  assert len(chat) == 3 and chat.get_batch(0)["input_ids"].shape[1] % 16 == 0
  rows = {tuple(r[r != tok.pad_token_id]) for b in range(3) for r in chat.get_batch(b)["input_ids"]}
  assert rows == {tuple(ids) for ids in expected.input_ids}
  assert not rows & {tuple(r[r != tok.pad_token_id]) for r in alpaca.get_batch(0)["input_ids"]}
