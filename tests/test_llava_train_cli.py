"""``anlr train`` on a LLaVA model: LLaVA data (``data.format: llava``, images from
``data.image_folder``) batched with the model's pixel values, LoRA and AnLR trained end to end with
the vision tower left alone, and one-line errors for data that does not fit the model."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil

import numpy as np
import pytest
import transformers
import yaml
from PIL import Image
from safetensors import safe_open

from anlr_jax.app import cli
from anlr_jax.app.config import load_config
from anlr_jax.app.model import load_base
from anlr_jax.app.train import training_source
from anlr_jax.models.llava_image import preprocess_image
from tests.helpers.tiny_llava import save_tiny_llava
from tests.tiny_tokenizer import build_tiny_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _write_visual_task(out, **kw):
  spec = importlib.util.spec_from_file_location(
      "make_visual_task", os.path.join(REPO, "scripts", "make_visual_task.py")
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.write_task(str(out), **kw)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  """A tiny random LLaVA in the llava-hf layout with its tokenizer (``<image>`` one token), a
  LLaVA-format task of scikit-image photos (its images moved to a folder of their own) and a
  text-only model."""
  root = tmp_path_factory.mktemp("llava_cli")
  model_dir = root / "llava"
  _, text = save_tiny_llava(model_dir)

  task = _write_visual_task(root / "task", n_train=8, n_test=1, seed=0, size=32)
  images = root / "photos"
  shutil.move(task["images"], images / "images")  # the records name "images/<file>"

  text_dir = root / "text"
  build_tiny_tokenizer(text_dir)
  transformers.LlamaForCausalLM(text).save_pretrained(text_dir)
  return root, model_dir, task["train"], images, text_dir


def _config(root, model_dir, train, images, *overrides):
  config = {
      "method": "lora",
      "run_dir": str(root / "runs" / "{method}-{timestamp}"),
      "seed": 0,
      "model": {"path": str(model_dir)},
      "lora": {"rank": 2, "alpha": 4, "dropout": 0.0},
      "anlr": {"warmup_steps": 1},
      "data": {
          "train": str(train),
          "image_folder": str(images),
          "template": "vicuna_v1",
          "max_length": 512,
          "pad_multiple": 32,
      },
      "trainer": {
          "steps": 2,
          "global_batch": 8,  # the tests' 8 CPU devices
          "learning_rate": 1e-2,
          "compute_dtype": "float32",
          "progress": False,
          "log_every": 1,
      },
  }
  path = root / "llava.yaml"
  path.write_text(yaml.safe_dump(config))
  return [str(path), *overrides]


def test_training_source_batches_the_images_as_the_model_sees_them(setup):
  root, model_dir, train, images, _ = setup
  path, *_ = _config(root, model_dir, train, images)
  config = load_config(path, [])
  _, model_config, tok = load_base(config)
  source = training_source(config, str(train), tok, model_config=model_config)
  assert source.format == "llava"
  batch = source.get_batch(0)
  ids = source.batch_example_ids(0)
  expected = [
      preprocess_image(Image.open(p), model_config)
      for i in ids
      for p in source.examples.images[int(i)]
  ]
  assert expected, "the first batch holds images"
  n = len(expected)
  np.testing.assert_array_equal(batch["pixel_values"][:n], np.stack(expected))
  assert batch["image_mask"][:n].all() and not batch["image_mask"][n:].any()
  per_image = model_config.num_image_tokens
  assert (batch["input_ids"] == model_config.image_token_index).sum() == n * per_image


@pytest.mark.parametrize("method", ["lora", "anlr"])
def test_train_runs_llava_end_to_end(setup, method):
  root, model_dir, train, images, _ = setup
  argv = _config(root, model_dir, train, images)
  assert cli.main(["train", "--config", argv[0], f"method={method}"]) == 0
  (run_dir,) = [d for d in (root / "runs").iterdir() if d.name.startswith(f"{method}-")]
  rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
  losses = [r["loss"] for r in rows if "loss" in r]
  assert len(losses) == 2 and all(np.isfinite(losses))
  with safe_open(str(run_dir / "lora_final.safetensors"), "np") as f:
    keys = list(f.keys())
  assert keys and all(k.startswith("model.language_model.layers.") for k in keys), keys
  assert not any("vision_tower" in k for k in keys)


def _error(capsys, argv):
  assert cli.main(["train", "--config", *argv]) == 2
  err = capsys.readouterr().err
  assert err.count("error:") == 1, err  # one line (after progress bars, if any)
  return err.strip().splitlines()[-1]


def test_bad_llava_inputs_give_one_line(setup, capsys, tmp_path):
  root, model_dir, train, images, text_dir = setup
  records = json.loads(open(train).read())
  record = next(r for r in records if "image" in r)
  record["image"] = "images/missing.png"
  bad = tmp_path / "bad.json"
  bad.write_text(json.dumps(records))
  err = _error(capsys, _config(tmp_path, model_dir, bad, images))
  assert re.search(rf"bad.json:\d+: record {record['id']}: .*missing.png", err), err

  boolq = tmp_path / "boolq.json"
  boolq.write_text(json.dumps([{"instruction": "Is it?", "output": "true", "answer": "true"}]))
  cases = [
      ([f"data.image_folder={tmp_path / 'nowhere'}"], r"data.image_folder: .*nowhere does not"),
      (["data.template=alpaca"], r"data.template=alpaca: LLaVA data takes chat or vicuna_v1"),
      (["data.format=sharegpt"], r"data.format=sharegpt: model.path .* is a LLaVA model"),
      (
          ["data.train=benchmark://boolq/tune"],
          r"data.train: benchmark://boolq/tune holds text records; model.path .* is a LLaVA",
      ),
      (
          [f"eval.tasks.boolq={boolq}"],
          r"eval.tasks: the text tasks are prompted in data.template",
      ),
      (
          [f"model.path={text_dir}", "data.format=llava"],
          r"data.format=llava: model.path .* is not a LLaVA model",
      ),
      (
          [f"model.path={text_dir}", "data.format=sharegpt"],
          r"data.image_folder: only LLaVA data",
      ),
      (
          [f"model.path={text_dir}", "data.format=sharegpt", "data.image_folder=null"],
          r"data.template=vicuna_v1: LLaVA-1.5's format, for LLaVA data only",
      ),
  ]
  for overrides, pattern in cases:
    err = _error(capsys, _config(tmp_path, model_dir, train, images, *overrides))
    assert re.search(pattern, err), (overrides, err)
