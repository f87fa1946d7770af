r"""Judgments per hour and peak resident memory of a local MT-Bench judge, per setting, side by side.

Each setting (``eval.judge.dtype`` / ``eval.judge.quantize``) runs in its own process, so its peak
resident memory (``VmHWM``) is its own. A process loads the judge as ``anlr judge`` does
(:func:`anlr_jax.app.model.load_base` with the judge's model section), builds real single-grading
judge prompts (MT-Bench's ``single-v1`` prompt of the first ``--prompts`` questions, with a short
made-up answer, in the judge's chat template) and times, with the product's own jitted programs
(:mod:`anlr_jax.models.generation`):

    prefill   one pass over the left-padded prompt batch (width: the ladder of prompt_width)
    decode    ``--tokens`` single-token steps after it (per-step median)

each after its own compile (compile seconds reported apart). A judgment of ``T`` new tokens then
costs ``prefill + T * decode`` per batch of ``--batch`` judgments, and the judgments per hour are
``3600 * batch / (prefill + T * decode)``, reported for ``T = --tokens`` and for the lengths in
``--lengths`` (FastChat's judge replies run to a few hundred tokens). The probability rating's
extra forward pass is left out (the same for every setting).

    python benchmarks/judge_speed.py --json out.json
    python benchmarks/judge_speed.py --settings float32:none,float32:int8 --tokens 4
    python benchmarks/judge_speed.py --settings float32:none:1,float32:nf4:8 --prompts 8

A setting's third field is its batch (the rate is per judgment, so batches compare directly).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

if __package__ in (None, ""):
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common  # noqa: E402

ANSWER = "The answer is 42, because the question asks for a number and 42 is a number."


def peak_rss_gib() -> float:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith("VmHWM:"):
        return int(line.split()[1]) / 2**20
  return float("nan")


def parse_setting(setting: str, batch: int) -> tuple[str, str, int]:
  """``(dtype, quantize, batch)`` of a ``dtype:quantize[:batch]`` setting (``batch``: the default)."""
  parts = setting.split(":")
  if len(parts) not in (2, 3) or (len(parts) == 3 and not parts[2].isdigit()):
    raise ValueError(f"--settings: {setting!r} is not dtype:quantize or dtype:quantize:batch")
  return parts[0], parts[1], int(parts[2]) if len(parts) == 3 else batch


def worker(args) -> dict:
  import dataclasses

  import jax
  import jax.numpy as jnp
  from flax import nnx

  from anlr_jax.app.config import ModelSection, RunConfig
  from anlr_jax.app.judge import judge_prompt
  from anlr_jax.app.model import load_base
  from anlr_jax.compiles import compile_log
  from anlr_jax.data import mtbench
  from anlr_jax.models import generation
  from anlr_jax.models.llama import init_cache

  dtype, quantize, args.batch = parse_setting(args.setting, args.batch)
  config = dataclasses.replace(
      RunConfig(), model=ModelSection(path=args.model, dtype=dtype, quantize=quantize)
  )
  t0 = time.perf_counter()
  model, _, tokenizer = load_base(config)
  model.eval()
  load_s = time.perf_counter() - t0
  from benchmarks import common

  peak_load = peak_rss_gib()
  rss_loaded = common.current_rss_mib() / 1024
  common.reset_peak_rss()  # from here on VmHWM is the peak while judging
  template = mtbench.load_judge_prompts()["single-v1"]
  questions = mtbench.load_questions()[: args.prompts]
  rows = []
  for q in questions:
    user = mtbench.format_single(template, q, [ANSWER, ANSWER], 1)
    text = judge_prompt(tokenizer, template["system_prompt"], user)
    rows.append(tokenizer(text, add_special_tokens=False).input_ids)
  rows = (rows * args.batch)[: args.batch]
  pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
  ids, mask = generation.left_padded_batch(rows, int(pad), batch_size=args.batch)
  ids, mask = jnp.asarray(ids), jnp.asarray(mask)
  graphdef, state = nnx.split(model)
  params = generation.SamplingParams(
      temperature=jnp.float32(1.0),
      top_k=jnp.int32(0),
      top_p=jnp.float32(1.0),
      eos_token_id=jnp.int32(-1),  # no early stop: every step is timed
      pad_token_id=jnp.int32(pad),
  )
  rng = jax.random.key(0)
  length = ids.shape[1] + args.tokens + 1

  def prefill():
    cache = init_cache(model.config, ids.shape[0], length)
    out = generation._prefill(graphdef, state, ids, mask, cache, rng, params, greedy=True)
    jax.block_until_ready(out)
    return out

  with compile_log() as compiled:
    t = time.perf_counter()
    prefill()
    first = time.perf_counter() - t
  prefill_compile_s = compiled.seconds
  times = []
  for _ in range(args.prefill_repeats):
    t = time.perf_counter()
    token, cache, done, position = prefill()
    times.append(time.perf_counter() - t)
  prefill_s = statistics.median(times)
  steps = []
  with compile_log() as decode_compiled:
    for step in range(args.tokens + 1):
      t = time.perf_counter()
      token, cache, done, position = generation._decode_step(
          graphdef,
          state,
          token,
          cache,
          done,
          position,
          rng,
          jnp.int32(step + 1),
          params,
          greedy=True,
      )
      jax.block_until_ready(token)
      steps.append(time.perf_counter() - t)
  decode_s = statistics.median(steps[1:])  # the first step compiles
  rate = lambda n: 3600 * args.batch / (prefill_s + n * decode_s)
  return {
      "setting": args.setting,
      "batch": args.batch,
      "prompt_tokens": [len(r) for r in rows],
      "width": int(ids.shape[1]),
      "load_s": round(load_s, 2),
      "prefill_first_call_s": round(first, 2),
      "prefill_compile_s": round(prefill_compile_s, 2),
      "prefill_s": round(prefill_s, 3),
      "prefill_runs_s": [round(t, 3) for t in times],
      "decode_compile_s": round(decode_compiled.seconds, 2),
      "decode_step_s": round(decode_s, 4),
      "decode_steps_s": [round(t, 4) for t in steps],
      "judgments_per_hour": {str(n): round(rate(n), 2) for n in [args.tokens, *args.lengths]},
      "peak_rss_gib": round(max(peak_load, peak_rss_gib()), 3),
      "peak_loading_gib": round(peak_load, 3),
      "rss_loaded_gib": round(rss_loaded, 3),
      "peak_judging_gib": round(peak_rss_gib(), 3),
  }


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument(
      "--model", default=os.path.expanduser(common.JOINED_JUDGE), help="the judge (default: joined)"
  )
  ap.add_argument(
      "--settings",
      default="float32:none,float32:int8,float32:nf4",
      help=(
          "comma-separated dtype:quantize[:batch] (batch: judge prompts per batch, default"
          " --batch); the first is the reference of the ratios"
      ),
  )
  ap.add_argument("--prompts", type=int, default=1, help="MT-Bench questions (first ones)")
  ap.add_argument("--batch", type=int, default=1, help="judge prompts per batch")
  ap.add_argument("--tokens", type=int, default=4, help="decode steps timed (the new-token cap)")
  ap.add_argument("--lengths", default="200,500", help="reply lengths to report the rate for")
  ap.add_argument("--prefill-repeats", type=int, default=1)
  ap.add_argument("--json", help="also write the results to this file")
  ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  ap.add_argument("--setting", help=argparse.SUPPRESS)
  args = ap.parse_args()
  args.lengths = [int(n) for n in args.lengths.split(",") if n]
  if args.worker:
    common.emit_result(worker(args))
    return
  if not os.path.isfile(args.model):
    sys.exit(f"--model: {args.model} does not exist (anlr judge-model joins it)")
  for setting in args.settings.split(","):
    try:
      parse_setting(setting, args.batch)
    except ValueError as err:
      sys.exit(str(err))
  worker_args = []
  for key in ("model", "prompts", "batch", "tokens", "prefill_repeats"):
    worker_args += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
  worker_args += ["--lengths", ",".join(map(str, args.lengths))]
  results = common.run_settings(__file__, args.settings.split(","), worker_args)
  base = results[0]
  for r in results:
    if "error" in r or "error" in base:
      continue
    r["ratio_vs_first"] = {
        n: round(r["judgments_per_hour"][n] / base["judgments_per_hour"][n], 3)
        for n in r["judgments_per_hour"]
    }
    r["rss_ratio_vs_first"] = round(r["peak_rss_gib"] / base["peak_rss_gib"], 3)
    print(
        f"{r['setting']:>16}: prefill {r['prefill_s']:.1f} s (width {r['width']}), decode"
        f" {r['decode_step_s']:.3f} s/step, judgments/h {r['judgments_per_hour']}"
        f" (x{r['ratio_vs_first']} of {base['setting']}), peak {r['peak_rss_gib']:.2f} GiB"
        f" (loading {r['peak_loading_gib']:.2f}, loaded {r['rss_loaded_gib']:.2f}, judging"
        f" {r['peak_judging_gib']:.2f})"
    )
  common.write_record(args.json, results)


if __name__ == "__main__":
  main()
