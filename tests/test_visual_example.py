"""examples/visual_llava_cpu.py end to end on tiny settings (a tiny random LLaMA as the language model,
a one-layer 28-pixel vision tower, two updates): the task and the LLaVA are built, base, LoRA and
AnLR-LoRA are scored on the held-out views with their records saved, and the rank-one figures are
drawn. The example and the step benchmark on its output run in one process of their own, on one
CPU device as on a user's CPU (this test process's 8 devices would shard and compile each train step 8
ways)."""

import json
import os
import re

import numpy as np
import pytest

from anlr_jax.app.config import load_config
from anlr_jax.models import load_llava_model, load_hf_model
from tests.helpers.fresh_process import run_helper
from tests.helpers.tiny_llama import save_tiny_llama
from tests.tiny_tokenizer import build_tiny_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(REPO, "examples", "visual_llava_cpu.py")
CONFIG = os.path.join(REPO, "configs", "smollm2_llava_visual_cpu.yaml")
BENCHMARK = os.path.join(REPO, "benchmarks", "llava_step.py")


def test_config_compares_lora_and_anlr_with_the_base_model():
  config = load_config(CONFIG)
  assert config.compare == ["lora", "anlr"] and config.eval.include_base
  assert config.model.projector_lr and 0 < config.trainer.diag_every < config.trainer.steps
  assert {t: v.format for t, v in config.eval.visual_tasks().items()} == {
      "qa": "llava_qa",
      "pope": "pope",
  }


def _run_scripts(runs):
  """stdout of ``[(script, argv), ...]`` run by tests/helpers/run_scripts.py in a process."""
  return run_helper("run_scripts", json.dumps(runs)).stdout


@pytest.mark.slow
def test_example_runs_end_to_end_on_tiny_settings(tmp_path):
  lm = tmp_path / "lm"
  save_tiny_llama(lm, len(build_tiny_tokenizer(lm)), max_position_embeddings=512)
  out = tmp_path / "out"
  example = (
      EXAMPLE,
      [
          "--out",
          str(out),
          "--language_model",
          str(lm),
          "--train",
          "8",
          "--test",
          "2",
          "--image_size",
          "28",
          "--patch_size",
          "14",
          "--vision_width",
          "32",
          "--vision_layers",
          "1",
          "data.template=vicuna_v1",  # the tiny tokenizer has no chat template
          "data.pad_multiple=128",
          "trainer.steps=2",
          "trainer.lr_warmup_steps=1",
          "trainer.log_every=1",
          "trainer.diag_every=1",
          "trainer.progress=false",
          "anlr.warmup_steps=1",
          "eval.batch_size=8",
          "eval.max_new_tokens=2",
      ],
  )
  # the step benchmark on the example's model and task (after it, in the same process): the text
  # batch is the image batch without its image positions
  benchmark = (
      BENCHMARK,
      [
          "--out",
          str(out),
          "--rounds",
          "1",
          "--warmup",
          "0",
          "--json",
          str(tmp_path / "s.json"),
          "data.template=vicuna_v1",
          "data.pad_multiple=32",
      ],
  )
  printed = _run_scripts([example, benchmark])
  # the LLaVA keeps the language model's weights, with <image> added as its last token
  model, config = load_llava_model(out / "model")
  text, _ = load_hf_model(lm)
  embed = np.asarray(model.model.language_model.embed_tokens.embedding.get_value())
  original = np.asarray(text.model.embed_tokens.embedding.get_value())
  np.testing.assert_array_equal(embed[: len(original)], original)
  np.testing.assert_allclose(embed[-1], original.mean(axis=0), rtol=1e-6)
  assert config.image_token_index == len(original) and config.num_image_tokens == 4
  run = out / "runs" / "seed0"
  for where in (run, run / "lora", run / "anlr"):
    records = (where / "eval_qa.jsonl").read_text().splitlines()
    assert len(records) == 2 * 4 and all("<image>" in json.loads(r)["prompt"] for r in records)
    assert (where / "eval_pope.jsonl").is_file()
  for method in ("lora", "anlr"):
    assert set(json.loads((run / method / "results.json").read_text())["accuracy"]) == {
        "qa",
        "pope",
    }
  figures = list((run / "anlr" / "analysis").glob("*.png"))
  assert figures, "anlr analyze drew the rank-one figures"
  assert re.search(r"^\s*base\s+[\d.]+\s+[\d.]+", printed, flags=re.M), printed

  result = json.loads((tmp_path / "s.json").read_text())
  assert result["images"] > 0 and result["image_positions_per_image"] == 4
  assert result["real_tokens"]["image"] - result["real_tokens"]["text"] == 4 * result["images"]
  assert set(result["median_s"]) == {"image", "text"} and result["paired_ratio_image_over_text"] > 0
