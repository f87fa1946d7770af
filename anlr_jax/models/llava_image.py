r"""Images as a LLaVA model's vision tower takes them: :func:`preprocess_image`, exactly as
transformers' ``CLIPImageProcessor`` (PIL backend) does. Loading and checking image files is
:mod:`anlr_jax.data.images`'s.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from anlr_jax.models.clip import ClipVisionConfig
from anlr_jax.models.llava_config import LlavaConfig

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)


OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def preprocess_image(
    image,
    config: LlavaConfig | ClipVisionConfig | int,
    *,
    mean: Sequence[float] = OPENAI_CLIP_MEAN,
    std: Sequence[float] = OPENAI_CLIP_STD,
) -> np.ndarray:
  r"""An image as the vision tower's input, float32 ``(3, S, S)``, like ``CLIPImageProcessor``.

  Steps (those of transformers' ``CLIPImageProcessor`` with ``size={'shortest_edge': S}``,
  ``crop_size=S``, PIL backend): convert to RGB; resize with PIL's bicubic filter so the shorter
  side is ``S`` and the longer ``int(S * long / short)``; crop the centre ``S x S`` (top/left offset
  ``(side - S) // 2``; a side shorter than ``S`` is zero-padded around the centre); scale by
  ``1/255``; normalise ``(x - mean) / std`` per channel; channels first.

  Args:
    image: a PIL image, or an ``(H, W, 3)`` / ``(H, W)`` uint8 array.
    config: the model's config (``S`` = ``vision_config.image_size``) or ``S`` itself.
    mean, std: per-channel statistics (OpenAI CLIP's by default, as LLaVA-1.5 uses).
  """
  from PIL import Image

  if isinstance(config, LlavaConfig):
    config = config.vision_config
  size = config.image_size if isinstance(config, ClipVisionConfig) else int(config)
  if isinstance(image, np.ndarray):
    if image.dtype != np.uint8:
      raise ValueError(f"an image array must be uint8 (H, W[, 3]), got {image.dtype}.")
    image = Image.fromarray(image)
  if not isinstance(image, Image.Image):
    raise TypeError(f"image must be a PIL image or a uint8 array, got {type(image).__name__}.")
  image = image.convert("RGB")
  width, height = image.size
  short, long = (width, height) if width <= height else (height, width)
  new_short, new_long = size, int(size * long / short)
  new_w, new_h = (new_short, new_long) if width <= height else (new_long, new_short)
  pixels = np.asarray(image.resize((new_w, new_h), resample=Image.Resampling.BICUBIC))
  pixels = pixels.transpose(2, 0, 1)  # (3, H, W)
  if new_h < size or new_w < size:
    padded = np.zeros((3, max(size, new_h), max(size, new_w)), pixels.dtype)
    top, left = math.ceil((padded.shape[1] - new_h) / 2), math.ceil((padded.shape[2] - new_w) / 2)
    padded[:, top : top + new_h, left : left + new_w] = pixels
    pixels = padded
  top, left = (pixels.shape[1] - size) // 2, (pixels.shape[2] - size) // 2
  pixels = pixels[:, top : top + size, left : left + size]
  scaled = (pixels.astype(np.float64) * (1 / 255)).astype(np.float32)
  mean = np.asarray(mean, np.float32)[:, None, None]
  std = np.asarray(std, np.float32)[:, None, None]
  return np.ascontiguousarray((scaled - mean) / std)


__all__ = ["OPENAI_CLIP_MEAN", "OPENAI_CLIP_STD", "preprocess_image"]
