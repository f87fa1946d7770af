"""Tests for anlr_jax.evals: answer extraction per task, evaluate() with a fake generator, tables."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest

from anlr_jax.evals import (
    EvalResult,
    accuracy_table,
    default_prompt,
    evaluate,
    extract_number,
    extract_prediction,
    get_task,
    is_correct,
    load_eval_examples,
    parse_gold,
    write_accuracy_table,
)

CHOICE_CASES = [
    # (task, generation, expected prediction)
    ("boolq", "the correct answer is true", "true"),
    ("boolq", "False. It is untrue that ...", "false"),
    ("boolq", "it is untrue", None),  # "true" inside "untrue" is not a whole word
    ("piqa", "the correct answer is solution2", "solution2"),
    ("social_i_qa", "the correct answer is answer3", "answer3"),
    ("social_i_qa", "the correct answer is answer4", None),  # SIQA has three options
    ("hellaswag", "ending4 then ending1", "ending4"),
    ("winogrande", "the answer is not option1 but option2", "option1"),  # first match wins
    ("winogrande", "The correct answer is Option2.", "option2"),
    ("ARC-Easy", "answer10 is not an option, answer5 is", "answer5"),
    ("ARC-Challenge", "the correct answer is answer1", "answer1"),
    ("openbookqa", "I think (answer2)", "answer2"),
    ("openbookqa", "no idea", None),
]


@pytest.mark.parametrize("task,text,expected", CHOICE_CASES)
def test_choice_extraction(task, text, expected):
  assert extract_prediction(task, text) == expected


NUMBER_CASES = [
    ("The total is 1,234.5 dollars.", 1234.5),
    ("She owes -3 apples", -3.0),
    ("It costs $12.", 12.0),
    ("#### 42", 42.0),
    ("Step: 5 + 7 = 12\n#### 12\nThen 99 more tokens", 12.0),  # the number after the marker wins
    ("So 48 / 2 = 24 and 48 + 24 = 72. The answer is: 72", 72.0),
    ("She lost -$15 and then $-3", -3.0),
    ("10-3=7", 7.0),
    ("x2 plus 5", 5.0),  # "x2" is not a number
    ("1,2,3", 3.0),  # not a thousands separator
    ("The answer is 0.5.", 0.5),
    ("The answer is 1,000,000", 1_000_000.0),
    ("no digits here", None),
]


@pytest.mark.parametrize("text,expected", NUMBER_CASES)
def test_gsm8k_number_extraction(text, expected):
  assert extract_number(text) == expected
  assert extract_prediction("gsm8k", text) == expected


def test_scoring_rules():
  assert is_correct("gsm8k", 72.0004, parse_gold("gsm8k", "72"))
  assert not is_correct("gsm8k", 72.01, parse_gold("gsm8k", "72"))
  assert parse_gold("gsm8k", "Natalia sold 48/2 = 24 clips.\n#### 1,272") == 1272.0
  assert not is_correct("gsm8k", None, 0.0)
  assert is_correct(
      "exact_match",
      extract_prediction("exact", "  Paris\n is  THE capital "),
      parse_gold("exact_match", "paris is the capital"),
  )
  assert not is_correct(
      "exact_match", extract_prediction("exact", "Paris."), parse_gold("exact", "paris")
  )
  assert parse_gold("boolq", " True ") == "true"
  with pytest.raises(ValueError, match="not an option of winogrande"):
    parse_gold("winogrande", "option3")
  with pytest.raises(ValueError, match="contains no number"):
    parse_gold("gsm8k", "n/a")
  with pytest.raises(ValueError, match="unknown task 'mmlu'"):
    get_task("mmlu")
  assert get_task("SIQA").name == "social_i_qa" and get_task("arc_c").name == "ARC-Challenge"


def test_evaluate_with_fake_generator(tmp_path):
  items = [
      {"instruction": "Q1 options: option1 / option2", "answer": "option1"},
      {"instruction": "Q2 options: option1 / option2", "answer": "option2"},
      {"instruction": "Q3 options: option1 / option2", "answer": "option2"},
      {"instruction": "Q4 options: option1 / option2", "answer": "option1"},
      {"instruction": "Q5 options: option1 / option2", "answer": "option2", "input": "context"},
  ]
  path = tmp_path / "winogrande_test.json"
  path.write_text(json.dumps(items))
  examples = load_eval_examples(path)
  replies = {
      "Q1": "the correct answer is option1",
      "Q2": "the correct answer is option1",  # wrong
      "Q3": "the correct answer is option2",
      "Q4": "I cannot tell",  # no option word: wrong
      "Q5": "option2",
  }
  calls = []

  def generate_fn(prompts):
    calls.append(len(prompts))
    out = []
    for p in prompts:
      reply = replies[p.split("### Instruction:\n")[1][:2]]
      out.append(p + reply if "Q3" in p else reply)  # Q3 echoes its prompt, which lists option1
    return out

  result = evaluate(generate_fn, examples, "winogrande", batch_size=2)
  assert calls == [2, 2, 1]
  assert [r.correct for r in result.records] == [True, False, True, False, True]
  assert (result.correct, result.total, result.accuracy) == (3, 5, 0.6)
  assert result.records[3].prediction is None
  assert result.records[2].generation == "the correct answer is option2"
  assert result.records[0].prompt == default_prompt(examples[0])
  assert result.records[0].prompt.endswith(
      "### Instruction:\nQ1 options: option1 / option2\n\n### Response:\n"
  )
  assert "### Input:\ncontext\n\n" in result.records[4].prompt
  result.save_records(tmp_path / "records.jsonl")
  saved = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
  assert [s["correct"] for s in saved] == [True, False, True, False, True]

  with pytest.raises(ValueError, match="generate_fn returned 1 for 2 prompts"):
    evaluate(lambda ps: ["x"], examples, "winogrande", batch_size=2)
  with pytest.raises(ValueError, match=r"examples\[1\]: gold answer 'maybe'"):
    evaluate(
        generate_fn, [items[0], {"instruction": "x", "answer": "maybe"}], "winogrande", batch_size=2
    )
  with pytest.raises(ValueError, match="batch_size"):
    evaluate(generate_fn, examples, "winogrande", batch_size=0)
  bad = tmp_path / "bad.json"
  bad.write_text(json.dumps([{"instruction": "x"}]))
  with pytest.raises(ValueError, match=r"bad\.json: item 0: key 'answer'"):
    load_eval_examples(bad)


def test_evaluate_gsm8k():
  examples = [{"instruction": "2+2?", "answer": "4"}, {"instruction": "10*100?", "answer": "1000"}]
  result = evaluate(
      lambda ps: ["2+2 = 4. The answer is: 4", "#### 1,000"], examples, "gsm8k", batch_size=8
  )
  assert result.accuracy == 1.0 and [r.prediction for r in result.records] == [4.0, 1000.0]


def _fake_result(task, n_correct, n_total):
  gen = ["option1"] * n_correct + ["option2"] * (n_total - n_correct)
  return evaluate(
      lambda ps: gen[: len(ps)],
      [{"instruction": "q", "answer": "option1"}] * n_total,
      task,
      batch_size=n_total,
  )


def test_accuracy_table_csv_and_markdown(tmp_path):
  lora = {"boolq": 0.693, "piqa": 0.822, "winogrande": _fake_result("winogrande", 3, 4)}
  anlr = {"WinoGrande": 0.8, "PIQA": 0.83, "BoolQ": 0.7}  # aliases, another order
  partial = {"boolq": 0.5}
  csv_path, md_path = write_accuracy_table(
      {"LoRA": lora, "AnLR-LoRA": anlr, "Partial": partial}, tmp_path / "out" / "table.md"
  )
  assert csv_path.name == "table.csv" and md_path.name == "table.md"
  with open(csv_path, newline="") as f:
    rows = list(csv.reader(f))
  assert rows[0] == ["Method", "BoolQ", "PIQA", "WinoGrande", "Avg."]
  expected_avg = np.mean([69.3, 82.2, 75.0])
  assert rows[1] == ["LoRA", "69.3", "82.2", "75.0", f"{expected_avg:.1f}"]
  assert rows[2] == ["AnLR-LoRA", "70.0", "83.0", "80.0", "77.7"]
  assert rows[3] == ["Partial", "50.0", "", "", ""]
  md = md_path.read_text().splitlines()
  assert md[0] == "| Method | BoolQ | PIQA | WinoGrande | Avg. |"
  assert md[1] == "|---|---:|---:|---:|---:|"
  assert md[3] == "| AnLR-LoRA | **70.0** | **83.0** | **80.0** | **77.7** |"
  assert md[2] == "| LoRA | 69.3 | 82.2 | 75.0 | 75.5 |"

  header, table = accuracy_table({"m": {"gsm8k": 0.25, "my_set": 1.0, "openbookqa": 0.5}})
  assert header == ["Method", "OBQA", "GSM8K", "my_set", "Avg."]
  assert table == [("m", [50.0, 25.0, 100.0, pytest.approx(175 / 3)])]
  header, _ = accuracy_table({"m": {"boolq": 0.5, "piqa": 0.5}}, tasks=["piqa", "boolq"])
  assert header == ["Method", "PIQA", "BoolQ", "Avg."]
  with pytest.raises(
      ValueError, match=r"results\['m'\]\['boolq'\]: an accuracy must be a fraction"
  ):
    accuracy_table({"m": {"boolq": 69.3}})
  assert isinstance(lora["winogrande"], EvalResult)


def test_generation_progress_bar_on_stderr(capsys):
  """Long evaluations show how many prompts are done (tqdm on stderr); a single batch does not."""
  examples = [{"instruction": f"Q{i}", "answer": "option1"} for i in range(5)]
  evaluate(lambda ps: ["option1"] * len(ps), examples, "winogrande", batch_size=2)
  assert "winogrande:" in capsys.readouterr().err  # three batches: a bar by default
  evaluate(lambda ps: ["option1"] * len(ps), examples, "winogrande", batch_size=8)
  assert "prompt" not in capsys.readouterr().err  # one batch: nothing
  evaluate(lambda ps: ["option1"] * len(ps), examples, "winogrande", batch_size=2, progress=False)
  assert "prompt" not in capsys.readouterr().err
