"""HumanEval as an `anlr eval` task: `anlr eval` with `eval.tasks.humaneval` and a stub generation
that answers the problems' canonical solutions (pass@1 = 1) or wrong code (pass@1 = 0); the raw
prompt, the stop sequences, code_max_new_tokens and eval_humaneval.jsonl; the chat protocol
(eval.code_prompt=chat): the problem in the chat template, the code taken from the reply."""

import gzip
import json
import re

import pytest

import anlr_jax.models
import anlr_jax.app.evaluate
from anlr_jax.app import cli
from anlr_jax.app.config import ConfigError, load_config
from anlr_jax.evals import evaluate, humaneval, load_code_problems
from anlr_jax.evals.code import (
    CHAT_INSTRUCTION,
    STOP_SEQUENCES,
    code_from_reply,
    truncate_completion,
)
from anlr_jax.app.evaluate import make_generate_fn
from tests.helpers.tiny_chat import chat_tokenizer
from tests.tiny_tokenizer import build_tiny_tokenizer

N = 3  # problems scored (eval.limit)


@pytest.fixture(scope="module")
def problems():
  try:
    return humaneval.load_problems()
  except ValueError as err:
    pytest.skip(str(err))


class _Model:

  def eval(self):
    return self


def _stub_eval(monkeypatch, problems, answer, tokenizer=None):
  """`anlr eval`'s model loading and generation replaced by `answer(problem) -> generation`; with a
  `tokenizer`, prompts must be the chat protocol's (the problem's prompt in its chat template)."""
  by_prompt = {p["prompt"]: p for p in problems.values()}
  if getattr(tokenizer, "chat_template", None):
    by_prompt = {
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"{CHAT_INSTRUCTION}\n\n```python\n{p.rstrip()}\n```"}],
            tokenize=False,
            add_generation_prompt=True,
        ): problem
        for p, problem in by_prompt.items()
    }
  calls = []

  def fake_make_generate_fn(model, tokenizer, **kwargs):
    calls.append(kwargs)

    def generate_fn(prompts):
      return [answer(by_prompt[p]) for p in prompts]  # KeyError unless the prompt is as expected

    return generate_fn

  monkeypatch.setattr(anlr_jax.app.evaluate, "make_generate_fn", fake_make_generate_fn)
  monkeypatch.setattr(
      anlr_jax.app.evaluate,
      "load_adapted_model",
      lambda config, adapter: (_Model(), None, tokenizer),
  )
  return calls


def _eval(tmp_path, *overrides):
  """`anlr eval --config <humaneval only> --out <dir> [overrides]`: (results.json, records)."""
  out = tmp_path / "out"
  config = {"model": {"path": "unused"}, "eval": {"tasks": {"humaneval": "humaneval"}}}
  config["eval"].update(limit=N, batch_size=2)
  (tmp_path / "he.yaml").write_text(json.dumps(config))
  args = ["eval", "--config", str(tmp_path / "he.yaml"), "--out", str(out), *overrides]
  assert cli.main(args) == 0
  results = json.loads((out / "results.json").read_text())
  records = [json.loads(l) for l in (out / "eval_humaneval.jsonl").read_text().splitlines()]
  return results, records


def test_canonical_solutions_pass_and_are_cut_at_the_stop_sequences(
    tmp_path, monkeypatch, problems
):
  # the completion goes on past the function; without the cut at "\nprint(" the program fails
  calls = _stub_eval(
      monkeypatch, problems, lambda p: p["canonical_solution"] + "\nprint(undefined_name)\n"
  )
  results, records = _eval(tmp_path, "eval.code_max_new_tokens=300")
  assert results["accuracy"] == {"humaneval": 1.0}
  assert [r["task_id"] for r in records] == list(problems)[:N]
  first = problems["HumanEval/0"]
  assert records[0]["prompt"] == first["prompt"]  # the raw prompt: no template
  assert records[0]["completion"] == first["canonical_solution"]
  assert records[0]["generation"].endswith("print(undefined_name)\n")
  assert all(r["passed"] and r["result"] == "passed" for r in records)
  code_calls = [c for c in calls if c.get("exact_continuation")]
  assert [c["max_new_tokens"] for c in code_calls] == [300]
  assert (tmp_path / "out" / "accuracy.csv").read_text().startswith("Method,HumanEval,Avg.")


def test_wrong_completions_score_zero(tmp_path, monkeypatch, problems):
  _stub_eval(monkeypatch, problems, lambda p: "    return None\n")
  results, records = _eval(tmp_path)
  assert results["accuracy"] == {"humaneval": 0.0}
  assert len(records) == N and not any(r["passed"] for r in records)
  assert all(r["result"].startswith("failed") for r in records)


def test_a_problems_file_path_and_its_errors(tmp_path, monkeypatch, capsys, problems):
  subset = [problems["HumanEval/2"], problems["HumanEval/4"]]
  with gzip.open(tmp_path / "two.jsonl.gz", "wt") as f:
    f.write("".join(json.dumps(p) + "\n" for p in subset))
  assert [p["task_id"] for p in load_code_problems(tmp_path / "two.jsonl.gz")] == [
      "HumanEval/2",
      "HumanEval/4",
  ]
  _stub_eval(monkeypatch, problems, lambda p: p["canonical_solution"])
  results, records = _eval(tmp_path, f"eval.tasks.humaneval={tmp_path / 'two.jsonl.gz'}")
  assert results["accuracy"] == {"humaneval": 1.0} and len(records) == 2
  (tmp_path / "bad.jsonl").write_text("{not json\n")
  config = tmp_path / "he.yaml"
  for file, message in (
      ("bad.jsonl", r"eval.tasks.humaneval: HumanEval problems file .*bad.jsonl:1: invalid JSON"),
      ("missing.jsonl", r"eval.tasks.humaneval: .*missing.jsonl does not exist"),
  ):
    args = ["eval", "--config", str(config), f"eval.tasks.humaneval={tmp_path / file}"]
    assert cli.main(args) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert re.search(message, line), line
  with pytest.raises(ConfigError, match="eval.code_max_new_tokens"):
    load_config(None, ["eval.code_max_new_tokens=0"])
  with pytest.raises(ValueError, match="running its unit tests"):
    evaluate(lambda ps: ps, [{"instruction": "x", "answer": "y"}], "humaneval", batch_size=1)


def test_truncation_and_exact_continuation(monkeypatch):
  assert STOP_SEQUENCES == ("\ndef ", "\nclass ", "\nif __name__", "\nprint(")
  text = "    return 1\n\n\ndef helper():\n    pass\n"
  assert truncate_completion(text) == "    return 1\n\n"
  assert truncate_completion("    x = 1\nif __name__ == '__main__':\n") == "    x = 1"
  assert truncate_completion("    return 2") == "    return 2"
  tok = build_tiny_tokenizer()
  new = tok("    return a + b\n", add_special_tokens=False).input_ids

  def fake_generate(model, ids, mask, *, max_new_tokens, eos_token_id, pad_token_id, **kw):
    import numpy as np

    return np.tile(np.asarray(new), (ids.shape[0], 1))

  monkeypatch.setattr(anlr_jax.app.text_generation, "generate", fake_generate)
  fn = make_generate_fn(None, tok, max_new_tokens=8, batch_size=1, exact_continuation=True)
  assert fn(["def add(a, b):\n"]) == ["    return a + b\n"]


def test_code_from_reply():
  fn = "def add(a, b):\n    return a + b\n"
  prose = f"Here is the function:\n```python\n{fn}```\nIt adds the numbers.\n"
  assert code_from_reply(prose, "add") == "\n" + fn
  # the block that defines the entry point wins over an earlier usage example
  usage = "```python\nprint(add(1, 2))\n```\n"
  assert code_from_reply(usage + prose, "add") == "\n" + fn
  # demo and test code after the function is cut; an unclosed block runs to the end
  demo = fn + "\nprint(add(1, 2))\nassert add(1, 1) == 2\n"
  assert code_from_reply(f"```py\n{demo}", "add") == "\n" + fn
  assert code_from_reply(fn + "\nif __name__ == '__main__':\n    add(1, 2)\n", "add") == "\n" + fn
  # a body alone is indented under the prompt's signature; an indented one is kept as it is
  assert code_from_reply("```\nx = a + b\nreturn x\n```", "add") == "    x = a + b\n    return x\n"
  assert code_from_reply("        return a + b", "add") == "    return a + b\n"
  # another function's definition is not the entry point's: taken as a body (and fails its tests)
  assert code_from_reply("def adder(a, b):\n    return 0", "add").startswith("    def adder")
  assert code_from_reply("I cannot help with that.", "add") == "    I cannot help with that.\n"
  assert code_from_reply("", "add") == ""


def test_chat_protocol_scores_the_code_of_the_reply(tmp_path, monkeypatch, problems):
  tok = chat_tokenizer()

  def reply(p):  # an instruct model's answer: prose around the whole function in a code block
    return f"Sure!\n```python\n{p['prompt']}{p['canonical_solution']}```\nprint(f(1)) shows it.\n"

  calls = _stub_eval(monkeypatch, problems, reply, tokenizer=tok)
  results, records = _eval(tmp_path, "eval.code_prompt=chat")
  assert results["accuracy"] == {"humaneval": 1.0}
  first = problems["HumanEval/0"]
  assert records[0]["generation"] == reply(first)
  whole = first["prompt"] + first["canonical_solution"]
  assert records[0]["completion"] == "\n" + whole.strip("\n") + "\n"
  assert all(r["protocol"] == "chat" and r["passed"] for r in records)
  (code_call,) = [c for c in calls if c.get("exact_continuation")]
  assert code_call["template"] == "chat"  # no bos, decoding stops at the end-of-turn token

  _stub_eval(monkeypatch, problems, lambda p: "The function returns the answer.", tokenizer=tok)
  results, records = _eval(tmp_path, "eval.code_prompt=chat")
  assert results["accuracy"] == {"humaneval": 0.0}


def test_chat_protocol_needs_a_chat_template(tmp_path, monkeypatch, capsys, problems):
  _stub_eval(monkeypatch, problems, lambda p: "", tokenizer=build_tiny_tokenizer())
  config = {"model": {"path": "unused"}, "eval": {"tasks": {"humaneval": "humaneval"}, "limit": 1}}
  (tmp_path / "he.yaml").write_text(json.dumps(config))
  args = ["eval", "--config", str(tmp_path / "he.yaml"), "eval.code_prompt=chat"]
  assert cli.main(args + ["--out", str(tmp_path / "out")]) == 2
  (line,) = capsys.readouterr().err.strip().splitlines()
  assert "eval.code_prompt=chat: the tokenizer has no chat template" in line
  with pytest.raises(ConfigError, match="eval.code_prompt"):
    load_config(None, ["eval.code_prompt=markdown"])


def test_whole_function_replies_pass_on_every_problem(problems):
  """Every problem's prompt + canonical solution, given back as a chat reply, passes: redefining
  the prompt's stub (and its helper functions) after the prompt keeps the program valid."""
  samples = [
      {
          "task_id": t,
          "completion": code_from_reply(
              f"```python\n{p['prompt']}{p['canonical_solution']}```", p["entry_point"]
          ),
      }
      for t, p in problems.items()
  ]
  result = humaneval.evaluate(samples, problems, k=(1,), timeout=10.0)
  failed = [r for r in result.results if not r.passed]
  assert not failed, failed[:3]
