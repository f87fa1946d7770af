r"""The local MT-Bench judge on MT-Bench's own judge prompts: before / after, side by side.

Each setting runs in its own process (its peak resident memory, ``VmHWM`` reset before each phase,
is its own), loads the judge as ``anlr judge`` does and judges one batch of real single-grading
prompts with the product's generation and probability rating, put together as
:func:`anlr_jax.app.judge.load_judge` puts them: the prompts of the committed dialogue answers
(``docs/results/dialogue_epoch/lora``), built as ``anlr judge`` builds them and ordered longest
first as it batches them; the ``--batch`` prompts around the median length are taken. It times

    prefill   the replies' generation cut to one new token (the prompts' prefill)
    reply     the generation of ``--tokens`` new tokens (no early stop is forced: a reply that
              ends earlier ends the batch earlier, as in a run)
    probe     the probability rating of those replies (``probes.choice_logprobs``)

each less the seconds its compiles took (JAX's compile events, reported apart), and derives the
per-step decode time ``(reply - prefill) / (tokens - 1)``. A batch of judgments of ``T`` new
tokens then costs ``prefill + (T - 1) * step + probe``; the rate (judgments per hour) is reported
for ``T`` in ``--lengths``. The probe's time is the one measured after ``--tokens``-token replies:
prefilling again (the ``before`` setting) costs more after longer replies, so its rate at 200
tokens is an upper bound. A setting is ``quantize:prefill_chunk:reuse`` (``prefill_chunk`` ``0``:
each batch in one pass at the prompt ladder's width; ``reuse`` 1: the probe goes on from the
replies' KV cache, 0: it prefills prompt, reply and cue again).

    python benchmarks/judge_real.py --settings int8:0:0,int8:256:1 --json out.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time

if __package__ in (None, ""):
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common  # noqa: E402

ANSWERS = os.path.join("docs", "results", "dialogue_epoch", "lora", "mt_bench_answers.jsonl")


def parse_setting(setting: str) -> tuple[str, int, bool]:
  """``(quantize, prefill_chunk or 0, reuse)`` of a ``quantize:prefill_chunk:reuse`` setting."""
  parts = setting.split(":")
  if len(parts) != 3 or not parts[1].isdigit() or parts[2] not in ("0", "1"):
    raise ValueError(f"--settings: {setting!r} is not quantize:prefill_chunk:reuse (reuse 0 or 1)")
  return parts[0], int(parts[1]), parts[2] == "1"


def real_prompts(answers_file: str, count: int) -> list[tuple[str, str]]:
  """``count`` single-grading ``(system, user)`` prompts of ``answers_file`` around the median
  length, in the order ``anlr judge`` batches them (longest first)."""
  from anlr_jax.app.judge import read_answers
  from anlr_jax.data import mtbench
  from anlr_jax.evals.judge import TURNS, judge_prompt_name

  _, answers = read_answers(answers_file)
  templates = mtbench.load_judge_prompts()
  prompts = []
  for q in mtbench.load_questions():
    if q.question_id not in answers:
      continue
    for turn in TURNS:
      template = templates[judge_prompt_name(q.category, turn)]
      user = mtbench.format_single(template, q, answers[q.question_id], turn)
      prompts.append((template["system_prompt"], user))
  prompts.sort(key=lambda p: -(len(p[0]) + len(p[1])))
  first = max(0, len(prompts) // 2 - count // 2)
  return prompts[first : first + count]


def worker(args) -> dict:
  import dataclasses

  from anlr_jax.app.config import ModelSection, RunConfig
  from anlr_jax.app.judge import judge_prompt
  from anlr_jax.app.model import load_base
  from anlr_jax.app.text_generation import make_generate_fn
  from anlr_jax.compiles import compile_log
  from anlr_jax.evals.judge_probs import (
      RATING_CUE,
      RATINGS,
      ReplyHolder,
      expected_rating,
      local_probes,
      normalise,
  )
  from benchmarks import common

  quantize, chunk, reuse = parse_setting(args.setting)
  config = dataclasses.replace(
      RunConfig(), model=ModelSection(path=args.model, dtype="float32", quantize=quantize)
  )
  t0 = time.perf_counter()
  model, _, tokenizer = load_base(config)  # as anlr judge loads eval.judge.model
  model.eval()
  load_s = time.perf_counter() - t0
  peak_load = common.peak_rss_mib() / 1024
  prompts = real_prompts(args.answers, args.batch)
  texts = [judge_prompt(tokenizer, s, u) for s, u in prompts]
  holder = ReplyHolder() if reuse else None
  kw = dict(batch_size=args.batch, template="chat", prefill_chunk=chunk or None)
  prefill = make_generate_fn(model, tokenizer, max_new_tokens=1, **kw)
  reply = make_generate_fn(
      model, tokenizer, max_new_tokens=args.tokens, hold=holder and holder.hold, **kw
  )
  probes = local_probes(
      model,
      tokenizer,
      lambda s, u: judge_prompt(tokenizer, s, u),
      batch_size=args.batch,
      max_new_tokens=args.tokens,
      prefill_chunk=chunk or None,
      held=holder,
  )
  times, compiles, peaks = {}, {}, {}

  def timed(name, fn, *a):
    common.reset_peak_rss()
    with compile_log() as log:
      t = time.perf_counter()
      out = fn(*a)
      spent = time.perf_counter() - t
    times[name], compiles[name] = spent - log.seconds, round(log.seconds, 2)
    peaks[name] = round(common.peak_rss_mib() / 1024, 3)
    return out

  timed("prefill_s", prefill, texts)
  replies = timed("reply_s", reply, texts)
  judgments = [(s, u, r) for (s, u), r in zip(prompts, replies)]
  logprobs = timed("probe_s", probes.choice_logprobs, judgments, RATING_CUE, RATINGS)
  ratings = [expected_rating(q) for q in normalise(logprobs)]
  step = (times["reply_s"] - times["prefill_s"]) / max(1, args.tokens - 1)
  if step <= 0:  # the difference of two timed calls: a loaded machine can make it nonsense
    step = float("nan")
  rate = lambda n: 3600 * args.batch / (times["prefill_s"] + (n - 1) * step + times["probe_s"])
  return {
      "setting": args.setting,
      "batch": args.batch,
      "prompt_tokens": [len(tokenizer(t, add_special_tokens=False).input_ids) for t in texts],
      "reply_tokens": [len(tokenizer(r, add_special_tokens=False).input_ids) for r in replies],
      "load_s": round(load_s, 1),
      **{k: round(v, 2) for k, v in times.items()},
      "compile_s": compiles,
      "decode_step_s": round(step, 4),
      "judgments_per_hour": {str(n): round(rate(n), 2) for n in [args.tokens, *args.lengths]},
      "peak_loading_gib": round(peak_load, 3),
      "peak_judging_gib": max(peaks.values()),
      "peak_gib": peaks,
      "prob_ratings": [round(r, 6) for r in ratings],
      "replies": replies,
  }


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument(
      "--model", default=os.path.expanduser(common.JOINED_JUDGE), help="the judge (default: joined)"
  )
  ap.add_argument("--answers", default=ANSWERS, help="MT-Bench answers whose judge prompts to use")
  ap.add_argument(
      "--settings",
      default="int8:0:0,int8:256:1",
      help="comma-separated quantize:prefill_chunk:reuse; the first is the reference of the ratios",
  )
  ap.add_argument("--batch", type=int, default=8, help="judge prompts in the batch")
  ap.add_argument("--tokens", type=int, default=32, help="new tokens of the timed replies")
  ap.add_argument("--lengths", default="200,500", help="reply lengths to report the rate for")
  ap.add_argument("--json", help="also write the results to this file")
  ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  ap.add_argument("--setting", help=argparse.SUPPRESS)
  args = ap.parse_args()
  args.lengths = [int(n) for n in args.lengths.split(",") if n]
  if args.worker:
    common.emit_result(worker(args))
    return
  for setting in args.settings.split(","):
    try:
      parse_setting(setting)
    except ValueError as err:
      sys.exit(str(err))
  if not os.path.isfile(args.model):
    sys.exit(f"--model: {args.model} does not exist (anlr judge-model joins it)")
  worker_args = []
  for key in ("model", "answers", "batch", "tokens"):
    worker_args += [f"--{key}", str(getattr(args, key))]
  worker_args += ["--lengths", ",".join(map(str, args.lengths))]
  results = common.run_settings(__file__, args.settings.split(","), worker_args)
  base = results[0]
  for r in results:
    if "error" in r or "error" in base:
      continue
    r["same_replies_as_first"] = sum(a == b for a, b in zip(r["replies"], base["replies"]))
    r["prob_rating_max_diff_vs_first"] = max(
        abs(a - b) for a, b in zip(r["prob_ratings"], base["prob_ratings"])
    )
    r["ratio_vs_first"] = {
        n: round(r["judgments_per_hour"][n] / base["judgments_per_hour"][n], 3)
        for n in r["judgments_per_hour"]
    }
    print(
        f"{r['setting']:>12}: prefill {r['prefill_s']:.1f} s, decode {r['decode_step_s']:.3f}"
        f" s/step, probe {r['probe_s']:.1f} s; judgments/h {r['judgments_per_hour']}"
        f" (x{r['ratio_vs_first']} of {base['setting']}); peak judging"
        f" {r['peak_judging_gib']:.2f} GiB (loading {r['peak_loading_gib']:.2f}); replies equal"
        f" to {base['setting']}'s: {r['same_replies_as_first']} of {r['batch']}, probability"
        f" ratings within {r['prob_rating_max_diff_vs_first']:.2g}"
    )
  common.write_record(args.json, results)


if __name__ == "__main__":
  main()
