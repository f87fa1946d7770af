"""``python -m anlr_jax.evals.visual BENCHMARK PREDICTIONS OFFICIAL_FILE [options]``: scores a
model's answers on one of LLaVA-1.5's seven visual benchmarks (see :mod:`anlr_jax.evals.visual`);
one line on stderr and exit status 2 for bad input.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from typing import Any

from anlr_jax import fileio
from anlr_jax.data.formats import VISUAL_FORMATS as FORMATS
from anlr_jax.evals.visual.scorers import VisualScore, score_file


def _report(score: VisualScore) -> str:
  lines = [
      f"{score.benchmark}: {100 * score.score:.2f} ({score.primary}) on {score.count} questions"
  ]
  if score.missing:
    lines[0] += f", {score.missing} without a prediction"
  lines += [f"  {name}: {100 * value:.2f}" for name, value in score.metrics.items()]
  for kind, groups in score.breakdown.items():
    lines.append(f"  by {kind}:")
    lines += [f"    {group or '(none)'}: {100 * value:.2f}" for group, value in groups.items()]
  return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
  """``python -m anlr_jax.evals.visual BENCHMARK PREDICTIONS OFFICIAL_FILE [options]``."""
  import argparse  # pylint: disable=import-outside-toplevel

  parser = argparse.ArgumentParser(
      prog="python -m anlr_jax.evals.visual",
      description="Scores a model's answers on one of LLaVA-1.5's seven visual benchmarks.",
  )
  parser.add_argument("benchmark", choices=FORMATS)
  parser.add_argument("predictions", help="LLaVA answer JSONL, VQA results JSON or {id: text} JSON")
  parser.add_argument("official", help="the benchmark's official annotation / question file")
  parser.add_argument("--questions", help="vqav2: the questions file, checked against the ids")
  parser.add_argument("--splits", help="scienceqa: pid_splits.json (default: beside problems.json)")
  parser.add_argument("--split", default="test", help="scienceqa: the split (default test)")
  parser.add_argument("--subset", choices=("img", "all"), default="img", help="scienceqa")
  parser.add_argument("--circular", action="store_true", help="mmbench: circular evaluation")
  parser.add_argument("--on_missing", choices=("raise", "skip", "wrong"), default="raise")
  parser.add_argument("--out", help="also write the score (and each question's) as JSON here")
  args = parser.parse_args(argv)
  options: dict[str, Any] = {"on_missing": args.on_missing}
  if args.benchmark == "vqav2" and args.questions:
    options["questions_path"] = args.questions
  if args.benchmark == "scienceqa":
    options |= {"splits_path": args.splits, "split": args.split, "subset": args.subset}
  if args.benchmark == "mmbench":
    options["circular"] = args.circular
  try:
    score = score_file(args.benchmark, args.predictions, args.official, **options)
  except (OSError, ValueError, TypeError) as err:
    print(f"error: {err}", file=sys.stderr)
    return 2
  print(_report(score))
  if args.out:
    fileio.write_json_atomic(args.out, dataclasses.asdict(score))
  return 0


__all__ = ["main"]
