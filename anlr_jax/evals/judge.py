r"""An LLM judge of MT-Bench answers: single-answer grading and pairwise comparison.

The protocol is FastChat's ``llm_judge``. The judge sees, as system message and user message, a
prompt of ``judge_prompts.jsonl`` (:func:`anlr_jax.data.mtbench.judge_prompt_name`: the ``math``
prompts with the reference answer for math, reasoning and coding; the ``-multi-turn`` form, which
shows the whole conversation, for turn 2) and answers greedily.

**Single-answer grading** reads the rating as the first ``[[N]]`` of the reply (``N`` an integer or
a decimal, ``\[\[(\d+\.?\d*)\]\]``), else the first ``[N]``; a reply with neither is *unparsed*: its
record holds ``score: -1`` (FastChat's marker), it is counted and reported, and it enters no mean.
Scores are averaged per turn, per category and overall (the mean of every parsed turn score).

**Pairwise comparison** of models 1 and 2 plays each (question, turn) twice against position bias:
game 1 shows model 1 as assistant A, game 2 shows it as B. A verdict is ``[[A]]``, ``[[B]]`` or
``[[C]]`` (a tie), looked for in that order; a reply with none is an ``error``. A pair whose games
agree counts as a win or loss for model 1, one that disagrees (inconsistent) or opens with a tie
counts as a tie, and one with an error in either game is left out (counted and reported), as
FastChat's ``show_result`` does. ``win_rate_adjusted`` counts a tie as half a win.

Judgments are appended to a JSONL file after each batch, verbatim, with the user prompt the judge
saw (FastChat's record layout plus ``category`` and ``judge_settings``, the judge's settings that
change its replies: ``dtype``, ``quantize``, ``max_new_tokens``); a rerun judges only what the file
does not hold for this judge and these models, and refuses to go on from judgments its judge made
with other settings (mixed, their mean would describe neither). A higher ``max_new_tokens`` alone
goes on: greedy decoding repeats a reply up to the old limit, so a judgment that ended before it
stands, and one the old limit cut without a verdict (``finish_reason`` ``length``) is judged
again; the new record is appended after the old one and replaces it (the last record of a
judgment counts).

**Beside the protocol** (its fields unchanged), each record holds what the judge's own
probabilities say (:mod:`anlr_jax.evals.judge_probs`, a local judge; ``null`` for a judge behind an
endpoint, which gives no probabilities): ``prob_rating`` (the expected rating after ``Rating: [[``)
and ``prob_rating_dist`` (the ten probabilities), or per game ``g1_prob_verdict`` /
``g2_prob_verdict`` (``{A, B, C}`` probabilities after ``Final verdict: [[``) and
``g1_prob_winner`` / ``g2_prob_winner``; and ``finish_reason`` (``length`` or ``stop``; per game
``g1_finish_reason``, ``g2_finish_reason``). The summaries add the protocol's ``parse_rate``, what
the replies without a verdict were (``failures``: a greedy loop, cut by the token limit, stopped, or
unknown), and the probability ratings' means, their correlation with the protocol's ratings on the
judgments that have both, or for pairs the probability verdicts' win / tie / loss, their agreement
with the protocol's verdicts and the position bias of both (the share of pairs whose two orders
disagree).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import scipy.stats
import tqdm

from anlr_jax.data.mtbench import (
    TURNS,
    Question,
    format_pair,
    format_single,
    judge_prompt_name,
)
from anlr_jax.evals.judge_probs import (
    FAILURE_KINDS,
    RATING_CUE,
    RATINGS,
    VERDICT_CUE,
    VERDICTS,
    JudgeProbes,
    expected_rating,
    failure_kind,
    normalise,
)
from anlr_jax.evals.mtbench import append_records, read_records

JudgeFn = Callable[[list[tuple[str, str]]], list[str]]
"""``[(system message, user message)] -> [judge reply]``, one reply per prompt, in order."""

UNPARSED = -1
"""The ``score`` of a single-answer judgment without a parsable rating (FastChat's marker)."""

_RATING = re.compile(r"\[\[(\d+\.?\d*)\]\]")
_RATING_ONE_BRACKET = re.compile(r"\[(\d+\.?\d*)\]")


def parse_rating(judgment: str) -> float | None:
  """The rating of a single-answer judgment: the first ``[[N]]``, else the first ``[N]``; None
  when there is neither."""
  match = _RATING.search(judgment) or _RATING_ONE_BRACKET.search(judgment)
  return None if match is None else float(match.group(1))


def parse_verdict(judgment: str) -> str:
  """``A``, ``B`` or ``tie`` for a reply holding ``[[A]]``, ``[[B]]`` or ``[[C]]`` (checked in that
  order), else ``error``."""
  for mark, verdict in (("[[A]]", "A"), ("[[B]]", "B"), ("[[C]]", "tie")):
    if mark in judgment:
      return verdict
  return "error"


def _judge_batches(
    judge_fn: JudgeFn,
    items: Sequence[Any],
    prompts: Sequence[Sequence[tuple[str, str]]],
    *,
    batch_size: int,
    desc: str,
    done: int,
    progress: bool,
    write: Callable[[list[Any], list[list[str]]], None],
) -> None:
  """Judges ``items`` (each with one or more prompts) in batches of about ``batch_size`` prompts,
  longest first (similar lengths share a batch); ``write(items, replies)`` after each batch."""
  order = sorted(range(len(items)), key=lambda i: -sum(len(s) + len(u) for s, u in prompts[i]))
  per_item = max(1, batch_size // max(1, max((len(p) for p in prompts), default=1)))
  with tqdm.tqdm(
      total=done + len(items),
      initial=done,
      desc=desc,
      unit="judgment",
      disable=not progress,
      leave=False,
  ) as bar:
    for start in range(0, len(order), per_item):
      chunk = order[start : start + per_item]
      flat = [p for i in chunk for p in prompts[i]]
      replies = judge_fn(flat)
      if len(replies) != len(flat):
        raise ValueError(f"the judge returned {len(replies)} replies for {len(flat)} prompts")
      grouped, at = [], 0
      for i in chunk:
        grouped.append(list(replies[at : at + len(prompts[i])]))
        at += len(prompts[i])
      write([items[i] for i in chunk], grouped)
      bar.update(len(chunk))


def _check_answers(questions: Sequence[Question], answers: Mapping[int, Sequence[str]], where: str):
  missing = [q.question_id for q in questions if q.question_id not in answers]
  if missing:
    raise ValueError(f"{where}: no answer to question(s) {missing[:8]}")


def _check_settings(saved, wanted, key, settings, path: str, cut) -> set:
  """Raises ValueError when a saved record of ``wanted`` (its ``key``) was judged with other
  ``judge_settings`` than ``settings`` (None on either side: not known, not checked), except with
  a lower ``max_new_tokens`` alone, where the reply's end is known (``cut(record)``: True, cut by
  the limit without a verdict; False, ended before it or holds one; None, not known). Returns the
  keys of the records the lower limit cut: judged again (greedy decoding repeats the reply up to
  the old limit, so the records it did not cut stand as they are)."""
  again = set()
  if settings is None:
    return again
  for r in saved:
    theirs = r.get("judge_settings")
    if theirs is None or key(r) not in wanted or theirs == settings:
      continue
    ended = cut(r) if _higher_limit(theirs, settings) else None
    if ended is not None:
      if ended:
        again.add(key(r))
      continue
    diff = ", ".join(
        f"eval.judge.{k}={theirs.get(k)} there, {settings.get(k)} here"
        for k in sorted(set(theirs) | set(settings))
        if theirs.get(k) != settings.get(k)
    )
    raise ValueError(
        f"{path} holds judgments by {tuple(r['judge'])[0]} made with other settings ({diff}):"
        " judge into another directory, or with the same settings to go on"
    )
  return again


def _higher_limit(theirs: Mapping[str, Any], settings: Mapping[str, Any]) -> bool:
  """Whether ``settings`` differ from ``theirs`` only by a higher ``max_new_tokens``."""
  old, new = theirs.get("max_new_tokens"), settings.get("max_new_tokens")
  rest = lambda s: {k: v for k, v in s.items() if k != "max_new_tokens"}
  numbers = isinstance(old, int) and isinstance(new, int)
  return numbers and new > old and rest(theirs) == rest(settings)


def _cut(verdict_missing: bool, finish_reason: str | None) -> bool | None:
  """Whether a reply was cut by the token limit without a verdict (None: its end is not known)."""
  if not verdict_missing:
    return False
  return {"length": True, "stop": False}.get(finish_reason)


def _cut_single(r: Mapping[str, Any]) -> bool | None:
  return _cut(r["score"] == UNPARSED, r.get("finish_reason"))


def _cut_pair(r: Mapping[str, Any]) -> bool | None:
  games = [_cut(r[f"g{g}_winner"] == "error", r.get(f"g{g}_finish_reason")) for g in (1, 2)]
  return True if True in games else None if None in games else False


def _latest(path: str, field: str, key) -> list[dict[str, Any]]:
  """The last record of each ``key`` among the records of ``path`` holding ``field``: a judgment
  made again replaces the one before it."""
  return list({key(r): r for r in read_records(path) if field in r}.values())


def _judged(path: str, field: str, key, wanted, settings, cut, log) -> set:
  """The keys of the judgments ``path`` holds that stand (:func:`_check_settings`: those a lower
  token limit cut are judged again, said by ``log``)."""
  saved = _latest(path, field, key)
  again = _check_settings(saved, wanted, key, settings, path, cut)
  if again and log is not None:
    log(f"  {len(again)} saved judgments cut by a lower token limit are judged again")
  return {key(r) for r in saved} - again


def _probabilities(probes, judgments, cue, choices) -> list[np.ndarray | None]:
  """The normalised choice probabilities of each ``(system, user, reply)``; Nones without
  ``probes``."""
  if probes is None:
    return [None] * len(judgments)
  logprobs = np.asarray(probes.choice_logprobs(judgments, cue, choices))
  if logprobs.shape != (len(judgments), len(choices)):
    raise ValueError(
        f"the judge's probabilities have shape {logprobs.shape}, not {(len(judgments), len(choices))}"
    )
  return list(normalise(logprobs))


def _finish(probes, judgment: str) -> str | None:
  return None if probes is None else probes.finish_reason(judgment)


def _rounded(probs) -> list[float]:
  return [round(float(p), 6) for p in probs]


# ------------------------------------------------------------------------------------- single
def judge_single(
    judge_fn: JudgeFn,
    questions: Sequence[Question],
    answers: Mapping[int, Sequence[str]],
    path: str,
    *,
    model: str,
    judge_name: str,
    prompts: Mapping[str, Mapping[str, Any]],
    batch_size: int,
    progress: bool = True,
    probes: JudgeProbes | None = None,
    judge_settings: Mapping[str, Any] | None = None,
    log: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
  """Grades both turns of each question's answer (see the module doc); returns the records of
  this judge and model for ``questions`` (those saved before and those made now). ``probes``: the
  local judge's probabilities and reply lengths (None: those fields are null). ``judge_settings``:
  saved with each record; a saved record of these questions made with other settings is a
  ValueError (None: not checked), except a lower ``max_new_tokens`` (see the module doc). ``log``:
  a line when saved judgments are judged again."""
  _check_answers(questions, answers, f"answers of {model}")
  key = lambda r: (tuple(r["judge"])[0], r["model"], r["question_id"], r["turn"])
  wanted = {(judge_name, model, q.question_id, t) for q in questions for t in TURNS}
  have = _judged(path, "model", key, wanted, judge_settings, _cut_single, log)
  items, item_prompts = [], []
  for q in questions:
    for turn in TURNS:
      if (judge_name, model, q.question_id, turn) in have:
        continue
      name = judge_prompt_name(q.category, turn)
      user = format_single(prompts[name], q, answers[q.question_id], turn)
      items.append((q, turn, name, user))
      item_prompts.append([(prompts[name]["system_prompt"], user)])

  def write(batch, replies):
    records = []
    judgments = [
        (prompts[name]["system_prompt"], user, j)
        for (_, _, name, user), (j,) in zip(batch, replies)
    ]
    dists = _probabilities(probes, judgments, RATING_CUE, RATINGS)
    for (q, turn, name, user), (judgment,), dist in zip(batch, replies, dists):
      rating = parse_rating(judgment)
      records.append(
          {
              "question_id": q.question_id,
              "category": q.category,
              "model": model,
              "judge": [judge_name, name],
              "judge_settings": judge_settings,
              "user_prompt": user,
              "judgment": judgment,
              "score": UNPARSED if rating is None else rating,
              "turn": turn,
              "tstamp": time.time(),
              "finish_reason": _finish(probes, judgment),
              "prob_rating": None if dist is None else expected_rating(dist),
              "prob_rating_dist": None if dist is None else _rounded(dist),
          }
      )
    append_records(path, records)

  _judge_batches(
      judge_fn,
      items,
      item_prompts,
      batch_size=batch_size,
      desc=f"judging {model}",
      done=2 * len(questions) - len(items),
      progress=progress,
      write=write,
  )
  return [r for r in _latest(path, "model", key) if key(r) in wanted]


def _mean(values: Sequence[float]) -> float | None:
  return float(np.mean(values)) if values else None


def single_summary(records: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
  """Scores of single-answer judgments: ``overall`` (mean of every parsed turn score), ``turns``
  ``{1: mean, 2: mean}``, ``categories`` ``{category: mean}`` (None where nothing parsed), their
  bootstrap intervals ``ci95`` (:func:`bootstrap_interval`), and the counts ``judgments``,
  ``unparsed`` and ``unparsed_rate``."""
  records = list(records)
  scored = [r for r in records if r["score"] != UNPARSED]
  return {
      **_means(scored, "score", _categories(records)),
      "judgments": len(records),
      "unparsed": len(records) - len(scored),
      "unparsed_rate": (len(records) - len(scored)) / len(records) if records else None,
      "parse_rate": len(scored) / len(records) if records else None,
      **_failures(
          [(r["judgment"], r.get("finish_reason")) for r in records if r["score"] == UNPARSED]
      ),
      "prob_rating": _prob_rating_summary(records),
      "rating_correlation": _correlation(
          [(r["score"], r["prob_rating"]) for r in scored if r.get("prob_rating") is not None]
      ),
  }


def _failures(replies: Sequence[tuple[str, str | None]]) -> dict[str, Any]:
  """``failures`` (count per :data:`~anlr_jax.evals.judge_probs.FAILURE_KINDS`) of the replies
  ``(text, finish_reason)`` without a verdict, and ``failure_shares`` (None without failures)."""
  counts = dict.fromkeys(FAILURE_KINDS, 0)
  for text, finish in replies:
    counts[failure_kind(text, finish)] += 1
  shares = {k: n / len(replies) for k, n in counts.items()} if replies else None
  return {"failures": counts, "failure_shares": shares}


def _prob_rating_summary(records: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
  """Means of the probability ratings (overall, per turn, per category); None when no record has
  one (a judge behind an endpoint)."""
  rated = [r for r in records if r.get("prob_rating") is not None]
  if not rated:
    return None
  return {**_means(rated, "prob_rating", _categories(rated)), "judgments": len(rated)}


def _categories(records: Sequence[Mapping[str, Any]]) -> list:
  return sorted({r.get("category") for r in records}, key=str)


def _means(records: Sequence[Mapping[str, Any]], field: str, categories: Sequence) -> dict:
  """The mean ``field`` of ``records`` overall, per turn and per category (None where there is
  none), and ``ci95``, the same means' bootstrap intervals over questions."""
  mean = lambda rs: _mean([r[field] for r in rs])
  ci = lambda rs: bootstrap_interval((r["question_id"], r[field]) for r in rs)

  def each(f):
    return {
        "overall": f(records),
        "turns": {t: f([r for r in records if r["turn"] == t]) for t in TURNS},
        "categories": {c: f([r for r in records if r.get("category") == c]) for c in categories},
    }

  return {**each(mean), "ci95": each(ci)}


def bootstrap_interval(
    scores: Iterable[tuple[Any, float]], *, level: float = 0.95, resamples: int = 9999
) -> list[float] | None:
  """Percentile bootstrap interval of a mean score over questions: ``scores`` are ``(question,
  score)``; each resample draws questions with replacement and takes the mean of all their scores
  (both turns of a question move together). ``[low, high]``; None below two questions. The seed
  is fixed, so a summary is reproducible."""
  by_question: dict[Any, list[float]] = {}
  for question, score in scores:
    by_question.setdefault(question, []).append(float(score))
  if len(by_question) < 2:
    return None
  sums = np.array([sum(v) for v in by_question.values()])
  counts = np.array([len(v) for v in by_question.values()], np.float64)
  result = scipy.stats.bootstrap(
      (sums, counts),
      lambda s, c, axis: s.sum(axis=axis) / c.sum(axis=axis),
      paired=True,
      vectorized=True,
      n_resamples=resamples,
      confidence_level=level,
      method="percentile",
      rng=np.random.default_rng(0),
  )
  return [float(result.confidence_interval.low), float(result.confidence_interval.high)]


def _correlation(pairs: Sequence[tuple[float, float]]) -> dict[str, Any] | None:
  """Pearson's and Spearman's correlation of the ``(protocol, probability)`` ratings; None
  without any pair, None coefficients where fewer than two pairs or a constant side."""
  if not pairs:
    return None
  x, y = (np.asarray(v, np.float64) for v in zip(*pairs))
  ok = len(pairs) >= 2 and x.std() > 0 and y.std() > 0
  pearson = float(np.corrcoef(x, y)[0, 1]) if ok else None
  spearman = float(scipy.stats.spearmanr(x, y).statistic) if ok else None
  return {"pearson": pearson, "spearman": spearman, "judgments": len(pairs)}


# ----------------------------------------------------------------------------------- pairwise
_WINNER_1 = {"A": "model_1", "B": "model_2", "C": "tie"}  # game 1: model 1 is assistant A
_WINNER_2 = {"A": "model_2", "B": "model_1", "C": "tie"}  # game 2: model 1 is assistant B


def judge_pair(
    judge_fn: JudgeFn,
    questions: Sequence[Question],
    answers_1: Mapping[int, Sequence[str]],
    answers_2: Mapping[int, Sequence[str]],
    path: str,
    *,
    model_1: str,
    model_2: str,
    judge_name: str,
    prompts: Mapping[str, Mapping[str, Any]],
    batch_size: int,
    progress: bool = True,
    probes: JudgeProbes | None = None,
    judge_settings: Mapping[str, Any] | None = None,
    log: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
  """Compares the answers of models 1 and 2 on both turns of each question, in both orders (see the
  module doc); returns the records of this judge and pair for ``questions``. ``probes``,
  ``judge_settings`` and ``log`` as for :func:`judge_single`."""
  if model_1 == model_2:
    raise ValueError(f"the two models of a pairwise comparison need two names, got {model_1!r}")
  _check_answers(questions, answers_1, f"answers of {model_1}")
  _check_answers(questions, answers_2, f"answers of {model_2}")
  key = lambda r: (tuple(r["judge"])[0], r["model_1"], r["model_2"], r["question_id"], r["turn"])
  wanted = {(judge_name, model_1, model_2, q.question_id, t) for q in questions for t in TURNS}
  have = _judged(path, "model_1", key, wanted, judge_settings, _cut_pair, log)
  items, item_prompts = [], []
  for q in questions:
    for turn in TURNS:
      if (judge_name, model_1, model_2, q.question_id, turn) in have:
        continue
      name = judge_prompt_name(q.category, turn, pairwise=True)
      one, two = answers_1[q.question_id], answers_2[q.question_id]
      g1 = format_pair(prompts[name], q, one, two, turn)  # model 1 is assistant A
      g2 = format_pair(prompts[name], q, two, one, turn)  # model 1 is assistant B
      system = prompts[name]["system_prompt"]
      items.append((q, turn, name, g1, g2))
      item_prompts.append([(system, g1), (system, g2)])

  def write(batch, replies):
    records = []
    games = [
        (prompts[name]["system_prompt"], g, j)
        for (_, _, name, g1, g2), (j1, j2) in zip(batch, replies)
        for g, j in ((g1, j1), (g2, j2))
    ]
    dists = _probabilities(probes, games, VERDICT_CUE, VERDICTS)
    for k, ((q, turn, name, g1, g2), (j1, j2)) in enumerate(zip(batch, replies)):
      v1, v2 = parse_verdict(j1), parse_verdict(j2)
      d1, d2 = dists[2 * k], dists[2 * k + 1]
      records.append(
          {
              "question_id": q.question_id,
              "category": q.category,
              "model_1": model_1,
              "model_2": model_2,
              "g1_winner": _WINNER_1.get(v1, v1),
              "g2_winner": _WINNER_2.get(v2, v2),
              "judge": [judge_name, name],
              "judge_settings": judge_settings,
              "g1_user_prompt": g1,
              "g1_judgment": j1,
              "g2_user_prompt": g2,
              "g2_judgment": j2,
              "turn": turn,
              "tstamp": time.time(),
              "g1_finish_reason": _finish(probes, j1),
              "g2_finish_reason": _finish(probes, j2),
              "g1_prob_verdict": None if d1 is None else dict(zip(VERDICTS, _rounded(d1))),
              "g2_prob_verdict": None if d2 is None else dict(zip(VERDICTS, _rounded(d2))),
              "g1_prob_winner": None if d1 is None else _WINNER_1[VERDICTS[int(np.argmax(d1))]],
              "g2_prob_winner": None if d2 is None else _WINNER_2[VERDICTS[int(np.argmax(d2))]],
          }
      )
    append_records(path, records)

  _judge_batches(
      judge_fn,
      items,
      item_prompts,
      batch_size=batch_size,
      desc=f"judging {model_1} vs {model_2}",
      done=2 * len(questions) - len(items),
      progress=progress,
      write=write,
  )
  return [r for r in _latest(path, "model_1", key) if key(r) in wanted]


def pair_outcome(record: Mapping[str, Any], *, verdict: str = "winner") -> str:
  """``win`` / ``loss`` (for model 1), ``tie`` (a tie or two games that disagree) or ``error``
  (a game without a verdict); ``verdict="prob_winner"``: of the probability verdicts."""
  g1, g2 = record[f"g1_{verdict}"], record[f"g2_{verdict}"]
  if "error" in (g1, g2):
    return "error"
  if g1 == "tie" or g1 != g2:
    return "tie"
  return "win" if g1 == "model_1" else "loss"


def pair_summary(records: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
  """Model 1's ``win`` / ``tie`` / ``loss`` counts over the pairs both games judged, with
  ``inconsistent`` (games that disagree, counted as ties), ``errors`` (left out), ``win_rate``,
  ``loss_rate`` and ``win_rate_adjusted`` (a tie as half a win)."""
  records = list(records)
  counts = {"win": 0, "tie": 0, "loss": 0, "error": 0}
  for r in records:
    counts[pair_outcome(r)] += 1
  inconsistent = sum(
      1 for r in records if pair_outcome(r) == "tie" and r["g1_winner"] != r["g2_winner"]
  )
  n = counts["win"] + counts["tie"] + counts["loss"]
  rate = lambda x: x / n if n else None
  return {
      "win": counts["win"],
      "tie": counts["tie"],
      "loss": counts["loss"],
      "inconsistent": inconsistent,
      "errors": counts["error"],
      "pairs": len(records),
      "win_rate": rate(counts["win"]),
      "loss_rate": rate(counts["loss"]),
      "win_rate_adjusted": rate(counts["win"] + 0.5 * counts["tie"]),
      **_pair_extras(records),
  }


def _disagree(records: Sequence[Mapping[str, Any]], verdict: str) -> float | None:
  """The share of pairs, both games decided, whose two orders disagree (position bias)."""
  decided = [r for r in records if "error" not in (r[f"g1_{verdict}"], r[f"g2_{verdict}"])]
  if not decided:
    return None
  return sum(r[f"g1_{verdict}"] != r[f"g2_{verdict}"] for r in decided) / len(decided)


def _pair_extras(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
  """Parse rate and failures of the games; the probability verdicts' outcomes, agreement with the
  protocol's verdicts and mean probabilities; the position bias of both (module doc)."""
  fields = ("winner", "judgment", "finish_reason", "prob_winner", "prob_verdict")
  games = [{f: r.get(f"{g}_{f}") for f in fields} for r in records for g in ("g1", "g2")]
  failed = [(g["judgment"], g["finish_reason"]) for g in games if g["winner"] == "error"]
  probed = [r for r in records if None not in (r.get("g1_prob_winner"), r.get("g2_prob_winner"))]
  verdicts = None
  if probed:
    outcomes = [pair_outcome(r, verdict="prob_winner") for r in probed]
    both = [g for g in games if g["winner"] != "error" and g["prob_winner"] is not None]
    dists = [g["prob_verdict"] for g in games if g["prob_verdict"] is not None]
    verdicts = {
        "win": outcomes.count("win"),
        "tie": outcomes.count("tie"),
        "loss": outcomes.count("loss"),
        "inconsistent": sum(r["g1_prob_winner"] != r["g2_prob_winner"] for r in probed),
        "pairs": len(probed),
        "win_rate_adjusted": (outcomes.count("win") + 0.5 * outcomes.count("tie")) / len(probed),
        "agreement": _mean([g["winner"] == g["prob_winner"] for g in both]),
        "agreement_games": len(both),
        "mean_probs": {v: _mean([d[v] for d in dists]) for v in VERDICTS},
    }
  return {
      "parse_rate": (len(games) - len(failed)) / len(games) if games else None,
      **_failures(failed),
      "prob_verdicts": verdicts,
      "position_bias": {
          "protocol": _disagree(records, "winner"),
          "probability": _disagree(probed, "prob_winner") if probed else None,
      },
  }


def _share(value: float | None) -> str:
  return "n/a" if value is None else f"{100 * value:.0f}%"


def _failure_text(summary: Mapping[str, Any]) -> str:
  shares = summary["failure_shares"]
  if not shares:
    return "no failures"
  names = {"loop": "greedy loop", "length": "cut by the token limit", "stopped": "stopped"}
  return ", ".join(
      f"{_share(shares[k])} {names.get(k, k)}" for k in FAILURE_KINDS if summary["failures"][k]
  )


NO_PROBABILITIES = "none (a judge behind an endpoint gives no probabilities)"


def format_single_extras(summary: Mapping[str, Any]) -> str:
  """One line: the protocol's parse rate and failures, the probability rating and its
  correlation with the protocol's (of :func:`single_summary`)."""
  prob, corr = summary["prob_rating"], summary["rating_correlation"]
  num = lambda v: "n/a" if v is None else f"{v:.2f}"
  if prob is None:
    rated = NO_PROBABILITIES
  else:
    rated = f"{num(prob['overall'])}/10 over {prob['judgments']} judgments"
    if corr is not None:
      rated += (
          f"; correlation with the protocol's rating r = {num(corr['pearson'])} (Spearman"
          f" {num(corr['spearman'])}) on the {corr['judgments']} with both"
      )
  return (
      f"  protocol rating parsed in {_share(summary['parse_rate'])} of {summary['judgments']}"
      f" judgments ({_failure_text(summary)}); probability rating: {rated}"
  )


def format_pair_extras(summary: Mapping[str, Any]) -> str:
  """One line: the games' parse rate and failures, the probability verdicts and position bias
  (of :func:`pair_summary`)."""
  verdicts, bias = summary["prob_verdicts"], summary["position_bias"]
  if verdicts is None:
    probs = NO_PROBABILITIES
  else:
    probs = (
        f"{verdicts['win']} win / {verdicts['tie']} tie / {verdicts['loss']} loss, agreeing with"
        f" the protocol's verdict in {_share(verdicts['agreement'])} of"
        f" {verdicts['agreement_games']} games"
    )
  return (
      f"  protocol verdict parsed in {_share(summary['parse_rate'])} of {2 * summary['pairs']}"
      f" games ({_failure_text(summary)}); probability verdicts: {probs}; the two orders"
      f" disagree in {_share(bias['protocol'])} of pairs (protocol),"
      f" {_share(bias['probability'])} (probability)"
  )


__all__ = [
    "JudgeFn",
    "NO_PROBABILITIES",
    "format_pair_extras",
    "format_single_extras",
    "UNPARSED",
    "judge_pair",
    "judge_single",
    "pair_outcome",
    "pair_summary",
    "parse_rating",
    "parse_verdict",
    "single_summary",
]
