r"""Builds a small visual question task from real photos that ship with scikit-image (no download).

Photos (``skimage.data``; all inside the scikit-image wheel, loaded without network access; the
licence notes are those of scikit-image's documentation):

=================  ==============  ===========================================================
label              function        source
=================  ==============  ===========================================================
``astronaut``      ``astronaut``   NASA portrait of astronaut Eileen Collins; public domain
``cat``            ``chelsea``     Chelsea the cat, photo by Stefan van der Walt; CC0
``coffee``         ``coffee``      a cup of coffee, photo by Rachel Michetti; CC0
``rocket``         ``rocket``      SpaceX's launch of DSCOVR on a Falcon 9; public domain
``galaxies``       ``hubble_deep_field``  Hubble eXtreme Deep Field, NASA; public domain
``photographer``   ``camera``      a man with a camera (grey levels), photo by Lav Varshney; CC0
``coins``          ``coins``       Greek coins from Pompeii (grey levels), Brooklyn Museum; no
                                   known copyright restrictions
=================  ==============  ===========================================================

Every *view* of a photo is a random square crop (side 60-100% of the shorter side), resized to
``size`` x ``size`` pixels, mirrored left-right with probability 1/2, turned to grey levels with
probability 1/4 (colour photos), and turned upside down with probability 1/4. Four kinds of question,
each with LLaVA-1.5's short-answer instruction ("Answer the question using a single word or
phrase."):

* object — "What is in the photo?" -> the label (chance 1/7);
* colour — "Is the photo in colour or in black and white?" -> "colour" / "black and white";
* orientation — "Is the photo upside down?" -> "yes" / "no";
* presence (POPE-style) — "Is there {a cat} in the image?" -> "yes" / "no", the object asked
  about being the photo's own with probability 1/2, else another label's.

Outputs, in LLaVA's format (``anlr_jax.data.llava``), image paths relative to the output directory
(the images are under ``images/``):

* ``train.json`` — ``--train`` views, each one record with two or three of the question kinds as a
  multi-turn conversation (the first turn holds ``<image>``), plus ``--train // 10`` text-only
  records ("Is {a cat} a living thing?");
* ``test.json`` — ``--test`` other views, each asked every kind once, one record per question
  (``id`` = ``{view}-{kind}``), the answer in the ``gpt`` turn;
* ``pope_test.json`` — the test views' presence questions in POPE's file format (JSON lines
  ``question_id, image, text, label``), for ``anlr_jax.evals.visual.score_pope``;
* ``task_info.json`` — the seed, the counts and the photos used.

Train and test views are different crops of the same seven photos: the task measures whether a
model learns to answer about the photos, not whether it recognises unseen objects. Everything
follows from ``--seed``: the same seed writes the same files, byte for byte.

Usage::

    python scripts/make_visual_task.py --out data/visual [--train 400] [--test 80] [--size 64] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
from PIL import Image

SHORT_ANSWER = "Answer the question using a single word or phrase."
"""LLaVA-1.5's instruction for short answers."""

PHOTOS = {
    # label: (skimage.data function, the object's phrase in a presence question, living thing)
    "astronaut": ("astronaut", "an astronaut", True),
    "cat": ("chelsea", "a cat", True),
    "coffee": ("coffee", "a cup of coffee", False),
    "rocket": ("rocket", "a rocket", False),
    "galaxies": ("hubble_deep_field", "a galaxy", False),
    "photographer": ("camera", "a photographer", True),
    "coins": ("coins", "coins", False),
}

KINDS = ("object", "colour", "orientation", "presence")


def load_photos() -> dict[str, np.ndarray]:
  """The seven photos as uint8 RGB arrays (grey-level ones repeated over three channels)."""
  import skimage.data  # pylint: disable=import-outside-toplevel

  photos = {}
  for label, (name, _, _) in PHOTOS.items():
    pixels = np.asarray(getattr(skimage.data, name)())
    if pixels.ndim == 2:
      pixels = np.repeat(pixels[:, :, None], 3, axis=2)
    photos[label] = np.ascontiguousarray(pixels[:, :, :3], dtype=np.uint8)
  return photos


def _is_grey(pixels: np.ndarray) -> bool:
  return bool(
      (pixels[:, :, 0] == pixels[:, :, 1]).all() and (pixels[:, :, 1] == pixels[:, :, 2]).all()
  )


def make_view(photo: np.ndarray, rng: np.random.Generator, size: int) -> tuple[Image.Image, dict]:
  """One random view of `photo` and what was done to it: ``{"grey", "upside_down"}``."""
  height, width = photo.shape[:2]
  side = int(round(min(height, width) * rng.uniform(0.6, 1.0)))
  top, left = int(rng.integers(0, height - side + 1)), int(rng.integers(0, width - side + 1))
  image = Image.fromarray(photo[top : top + side, left : left + side])
  image = image.resize((size, size), Image.BICUBIC)
  if rng.random() < 0.5:
    image = image.transpose(Image.FLIP_LEFT_RIGHT)
  grey = _is_grey(photo)
  if not grey and rng.random() < 0.25:
    image = image.convert("L").convert("RGB")
    grey = True
  upside_down = bool(rng.random() < 0.25)
  if upside_down:
    image = image.transpose(Image.ROTATE_180)
  return image, {"grey": grey, "upside_down": upside_down}


def question(kind: str, label: str, facts: dict, rng: np.random.Generator) -> tuple[str, str]:
  """The question of `kind` about a view of `label` and its answer."""
  if kind == "object":
    return f"What is in the photo?\n{SHORT_ANSWER}", label
  if kind == "colour":
    answer = "black and white" if facts["grey"] else "colour"
    return f"Is the photo in colour or in black and white?\n{SHORT_ANSWER}", answer
  if kind == "orientation":
    return f"Is the photo upside down?\n{SHORT_ANSWER}", "yes" if facts["upside_down"] else "no"
  if rng.random() < 0.5:
    asked, answer = label, "yes"
  else:
    others = [other for other in PHOTOS if other != label]
    asked, answer = others[int(rng.integers(len(others)))], "no"
  return f"Is there {PHOTOS[asked][1]} in the image?\n{SHORT_ANSWER}", answer


def _conversation(turns: list[tuple[str, str]]) -> list[dict[str, str]]:
  messages = []
  for i, (q, a) in enumerate(turns):
    messages.append({"from": "human", "value": f"<image>\n{q}" if i == 0 else q})
    messages.append({"from": "gpt", "value": a})
  return messages


def write_task(out: str, n_train: int, n_test: int, seed: int, size: int = 64) -> dict[str, str]:
  """Writes the task under `out` (see the module docstring); returns the paths of its files."""
  if n_train < 1 or n_test < 1 or size < 8:
    raise ValueError("--train and --test must be >= 1 and --size >= 8")
  rng = np.random.default_rng(seed)
  photos = load_photos()
  labels = list(PHOTOS)
  images_dir = os.path.join(out, "images")
  os.makedirs(images_dir, exist_ok=True)

  def view(split: str, i: int) -> tuple[str, str, dict]:
    label = labels[int(rng.integers(len(labels)))]
    image, facts = make_view(photos[label], rng, size)
    name = f"{split}_{i:05d}.png"
    image.save(os.path.join(images_dir, name))
    return f"images/{name}", label, facts

  train = []
  for i in range(n_train):
    name, label, facts = view("train", i)
    kinds = [KINDS[k] for k in rng.permutation(len(KINDS))[: int(rng.integers(2, 4))]]
    turns = [question(kind, label, facts, rng) for kind in kinds]
    train.append({"id": f"train-{i}", "image": name, "conversations": _conversation(turns)})
  for i in range(n_train // 10):
    label = labels[int(rng.integers(len(labels)))]
    _, phrase, living = PHOTOS[label]
    q = f"Is {phrase} a living thing?\n{SHORT_ANSWER}"
    record = {"id": f"text-{i}", "conversations": _conversation([(q, "yes" if living else "no")])}
    record["conversations"][0]["value"] = q  # text-only: no <image>
    train.insert(int(rng.integers(len(train) + 1)), record)

  test, pope = [], []
  for i in range(n_test):
    name, label, facts = view("test", i)
    for kind in KINDS:
      q, a = question(kind, label, facts, rng)
      test.append(
          {"id": f"test-{i}-{kind}", "image": name, "conversations": _conversation([(q, a)])}
      )
      if kind == "presence":
        text = q.split("\n", 1)[0]
        pope.append({"question_id": len(pope) + 1, "image": name, "text": text, "label": a})

  paths = {
      "train": os.path.join(out, "train.json"),
      "test": os.path.join(out, "test.json"),
      "pope": os.path.join(out, "pope_test.json"),
      "info": os.path.join(out, "task_info.json"),
      "images": images_dir,
  }
  info = {
      "seed": seed,
      "size": size,
      "train_records": len(train),
      "test_records": len(test),
      "pope_questions": len(pope),
      "photos": {label: f"skimage.data.{fn}" for label, (fn, _, _) in PHOTOS.items()},
  }
  for key, data in (("train", train), ("test", test), ("info", info)):
    with open(paths[key], "w", encoding="utf-8") as f:
      json.dump(data, f, indent=1)
      f.write("\n")
  with open(paths["pope"], "w", encoding="utf-8") as f:
    f.writelines(json.dumps(record) + "\n" for record in pope)
  return paths


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default="data/visual", help="output directory (default data/visual)")
  parser.add_argument("--train", type=int, default=400, help="training views (default 400)")
  parser.add_argument("--test", type=int, default=80, help="test views (default 80)")
  parser.add_argument("--size", type=int, default=64, help="image side in pixels (default 64)")
  parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
  args = parser.parse_args(argv)
  try:
    paths = write_task(args.out, args.train, args.test, args.seed, args.size)
  except (ValueError, ImportError) as err:
    parser.exit(2, f"make_visual_task: {err}\n")
  print(f"wrote {paths['train']}, {paths['test']}, {paths['pope']} and images in {paths['images']}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
