"""Images of the visual data and benchmarks: the one check that a file is an image, and the one
loader that makes it pixel values.

:func:`image_problem` says why a file cannot serve as an image (missing, or not an image PIL can
open: its header is read, not its pixels), or None; :func:`load_image` opens an image (a path, or
the bytes of one, such as an MMBench TSV's base64 cell decoded), converts it to RGB and hands it to
``preprocess`` (a PIL RGB image -> ``(3, H, W)`` float32 array, e.g. the model's CLIP
preprocessing, :func:`anlr_jax.models.llava_image.preprocess_image`). The LLaVA training data
(:mod:`anlr_jax.data.llava`) and the visual eval tasks (:mod:`anlr_jax.evals.visual_tasks`) use
both.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable

import numpy as np
from PIL import Image, UnidentifiedImageError

Preprocess = Callable[[Image.Image], np.ndarray]
"""A PIL RGB image -> its ``(3, H, W)`` float32 pixel values."""


def image_problem(path: str | os.PathLike[str]) -> str | None:
  """Why the file ``path`` is not a usable image (``"image file not found: <path>"`` or
  ``"unreadable image <path>: <reason>"``), or None when PIL opens it (its header is read; broken
  pixel data shows when :func:`load_image` loads it)."""
  path = os.fspath(path)
  if not os.path.isfile(path):
    return f"image file not found: {path}"
  try:
    with Image.open(path):
      pass
  except (UnidentifiedImageError, OSError) as err:
    return f"unreadable image {path}: {err}"
  return None


def encoded_image_problem(data: bytes) -> str | None:
  """Why the bytes ``data`` are not a whole image (PIL's ``verify``), or None."""
  try:
    Image.open(io.BytesIO(data)).verify()
  except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as err:
    return str(err)
  return None


def load_image(source: str | os.PathLike[str] | bytes, preprocess: Preprocess) -> np.ndarray:
  """``preprocess`` of the image at ``source`` (a path or an image's bytes), converted to RGB,
  checked to be a ``(3, H, W)`` array.

  Raises:
    OSError (PIL's UnidentifiedImageError among them): the image does not load.
    ValueError: ``preprocess`` returned another shape.
  """
  if isinstance(source, bytes):
    source = io.BytesIO(source)
  with Image.open(source) as image:
    image.load()
    pixels = np.asarray(preprocess(image.convert("RGB")), dtype=np.float32)
  if pixels.ndim != 3 or pixels.shape[0] != 3:
    raise ValueError(f"preprocess must return a (3, H, W) array, got shape {pixels.shape}")
  return pixels


__all__ = ["Preprocess", "encoded_image_problem", "image_problem", "load_image"]
