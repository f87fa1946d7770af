r"""Scorers of the seven visual benchmarks of LLaVA-1.5, each on its official file format.

Every scorer takes the model's answers as a mapping ``question id -> answer text`` (the raw text the
model generated; :func:`read_predictions` reads LLaVA's answer files) and the path of the official
annotation file, and returns a :class:`VisualScore` with fractions in ``[0, 1]``.

One module per job: :mod:`~anlr_jax.evals.visual.normalize` (answer normalisation and the rules that
read a letter or a yes/no out of an answer), :mod:`~anlr_jax.evals.visual.files` (the answer files
and the MMBench TSV, read by one reader for the scorer and the visual eval tasks alike),
:mod:`~anlr_jax.evals.visual.scorers` (the eight scorers, pure functions of the answers and the
official file) and :mod:`~anlr_jax.evals.visual.command` (the command line). The format names are
:data:`anlr_jax.data.formats.VISUAL_FORMATS`.

VQA accuracy (VQAv2, TextVQA, VizWiz)
  Ten people answered each question. An answer ``a`` scores, for the ten subsets of nine of those
  answers, ``min(1, #{people in the subset who said a} / 3)``, averaged over the ten subsets: with
  ``k`` of the ten people agreeing that is 0, 0.3, 0.6, 0.9 and 1 for ``k = 0, 1, 2, 3, >= 4``.
  Answers are compared after the normalisation of the official VQA evaluation
  (:func:`normalize_vqa_answer`): lower case; the punctuation ``; / [ ] " { } ( ) = + \ _ - > < @ `
  , ? !`` removed where it touches a space or when the text holds a digit-comma-digit, else replaced
  by a space; a period removed unless a digit follows; the number words ``none, zero .. ten`` turned
  into digits; the articles ``a, an, the`` dropped; contractions written without their apostrophe
  (``dont``, ``youre``) given it back. :func:`normalize_llava_answer` is that normalisation after
  LLaVA's extra first step (lower case, commas and question marks removed, ``'s`` split off), which
  LLaVA applies to every answer before submitting it.

  * ``vqav2`` — the annotation file (``{"annotations": [{"question_id", "answers": [{"answer",
    "answer_id"}, ...], "answer_type", "question_type"}, ...]}``) and optionally the questions file
    (``{"questions": [{"question_id", "image_id", "question"}]}``), whose ids must then match. The
    model's answer goes through :func:`normalize_llava_answer` (as LLaVA submits it), then through the
    official rule: when the ten human answers are not all the same string, both sides are normalised
    (:func:`normalize_vqa_answer`) before comparing, else they are compared as they are (after
    trimming whitespace). Broken down by answer type and question type.
  * ``textvqa`` — the TextVQA JSON (``{"data": [{"question_id", "answers": [10 strings], ...}]}``).
    As LLaVA's TextVQA evaluation (MMF's ``TextVQAAccuracyEvaluator``): the model's answer and every
    human answer go through :func:`normalize_llava_answer`.
  * ``vizwiz`` — the VizWiz annotations (a JSON list of ``{"image", "question", "answers": [{"answer",
    "answer_confidence"}, ...], "answer_type", "answerable"}``); questions are keyed by the ``image``
    file name. As the official VizWiz evaluation after LLaVA's submission step: the model's answer goes
    through :func:`normalize_llava_answer`, the human answers are taken as they are in the file. Broken
    down by answer type (``yes/no``, ``number``, ``other``, ``unanswerable``); the metrics also hold the
    precision, recall and F1 of saying "unanswerable" exactly when ``answerable`` is 0.

GQA exact match (``gqa``)
  The balanced test-dev questions file (``{qid: {"answer", "isBalanced", "types": {"structural",
  "semantic"}, ...}}``). LLaVA's post-processing (whitespace trimmed, trailing periods removed, lower
  case), then the official rule: correct when equal to ``answer``. Only balanced questions are scored
  (all of ``testdev_balanced``). Broken down by structural and semantic type.

ScienceQA-IMG (``scienceqa``)
  ``problems.json`` (``{pid: {"choices", "answer": index, "image": name or null, "subject", ...}}``) and
  ``pid_splits.json`` beside it (``{"test": [pid, ...], ...}``). The scored problems are the split's
  problems with an image (``subset="img"``, the benchmark; predictions for the others are ignored) or
  all of them (``subset="all"``). LLaVA's
  letter extraction: the whole answer is a letter ``A``-``E``; or it starts with a letter followed by
  ``". "``; or it holds exactly one match of ``The answer is ([A-Z]).`` (the dot matching any one
  character); a letter beyond the problem's choices, or none, is wrong. Broken down by subject.

MMBench (``mmbench``)
  The MMBench TSV (columns ``index, question, A, B, C, D, answer, category``, optional ``hint,
  l2-category, image, ...``; empty option cells mean fewer options). The option letter is extracted
  by MMBench's rule-based matching (:func:`extract_mmbench_choice`; the GPT fallback of the official
  evaluation is not used): the answer's words (after ``. ( ) [ ] , : ; ! * # { }`` become spaces)
  that are an option letter; exactly one -> that letter; else the options whose text appears in the
  answer (case-insensitive); exactly one -> that option. Plain accuracy by default. With
  ``circular=True`` the circular evaluation: a prediction may be a list of answers, answer ``r`` for
  the options rotated ``r`` times (LLaVA's ``--all-rounds``: round ``r`` shows original option ``(j +
  r) mod n`` as letter ``j``), and rows whose ``index`` agree modulo 1,000,000 (the circular copies of
  the official files) form one question; a question counts only when every round of every copy is
  right. Broken down by category (and ``l2-category`` when present).

POPE (``pope``)
  One POPE file (JSON lines ``{"question_id", "image", "text", "label": "yes"|"no"}``, e.g.
  ``coco_pope_adversarial.json``; its ids start again in every file, so score each file on its own).
  LLaVA's yes/no extraction: only the text before the first period is read, commas are removed, and
  the answer is "no" when one of its space-separated words is ``No``, ``no`` or ``not``, else "yes".
  Metrics: accuracy, precision, recall and F1 of "yes", and the yes-ratio; the score is the F1 (a
  precision or recall with a zero denominator is 0).

LLaVA-format questions with answers (``llava_qa``)
  A question file in LLaVA's conversation format (a JSON list or JSONL of ``{"id", "image",
  "conversations": [{"from": "human", "value": "<image>\\n..."}, {"from": "gpt", "value": answer}]}``,
  one question per record, as ``scripts/make_visual_task.py`` writes its test set): exact match of
  the answer and the first ``gpt`` turn, both after :func:`normalize_llava_answer`.

A question of the file with no prediction raises by default (``on_missing="raise"``); ``"skip"``
scores only the questions that have one, ``"wrong"`` counts them as wrong (a missing POPE answer is
the opposite of the label). A prediction for an id the file does not hold raises: the files do not
belong together. Malformed files raise :class:`~anlr_jax.data.formats.DataFormatError` naming the file
(and the record).

From the shell (one line on stderr and exit status 2 for bad input)::

    python -m anlr_jax.evals.visual pope answers.jsonl coco_pope_adversarial.json [--out s.json]
    python -m anlr_jax.evals.visual mmbench answers.jsonl mmbench_dev_20230712.tsv --circular
"""

from anlr_jax.data.formats import VISUAL_BENCHMARKS as BENCHMARKS
from anlr_jax.data.formats import VISUAL_FORMATS as FORMATS
from anlr_jax.evals.visual.command import main
from anlr_jax.evals.visual.files import read_mmbench, read_predictions
from anlr_jax.evals.visual.normalize import (
    CONTRACTIONS,
    extract_mmbench_choice,
    extract_scienceqa_letter,
    gqa_answer,
    normalize_llava_answer,
    normalize_vqa_answer,
    pope_answer,
    vqa_accuracy,
)
from anlr_jax.evals.visual.scorers import (
    SCORERS,
    OnMissing,
    VisualScore,
    score_file,
    score_gqa,
    score_llava_qa,
    score_mmbench,
    score_pope,
    score_scienceqa,
    score_textvqa,
    score_vizwiz,
    score_vqav2,
)

__all__ = [
    "BENCHMARKS",
    "CONTRACTIONS",
    "FORMATS",
    "OnMissing",
    "SCORERS",
    "VisualScore",
    "extract_mmbench_choice",
    "extract_scienceqa_letter",
    "gqa_answer",
    "main",
    "normalize_llava_answer",
    "normalize_vqa_answer",
    "pope_answer",
    "read_mmbench",
    "read_predictions",
    "score_file",
    "score_gqa",
    "score_llava_qa",
    "score_mmbench",
    "score_pope",
    "score_scienceqa",
    "score_textvqa",
    "score_vizwiz",
    "score_vqav2",
    "vqa_accuracy",
]
