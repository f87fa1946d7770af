r"""What the image tokens cost per LLaVA train step: a batch with images vs the same batch without them.

The CPU example's settings (``configs/smollm2_llava_visual_cpu.yaml``, the model and task that
``examples/visual_llava_cpu.py`` built under ``--out``): its method's train step, jitted as
``anlr train`` runs it (:class:`anlr_jax.train.Trainer`, the LoRA factors in the stacked-layer
layout, ``trainer.lora_layout=stacked``), on its first batch

    image   the batch as training sees it: each ``<image>`` expanded to the model's image positions,
            the images' pixel values through the frozen vision tower and the trained projector
    text    the same rows with every image position removed (no pixel values, no vision tower),
            right-padded to the pipeline's multiple (``data.pad_multiple``)

timed side by side (``--rounds`` rounds, one step of each per round in a shuffled order, after
``--warmup`` untimed rounds; :func:`benchmarks.common.interleave`): medians and the paired ratio
image / text (the median of the per-round quotients, :func:`benchmarks.common.paired_ratio`).

    python examples/visual_llava_cpu.py --out runs/visual      # builds the model and the task once
    python benchmarks/llava_step.py --out runs/visual [--rounds 7] [--json step.json] [key=value]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

if __package__ in (None, ""):
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import interleave, machine_line, timed, write_json

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(REPO, "configs", "smollm2_llava_visual_cpu.yaml")


class FixedBatches:
  """A one-batch source: every step is ``batch``."""

  def __init__(self, batch: dict):
    self.batch = batch

  def __len__(self) -> int:
    return 1

  def get_batch(self, step: int, process_index: int = 0, process_count: int = 1) -> dict:
    return dict(self.batch)


def without_images(batch: dict, image_token: int, pad_multiple: int, pad_id: int) -> dict:
  """``batch`` (right-padded rows) with every image position removed, right-padded to a multiple of
  ``pad_multiple``; no pixel values."""
  ids, mask, loss = (np.asarray(batch[k]) for k in ("input_ids", "attention_mask", "loss_mask"))
  keep = [(row != image_token) & (m > 0) for row, m in zip(ids, mask)]
  longest = max(int(k.sum()) for k in keep)
  width = -(-longest // pad_multiple) * pad_multiple
  out = {
      "input_ids": np.full((len(ids), width), pad_id, np.int32),
      "attention_mask": np.zeros((len(ids), width), np.int32),
      "loss_mask": np.zeros((len(ids), width), np.float32),
  }
  for i, k in enumerate(keep):
    n = int(k.sum())
    out["input_ids"][i, :n] = ids[i][k]
    out["attention_mask"][i, :n] = 1
    out["loss_mask"][i, :n] = loss[i][k]
  return out


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", default="runs/visual", help="the example's --out (model/ and task/)")
  ap.add_argument("--config", default=CONFIG)
  ap.add_argument("--method", default="anlr")
  ap.add_argument("--rounds", type=int, default=7)
  ap.add_argument("--warmup", type=int, default=1)
  ap.add_argument("--json", help="write the figures here")
  ap.add_argument("overrides", nargs="*", metavar="key=value")
  args = ap.parse_args(argv)

  import jax

  from anlr_jax.app.config import load_config
  from anlr_jax.app.assemble import build_method
  from anlr_jax.app.model import load_base
  from anlr_jax.app.train import training_source
  from anlr_jax.train import Trainer

  out = os.path.abspath(args.out)
  task = os.path.join(out, "task")
  config = load_config(
      args.config,
      [
          f"model.path={os.path.join(out, 'model')}",
          f"data.train={os.path.join(task, 'train.json')}",
          f"data.image_folder={task}",
          "eval.tasks={}",
          f"method={args.method}",
          "compare=[]",
          "trainer.lora_layout=stacked",
          "trainer.progress=false",
          *args.overrides,
      ],
  )
  model, model_config, tokenizer = load_base(config)
  source = training_source(config, config.data.train, tokenizer, model_config=model_config)
  image_batch = source.get_batch(0)
  pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
  text_batch = without_images(
      image_batch, model_config.image_token_index, config.data.pad_multiple, int(pad)
  )
  built = build_method(config, model=model, total_steps=config.trainer.steps)
  trainer = Trainer(
      model,
      FixedBatches(image_batch),
      config.trainer.trainer_config(),
      built.tx,
      schedule=built.schedule,
      **built.hooks,
  )
  batches = {"image": trainer.global_batch(0)}
  trainer.batches = FixedBatches(text_batch)
  batches["text"] = trainer.global_batch(0)

  def step(batch):
    def run():
      with jax.set_mesh(trainer.mesh):
        trainer.state, metrics = trainer.step_fn(trainer.state, trainer.frozen, batch)
      jax.block_until_ready((trainer.state, metrics))

    return timed(run)

  compile_s = {}
  for name, batch in batches.items():
    start = time.perf_counter()
    step(batch)()
    compile_s[name] = round(time.perf_counter() - start, 2)
  timings = interleave(
      {name: step(batch) for name, batch in batches.items()}, args.rounds, warmup=args.warmup
  )
  images = int(np.asarray(image_batch["image_mask"]).sum())
  shape = {
      k: list(np.shape(b["input_ids"])) for k, b in (("image", image_batch), ("text", text_batch))
  }
  tokens = {
      "image": int(np.asarray(image_batch["attention_mask"]).sum()),
      "text": int(text_batch["attention_mask"].sum()),
  }
  result = {
      "machine": machine_line(),
      "date": time.strftime("%Y-%m-%d"),
      "method": args.method,
      "lora_layout": config.trainer.lora_layout,
      "images": images,
      "image_positions_per_image": model_config.num_image_tokens,
      "batch_shape": shape,
      "real_tokens": tokens,
      "first_step_s": compile_s,
      "median_s": {name: round(timings.median(name), 4) for name in batches},
      "paired_ratio_image_over_text": round(timings.paired("image", "text"), 3),
      "times_s": {k: [round(t, 4) for t in v] for k, v in timings.times.items()},
  }
  print(
      f"{result['machine']}; {args.method}, LoRA {config.trainer.lora_layout}, {args.rounds} rounds"
  )
  for name in batches:
    print(
        f"  {name:5s} batch {shape[name][0]} x {shape[name][1]} ({tokens[name]} real tokens):"
        f" median {result['median_s'][name]:.3f}s per step (first, compiling:"
        f" {compile_s[name]:.1f}s)"
    )
  print(
      f"  {images} images x {model_config.num_image_tokens} positions: image / text step ="
      f" {result['paired_ratio_image_over_text']:.3f} (paired median)"
  )
  if args.json:
    write_json(args.json, result)
  return 0


if __name__ == "__main__":
  sys.exit(main())
