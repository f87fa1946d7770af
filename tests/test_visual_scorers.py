"""Tests for anlr_jax.evals.visual: the seven visual benchmarks' scorers on small files in their
official formats, written here, with expected scores worked out by hand in the comments."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest

from anlr_jax.data.formats import DataFormatError
from anlr_jax.evals import visual
from anlr_jax.evals.visual import (
    extract_mmbench_choice,
    extract_scienceqa_letter,
    normalize_llava_answer,
    normalize_vqa_answer,
    pope_answer,
    read_predictions,
    score_gqa,
    score_mmbench,
    score_pope,
    score_scienceqa,
    score_textvqa,
    score_vizwiz,
    score_vqav2,
    vqa_accuracy,
)


def _write_json(path, data):
  path.write_text(json.dumps(data), encoding="utf-8")
  return path


def _write_jsonl(path, records):
  path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
  return path


# --------------------------------------------------------------------------------------------------
# Normalisation and the VQA accuracy formula.

NORMALIZE_CASES = [
    # (text, official VQA normalisation, LLaVA's normalisation)
    ("Two dogs.", "2 dogs", "2 dogs"),
    ("The red one", "red 1", "red 1"),  # article dropped, number word -> digit
    ("dont know", "don't know", "don't know"),  # contraction given its apostrophe
    ("couldnt've", "couldn't've", "couldn't've"),
    ("t-shirt", "t shirt", "t shirt"),  # punctuation between letters becomes a space
    ("yes - no", "yes no", "yes no"),  # next to a space it is removed; words rejoined by one space
    ("left/right", "left right", "left right"),  # else replaced by a space
    ("3,000 (approx)", "3000 approx", "3000 approx"),  # a digit-comma-digit: all removed
    ("1.5 m.", "1.5 m", "1.5 m"),  # a period before a digit stays
    ("What's that?", "what's that", "what 's that"),  # LLaVA splits off 's
    ("  A\tcat\n", "cat", "cat"),
    ("None", "0", "0"),
]


@pytest.mark.parametrize("text,official,llava", NORMALIZE_CASES)
def test_answer_normalisation(text, official, llava):
  assert normalize_vqa_answer(text) == official
  assert normalize_llava_answer(text) == llava


def test_contraction_table_keys():
  # Every one-apostrophe-less spelling maps back; the official table's reversed entry is kept.
  assert visual.CONTRACTIONS["youre"] == "you're"
  assert visual.CONTRACTIONS["yall'd've"] == visual.CONTRACTIONS["y'alld've"] == "y'all'd've"
  assert visual.CONTRACTIONS["somebody'd"] == "somebodyd"
  assert "im" not in visual.CONTRACTIONS  # the official "Im" key never matches a lower-cased word


@pytest.mark.parametrize(
    "k,expected", [(0, 0.0), (1, 0.3), (2, 0.6), (3, 0.9), (4, 1.0), (10, 1.0)]
)
def test_vqa_accuracy_leave_one_out(k, expected):
  # k of 10 agree: (k·min(1,(k-1)/3) + (10-k)·min(1,k/3)) / 10, e.g. k=3: (3·2/3 + 7·1)/10 = 0.9.
  humans = ["cat"] * k + ["dog"] * (10 - k)
  assert vqa_accuracy("cat", humans) == pytest.approx(expected)


# --------------------------------------------------------------------------------------------------
# VQAv2.


def _vqav2_files(tmp_path):
  def ann(qid, answers, answer_type, question_type):
    return {
        "question_id": qid,
        "image_id": 100 + qid,
        "question_type": question_type,
        "answer_type": answer_type,
        "multiple_choice_answer": answers[0],
        "answers": [
            {"answer": a, "answer_confidence": "yes", "answer_id": i + 1}
            for i, a in enumerate(answers)
        ],
    }

  annotations = [
      ann(1, ["yes"] * 10, "yes/no", "is the"),
      ann(2, ["2", "2", "two", "3", "3", "3", "3", "4", "4", "4"], "number", "how many"),
      ann(3, ["red"] + ["blue"] * 9, "other", "what color"),
      ann(4, ["yes"] * 10, "yes/no", "is the"),
      ann(5, ["T-shirt"] * 10, "other", "what is"),
  ]
  questions = [
      {"question_id": a["question_id"], "image_id": a["image_id"], "question": "?"}
      for a in annotations
  ]
  return (
      _write_json(tmp_path / "v2_mscoco_val2014_annotations.json", {"annotations": annotations}),
      _write_json(
          tmp_path / "v2_OpenEnded_mscoco_val2014_questions.json", {"questions": questions}
      ),
  )


def test_vqav2(tmp_path):
  annotations, questions = _vqav2_files(tmp_path)
  predictions = {
      1: "Yes.",  # -> "yes"; the ten answers agree, compared as they are: 1
      2: "Two",  # answers disagree, all normalised: "2" three times -> 0.9
      3: "Red",  # one person said red -> 0.3
      4: "Yes, it is.",  # -> "yes it is", not "yes" -> 0
      # -> "t shirt"; the ten agree, so the official rule compares them unnormalised: 0 (the
      # official files hold normalised answers, where this cannot happen)
      5: "T-shirt",
  }
  score = score_vqav2(predictions, annotations, questions)
  assert score.per_question == pytest.approx({"1": 1.0, "2": 0.9, "3": 0.3, "4": 0.0, "5": 0.0})
  assert score.score == pytest.approx((1 + 0.9 + 0.3 + 0 + 0) / 5)
  assert score.breakdown["answer_type"] == pytest.approx(
      {"yes/no": 0.5, "number": 0.9, "other": 0.15}
  )
  assert score.breakdown["question_type"]["how many"] == pytest.approx(0.9)
  assert (score.count, score.missing) == (5, 0)


def test_vqav2_missing_and_unknown_predictions(tmp_path):
  annotations, questions = _vqav2_files(tmp_path)
  with pytest.raises(ValueError, match=r"4 of 5 questions have no prediction"):
    score_vqav2({1: "yes"}, annotations)
  skipped = score_vqav2({1: "yes"}, annotations, on_missing="skip")
  assert (skipped.score, skipped.count, skipped.missing) == (1.0, 1, 4)
  wrong = score_vqav2({1: "yes"}, annotations, on_missing="wrong")
  assert (wrong.score, wrong.count, wrong.missing) == (0.2, 5, 4)
  with pytest.raises(ValueError, match=r"annotations\.json: 1 prediction\(s\) for questions"):
    score_vqav2({1: "yes", 2: "2", 3: "3", 4: "4", 5: "5", 99: "no"}, annotations)
  _write_json(questions, {"questions": [{"question_id": 1}]})
  with pytest.raises(DataFormatError, match=r"questions\.json: its 1 question ids"):
    score_vqav2({}, annotations, questions)


def test_vqav2_malformed(tmp_path):
  path = _write_json(tmp_path / "ann.json", {"annotations": [{"question_id": 7, "answers": "no"}]})
  with pytest.raises(
      DataFormatError, match=r"ann\.json: annotations\[0\] \(question 7\): 'answers'"
  ):
    score_vqav2({7: "x"}, path)
  path.write_text('{"annotations": [', encoding="utf-8")
  with pytest.raises(DataFormatError, match=r"ann\.json:1: invalid JSON"):
    score_vqav2({}, path)
  with pytest.raises(FileNotFoundError, match="VQAv2 annotation file not found"):
    score_vqav2({}, tmp_path / "absent.json")


# --------------------------------------------------------------------------------------------------
# TextVQA and VizWiz.


def test_textvqa(tmp_path):
  data = {
      "dataset_name": "textvqa",
      "dataset_version": "0.5.1",
      "data": [
          {
              "question_id": 34602,
              "image_id": "0054c91397f2fe05",
              "question": "what is the brand?",
              "answers": ["Coca-Cola"] * 4 + ["coca cola"] * 2 + ["coke"] * 4,
          },
          {
              "question_id": 34603,
              "image_id": "005635e119b9f32f",
              "question": "what does the sign say?",
              "answers": ["stop"] * 2 + ["halt"] * 8,
          },
      ],
  }
  path = _write_json(tmp_path / "TextVQA_0.5.1_val.json", data)
  # "Coca Cola" and "Coca-Cola" both normalise to "coca cola": 6 of 10 -> 1; "STOP": 2 -> 0.6.
  score = score_textvqa({34602: "Coca Cola", 34603: "STOP"}, path)
  assert score.per_question == pytest.approx({"34602": 1.0, "34603": 0.6})
  assert score.score == pytest.approx(0.8)


def test_vizwiz(tmp_path):
  def item(image, answers, answer_type, answerable):
    return {
        "image": image,
        "question": "What is this?",
        "answers": [{"answer": a, "answer_confidence": "yes"} for a in answers],
        "answer_type": answer_type,
        "answerable": answerable,
    }

  data = [
      item("VizWiz_val_00000001.jpg", ["unanswerable"] * 10, "unanswerable", 0),
      item("VizWiz_val_00000002.jpg", ["blue"] * 2 + ["unanswerable"] * 8, "other", 1),
      item("VizWiz_val_00000003.jpg", ["yes"] * 10, "yes/no", 1),
      item("VizWiz_val_00000004.jpg", ["unanswerable"] * 10, "unanswerable", 0),
  ]
  path = _write_json(tmp_path / "val.json", data)
  predictions = {
      "VizWiz_val_00000001.jpg": "Unanswerable",  # 1; says unanswerable, rightly (TP)
      "VizWiz_val_00000002.jpg": "unanswerable.",  # 8 agree -> 1; but answerable (FP)
      "VizWiz_val_00000003.jpg": "No",  # 0
      "VizWiz_val_00000004.jpg": "A dog",  # 0; misses an unanswerable one (FN)
  }
  score = score_vizwiz(predictions, path)
  assert score.score == pytest.approx(0.5)
  assert score.breakdown["answer_type"] == pytest.approx(
      {"unanswerable": 0.5, "other": 1.0, "yes/no": 0.0}
  )
  # Unanswerable detection: TP 1, FP 1, FN 1 -> precision = recall = F1 = 1/2.
  assert score.metrics["unanswerable_precision"] == pytest.approx(0.5)
  assert score.metrics["unanswerable_recall"] == pytest.approx(0.5)
  assert score.metrics["unanswerable_f1"] == pytest.approx(0.5)
  data[1].pop("answerable")
  _write_json(path, data)
  with pytest.raises(DataFormatError, match=r"val\.json: record 1 \(VizWiz_val_00000002\.jpg\)"):
    score_vizwiz(predictions, path)


# --------------------------------------------------------------------------------------------------
# GQA.


def test_gqa(tmp_path):
  def question(answer, structural, semantic, balanced=True):
    return {
        "imageId": "n1",
        "question": "?",
        "answer": answer,
        "fullAnswer": "...",
        "isBalanced": balanced,
        "types": {"structural": structural, "semantic": semantic, "detailed": "x"},
    }

  data = {
      "20968379": question("yes", "verify", "attr"),
      "20968380": question("left", "query", "rel"),
      "20968381": question("table", "query", "obj"),
      "20968382": question("no", "verify", "attr", balanced=False),
  }
  path = _write_json(tmp_path / "testdev_balanced_questions.json", data)
  # "Yes." -> "yes" right; "left " -> "left" right; "the table" is not "table": 2/3.
  predictions = {"20968379": "Yes.", "20968380": "left ", "20968381": "the table"}
  score = score_gqa(predictions, path)
  assert score.per_question == {"20968379": 1.0, "20968380": 1.0, "20968381": 0.0}
  assert score.score == pytest.approx(2 / 3)
  assert score.breakdown["structural"] == pytest.approx({"verify": 1.0, "query": 0.5})
  assert score.missing == 0  # the unbalanced question is not scored, so not missing either
  # A prediction for the unbalanced question is ignored, not an error.
  assert score_gqa(predictions | {"20968382": "no"}, path).count == 3


# --------------------------------------------------------------------------------------------------
# ScienceQA-IMG.


SCIENCEQA_LETTER_CASES = [
    ("B", "B"),
    (" C\n", "C"),
    ("C. blue", "C"),
    ("The answer is A.", "A"),
    ("The answer is B", None),  # the pattern's final dot needs one more character
    ("The answer is A. The answer is B.", None),  # two matches
    ("F", None),
    ("I think B", None),
    ("", None),
]


@pytest.mark.parametrize("text,expected", SCIENCEQA_LETTER_CASES)
def test_scienceqa_letter(text, expected):
  assert extract_scienceqa_letter(text) == expected


def _scienceqa_files(tmp_path):
  def problem(choices, answer, image, subject="natural science", split="test"):
    return {
        "question": "?",
        "choices": choices,
        "answer": answer,
        "hint": "",
        "image": image,
        "subject": subject,
        "split": split,
    }

  problems = {
      "1": problem(["a", "b", "c"], 1, "image.png"),
      "2": problem(["a", "b"], 0, "image.png", subject="social science"),
      "3": problem(["x", "y", "z"], 2, "image.png"),
      "4": problem(["p", "q"], 0, None),
      "5": problem(["p", "q"], 0, "image.png", split="train"),
  }
  splits = {"train": ["5"], "val": [], "test": ["1", "2", "3", "4"]}
  path = _write_json(tmp_path / "problems.json", problems)
  _write_json(tmp_path / "pid_splits.json", splits)
  return path


def test_scienceqa_img(tmp_path):
  path = _scienceqa_files(tmp_path)
  # 1: "B" right; 2: "The answer is A." right; 3: "D" is beyond its three choices: wrong; 4: no image.
  predictions = {"1": "B", "2": "The answer is A.", "3": "D", "4": "A"}
  img = score_scienceqa(predictions, path)  # problem 4 has no image: not scored
  assert img.per_question == {"1": 1.0, "2": 1.0, "3": 0.0}
  assert img.score == pytest.approx(2 / 3)
  assert img.breakdown["subject"] == pytest.approx({"natural science": 0.5, "social science": 1.0})
  every = score_scienceqa(predictions, path, subset="all")
  assert every.score == pytest.approx(3 / 4)
  with pytest.raises(DataFormatError, match=r"pid_splits\.json: no split 'minitest'"):
    score_scienceqa(predictions, path, split="minitest")


# --------------------------------------------------------------------------------------------------
# MMBench.

MMBENCH_COLUMNS = ["index", "question", "hint", "A", "B", "C", "D", "answer", "category", "image"]


def _write_mmbench(path, rows):
  with open(path, "w", encoding="utf-8", newline="") as f:
    writer = csv.writer(f, delimiter="\t")
    writer.writerow(MMBENCH_COLUMNS)
    for row in rows:
      writer.writerow(row)
  return path


def _mmbench(tmp_path):
  image = "iVBORw0KGgo" * 2000  # a long base64 cell, as in the real file
  rows = [
      [0, "Which fruit?", "nan", "apple", "banana", "cherry", "date", "B", "object", image],
      [1, "Which colour?", "", "red", "green", "blue", "", "C", "attribute", image],
      [2, "Which animal?", "", "cat", "dog", "", "", "A", "object", image],
      [3, "Which animal?", "", "cat", "dog", "", "", "A", "object", image],
  ]
  return _write_mmbench(tmp_path / "mmbench_dev_20230712.tsv", rows)


MMBENCH_CHOICE_CASES = [
    ("B", "B"),
    ("B. banana", "B"),
    ("(C)", "C"),
    ("The answer is C: cherry", "C"),
    ("A cat", "A"),  # "A" is a word here: MMBench's rule takes it
    ("a cat", "A"),  # no letter; the text of option A
    ("A or B", None),  # two letters, and no option text
    ("banana", "B"),
    ("fruit", None),
]


@pytest.mark.parametrize("text,expected", MMBENCH_CHOICE_CASES)
def test_mmbench_choice(text, expected):
  options = {"A": "cat", "B": "banana", "C": "cherry", "D": "date"}
  assert extract_mmbench_choice(text, options) == expected


def test_mmbench_plain(tmp_path):
  path = _mmbench(tmp_path)
  # 0: "B" right; 1: three options, "The answer is C." right; 2: "a cat" -> A right; 3: ambiguous.
  predictions = {0: "B", 1: "The answer is C.", 2: "a cat", 3: "A or B"}
  score = score_mmbench(predictions, path)
  assert score.per_question == {"0": 1.0, "1": 1.0, "2": 1.0, "3": 0.0}
  assert score.score == pytest.approx(0.75)
  assert score.breakdown["category"] == pytest.approx({"object": 2 / 3, "attribute": 1.0})
  with pytest.raises(ValueError, match="pass circular=True"):
    score_mmbench(predictions | {0: ["B", "A", "D", "C"]}, path)


def test_mmbench_circular_rounds(tmp_path):
  path = _mmbench(tmp_path)
  # Question 0 (answer B, banana, of four): round r shows original option (j + r) mod 4 as letter
  # j, so the right letters are B, A, D, C; round 1 answers with the text, which is option A there.
  # Question 1 (answer C of three): C, B, A; round 2 says B: wrong.
  predictions = {0: ["B", "banana", "D", "C"], 1: ["C", "B", "B"], 2: ["A", "B"], 3: ["A", "A"]}
  score = score_mmbench(predictions, path, circular=True)
  # 2: cat/dog answer A -> rounds A, B: right; 3: rounds A, A: wrong.
  assert score.per_question == {"0": 1.0, "1": 0.0, "2": 1.0, "3": 0.0}
  assert score.score == pytest.approx(0.5)
  # The same answers in plain mode only look at round 0: 0, 1, 2, 3 all right.
  plain = {k: v[0] for k, v in predictions.items()}
  assert score_mmbench(plain, path).score == 1.0
  with pytest.raises(ValueError, match="question 1 has 2 rounds"):
    score_mmbench(predictions | {1: ["C", "B"]}, path, circular=True)


def test_mmbench_circular_copies(tmp_path):
  # The official files' circular copies: index 5 and its copy 1000005, options rotated by one.
  rows = [
      [5, "Which?", "", "cat", "dog", "cow", "", "A", "object", ""],
      [1000005, "Which?", "", "dog", "cow", "cat", "", "C", "object", ""],
      [6, "Which?", "", "red", "blue", "", "", "B", "attribute", ""],
      [1000006, "Which?", "", "blue", "red", "", "", "A", "attribute", ""],
  ]
  path = _write_mmbench(tmp_path / "mmbench.tsv", rows)
  predictions = {5: "A", 1000005: "A", 6: "B", 1000006: "A"}
  plain = score_mmbench(predictions, path)
  assert plain.score == pytest.approx(3 / 4)
  circular = score_mmbench(predictions, path, circular=True)
  assert circular.per_question == {"5": 0.0, "6": 1.0}


def test_mmbench_malformed(tmp_path):
  path = _write_mmbench(tmp_path / "bad.tsv", [[0, "?", "", "x", "y", "", "", "C", "c", ""]])
  with pytest.raises(DataFormatError, match=r"bad\.tsv:2: answer 'C' is not one of the options"):
    score_mmbench({}, path)
  path.write_text("index\tquestion\tA\tB\n0\t?\tx\ty\n", encoding="utf-8")
  with pytest.raises(DataFormatError, match=r"bad\.tsv: no 'answer' column"):
    score_mmbench({}, path)


# --------------------------------------------------------------------------------------------------
# POPE.

POPE_CASES = [
    ("Yes, there is a dog in the image.", "yes"),
    ("There is no dog.", "no"),
    ("No", "no"),
    ("I do not see one", "no"),
    ("There is a cat. No dog though.", "yes"),  # only the first sentence counts
    ("NO", "yes"),  # LLaVA's rule looks for "No", "no" and "not" only
    ("Not,", "yes"),
]


@pytest.mark.parametrize("text,expected", POPE_CASES)
def test_pope_answer(text, expected):
  assert pope_answer(text) == expected


def test_pope(tmp_path):
  labels = ["yes", "yes", "yes", "no", "no", "no"]
  records = [
      {
          "question_id": i + 1,
          "image": f"COCO_val2014_{i:012d}.jpg",
          "text": "Is there a dog?",
          "label": l,
      }
      for i, l in enumerate(labels)
  ]
  path = _write_jsonl(tmp_path / "coco_pope_adversarial.json", records)
  predictions = {
      1: "Yes, there is a dog.",  # TP
      2: "There is no dog.",  # FN
      3: "Yes",  # TP
      4: "No.",  # TN
      5: "I do not see one",  # TN
      6: "There is a cat in the image. No dog",  # yes: FP
  }
  score = score_pope(predictions, path)
  # TP 2, FN 1, TN 2, FP 1: accuracy 4/6, precision 2/3, recall 2/3, F1 2/3, yes-ratio 3/6.
  assert score.metrics == pytest.approx(
      {"accuracy": 4 / 6, "precision": 2 / 3, "recall": 2 / 3, "f1": 2 / 3, "yes_ratio": 0.5}
  )
  assert score.score == pytest.approx(2 / 3)
  # A missing answer counted wrong is the opposite of the label: question 1 becomes a FN.
  wrong = score_pope({k: v for k, v in predictions.items() if k != 1}, path, on_missing="wrong")
  assert wrong.metrics["recall"] == pytest.approx(1 / 3)
  records[2]["label"] = "maybe"
  _write_jsonl(path, records)
  with pytest.raises(DataFormatError, match=r"coco_pope_adversarial\.json:3: label must be"):
    score_pope(predictions, path)


# --------------------------------------------------------------------------------------------------
# Prediction files and the registry.


def test_read_predictions(tmp_path):
  llava = _write_jsonl(
      tmp_path / "answers.jsonl",
      [
          {"question_id": 7, "prompt": "?", "text": "yes", "answer_id": "x"},
          {"question_id": 8, "round_id": 1, "text": "B"},
          {"question_id": 8, "round_id": 0, "text": "A"},
      ],
  )
  assert read_predictions(llava) == {"7": "yes", "8": ["A", "B"]}
  single = _write_jsonl(tmp_path / "one.jsonl", [{"question_id": 3, "text": "no"}])
  assert read_predictions(single) == {"3": "no"}
  results = _write_json(tmp_path / "results.json", [{"question_id": 1, "answer": "two"}])
  assert read_predictions(results) == {"1": "two"}
  mapping = _write_json(tmp_path / "map.json", {"VizWiz_test_1.jpg": "unanswerable"})
  assert read_predictions(mapping) == {"VizWiz_test_1.jpg": "unanswerable"}
  bad = _write_jsonl(tmp_path / "bad.jsonl", [{"question_id": 1, "text": "a"}, {"text": "b"}])
  with pytest.raises(DataFormatError, match=r"bad\.jsonl:2: missing key 'question_id'"):
    read_predictions(bad)
  twice = _write_jsonl(tmp_path / "twice.jsonl", [{"question_id": 1, "text": "a"}] * 2)
  with pytest.raises(DataFormatError, match=r"twice\.jsonl:2: question 1 has a second answer"):
    read_predictions(twice)


def test_registry_lists_the_seven_benchmarks():
  assert set(visual.SCORERS) == set(visual.FORMATS) and len(visual.BENCHMARKS) == 7
  assert set(visual.FORMATS) - set(visual.BENCHMARKS) == {"llava_qa"}


def test_llava_qa_is_exact_match_after_llava_normalisation(tmp_path):
  def record(i, answer):
    turns = [{"from": "human", "value": "<image>\nWhat?"}, {"from": "gpt", "value": answer}]
    return {"id": f"q{i}", "image": "x.png", "conversations": turns}

  golds = ["cat", "cat", "colour", "black and white"]
  path = _write_json(tmp_path / "test.json", [record(i, a) for i, a in enumerate(golds)])
  said = {"q0": "Cat", "q1": "a cat.", "q2": "black and white", "q3": "black, and white"}
  score = visual.score_llava_qa(said, path)
  assert score.per_question == {"q0": 1.0, "q1": 1.0, "q2": 0.0, "q3": 1.0}
  assert score.score == 0.75 and score.count == 4
  jsonl = _write_jsonl(tmp_path / "test.jsonl", [record(i, a) for i, a in enumerate(golds)])
  assert visual.score_llava_qa(said, jsonl).score == 0.75
  with pytest.raises(ValueError, match=r"1 of 4 questions have no prediction"):
    visual.score_llava_qa({k: v for k, v in said.items() if k != "q3"}, path)
  bad = _write_json(tmp_path / "bad.json", [{"id": 1, "conversations": [{"from": "human"}]}])
  with pytest.raises(DataFormatError, match=r"bad.json: record 0: question 1 has no gpt turn"):
    visual.score_llava_qa({}, bad)


def test_command_line(tmp_path, capsys):
  labels = [{"question_id": i, "image": "x.jpg", "text": "?", "label": "yes"} for i in (1, 2)]
  pope = _write_jsonl(tmp_path / "coco_pope_random.json", labels)
  answers = _write_jsonl(
      tmp_path / "answers.jsonl",
      [{"question_id": 1, "text": "Yes"}, {"question_id": 2, "text": "No"}],
  )
  out = tmp_path / "score.json"
  assert visual.main(["pope", str(answers), str(pope), "--out", str(out)]) == 0
  printed = capsys.readouterr().out
  assert "pope: 66.67 (f1) on 2 questions" in printed and "recall: 50.00" in printed
  saved = json.loads(out.read_text())
  assert saved["metrics"]["accuracy"] == 0.5 and saved["per_question"] == {"1": 1.0, "2": 0.0}
  # Bad input: one line naming the file, exit status 2.
  assert visual.main(["pope", str(answers), str(tmp_path / "absent.json")]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "POPE file not found" in err and "absent.json" in err
  # The module entry point, as a user runs it: no warning, the same report.
  result = subprocess.run(
      [sys.executable, "-m", "anlr_jax.evals.visual", "pope", str(answers), str(pope)],
      capture_output=True,
      text=True,
      check=False,
      timeout=120,
  )
  assert result.returncode == 0 and result.stderr == "", result.stderr
  assert result.stdout.startswith("pope: 66.67 (f1) on 2 questions")


def test_mmbench_circular_counts_a_question_only_when_every_round_and_copy_is_right(tmp_path):
  """Wrong in an early round (or copy) and right in the last is wrong: the circular evaluation
  needs every rotation right, not the last one nor any one."""
  path = _mmbench(tmp_path)
  # Question 0 (answer B of four): the right rounds are B, A, D, C. Question 2 (A of two): A, B.
  predictions = {0: ["A", "A", "D", "C"], 2: ["B", "B"]}
  score = score_mmbench(predictions, path, circular=True, on_missing="skip")
  assert score.per_question == {"0": 0.0, "2": 0.0}
  right = {0: ["B", "A", "D", "C"], 2: ["A", "B"]}
  assert score_mmbench(right, path, circular=True, on_missing="skip").score == 1.0
  rows = [  # the official files' circular copies: wrong first copy, right last copy
      [7, "Which?", "", "cat", "dog", "cow", "", "A", "object", ""],
      [1000007, "Which?", "", "dog", "cow", "cat", "", "C", "object", ""],
      [2000007, "Which?", "", "cow", "cat", "dog", "", "B", "object", ""],
  ]
  path = _write_mmbench(tmp_path / "copies.tsv", rows)
  copies = score_mmbench({7: "B", 1000007: "C", 2000007: "B"}, path, circular=True)
  assert copies.per_question == {"7": 0.0}
  assert score_mmbench({7: "A", 1000007: "C", 2000007: "B"}, path, circular=True).score == 1.0
