"""A tiny ``anlr train`` setup: a random 2-layer HF LLaMA with its tokenizer, a two-option task
and a run config, written under one folder (the CLI tests train on it)."""

import json
import pathlib

import numpy as np
import torch
import transformers
import yaml

from tests.helpers.tiny_llama import tiny_llama_config
from tests.tiny_tokenizer import build_tiny_tokenizer

ANSWERS = ("option1", "option2")


def tiny_run_setup(root: pathlib.Path, *, n_train=48, n_test=8, layers=2):
  """A tiny random LLaMA (``layers`` decoder layers) + tokenizer saved as one HF directory, and a
  JSONL/JSON MC task."""
  tokenizer = build_tiny_tokenizer(root / "model")
  torch.manual_seed(0)
  hf_config = tiny_llama_config(len(tokenizer), intermediate_size=64, num_hidden_layers=layers)
  transformers.LlamaForCausalLM(hf_config).save_pretrained(root / "model")
  rng = np.random.default_rng(0)
  records = []
  for i in range(n_train + n_test):
    answer = ANSWERS[int(rng.integers(2))]
    records.append(
        {
            "instruction": f"{i} + {i}? option1: true option2: false",
            "input": "",
            "output": f"the correct answer is {answer}",
            "answer": answer,
        }
    )
  with open(root / "train.jsonl", "w") as f:
    for record in records[:n_train]:
      f.write(json.dumps(record) + "\n")
  (root / "test.json").write_text(json.dumps(records[n_train:]))
  config = {
      "method": "anlr",
      "run_dir": str(root / "runs" / "{method}-{timestamp}"),
      "seed": 0,
      "model": {"path": str(root / "model")},
      "lora": {"rank": 4, "alpha": 8, "dropout": 0.0},
      "anlr": {"warmup_steps": 1},
      "data": {"train": str(root / "train.jsonl"), "max_length": 128, "pad_multiple": 32},
      "trainer": {
          "steps": 4,
          "global_batch": 8,
          "learning_rate": 5e-3,
          "compute_dtype": "float32",
          "progress": False,
          # one of the test process's 8 fake devices: an 8-way sharded step compiles slower, and the
          # mesh tests ask for the devices they shard over (trainer.devices=null)
          "devices": 1,
      },
      "eval": {
          "tasks": {"winogrande": str(root / "test.json")},
          "batch_size": 8,
          "max_new_tokens": 6,
      },
  }
  (root / "tiny.yaml").write_text(yaml.safe_dump(config))
  return root / "tiny.yaml"


def tiny_run_config(root: pathlib.Path, *, layers=2, **changes) -> pathlib.Path:
  """The tiny CLI setup (a model of ``layers`` decoder layers) with a fixed run_dir and
  extra/changed keys (dotted)."""
  path = tiny_run_setup(root, layers=layers)
  raw = yaml.safe_load(path.read_text())
  raw["run_dir"] = str(root / "run")
  for key, value in changes.items():
    node = raw
    *parents, leaf = key.split(".")
    for p in parents:
      node = node.setdefault(p, {})
    node[leaf] = value
  path.write_text(yaml.safe_dump(raw))
  return path
