"""scripts/make_visual_task.py: runs offline on scikit-image's photos, is deterministic given the
seed, and writes files that anlr_jax.data.llava batches and anlr_jax.evals.visual scores."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from anlr_jax.data.llava import make_llava_source, read_llava_examples
from anlr_jax.evals.visual import score_pope
from tests.tiny_tokenizer import build_tiny_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "scripts", "make_visual_task.py")
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def task():
  spec = importlib.util.spec_from_file_location("make_visual_task", SCRIPT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.fixture(scope="module")
def built(tmp_path_factory):
  out = tmp_path_factory.mktemp("visual")
  result = subprocess.run(
      [sys.executable, SCRIPT, "--out", str(out), "--train", "30", "--test", "8", "--size", "32"],
      capture_output=True,
      text=True,
      check=False,
      timeout=120,
  )
  assert result.returncode == 0, result.stderr
  return out


def test_the_photos_load_offline(task):
  photos = task.load_photos()
  assert sorted(photos) == sorted(task.PHOTOS)
  for pixels in photos.values():
    assert pixels.dtype == np.uint8 and pixels.ndim == 3 and pixels.shape[2] == 3
    assert min(pixels.shape[:2]) >= 256


def test_views_answer_what_was_done(task):
  rng = np.random.default_rng(0)
  photo = task.load_photos()["cat"]
  for _ in range(20):
    image, facts = task.make_view(photo, rng, 24)
    pixels = np.asarray(image)
    assert pixels.shape == (24, 24, 3)
    assert task._is_grey(pixels) == facts["grey"]
    q, a = task.question("colour", "cat", facts, rng)
    assert a == ("black and white" if facts["grey"] else "colour")
    assert q.endswith(task.SHORT_ANSWER)


def test_files_and_loading(built):
  train = read_llava_examples(built / "train.json")
  assert len(train.examples) == 30 + 3  # 30 views and 3 text-only records
  assert sum(not e.images for e in train.examples) == 3
  assert all(2 <= len(e.messages) // 2 <= 3 for e in train.examples if e.images)
  test = read_llava_examples(built / "test.json", image_folder=built)
  assert len(test.examples) == 8 * 4
  tok = build_tiny_tokenizer()
  tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<image>"]})
  tok.chat_template = CHATML

  def preprocess(image):
    return np.asarray(image.resize((16, 16)), dtype=np.float32).transpose(2, 0, 1) / 255.0

  source = make_llava_source(
      built / "train.json",
      tok,
      preprocess=preprocess,
      num_image_tokens=4,
      max_length=512,
      global_batch=8,
      seed=0,
  )
  batch = source.get_batch(0)
  assert batch["pixel_values"].shape == (8, 3, 16, 16)
  assert 0 < batch["image_mask"].sum() <= 8
  # The POPE file is POPE's format: the right answers score 1, always saying yes scores F1 2/3 at
  # best (precision = the share of yes labels).
  labels = [json.loads(line) for line in (built / "pope_test.json").read_text().splitlines()]
  assert len(labels) == 8 and {r["label"] for r in labels} <= {"yes", "no"}
  right = {r["question_id"]: r["label"].capitalize() + "." for r in labels}
  assert score_pope(right, built / "pope_test.json").score == 1.0
  info = json.loads((built / "task_info.json").read_text())
  assert info["photos"]["cat"] == "skimage.data.chelsea"


def test_deterministic_given_the_seed(task, tmp_path):
  def files(out):
    return {
        name: (out / name).read_bytes()
        for name in ("train.json", "test.json", "pope_test.json", "images/train_00003.png")
    }

  task.write_task(str(tmp_path / "a"), 5, 2, seed=1, size=16)
  task.write_task(str(tmp_path / "b"), 5, 2, seed=1, size=16)
  task.write_task(str(tmp_path / "c"), 5, 2, seed=2, size=16)
  assert files(tmp_path / "a") == files(tmp_path / "b")
  assert files(tmp_path / "a") != files(tmp_path / "c")
  with Image.open(tmp_path / "a" / "images" / "test_00001.png") as image:
    assert image.size == (16, 16)
