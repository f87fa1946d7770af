"""AnLR-LoRA as the optimizer of Tunix's ``PeftTrainer``: Qwix LoRA on a Gemma's attention and MLP.

  pip install "anlr-jax[tunix]"
  python examples/finetune_tunix.py [--steps 60] [--checkpoint_dir runs/tunix_anlr]

Builds a small Gemma (Tunix's own model code with random weights, so that it runs anywhere; load
real weights with ``tunix.models.gemma.params`` instead), puts Qwix LoRA (rank 4) on every attention
einsum (q, kv, output) and MLP projection, prints what AnLR will do with each LoRA module
(``anlr_jax.describe``), and trains the adapters with ``PeftTrainer`` and ``anlr_jax.anlr`` on a
synthetic next-token task (each token is followed by the next one, modulo the vocabulary). With
``--checkpoint_dir`` Tunix saves the LoRA params and the optimizer state (AnLR's per-rank state
included) and a re-run resumes from them.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import qwix
from flax import nnx
from tunix.models.gemma import model as gemma
from tunix.sft import peft_trainer, utils

import anlr_jax

VOCAB, SEQ, BATCH = 32, 16, 8


def tiny_gemma(seed: int = 0, weight_qtype: str | None = None) -> nnx.Module:
  """A 2-layer Gemma (``d_model`` 32, 2 query heads, 1 KV head) with Qwix LoRA on attention + MLP.

  ``weight_qtype="nf4"`` is QLoRA: Qwix stores each adapted weight as a 4-bit NormalFloat ``QArray``
  (``uint4`` codes and a float scale per output channel, ``nnx.Param`` leaves that ``PeftTrainer``
  does not train) beside its float LoRA factors.
  """
  config = gemma.ModelConfig(
      num_layers=2,
      num_embed=VOCAB,
      embed_dim=32,
      hidden_dim=64,
      num_heads=2,
      head_dim=16,
      num_kv_heads=1,
      final_logit_softcap=None,
      use_post_attn_norm=False,
      use_post_ffw_norm=False,
      attention_types=(gemma.AttentionType.GLOBAL,) * 2,
  )
  model = gemma.Gemma(config, rngs=nnx.Rngs(seed))
  # Tunix initialises the MLP kernels to zero (real weights are loaded over them): stand-in weights
  # here, or the MLP would pass no gradient to its adapters
  keys = iter(jax.random.split(jax.random.key(seed + 1), 3 * config.num_layers))
  for layer in model.layers:
    for proj in (layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
      proj.kernel[...] = 0.1 * jax.random.normal(next(keys), proj.kernel.shape)
  lora = qwix.LoraProvider(
      module_path=".*(attn|mlp).*", rank=4, alpha=8.0, weight_qtype=weight_qtype
  )
  tokens = jnp.ones((1, SEQ), jnp.int32)
  positions = jnp.arange(SEQ)[None]
  return qwix.apply_lora_to_model(
      model, lora, tokens, positions, None, jnp.ones((1, SEQ, SEQ), bool), rngs=nnx.Rngs(seed)
  )


def batches(num: int, seed: int = 0):
  """``num`` batches of the counting task as Tunix ``TrainingInput`` s."""
  rng = np.random.default_rng(seed)
  for _ in range(num):
    start = rng.integers(0, VOCAB, size=(BATCH, 1))
    tokens = (start + np.arange(SEQ)) % VOCAB
    yield peft_trainer.TrainingInput(
        input_tokens=jnp.asarray(tokens, jnp.int32), input_mask=jnp.ones((BATCH, SEQ), bool)
    )


def model_inputs(x: peft_trainer.TrainingInput) -> dict:
  """What Tunix's default loss passes to the Gemma: tokens, mask, positions, causal mask."""
  return dict(
      input_tokens=x.input_tokens,
      input_mask=x.input_mask,
      positions=utils.build_positions_from_mask(x.input_mask),
      attention_mask=utils.make_causal_attn_mask(x.input_mask),
  )


def make_trainer(
    model: nnx.Module,
    steps: int,
    *,
    learning_rate: float = 3e-3,
    warmup_steps: int = 10,
    checkpoint_dir: str | None = None,
    save_every: int = 1000,
) -> peft_trainer.PeftTrainer:
  """A ``PeftTrainer`` over the model's LoRA params with ``clip -> anlr_jax.anlr`` as optimizer."""
  tx = optax.chain(
      optax.clip_by_global_norm(1.0),
      anlr_jax.anlr(learning_rate, weight_decay=0.0, warmup_steps=warmup_steps),
  )
  config = peft_trainer.TrainingConfig(
      eval_every_n_steps=steps + 1,
      max_steps=steps,
      checkpoint_root_directory=checkpoint_dir,
      checkpointing_options=ocp.CheckpointManagerOptions(save_interval_steps=save_every),
      pbar_description="anlr",
  )
  trainer = peft_trainer.PeftTrainer(model, tx, config)
  return trainer.with_gen_model_input_fn(model_inputs)


def loss(model: nnx.Module, seed: int = 123) -> float:
  """Tunix's default next-token loss on one held-out batch."""
  x = model_inputs(next(batches(1, seed)))
  return float(peft_trainer._default_loss_fn(model, **x))  # the loss PeftTrainer minimises


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--steps", type=int, default=60)
  parser.add_argument("--warmup_steps", type=int, default=10)
  parser.add_argument("--checkpoint_dir", default=None)
  args = parser.parse_args()

  model = tiny_gemma()
  print(anlr_jax.describe(nnx.state(model, nnx.LoRAParam)))
  before = loss(model)
  trainer = make_trainer(
      model, args.steps, warmup_steps=args.warmup_steps, checkpoint_dir=args.checkpoint_dir
  )
  trainer.train(batches(args.steps))
  trainer.close()
  state = anlr_jax.find_anlr_state(trainer.optimizer.opt_state)
  spread = {name: float(np.ptp(np.asarray(s[...]))) for name, s in state.multipliers.items()}
  print(f"loss {before:.3f} -> {loss(model):.3f} after {int(state.count[...])} AnLR updates")
  print(
      f"{len(spread)} LoRA modules; multiplier spread (max - min) from {min(spread.values()):.3f} "
      f"to {max(spread.values()):.3f}"
  )


if __name__ == "__main__":
  main()
