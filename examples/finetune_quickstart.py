"""LoRA / AnLR-LoRA fine-tune of the shipped quickstart LLaMA with the library API directly (CPU).

  python examples/finetune_quickstart.py [--method anlr] [--steps 300]

Loads the Flax LLaMA from the packaged HF checkpoint, wraps q/k/v/up/down with LoRA (r=8, alpha=16),
trains the adapters on the quickstart task with `anlr_jax.anlr` (or AdamW) under the sharded trainer,
and scores greedy answers on the held-out test set. The layers and the optimizer come from the method
table (`anlr_jax.methods`), as in `anlr train`, which does the same from a YAML config.
"""

import argparse

import numpy as np
from flax import nnx

from anlr_jax import assets
from anlr_jax.data import make_source
from anlr_jax.evals import evaluate, load_eval_examples
from anlr_jax.methods import inject_method, method_optimizer
from anlr_jax.models import generate, load_hf_model, load_tokenizer
from anlr_jax.train import Trainer, TrainerConfig

parser = argparse.ArgumentParser()
parser.add_argument("--method", choices=("lora", "anlr"), default="anlr")
parser.add_argument("--steps", type=int, default=300)
args = parser.parse_args()

root = assets.quickstart_dir()
tokenizer = load_tokenizer(root)
model, _ = load_hf_model(root)  # float32 Flax LlamaForCausalLM
# LoRA layers on the paper's targets q, k, v, up, down
inject_method(model, args.method, rank=8, alpha=16.0, dropout=0.0, rngs=nnx.Rngs(0))

data = make_source(
    root / assets.TRAIN_FILE, tokenizer, max_length=128, global_batch=16, seed=0, pad_multiple=16
)
warmup = min(30, args.steps // 10)  # 10 % of the updates, as the quickstart config (30 of 300)
config = TrainerConfig(
    steps=args.steps,
    global_batch=16,
    learning_rate=2e-3,
    lr_warmup_steps=warmup,
    compute_dtype="float32",
    log_every=25,
    progress=True,
)
schedule = config.schedule(args.steps)
# clip_by_global_norm(1.0), then AdamW (lora) or AdamW with AnLR's per-rank multipliers (anlr)
tx = method_optimizer(args.method, schedule, clip_norm=1.0, anlr_kwargs={"warmup_steps": warmup})
trainer = Trainer(model, data, config, tx, schedule=schedule)
rows = trainer.run()
model = trainer.updated_model()
model.eval()
print(f"{args.method}: loss {rows[0]['loss']:.3f} -> {rows[-1]['loss']:.3f}")


def generate_fn(prompts):
  """Greedy continuations of left-padded `[bos] + prompt` rows."""
  rows = [
      [tokenizer.bos_token_id] + tokenizer(p, add_special_tokens=False).input_ids for p in prompts
  ]
  width = max(map(len, rows))
  ids = np.full((len(rows), width), tokenizer.pad_token_id, np.int32)
  mask = np.zeros_like(ids)
  for i, row in enumerate(rows):
    ids[i, width - len(row) :], mask[i, width - len(row) :] = row, 1
  out = generate(
      model,
      ids,
      mask,
      max_new_tokens=8,
      eos_token_id=tokenizer.eos_token_id,
      pad_token_id=tokenizer.pad_token_id,
  )
  return tokenizer.batch_decode(np.asarray(out), skip_special_tokens=True)


result = evaluate(
    generate_fn, load_eval_examples(root / assets.TEST_FILE), assets.QUICKSTART_TASK, batch_size=50
)
print(f"test accuracy: {result.correct}/{result.total} = {100 * result.accuracy:.1f}%")
