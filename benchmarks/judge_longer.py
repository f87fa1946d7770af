r"""The single judgments that a token limit cut, judged again with a longer limit.

Reads saved single-grading records (``mt_bench_single.jsonl``), takes those without a rating
that stopped at the token limit without looping (``failure_kind`` ``length``), and has the same
local judge (loaded as ``anlr judge`` loads it: ``eval.judge.*`` settings) answer the same
prompts, greedily, with ``--max-new-tokens`` instead. Greedy decoding makes the same reply up to
the old limit (checked: ``same_start``), so this shows what the longer limit would have given
those judgments: a rating, a loop, still cut, or a stop without a rating. Each reply is written
to ``--out`` (JSON lines) as its batch ends; a second run with the same ``--out`` goes on. (``anlr
judge`` with a higher ``eval.judge.max_new_tokens`` judges the cut ones again in place, in the
judgment file; this script writes them apart, beside the records it read.)
``--kind loop`` (or ``stopped``) takes those failures instead, e.g. with ``--quantize none`` to
see whether the judge's loops come from its int8 rounding, or with ``--no-repeat-ngram 4`` to see
what the judge writes when it may not repeat a 4-gram of its reply (``eval.judge.no_repeat_ngram``).

    python benchmarks/judge_longer.py docs/results/dialogue_epoch/*/mt_bench_single.jsonl \
        --max-new-tokens 512 --out docs/results/dialogue_epoch/longer_limit.jsonl
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

if __package__ in (None, ""):
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common  # noqa: E402


def cut_records(paths: list[str], kind: str = "length") -> list[dict]:
  """The records of ``paths`` without a rating whose reply failed as ``kind`` (``failure_kind``:
  ``length``, cut by the token limit without a loop; ``loop``; ``stopped``)."""
  from anlr_jax.evals.judge import UNPARSED
  from anlr_jax.evals.judge_probs import failure_kind
  from anlr_jax.evals.mtbench import read_records

  out = []
  for path in paths:
    for r in read_records(path):
      if r.get("score") == UNPARSED and failure_kind(r["judgment"], r.get("finish_reason")) == kind:
        out.append(r)
  return out


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("records", nargs="+", help="mt_bench_single.jsonl files")
  ap.add_argument(
      "--judge",
      default=os.path.expanduser(common.JOINED_JUDGE),
      help="the judge: a .gguf file or a HF model directory (default: the joined offline judge)",
  )
  ap.add_argument("--max-new-tokens", type=int, default=512)
  ap.add_argument(
      "--kind",
      default="length",
      choices=("length", "loop", "stopped"),
      help="the failures to judge again (default: those the token limit cut)",
  )
  ap.add_argument("--quantize", default="int8", help="eval.judge.quantize")
  ap.add_argument("--batch", type=int, default=8, help="eval.judge.batch_size")
  ap.add_argument("--no-repeat-ngram", type=int, default=0, help="eval.judge.no_repeat_ngram")
  ap.add_argument("--out", required=True, help="JSON lines, one per judgment")
  args = ap.parse_args(argv)
  for path in args.records:
    if not os.path.isfile(path):
      sys.exit(f"{path}: no such file")
  if not os.path.exists(args.judge):
    sys.exit(f"--judge: {args.judge} does not exist (anlr judge-model joins it)")

  from anlr_jax.app.config import load_config
  from anlr_jax.app.judge import load_judge
  from anlr_jax.data import mtbench
  from anlr_jax.evals.judge import parse_rating
  from anlr_jax.evals.judge_probs import failure_kind
  from anlr_jax.evals.mtbench import append_records, read_records

  todo = cut_records(args.records, args.kind)
  key = lambda r: (r["model"], r["question_id"], r["turn"])
  done = {key(r) for r in read_records(args.out)} if os.path.exists(args.out) else set()
  todo = [r for r in todo if key(r) not in done]
  print(f"{len(todo)} {args.kind} judgments to judge again ({len(done)} done before)", flush=True)
  if not todo:
    return 0
  config = load_config(
      None,
      [
          f"eval.judge.model={args.judge}",
          f"eval.judge.max_new_tokens={args.max_new_tokens}",
          f"eval.judge.quantize={args.quantize}",
          f"eval.judge.batch_size={args.batch}",
          f"eval.judge.no_repeat_ngram={args.no_repeat_ngram}",
      ],
  )
  start = time.perf_counter()
  judge = load_judge(config)
  print(f"judge loaded in {time.perf_counter() - start:.0f} s", flush=True)
  systems = mtbench.load_judge_prompts()
  for at in range(0, len(todo), args.batch):
    batch = todo[at : at + args.batch]
    start = time.perf_counter()
    replies = judge.judge_fn(
        [(systems[r["judge"][1]]["system_prompt"], r["user_prompt"]) for r in batch]
    )
    seconds = time.perf_counter() - start
    rows = []
    for r, reply in zip(batch, replies):
      finish = judge.probes.finish_reason(reply)
      rating = parse_rating(reply)
      rows.append(
          {
              "model": r["model"],
              "question_id": r["question_id"],
              "turn": r["turn"],
              "category": r["category"],
              "max_new_tokens": args.max_new_tokens,
              "quantize": args.quantize,
              "no_repeat_ngram": args.no_repeat_ngram,
              "old_failure": args.kind,
              "judgment": reply,
              "score": rating,
              "finish_reason": finish,
              "failure": None if rating is not None else failure_kind(reply, finish),
              "same_start": reply.startswith(r["judgment"].rstrip()),
              "batch_seconds": round(seconds, 1),
          }
      )
    append_records(args.out, rows)
    print(
        f"batch {at // args.batch + 1}: {seconds:.0f} s;"
        f" {[row['score'] if row['score'] is not None else row['failure'] for row in rows]}",
        flush=True,
    )
  rows = read_records(args.out)
  outcome = collections.Counter("rated" if r["score"] is not None else r["failure"] for r in rows)
  print(json.dumps({"judgments": len(rows), **outcome}), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
