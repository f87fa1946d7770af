r"""Answer normalisation of the visual benchmarks (see :mod:`anlr_jax.evals.visual`): the official
VQA normalisation (:func:`normalize_vqa_answer`), LLaVA's extra first step
(:func:`normalize_llava_answer`), VQA accuracy, and the rules that read the answer out of a model's
text (GQA's post-processing, ScienceQA's and MMBench's letters, POPE's yes/no).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

_PUNCTUATION = (
    ";",
    "/",
    "[",
    "]",
    '"',
    "{",
    "}",
    "(",
    ")",
    "=",
    "+",
    "\\",
    "_",
    "-",
    ">",
    "<",
    "@",
)


_PUNCTUATION += ("`", ",", "?", "!")


_DIGIT_COMMA_DIGIT = re.compile(r"\d,\d")


_PERIOD = re.compile(r"\.(?!\d)")


_NUMBER_WORDS = {
    "none": "0",
    "zero": "0",
    "one": "1",
    "two": "2",
    "three": "3",
    "four": "4",
    "five": "5",
    "six": "6",
    "seven": "7",
    "eight": "8",
    "nine": "9",
    "ten": "10",
}


_ARTICLES = frozenset({"a", "an", "the"})


_CONTRACTED = """
ain't aren't can't could've couldn't couldn't've didn't doesn't don't hadn't hadn't've hasn't
haven't he'd he'd've he's how'd how'll how's isn't it'd it'd've it'll ma'am mightn't mightn't've
might've mustn't must've needn't not've o'clock oughtn't 'ow's'at shan't she'd've should've
shouldn't shouldn't've somebody'd've somebody'll somebody's someone'd someone'd've someone'll
someone's something'd something'd've something'll that's there'd there'd've there're there's they'd
they'd've they'll they're they've 'twas wasn't we'd've we've weren't what'll what're what's what've
when's where'd where's where've who'd who'd've who'll who's who've why'll why're why's won't
would've wouldn't wouldn't've y'all y'all'll y'all'd've you'd you'd've you'll you're you've
""".split()


def _contractions() -> dict[str, str]:
  table = {}
  for word in _CONTRACTED:
    for i, char in enumerate(word):
      if char == "'":
        table[word[:i] + word[i + 1 :]] = word
  table["somebody'd"] = "somebodyd"
  return table


CONTRACTIONS = _contractions()
"""Contracted words without an apostrophe -> with it, as the official VQA evaluation restores them."""


def _process_punctuation(text: str) -> str:
  out = text
  drop_all = _DIGIT_COMMA_DIGIT.search(text) is not None
  for p in _PUNCTUATION:
    if drop_all or p + " " in text or " " + p in text:
      out = out.replace(p, "")
    else:
      out = out.replace(p, " ")
  return _PERIOD.sub("", out)


def _process_digit_article(text: str) -> str:
  words = [_NUMBER_WORDS.get(w, w) for w in text.lower().split()]
  return " ".join(CONTRACTIONS.get(w, w) for w in words if w not in _ARTICLES)


def normalize_vqa_answer(text: str) -> str:
  """An answer as the official VQA evaluation compares it (see the module docstring)."""
  text = text.replace("\n", " ").replace("\t", " ").strip()
  return _process_digit_article(_process_punctuation(text))


def normalize_llava_answer(text: str) -> str:
  """LLaVA's answer processing (MMF's EvalAI processor): lower case, commas and question marks
  removed, ``'s`` split off as a word, then :func:`normalize_vqa_answer`."""
  text = text.lower().replace(",", "").replace("?", "").replace("'s", " 's")
  return normalize_vqa_answer(text)


def vqa_accuracy(answer: str, human_answers: Sequence[str]) -> float:
  """`answer`'s VQA accuracy against the human answers, compared as they are: the mean over the
  leave-one-out subsets of ``min(1, matches / 3)``."""
  n = len(human_answers)
  if n == 0:
    raise ValueError("no human answers")
  k = sum(a == answer for a in human_answers)
  # Leaving out one of the k matching answers leaves k - 1 matches; leaving out another, k.
  return (k * min(1.0, (k - 1) / 3) + (n - k) * min(1.0, k / 3)) / n


def gqa_answer(text: str) -> str:
  """LLaVA's GQA post-processing: whitespace trimmed, trailing periods removed, lower case."""
  return text.strip().rstrip(".").lower()


SCIENCEQA_LETTERS = "ABCDE"


_THE_ANSWER_IS = re.compile(r"The answer is ([A-Z]).")


def extract_scienceqa_letter(text: str) -> str | None:
  """LLaVA's ScienceQA letter extraction (see the module docstring); None when it finds none."""
  text = text.strip()
  if text in SCIENCEQA_LETTERS and len(text) == 1:
    return text
  if len(text) >= 3 and text[0] in SCIENCEQA_LETTERS and text[1:3] == ". ":
    return text[0]
  found = _THE_ANSWER_IS.findall(text)
  return found[0] if len(found) == 1 else None


MMBENCH_LETTERS = "ABCD"


_MMBENCH_SEPARATORS = str.maketrans({c: " " for c in ".()[],:;!*#{}"})


def extract_mmbench_choice(text: str, options: Mapping[str, str]) -> str | None:
  """MMBench's rule-based option matching (see the module docstring); None when it is ambiguous."""
  words = text.translate(_MMBENCH_SEPARATORS).split()
  letters = [letter for letter in options if letter in words]
  if len(letters) == 1:
    return letters[0]
  lowered = text.lower()
  matches = [letter for letter, option in options.items() if str(option).lower() in lowered]
  return matches[0] if len(matches) == 1 else None


def pope_answer(text: str) -> str:
  """LLaVA's POPE yes/no extraction (see the module docstring)."""
  first_sentence = text.split(".", 1)[0].replace(",", "")
  words = first_sentence.split(" ")
  return "no" if "No" in words or "no" in words or "not" in words else "yes"


__all__ = [
    "CONTRACTIONS",
    "MMBENCH_LETTERS",
    "SCIENCEQA_LETTERS",
    "extract_mmbench_choice",
    "extract_scienceqa_letter",
    "gqa_answer",
    "normalize_llava_answer",
    "normalize_vqa_answer",
    "pope_answer",
    "vqa_accuracy",
]
