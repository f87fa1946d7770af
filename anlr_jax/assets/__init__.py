r"""Assets shipped inside the package: the quickstart's base model and fine-tune task.

``quickstart_dir()`` holds a small pretrained LLaMA-architecture model in Hugging Face layout
(``config.json``, ``model.safetensors``, tokenizer files), the synthetic world it was pretrained on
(``world.json``), the short-answer fine-tune task in the LLM-Adapters / Commonsense170K layout
(``train.json``, ``test.json``: "Please answer the question: What colour is the fokoz?" -> "green",
scored as the ``exact_match`` task) and the numbers measured while building it
(``build_info.json``). Everything is rebuilt from a seed
by ``python scripts/build_quickstart.py --out anlr_jax/assets/quickstart``; see
``docs/quickstart_assets.md``.
"""

from __future__ import annotations

import pathlib

QUICKSTART_DIRNAME = "quickstart"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
WORLD_FILE = "world.json"
TRAIN_FILE = "train.json"
TEST_FILE = "test.json"
BUILD_INFO_FILE = "build_info.json"
QUICKSTART_TASK = "exact_match"
"""The `anlr_jax.evals` task that scores the quickstart test set: the greedy generation must equal
the gold attribute value (one word) after whitespace normalisation and case-folding."""
QUICKSTART_SEED = 0
"""The seed the shipped quickstart assets were built from."""


def quickstart_dir() -> pathlib.Path:
  """The directory of the shipped quickstart model, tokenizer and task files."""
  path = pathlib.Path(__file__).resolve().parent / QUICKSTART_DIRNAME
  if not path.is_dir():
    raise FileNotFoundError(
        f"quickstart assets not found at {path}; rebuild them with "
        "`python scripts/build_quickstart.py --out anlr_jax/assets/quickstart`."
    )
  return path


__all__ = [
    "BUILD_INFO_FILE",
    "CONFIG_FILE",
    "QUICKSTART_DIRNAME",
    "QUICKSTART_SEED",
    "QUICKSTART_TASK",
    "TEST_FILE",
    "TOKENIZER_CONFIG_FILE",
    "TOKENIZER_FILE",
    "TRAIN_FILE",
    "WEIGHTS_FILE",
    "WORLD_FILE",
    "quickstart_dir",
]
