"""LoRA / AnLR-LoRA on LLaVA: adapters in the language model only, the vision tower frozen, the
projector trained in full at its own learning rate, and the adapter (with the projector as PEFT's
``modules_to_save``) loaded by PEFT onto transformers' LLaVA with the same outputs."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from flax import nnx

from anlr_jax.methods import method_optimizer
from anlr_jax.models.llava_io import load_llava_model
from anlr_jax.nn import iter_adalora_layers, iter_lora_layers
from anlr_jax.nn.adalora import inject_adalora
from anlr_jax.nn.inject import PAPER_TARGET_MODULES, inject_lora
from anlr_jax.nn.lora import LoRALinear
from anlr_jax.nn.peft_io import export_peft_adapter, import_peft_adapter
from anlr_jax.nn.trainable import FullParam, train_in_full, with_full_params
from tests.helpers.tiny_llava import IMAGE_TOKEN, forward, hf_logits, image_ids, make_hf_llava, ours_logits, pixels, rel_err
from tests.helpers.cim_torch import torch_one_thread  # noqa: F401  (autouse)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  path = tmp_path_factory.mktemp("llava_hf")
  make_hf_llava(seed=11).save_pretrained(path)
  return str(path)


def _params(model, kind=nnx.Param):
  return {
      ".".join(map(str, p)): np.asarray(v[...])
      for p, v in nnx.to_flat_state(nnx.state(model, kind))
  }


def test_adapters_go_into_the_language_model_only(hf_dir):
  model, _ = load_llava_model(hf_dir)
  inject_lora(model, target_modules=PAPER_TARGET_MODULES, rank=2, alpha=4.0, rngs=nnx.Rngs(0))
  names = [name for name, _ in iter_lora_layers(model)]
  assert len(names) == 2 * 5  # two decoder layers x q/k/v/up/down
  assert all(n.startswith("model.language_model.layers.") for n in names)
  vision_attn = model.model.vision_tower.encoder.layers[0].self_attn
  assert type(vision_attn.q_proj) is nnx.Linear and type(vision_attn.v_proj) is nnx.Linear
  other, _ = load_llava_model(hf_dir)
  inject_adalora(other, target_modules=("q_proj", "v_proj"), rank=2, alpha=4.0, rngs=nnx.Rngs(0))
  assert all(n.startswith("model.language_model.") for n, _ in iter_adalora_layers(other))
  with pytest.raises(ValueError, match="out_proj"):  # a vision-only name matches nothing
    inject_lora(other, target_modules=("out_proj",), rank=2, alpha=4.0, rngs=nnx.Rngs(0))


def test_adalora_export_names_the_language_model_layers_in_full(hf_dir, tmp_path):
  from anlr_jax.nn.adalora import export_adalora_adapter
  from anlr_jax.optim.adalora import AdaLoRAConfig

  model, _ = load_llava_model(hf_dir)
  inject_adalora(model, target_modules=("q_proj", "v_proj"), rank=3, alpha=6.0, rngs=nnx.Rngs(0))
  config = AdaLoRAConfig(init_r=3, target_r=2, tinit=1, tfinal=1, deltaT=1, total_step=5)
  export_adalora_adapter(model, tmp_path, config=config)
  with open(tmp_path / "adapter_config.json") as f:
    targets = json.load(f)["target_modules"]
  assert targets == sorted(n for n, _ in iter_adalora_layers(model))
  assert all(t.startswith("model.language_model.layers.") for t in targets)


def test_projector_trains_in_float32_over_bfloat16_weights(hf_dir):
  model, _ = load_llava_model(hf_dir, dtype=jnp.bfloat16)
  before = _params(model)["model.multi_modal_projector.linear_1.kernel"]
  assert before.dtype == jnp.bfloat16
  train_in_full(model, model.PROJECTOR)
  trained = _params(model, FullParam)
  assert {v.dtype for v in trained.values()} == {np.dtype(np.float32)}
  np.testing.assert_array_equal(
      trained["model.multi_modal_projector.linear_1.kernel"], before.astype(np.float32)
  )
  assert _params(model)["model.vision_tower.pre_layrnorm.weight"].dtype == jnp.bfloat16


def test_projector_gets_its_own_learning_rate():
  """Adam's first step moves each leaf by its learning rate: 1e-3 (adapters) vs 1e-4 (full)."""
  params = {
      "model": {
          "language_model": {"q": {"lora_a": jnp.ones((4, 2)), "lora_b": jnp.ones((2, 4))}},
          "multi_modal_projector": {"linear_1": {"kernel": jnp.ones((4, 4))}},
      }
  }
  grads = jax.tree.map(lambda x: 3.0 * x, params)
  tx = with_full_params(
      optax.adamw(1e-3, weight_decay=0.0), 1e-4, [("model", "multi_modal_projector")]
  )
  updates, _ = tx.update(grads, tx.init(params), params)
  np.testing.assert_allclose(updates["model"]["language_model"]["q"]["lora_a"], -1e-3, rtol=1e-5)
  np.testing.assert_allclose(
      updates["model"]["multi_modal_projector"]["linear_1"]["kernel"], -1e-4, rtol=1e-5
  )
  clipped = with_full_params(
      optax.sgd(1.0), 0.0, [("model", "multi_modal_projector")], clip_norm=1.0
  )
  updates, _ = clipped.update(grads, clipped.init(params), params)
  lora_norm = optax.tree.norm(updates["model"]["language_model"])
  total = 3.0 * np.sqrt(8 + 8 + 16)  # one clip over every trained leaf, projector included
  np.testing.assert_allclose(lora_norm, 3.0 * 4 / total, rtol=1e-5)


def _loss(model, batch):
  logits = model(batch["ids"], attention_mask=batch["mask"], pixel_values=batch["px"])
  logp = jax.nn.log_softmax(logits[:, :-1])
  target = batch["ids"][:, 1:]
  nll = -jnp.take_along_axis(logp, target[..., None], axis=-1)[..., 0]
  weight = (batch["mask"][:, 1:] * (target != IMAGE_TOKEN)).astype(jnp.float32)
  return jnp.sum(nll * weight) / jnp.sum(weight)


def _train(model, tx, batch, steps):
  graphdef, trained, frozen = nnx.split(model, nnx.LoRAParam, ...)
  opt_state = tx.init(trained)

  @jax.jit
  def step(trained, opt_state):
    def loss_fn(trained):
      return _loss(nnx.merge(graphdef, trained, frozen), batch)

    loss, grads = jax.value_and_grad(loss_fn)(trained)
    updates, opt_state = tx.update(grads, opt_state, trained)
    return optax.apply_updates(trained, updates), opt_state, loss

  losses = []
  for _ in range(steps):
    trained, opt_state, loss = step(trained, opt_state)
    losses.append(float(loss))
  nnx.update(model, trained)
  return losses


@pytest.mark.parametrize("method", ["lora", "anlr"])
def test_trained_adapter_and_projector_load_in_peft(method, hf_dir, tmp_path):
  from peft import PeftModel
  from transformers import LlavaForConditionalGeneration

  model, _ = load_llava_model(hf_dir)
  inject_lora(model, rank=4, alpha=8.0, dropout=0.0, rngs=nnx.Rngs(1))
  projector = train_in_full(model, model.PROJECTOR)
  assert len(projector) == 4  # two kernels, two biases
  assert all(isinstance(v, FullParam) for _, v in nnx.to_flat_state(nnx.state(model, FullParam)))
  frozen_before = _params(model, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam)))
  projector_before = _params(model, FullParam)

  ids, mask = image_ids([[1, "img", 5, 17, 8, 30], [1, 9, 10, "img", 60]], 11)
  px = pixels(2, seed=12)
  batch = dict(ids=jnp.asarray(ids), mask=jnp.asarray(mask), px=jnp.asarray(px))
  adapter_tx = method_optimizer(method, 3e-2, clip_norm=None, anlr_kwargs=dict(warmup_steps=1))
  tx = with_full_params(adapter_tx, 1e-2, [model.PROJECTOR], clip_norm=1.0)
  losses = _train(model, tx, batch, steps=4)
  assert losses[-1] < losses[0]

  frozen_after = _params(model, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam)))
  assert frozen_after.keys() == frozen_before.keys()
  assert any(k.startswith("model.vision_tower.") for k in frozen_after)
  for k, v in frozen_before.items():  # the vision tower and the base LM never move
    np.testing.assert_array_equal(frozen_after[k], v, err_msg=k)
  moved = _params(model, FullParam)
  assert all(np.max(np.abs(moved[k] - projector_before[k])) > 1e-4 for k in moved)

  export_peft_adapter(model, tmp_path, modules_to_save=[model.PROJECTOR])
  with open(tmp_path / "adapter_config.json") as f:
    config = json.load(f)
  assert config["modules_to_save"] == ["multi_modal_projector"]
  assert all(t.startswith("model.language_model.") for t in config["target_modules"])

  eval_ids, eval_mask = image_ids([[1, 4, "img", 22, 23, 24], [1, "img", 70, 71]], 10)
  eval_px = pixels(2, seed=13)
  ours = ours_logits(model, eval_ids, eval_mask, eval_px)
  base = LlavaForConditionalGeneration.from_pretrained(hf_dir).eval()
  before = hf_logits(base, eval_ids, eval_mask, eval_px)
  peft_model = PeftModel.from_pretrained(base, str(tmp_path)).eval()
  after = hf_logits(peft_model, eval_ids, eval_mask, eval_px)
  real = eval_mask.astype(bool)
  assert rel_err(ours[real], after[real]) < 1e-4
  assert rel_err(before[real], after[real]) > 1e-2  # the adapter does change the outputs

  fresh, _ = load_llava_model(hf_dir)
  import_peft_adapter(fresh, tmp_path)
  assert isinstance(fresh.model.language_model.layers[0].self_attn.q_proj, LoRALinear)
  again = ours_logits(fresh, eval_ids, eval_mask, eval_px)
  np.testing.assert_allclose(again[real], ours[real], rtol=0, atol=1e-5)


class ImageBatches:
  """Four rows per batch, right-padded; rows 0, 2, 3 hold an image, row 1 none."""

  def __len__(self):
    return 2

  def get_batch(self, step, *, process_index=0, process_count=1):
    rows = [[1, "img", 5, 17, 8, 30], [1, 9, 10, 11], [1, 40, "img", 60], [1, "img", 2]]
    ids, mask = image_ids(rows, 11)
    ids, mask = ids[:, ::-1].copy(), mask[:, ::-1].copy()  # right padding, as the data produces
    for r, row in enumerate(rows):  # un-reverse each row's tokens
      n = int(mask[r].sum())
      ids[r, :n] = ids[r, :n][::-1]
    loss_mask = mask * (ids != IMAGE_TOKEN)
    # The data pipeline's layout: the batch's images in order of appearance, padded to one image
    # per row (row 1 has none), with image_mask marking the real ones.
    px = pixels(4, seed=20 + step)
    px[3] = 0.0
    image_mask = np.array([1, 1, 1, 0], np.int32)
    return dict(
        input_ids=ids,
        attention_mask=mask,
        loss_mask=loss_mask,
        pixel_values=px,
        image_mask=image_mask,
    )


def test_trainer_trains_llava_on_image_batches(hf_dir):
  """The trainer's step carries pixel_values, split by rows into micro-batches; its loss is the
  model's masked cross-entropy; the projector is trained, the vision tower is not."""
  from anlr_jax.train.loss import next_token_loss_sum
  from anlr_jax.train.trainer import Trainer, TrainerConfig

  def build(micro_batches):
    model, _ = load_llava_model(hf_dir)
    inject_lora(model, rank=4, alpha=8.0, dropout=0.0, rngs=nnx.Rngs(1))
    train_in_full(model, model.PROJECTOR)
    adapter_tx = method_optimizer("anlr", 1e-2, clip_norm=None, anlr_kwargs=dict(warmup_steps=1))
    tx = with_full_params(adapter_tx, 1e-2, [model.PROJECTOR], clip_norm=1.0)
    config = TrainerConfig(
        steps=2,
        global_batch=4,
        micro_batches=micro_batches,
        compute_dtype="float32",
        progress=False,
    )
    return model, Trainer(model, ImageBatches(), config, tx, devices=jax.devices()[:1])

  model, trainer = build(2)  # two micro-batches of two rows: their sums make the batch's loss
  batch = ImageBatches().get_batch(0)
  logits = forward(
      model,
      jnp.asarray(batch["input_ids"]),
      jnp.asarray(batch["attention_mask"]),
      jnp.asarray(batch["pixel_values"][batch["image_mask"] == 1]),
  )
  total, count = next_token_loss_sum(
      logits, jnp.asarray(batch["input_ids"]), jnp.asarray(batch["loss_mask"])
  )
  frozen_before = _params(model, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam)))
  projector_before = _params(model, FullParam)
  losses = [float(trainer.train_step()["loss"]) for _ in range(2)]
  np.testing.assert_allclose(losses[0], float(total / count), rtol=1e-5)
  updated = trainer.updated_model()
  frozen_after = _params(updated, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam)))
  for k, v in frozen_before.items():
    np.testing.assert_array_equal(frozen_after[k], v, err_msg=k)
  moved = _params(updated, FullParam)
  assert all(np.max(np.abs(moved[k] - projector_before[k])) > 1e-5 for k in moved)
