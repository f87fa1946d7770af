"""LLaVA (CLIP tower + projector + LLaMA) against transformers' LlavaForConditionalGeneration.

Tiny random models (vision width 32, 2 layers, 28 px images of 14 px patches = 4 image tokens; a
LLaMA of width 32 with grouped-query attention), float32 on the CPU, no network.
"""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from anlr_jax.models.generation import generate
from anlr_jax.models.llava_config import LlavaConfig
from anlr_jax.models.llava_image import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, preprocess_image
from anlr_jax.models.llava_io import canonical_key, load_llava_model, save_llava_model
from tests.helpers.tiny_llava import (
    IMAGE_TOKEN,
    PAD,
    TOKENS_PER_IMAGE,
    hf_logits,
    image_ids,
    make_hf_llava,
    ours_logits,
    pixels,
    rel_err,
)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  """transformers' tiny LLaVA and its save_pretrained directory (sharded)."""
  hf = make_hf_llava()
  path = tmp_path_factory.mktemp("llava_hf")
  hf.save_pretrained(path, max_shard_size="20KB")
  return hf, str(path)


@pytest.fixture(scope="module")
def pair(hf_dir):
  hf, path = hf_dir
  model, config = load_llava_model(path)
  return hf, model, config


def test_config_reads_transformers_config(pair):
  hf, _, config = pair
  assert config.num_image_tokens == TOKENS_PER_IMAGE
  assert config.image_token_index == IMAGE_TOKEN
  assert config.feature_layers == (1,)
  assert config.vision_config.hidden_act == "quick_gelu"
  assert config.text_config.num_key_value_heads == 2


def test_the_language_model_loader_points_a_llava_directory_to_load_llava_model(tmp_path):
  from anlr_jax.models import load_hf_model
  from anlr_jax.models.llava_config import is_llava_config

  (tmp_path / "config.json").write_text(json.dumps({"model_type": "llava"}))
  assert is_llava_config(tmp_path)
  with pytest.raises(ValueError, match="load it with anlr_jax.models.load_llava_model"):
    load_hf_model(tmp_path)
  (tmp_path / "config.json").write_text('{"model_type": "llava",\n oops}')
  assert not is_llava_config(tmp_path)
  with pytest.raises(ValueError, match=r"config\.json:2: invalid JSON"):
    LlavaConfig.from_pretrained(tmp_path)


def test_sparse_config_takes_transformers_defaults():
  """A llava-hf style config.json lists only non-default text/vision fields."""
  sparse = {
      "model_type": "llava",
      "image_token_index": 32000,
      "text_config": {"model_type": "llama", "vocab_size": 32064, "rms_norm_eps": 1e-5},
      "vision_config": {
          "hidden_size": 1024,
          "image_size": 336,
          "patch_size": 14,
          "intermediate_size": 4096,
          "num_attention_heads": 16,
          "num_hidden_layers": 24,
      },
  }
  config = LlavaConfig.from_hf_config(sparse)
  ref = transformers.LlavaConfig(**{k: v for k, v in sparse.items() if k != "model_type"})
  assert config.text_config.hidden_size == ref.text_config.hidden_size == 4096
  assert config.text_config.num_hidden_layers == ref.text_config.num_hidden_layers
  assert config.vision_config.hidden_act == ref.vision_config.hidden_act
  assert config.vision_config.layer_norm_eps == ref.vision_config.layer_norm_eps
  assert config.num_image_tokens == 576


def test_vision_tower_hidden_states_match(pair):
  hf, model, _ = pair
  px = pixels(2, seed=3)
  with torch.no_grad():
    ref = hf.model.vision_tower(torch.tensor(px), output_hidden_states=True).hidden_states
  ours = model.model.vision_tower(jnp.asarray(px))
  assert len(ours) == len(ref) == 3
  for a, b in zip(ours, ref):
    assert rel_err(np.asarray(a), b.numpy()) < 1e-5


def test_logits_match_transformers_text_and_image(pair):
  hf, model, _ = pair
  ids, mask = image_ids([[1, 7, "img", 12, 33, 4, 9]], 10)
  px = pixels(1)
  ref = hf_logits(hf, ids, mask, px)
  ours = ours_logits(model, ids, mask, px)
  assert rel_err(ours, ref) < 1e-4
  # The image matters: other pixels give other logits after the image tokens.
  other = ours_logits(model, ids, mask, pixels(1, seed=9))
  assert np.max(np.abs(other[:, -3:] - ours[:, -3:])) > 1e-2


def test_batch_with_several_images_and_padding(pair):
  """Rows with two, no and one image, left-padded: images fill the image tokens in order."""
  hf, model, _ = pair
  rows = [[1, "img", 5, "img", 8, 2], [1, 40, 41, 42], [1, 3, "img", 60]]
  ids, mask = image_ids(rows, 14)
  px = pixels(3, seed=1)
  ref = hf_logits(hf, ids, mask, px)
  ours = ours_logits(model, ids, mask, px)
  real = mask.astype(bool)
  assert rel_err(ours[real], ref[real]) < 1e-4
  # Swapping the first two images changes row 0 only.
  swapped = ours_logits(model, ids, mask, px[[1, 0, 2]])
  assert np.max(np.abs(swapped[0][real[0]] - ours[0][real[0]])) > 1e-2
  np.testing.assert_allclose(swapped[1:][real[1:]], ours[1:][real[1:]], atol=1e-5)
  # The per-row layout (B, K, 3, S, S): K image slots per row, unused slots ignored.
  junk = pixels(3, seed=8)
  per_row = np.stack([px[[0, 1]], junk[[0, 1]], np.stack([px[2], junk[2]])])
  rows_logits = ours_logits(model, ids, mask, per_row)
  np.testing.assert_allclose(rows_logits[real], ours[real], rtol=0, atol=1e-5)


def test_packed_images_become_per_row_slots(pair):
  """The data pipeline's packed images (+ image_mask) as the trainer's per-row slots."""
  _, model, _ = pair
  ids, _ = image_ids([[1, "img", "img", 5], [1, 2, 3], [1, "img", 4]], 12)
  px = pixels(6, seed=7)  # 3 real images, 3 padding: 2 slots per row
  mask = np.array([1, 1, 1, 0, 0, 0])
  slots = model.images_per_row(ids, px, image_mask=mask)
  assert slots.shape == (3, 2, 3, 28, 28)
  np.testing.assert_array_equal(slots[0], px[:2])
  np.testing.assert_array_equal(slots[1], 0.0)
  np.testing.assert_array_equal(slots[2, 0], px[2])
  with pytest.raises(ValueError, match="need 3 images, pixel_values holds 2"):
    model.images_per_row(ids, px, image_mask=np.array([1, 1, 0, 0, 0, 0]))
  with pytest.raises(ValueError, match="more than 1 slots"):
    model.images_per_row(ids, px[:3])


def test_per_row_images_are_checked(pair):
  _, model, _ = pair
  ids, _ = image_ids([[1, "img", "img", 5], [1, 2, 3]], 10)
  with pytest.raises(ValueError, match="row 0 of input_ids holds 8 image tokens"):
    model.check_image_tokens(ids, np.zeros((2, 1, 3, 28, 28)))
  with pytest.raises(ValueError, match="3 rows of images, input_ids 2 rows"):
    model.check_image_tokens(ids, np.zeros((3, 2, 3, 28, 28)))
  with pytest.raises(ValueError, match=r"must have shape \(num_images, 3, 28, 28\)"):
    model.check_image_tokens(ids, np.zeros((2, 3, 32, 32)))
  model.check_image_tokens(ids, np.zeros((2, 2, 3, 28, 28)))


def test_image_token_count_mismatch_is_an_error(pair):
  _, model, _ = pair
  ids, _ = image_ids([[1, "img", 5]], 8)
  with pytest.raises(ValueError, match=r"hold 4 image tokens .* 2 images .* need 8"):
    model(jnp.asarray(ids), pixel_values=jnp.asarray(pixels(2)))


def test_greedy_generation_matches_transformers(pair):
  hf, model, _ = pair
  ids, mask = image_ids([[1, "img", 5, 17, 8], [1, 9, "img", 60]], 9)
  px = pixels(2, seed=4)
  with torch.no_grad():
    ref = hf.generate(
        input_ids=torch.tensor(ids),
        attention_mask=torch.tensor(mask),
        pixel_values=torch.tensor(px),
        max_new_tokens=8,
        do_sample=False,
        pad_token_id=PAD,
    )[:, ids.shape[1] :].numpy()
  ours = generate(model, ids, mask, max_new_tokens=8, pixel_values=px, pad_token_id=PAD)
  np.testing.assert_array_equal(np.asarray(ours), ref)
  with pytest.raises(ValueError, match="image tokens"):
    generate(model, ids, mask, max_new_tokens=2, pixel_values=px[:1])


@pytest.mark.parametrize(
    "variant",
    [dict(hidden_act="gelu", strategy="full"), dict(feature_layer=[-3, -1])],
    ids=["gelu-full", "layer-list"],
)
def test_other_llava_choices_match(variant, tmp_path):
  """GELU towers, the 'full' strategy (CLS kept) and concatenated feature layers."""
  hf = make_hf_llava(seed=5, **variant)
  hf.save_pretrained(tmp_path)
  model, config = load_llava_model(tmp_path)
  n = config.num_image_tokens
  ids = np.array([[1, 4] + [IMAGE_TOKEN] * n + [7, 8]])
  px = pixels(1, seed=6)
  ref = hf_logits(hf, ids, np.ones_like(ids), px)
  ours = ours_logits(model, ids, np.ones_like(ids), px)
  assert rel_err(ours, ref) < 1e-4


# ------------------------------------------------------------------------------------ checkpoints


def _flax_params(model):
  return {
      ".".join(map(str, p)): np.asarray(v[...])
      for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
  }


def _write_layout(src_dir, dst_dir, rename):
  with open(os.path.join(src_dir, "model.safetensors.index.json")) as f:
    files = sorted(set(json.load(f)["weight_map"].values()))
  tensors = {}
  for file in files:
    with safe_open(os.path.join(src_dir, file), framework="numpy") as f:
      tensors.update({rename(k): f.get_tensor(k) for k in f.keys()})
  os.makedirs(dst_dir)
  save_file(tensors, os.path.join(dst_dir, "model.safetensors"))
  with open(os.path.join(src_dir, "config.json")) as f:
    config = f.read()
  with open(os.path.join(dst_dir, "config.json"), "w") as f:
    f.write(config)


def test_loads_every_llava_key_layout(pair, hf_dir, tmp_path):
  """llava-hf hub keys (vision_tower.vision_model.*), transformers' save (sharded, above) and its
  in-memory names (model.language_model.*, lm_head.*) load to the same weights."""
  hf, model, _ = pair
  _, path = hf_dir
  hub = tmp_path / "hub"
  _write_layout(path, hub, canonical_key)
  memory = tmp_path / "memory"
  names = set(hf.state_dict())

  def to_memory(key):
    for new in names:
      if canonical_key(new) == canonical_key(key):
        return new
    raise AssertionError(key)

  _write_layout(path, memory, to_memory)
  with safe_open(str(hub / "model.safetensors"), framework="numpy") as f:
    assert "vision_tower.vision_model.embeddings.class_embedding" in f.keys()
  with safe_open(str(memory / "model.safetensors"), framework="numpy") as f:
    assert "model.language_model.layers.0.self_attn.q_proj.weight" in f.keys()
  want = _flax_params(model)
  for layout in (hub, memory):
    got = _flax_params(load_llava_model(layout)[0])
    assert got.keys() == want.keys()
    for k in want:
      np.testing.assert_array_equal(got[k], want[k])


def test_unknown_or_missing_tensor_is_an_error(hf_dir, tmp_path):
  _, path = hf_dir
  broken = tmp_path / "extra"
  _write_layout(path, broken, lambda k: k.replace("linear_2", "linear_3"))
  with pytest.raises(ValueError, match="does not have: .*linear_3"):
    load_llava_model(broken)


def test_save_is_loaded_by_transformers(pair, tmp_path):
  hf, model, config = pair
  files = save_llava_model(model, config, tmp_path, max_shard_size="30KB")
  assert len(files) > 1 and os.path.isfile(tmp_path / "model.safetensors.index.json")
  with open(tmp_path / "model.safetensors.index.json") as f:
    keys = set(json.load(f)["weight_map"])
  assert "vision_tower.vision_model.encoder.layers.0.self_attn.q_proj.weight" in keys
  assert "language_model.lm_head.weight" in keys
  reloaded = transformers.LlavaForConditionalGeneration.from_pretrained(tmp_path).eval()
  ids, mask = image_ids([[1, "img", 5, 6]], 8)
  px = pixels(1, seed=2)
  np.testing.assert_allclose(
      hf_logits(reloaded, ids, mask, px), hf_logits(hf, ids, mask, px), rtol=0, atol=1e-6
  )
  again, _ = load_llava_model(tmp_path)
  want = _flax_params(model)
  for k, v in _flax_params(again).items():
    np.testing.assert_array_equal(v, want[k])


# ---------------------------------------------------------------------------------------- images


def _photos():
  skimage_data = pytest.importorskip("skimage.data")
  coffee = skimage_data.coffee()  # 400 x 600, landscape
  return {
      "astronaut": skimage_data.astronaut(),  # 512 x 512
      "coffee": coffee,
      "coffee-portrait": np.ascontiguousarray(coffee.transpose(1, 0, 2)),
      "chelsea": skimage_data.chelsea(),  # 300 x 451: upscaled to 336
      "camera-grey": skimage_data.camera(),  # 512 x 512 single channel
  }


@pytest.mark.parametrize("size", [336, 28])
def test_preprocess_matches_clip_image_processor(size):
  """Same pixel values as transformers' CLIPImageProcessor (PIL backend) on real photos.

  Both resize with PIL's bicubic filter on the same uint8 image and then run the same float32
  arithmetic, so they agree to float32 rounding (1e-6 allows a last-bit difference in the division).
  """
  from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
  from PIL import Image

  processor = CLIPImageProcessorPil(
      size={"shortest_edge": size},
      crop_size={"height": size, "width": size},
      image_mean=list(OPENAI_CLIP_MEAN),
      image_std=list(OPENAI_CLIP_STD),
  )
  for name, photo in _photos().items():
    ref = processor(images=Image.fromarray(photo), return_tensors="np")["pixel_values"][0]
    ours = preprocess_image(Image.fromarray(photo), size)
    assert ours.shape == ref.shape == (3, size, size), name
    assert ours.dtype == np.float32
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-6, err_msg=name)
    np.testing.assert_array_equal(preprocess_image(photo, size), ours)


@pytest.mark.parametrize("size", [336, 28])
def test_preprocess_matches_clip_image_processor_when_the_long_side_has_a_large_fraction(size):
  """COCO's usual 640 x 427 (and 500 x 333) photos: the resized long side ``S * long / short`` has a
  fraction >= .5 (503.6 at S = 336, 41.97 at 28), where truncating it, as transformers does, and
  rounding it differ by a pixel; the photos above all have fractions below .5."""
  from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
  from PIL import Image

  processor = CLIPImageProcessorPil(
      size={"shortest_edge": size},
      crop_size={"height": size, "width": size},
      image_mean=list(OPENAI_CLIP_MEAN),
      image_std=list(OPENAI_CLIP_STD),
  )
  coffee = Image.fromarray(_photos()["coffee"])  # 600 x 400 (width x height)
  for width, height in [(640, 427), (427, 640), (500, 333)]:
    photo = coffee.resize((width, height), Image.Resampling.BICUBIC)
    ref = processor(images=photo, return_tensors="np")["pixel_values"][0]
    ours = preprocess_image(photo, size)
    assert ours.shape == ref.shape == (3, size, size)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-6, err_msg=f"{width} x {height}")
