"""AnLR-LoRA fine-tune of a real LLaMA / Qwen2 checkpoint on a GPU mesh (one or many hosts).

Written for e.g. LLaMA2-7B on Commonsense170K (paper App. B: r 32, alpha 64, dropout 0.05, lr 1e-4,
batch 16, 3 epochs, linear schedule); not run in CI. Everything is local: download the model and data
first (configs/README.md).

Layout. Devices form a ``('data', 'fsdp', 'tensor')`` mesh (``anlr_jax.train.make_mesh``); the batch
is split over ``data x fsdp``, the frozen base weights are sharded over ``fsdp`` (and ``tensor``) by
their logical axis names (``anlr_jax.train.DEFAULT_LOGICAL_AXIS_RULES``), LoRA factors follow their
base kernel's input/output axes and keep the rank axis whole. Base weights are stored in bfloat16,
forward/backward run in bfloat16, LoRA params and optimizer state stay float32. ``--remat full``
recomputes each decoder layer in the backward pass (activation memory ~ one layer).

One host, 8 GPUs (FSDP over all 8)::

    python examples/finetune_llama_gpu_mesh.py --model models/Llama-2-7b-hf \
        --data data/commonsense_170k.json --out runs/llama2-anlr --mesh-fsdp 8

Several hosts (run the same command on every host; each reads only its rows of every batch)::

    JAX_COORDINATOR_ADDRESS=host0:1234 JAX_NUM_PROCESSES=4 JAX_PROCESS_ID=<i> \
    python examples/finetune_llama_gpu_mesh.py ... --mesh-data 4 --mesh-fsdp 8

(on SLURM / GKE / Cloud TPU, ``--auto-distributed`` lets ``jax.distributed.initialize()`` read the
cluster environment instead). Checkpoints (LoRA params + optimizer state, orbax) go to
``<out>/ckpt`` every ``--save-every`` updates; re-running the command resumes (with other settings
it stops and names them; ``--resume-allow trainer.steps`` lets a re-run extend the run, see
docs/reliability.md).

Methods. ``--method`` takes every method of ``anlr train``; the run is assembled by
``anlr_jax.app.assemble.build_method`` exactly as ``anlr train`` assembles it (adapter layers,
optimizer, trainer hooks such as AdaLoRA's regulariser and LoRA-Dash's launch), and
``--set KEY=VALUE`` sets any other config key (``--set loradash.launch_step=200``). A bad value
stops with one line.

At the end process 0 writes ``<out>/lora_final.safetensors`` and ``<out>/config.yaml`` (an
``anlr`` run directory: ``anlr evaluate --adapter <out>``, ``anlr export --run <out>``) and the
adapter in PEFT format to ``<out>/adapter`` (load it with ``peft.PeftModel``; AdaLoRA as a PEFT AdaLoRA adapter;
LoRA-Dash has no PEFT format: ``anlr export --run <out> --format merged``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
from flax import nnx

from anlr_jax.train import (
    DEFAULT_LOGICAL_AXIS_RULES,
    Trainer,
    initialize_distributed,
    make_mesh,
)


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--model", required=True, help="local HF model directory")
  p.add_argument("--data", required=True, help="training file (JSON/JSONL, see anlr_jax.data)")
  p.add_argument("--format", default=None, help="dataset format (default: detect)")
  p.add_argument("--out", required=True, help="run directory")
  p.add_argument("--method", default="anlr", help="any method of `anlr train` (anlr_jax.methods)")
  p.add_argument("--rank", type=int, default=32)
  p.add_argument("--alpha", type=float, default=64.0)
  p.add_argument("--dropout", type=float, default=0.05)
  p.add_argument("--lr", type=float, default=1e-4)
  p.add_argument("--warmup-steps", type=int, default=100)
  p.add_argument("--global-batch", type=int, default=16)
  p.add_argument("--micro-batches", type=int, default=1, help="gradient accumulation chunks")
  p.add_argument("--epochs", type=float, default=3.0)
  p.add_argument("--steps", type=int, default=None, help="overrides --epochs")
  p.add_argument(
      "--resume-allow",
      default="",
      help="comma-separated settings that may differ from the checkpoint's, e.g. trainer.steps",
  )
  p.add_argument("--max-length", type=int, default=256)
  p.add_argument("--mesh-data", type=int, default=1)
  p.add_argument("--mesh-fsdp", type=int, default=-1, help="-1: all remaining devices")
  p.add_argument("--mesh-tensor", type=int, default=1)
  p.add_argument(
      "--dtype",
      default="bfloat16",
      choices=("bfloat16", "float32"),
      help="storage and compute dtype of the base model",
  )
  p.add_argument("--remat", default="full", choices=("none", "full", "dots"))
  p.add_argument("--save-every", type=int, default=1000)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument(
      "--set",
      action="append",
      default=[],
      metavar="KEY=VALUE",
      help="any other `anlr train` config key, e.g. --set loradash.launch_step=200 (repeatable)",
  )
  p.add_argument(
      "--auto-distributed",
      action="store_true",
      help="call jax.distributed.initialize() with no arguments (cluster auto-detection)",
  )
  return p.parse_args(argv)


def run_config(args):
  """The ``anlr train`` config of these arguments (every value checked, bad ones named)."""
  from anlr_jax.app.config import load_config

  overrides = {
      "method": args.method,
      "seed": args.seed,
      "run_dir": args.out,
      "model.path": args.model,
      "model.dtype": args.dtype,
      "lora.rank": args.rank,
      "lora.alpha": args.alpha,
      "lora.dropout": args.dropout,
      "data.train": args.data,
      "data.max_length": args.max_length,
      "data.pad_multiple": 64,
      "trainer.steps": "null" if args.steps is None else args.steps,
      "trainer.epochs": args.epochs,
      "trainer.global_batch": args.global_batch,
      "trainer.micro_batches": args.micro_batches,
      "trainer.learning_rate": args.lr,
      "trainer.lr_warmup_steps": args.warmup_steps,
      "trainer.mesh_data": args.mesh_data,
      "trainer.mesh_fsdp": args.mesh_fsdp,
      "trainer.mesh_tensor": args.mesh_tensor,
      "trainer.compute_dtype": args.dtype,
      "trainer.remat": args.remat,
      "trainer.ckpt_dir": os.path.join(os.path.abspath(args.out), "ckpt"),
      "trainer.save_every": args.save_every,
      "trainer.diag_every": max(args.save_every // 10, 1),
      "trainer.resume_allow": f"[{args.resume_allow}]",
  }
  if args.format:
    overrides["data.format"] = args.format
  return load_config(None, [f"{key}={value}" for key, value in overrides.items()] + list(args.set))


def train(args):
  # Multi-host: must run before any JAX computation.
  if args.auto_distributed:
    jax.distributed.initialize()
  else:
    initialize_distributed()  # no-op for a single process without JAX_COORDINATOR_ADDRESS
  from anlr_jax import rundir
  from anlr_jax.app.config import save_config
  from anlr_jax.app.export import export_adalora_run
  from anlr_jax.app.assemble import build_method
  from anlr_jax.app.model import save_lora_params
  from anlr_jax.app.train import training_source
  from anlr_jax.methods import ADALORA_TOTAL_STEP
  from anlr_jax.models import load_hf_model, load_tokenizer
  from anlr_jax.nn import export_peft_adapter

  config = run_config(args)
  tc = config.trainer
  mesh = make_mesh(tc.mesh_data, tc.mesh_fsdp, tc.mesh_tensor)
  if jax.process_index() == 0:
    print(f"{jax.process_count()} processes, {jax.device_count()} devices, mesh {dict(mesh.shape)}")
  tokenizer = load_tokenizer(args.model)
  data = training_source(config, args.data, tokenizer)
  total = tc.total_steps(len(data))
  dtype = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32
  # Loading under the mesh and the logical-axis rules puts every tensor straight onto its shards;
  # build_method wraps the targeted layers with the method's adapter layer there too.
  with jax.set_mesh(mesh), nnx.logical_axis_rules(DEFAULT_LOGICAL_AXIS_RULES):
    model, model_config = load_hf_model(args.model, dtype=dtype)
    built = build_method(config, total_steps=total, model=model)
  model.train()
  trainer = Trainer(
      model,
      data,
      tc.trainer_config(),
      built.tx,
      checkpoint_dir=tc.ckpt_dir,
      log_dir=args.out,
      schedule=built.schedule,
      mesh=mesh,
      **built.hooks,
  )
  start = time.perf_counter()
  rows = trainer.run()
  trainer.close()
  if jax.process_index() == 0:
    print(
        f"{total} updates in {time.perf_counter() - start:.0f}s; final loss {rows[-1]['loss']:.4f}"
    )
  model = trainer.updated_model()  # LoRA params gathered to the host
  if jax.process_index() != 0:
    return
  # an anlr run directory: `anlr evaluate` / `anlr export` read it
  lora_path = os.path.join(args.out, rundir.LORA_FILE)
  metadata = {ADALORA_TOTAL_STEP: str(total)} if built.spec.uses_adalora else None
  save_lora_params(model, lora_path, metadata=metadata)
  save_config(config, os.path.join(args.out, rundir.CONFIG_FILE))
  adapter = os.path.join(args.out, "adapter")
  if built.spec.uses_loradash:  # PEFT cannot hold LoRA-Dash's directions
    print(f"adapter -> {lora_path}; merged model: anlr export --run {args.out} --format merged")
  elif built.spec.uses_adalora:
    export_adalora_run(model, config, lora_path, adapter)
    print(f"PEFT AdaLoRA adapter -> {adapter} ({model_config.model_type})")
  else:
    export_peft_adapter(model, adapter, base_model_name_or_path=args.model)
    print(f"PEFT adapter -> {adapter} ({model_config.model_type})")


def main(argv=None) -> int:
  """Trains; a bad argument or file ends with one line on stderr and exit status 2."""
  from anlr_jax.settings import ConfigError

  args = parse_args(argv)
  try:
    train(args)
  except (ConfigError, FileNotFoundError, ValueError) as err:
    print(f"{os.path.basename(__file__)}: error: {err}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
