"""scripts/make_arith_task.py: deterministic given the seed, no test question among the training
ones, worked answers whose arithmetic is right, files read by anlr_jax.data and anlr_jax.evals."""

import importlib.util
import json
import os
import random
import re
import subprocess
import sys

import pytest

from anlr_jax.data import read_examples
from anlr_jax.evals import evaluate, extract_number, load_eval_examples

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "scripts", "make_arith_task.py")


@pytest.fixture(scope="module")
def arith():
  spec = importlib.util.spec_from_file_location("make_arith_task", SCRIPT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_deterministic_given_the_seed(arith):
  assert arith.make_task(300, 50, seed=3) == arith.make_task(300, 50, seed=3)
  assert arith.make_task(300, 50, seed=3) != arith.make_task(300, 50, seed=4)


def test_no_duplicates_within_or_between_train_and_test(arith):
  train, test = arith.make_task(2000, 200, seed=0)
  train_questions = [r["query"] for r in train]
  test_questions = [r["instruction"] for r in test]
  assert len(train) == 2000 and len(test) == 200
  assert len(set(train_questions)) == 2000 and len(set(test_questions)) == 200
  assert not set(train_questions) & set(test_questions)


def test_worked_answers_are_right_and_end_with_the_number(arith):
  train, test = arith.make_task(500, 100, seed=1)
  solutions = [r["response"] for r in train] + [r["solution"] for r in test]
  for solution in solutions:
    steps = re.findall(r"(\d+) ([-+*/]) (\d+) = (\d+)", solution)
    assert len(steps) >= 2, solution  # multi-step
    for a, op, b, c in steps:
      a, b, c = int(a), int(b), int(c)
      assert {"+": a + b, "-": a - b, "*": a * b, "/": a / b}[op] == c, solution
    assert solution.endswith(f"#### {steps[-1][3]}"), solution  # the last step's result
  for record in test:
    assert extract_number(record["solution"]) == float(record["answer"])
  for kind in arith.KINDS:  # every kind of problem, on its own
    question, answer, number = kind(random.Random(0))
    assert question.endswith("?") and answer.endswith(f"#### {number}") and number >= 0


def test_the_files_read_as_metamath_training_data_and_gsm8k_tests(tmp_path):
  out = tmp_path / "arith"
  cmd = [sys.executable, SCRIPT, "--out", str(out), "--train", "40", "--test", "10", "--seed", "7"]
  printed = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
  assert "wrote 40 problems" in printed
  read = read_examples(out / "train.json")
  assert read.format == "metamath" and len(read.examples) == 40
  assert read.examples[0].turns[0][1].rsplit("\n", 1)[1].startswith("#### ")
  tests = load_eval_examples(out / "test.json")
  solutions = {r["instruction"]: r["solution"] for r in json.loads((out / "test.json").read_text())}
  result = evaluate(
      lambda ps: [solutions[p] for p in ps],
      tests,
      "gsm8k",
      batch_size=4,
      prompt_fn=lambda e: e.instruction,
  )
  assert result.accuracy == 1.0 and result.total == 10
  again = tmp_path / "again"
  subprocess.run([*cmd[:2], "--out", str(again), *cmd[4:]], check=True, capture_output=True)
  assert (again / "train.json").read_bytes() == (out / "train.json").read_bytes()
  assert (again / "test.json").read_bytes() == (out / "test.json").read_bytes()
