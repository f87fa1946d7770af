"""Writes a GSM8K-style task of multi-step arithmetic word problems with worked answers (seeded).

  python scripts/make_arith_task.py --out data/arith [--train 2000] [--test 200] [--seed 0]

writes

* ``<out>/train.json``: MetaMathQA-format records ``{"query", "response", "type": "arith"}``
  (``data.format: metamath``); the response works the problem out in short sentences, one
  operation each (``3 * 5 = 15``), and ends with ``#### <number>`` as GSM8K's solutions do;
* ``<out>/test.json``: LLM-Adapters-format test records ``{"instruction", "answer", "solution"}``
  scored by the ``gsm8k`` eval task (the number after the last ``####`` of a generation, else its
  last number, equal to ``answer`` within 1e-3).

Every problem takes two or three operations (+, -, *, /) on small whole numbers, and every
intermediate and final answer is a whole number >= 0. The files are a pure function of
``(--train, --test, --seed)``: problems are drawn with ``random.Random(seed)`` until there are
``train + test`` distinct questions, which are then shuffled and split, so no test question is a
training question.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from collections.abc import Callable

NAMES = (
    ("Ava", "she"),
    ("Ben", "he"),
    ("Chloe", "she"),
    ("Daniel", "he"),
    ("Emma", "she"),
    ("Finn", "he"),
    ("Grace", "she"),
    ("Hugo", "he"),
    ("Isla", "she"),
    ("Jack", "he"),
    ("Lena", "she"),
    ("Marco", "he"),
    ("Nora", "she"),
    ("Omar", "he"),
    ("Priya", "she"),
    ("Sam", "he"),
)
ITEMS = ("apples", "pencils", "stickers", "marbles", "cookies", "cards", "stamps", "shells")
CONTAINERS = ("bags", "boxes", "packs", "jars")

Problem = tuple[str, str, int]
"""(question, worked answer ending in ``#### <number>``, the number)."""


def _person(rng: random.Random) -> tuple[str, str]:
  return rng.choice(NAMES)


def _his(he: str) -> str:
  return "his" if he == "he" else "her"


def _packs_minus_given(rng: random.Random) -> Problem:
  (name, he), item, box = _person(rng), rng.choice(ITEMS), rng.choice(CONTAINERS)
  a, b = rng.randint(2, 9), rng.randint(3, 12)
  total = a * b
  c = rng.randint(1, total - 1)
  question = (
      f"{name} buys {a} {box} of {item} with {b} {item} in each. {he.capitalize()} gives {c} of"
      f" them to a friend. How many {item} does {name} have left?"
  )
  answer = (
      f"{name} buys {a} * {b} = {total} {item}.\nAfter giving away {c}, {he} has {total} - {c} ="
      f" {total - c} {item}.\n#### {total - c}"
  )
  return question, answer, total - c


def _savings_minus_spent(rng: random.Random) -> Problem:
  name, he = _person(rng)
  a, b = rng.randint(2, 15), rng.randint(2, 8)
  total = a * b
  c = rng.randint(1, total - 1)
  question = (
      f"{name} saves ${a} every week for {b} weeks and then spends ${c} on a book. How many"
      f" dollars does {name} have left?"
  )
  answer = (
      f"{name} saves {a} * {b} = {total} dollars.\nAfter the book, {he} has {total} - {c} ="
      f" {total - c} dollars.\n#### {total - c}"
  )
  return question, answer, total - c


def _share_equally(rng: random.Random) -> Problem:
  (name, he), item = _person(rng), rng.choice(ITEMS)
  friends, each = rng.randint(2, 6), rng.randint(2, 9)
  total = friends * each
  a = rng.randint(1, total - 1)
  b = total - a
  question = (
      f"{name} has {a} {item} and gets {b} more. {he.capitalize()} shares all of them equally"
      f" among {friends} friends. How many {item} does each friend get?"
  )
  answer = (
      f"{name} has {a} + {b} = {total} {item}.\nEach friend gets {total} / {friends} = {each}"
      f" {item}.\n#### {each}"
  )
  return question, answer, each


def _distance(rng: random.Random) -> Problem:
  speed, hours, extra = rng.randint(20, 90), rng.randint(2, 5), rng.randint(5, 60)
  total = speed * hours
  question = (
      f"A train travels at {speed} km per hour for {hours} hours and then {extra} km more. How"
      " many km does it travel in total?"
  )
  answer = (
      f"In {hours} hours it travels {speed} * {hours} = {total} km.\nIn total it travels {total}"
      f" + {extra} = {total + extra} km.\n#### {total + extra}"
  )
  return question, answer, total + extra


def _bake_and_sell(rng: random.Random) -> Problem:
  name, he = _person(rng)
  trays, per = rng.randint(2, 8), rng.randint(4, 12)
  total = trays * per
  morning = rng.randint(1, total - 2)
  afternoon = rng.randint(1, total - morning - 1)
  left = total - morning - afternoon
  question = (
      f"{name} bakes {trays} trays of {per} muffins. {he.capitalize()} sells {morning} muffins in"
      f" the morning and {afternoon} in the afternoon. How many muffins are left?"
  )
  answer = (
      f"{name} bakes {trays} * {per} = {total} muffins.\n{he.capitalize()} sells {morning} +"
      f" {afternoon} = {morning + afternoon}.\n{total} - {morning + afternoon} = {left} are"
      f" left.\n#### {left}"
  )
  return question, answer, left


def _win_then_lose_half(rng: random.Random) -> Problem:
  (name, he), item = _person(rng), rng.choice(ITEMS)
  a = rng.randint(2, 40)
  b = rng.randint(1, 30)
  if (a + b) % 2:
    b += 1
  total = a + b
  question = (
      f"{name} has {a} {item}. {he.capitalize()} wins {b} more and then loses half of all"
      f" {_his(he)} {item}. How many {item} does {name} have now?"
  )
  answer = (
      f"{name} has {a} + {b} = {total} {item}.\nHalf of them is {total} / 2 = {total // 2}, so"
      f" {he} has {total // 2} {item} now.\n#### {total // 2}"
  )
  return question, answer, total // 2


KINDS: tuple[Callable[[random.Random], Problem], ...] = (
    _packs_minus_given,
    _savings_minus_spent,
    _share_equally,
    _distance,
    _bake_and_sell,
    _win_then_lose_half,
)
"""The problem generators, drawn uniformly."""


def make_task(n_train: int, n_test: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
  """``(train records, test records)`` (see the module docstring); a pure function of the args."""
  if n_train < 1 or n_test < 1:
    raise ValueError(f"--train and --test must be >= 1, got {n_train} and {n_test}")
  rng = random.Random(seed)
  problems: dict[str, Problem] = {}
  for _ in range(100 * (n_train + n_test)):
    if len(problems) == n_train + n_test:
      break
    question, answer, number = rng.choice(KINDS)(rng)
    problems.setdefault(question, (question, answer, number))
  else:
    raise ValueError(f"could not draw {n_train + n_test} distinct problems")
  ordered = list(problems.values())
  rng.shuffle(ordered)
  train = [{"query": q, "response": a, "type": "arith"} for q, a, _ in ordered[:n_train]]
  test = [{"instruction": q, "answer": str(n), "solution": a} for q, a, n in ordered[n_train:]]
  return train, test


def write_task(out: str, n_train: int, n_test: int, seed: int = 0) -> tuple[str, str]:
  """Writes ``<out>/train.json`` and ``<out>/test.json``; returns their paths."""
  train, test = make_task(n_train, n_test, seed)
  os.makedirs(out, exist_ok=True)
  paths = os.path.join(out, "train.json"), os.path.join(out, "test.json")
  for path, records in zip(paths, (train, test)):
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
      json.dump(records, f, indent=1)
      f.write("\n")
    os.replace(tmp, path)
  return paths


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default="data/arith", help="output directory (default data/arith)")
  parser.add_argument("--train", type=int, default=2000, help="training problems (default 2000)")
  parser.add_argument("--test", type=int, default=200, help="held-out test problems (default 200)")
  parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
  args = parser.parse_args(argv)
  train_path, test_path = write_task(args.out, args.train, args.test, args.seed)
  print(f"wrote {args.train} problems to {train_path} and {args.test} to {test_path}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
