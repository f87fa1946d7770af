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
docs/reliability.md). At the end process 0
writes the adapter in PEFT format to ``<out>/adapter`` (load it with ``peft.PeftModel``).
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
from flax import nnx

from anlr_jax.train import (
    DEFAULT_LOGICAL_AXIS_RULES,
    Trainer,
    TrainerConfig,
    initialize_distributed,
    make_mesh,
)


def parse_args():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--model", required=True, help="local HF model directory")
  p.add_argument("--data", required=True, help="training file (JSON/JSONL, see anlr_jax.data)")
  p.add_argument("--format", default=None, help="dataset format (default: detect)")
  p.add_argument("--out", required=True, help="run directory")
  p.add_argument("--method", default="anlr", help="a method of anlr_jax.app.methods")
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
      "--auto-distributed",
      action="store_true",
      help="call jax.distributed.initialize() with no arguments (cluster auto-detection)",
  )
  return p.parse_args()


def main():
  args = parse_args()
  # Multi-host: must run before any JAX computation.
  if args.auto_distributed:
    jax.distributed.initialize()
  else:
    initialize_distributed()  # no-op for a single process without JAX_COORDINATOR_ADDRESS
  from anlr_jax.data import make_source
  from anlr_jax.app.methods import get_method, method_optimizer
  from anlr_jax.models import load_hf_model, load_tokenizer
  from anlr_jax.nn import export_peft_adapter, inject_lora

  mesh = make_mesh(args.mesh_data, args.mesh_fsdp, args.mesh_tensor)
  if jax.process_index() == 0:
    print(f"{jax.process_count()} processes, {jax.device_count()} devices, mesh {dict(mesh.shape)}")
  dtype = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32
  # Loading under the mesh and the logical-axis rules puts every tensor straight onto its shards.
  with jax.set_mesh(mesh), nnx.logical_axis_rules(DEFAULT_LOGICAL_AXIS_RULES):
    model, model_config = load_hf_model(args.model, dtype=dtype)
    method = get_method(args.method)
    inject_lora(
        model,
        rank=args.rank,
        alpha=args.alpha,
        dropout=args.dropout,
        rngs=nnx.Rngs(params=args.seed, dropout=args.seed + 1),
        **method.lora_kwargs(),
    )
  tokenizer = load_tokenizer(args.model)
  data = make_source(
      args.data,
      tokenizer,
      format=args.format,
      max_length=args.max_length,
      global_batch=args.global_batch,
      seed=args.seed,
      pad_multiple=64,
  )
  config = TrainerConfig(
      steps=args.steps,
      epochs=args.epochs,
      global_batch=args.global_batch,
      micro_batches=args.micro_batches,
      learning_rate=args.lr,
      lr_warmup_steps=args.warmup_steps,
      mesh_data=args.mesh_data,
      mesh_fsdp=args.mesh_fsdp,
      mesh_tensor=args.mesh_tensor,
      compute_dtype=args.dtype,
      remat=args.remat,
      run_dir=args.out,
      ckpt_dir=os.path.join(os.path.abspath(args.out), "ckpt"),
      save_every=args.save_every,
      resume_allow=[k for k in args.resume_allow.split(",") if k],
      diag_every=max(args.save_every // 10, 1),
      seed=args.seed,
  )
  total = config.total_steps(len(data))
  schedule = config.schedule(total)
  tx = method_optimizer(method, schedule, weight_decay=0.0, clip_norm=1.0, seed=args.seed)
  model.train()
  trainer = Trainer(model, data, config, tx, schedule=schedule, mesh=mesh)
  start = time.perf_counter()
  rows = trainer.run()
  if jax.process_index() == 0:
    print(
        f"{total} updates in {time.perf_counter() - start:.0f}s; final loss {rows[-1]['loss']:.4f}"
    )
  model = trainer.updated_model()  # LoRA params gathered to the host
  if jax.process_index() == 0:
    export_peft_adapter(
        model, os.path.join(args.out, "adapter"), base_model_name_or_path=args.model
    )
    print(f"PEFT adapter -> {os.path.join(args.out, 'adapter')} ({model_config.model_type})")


if __name__ == "__main__":
  main()
