"""``anlr_jax.models.hf_files``: shard sizes and the shard writer, on arrays written to tmp_path."""

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from anlr_jax.models.hf_files import INDEX_FILE, SINGLE_FILE, parse_size, write_safetensors_shards


@pytest.mark.parametrize(
    "size,expected",
    [(5000, 5000), ("5GB", 5 * 10**9), ("200MiB", 200 * 2**20), (" 1.5 kb ", 1500), ("7", 7)],
)
def test_parse_size_reads_decimal_and_binary_units(size, expected):
  assert parse_size(size) == expected


@pytest.mark.parametrize("size", ["5XB", "GB", "", True, 0, "0MB", -3])
def test_parse_size_refuses_what_is_not_a_positive_size(size):
  with pytest.raises(ValueError, match="max_shard_size"):
    parse_size(size)


def _arrays():
  rng = np.random.default_rng(0)
  return {
      name: rng.standard_normal(n).astype(np.float32)
      for name, n in [("a", 10), ("b", 30), ("c", 5)]
  }


def test_one_file_when_everything_fits(tmp_path):
  arrays = _arrays()
  sizes = {k: v.nbytes for k, v in arrays.items()}
  files = write_safetensors_shards(
      str(tmp_path), sizes, lambda ks: {k: arrays[k] for k in ks}, "1MB"
  )
  assert files == [SINGLE_FILE] and not (tmp_path / INDEX_FILE).exists()
  loaded = load_file(tmp_path / SINGLE_FILE)
  assert sorted(loaded) == ["a", "b", "c"]
  np.testing.assert_array_equal(loaded["b"], arrays["b"])


def test_shards_in_order_never_over_the_limit_and_an_index_that_maps_every_tensor(tmp_path):
  arrays = _arrays()  # 40, 120 and 20 bytes
  sizes = {k: v.nbytes for k, v in arrays.items()}
  asked = []

  def tensors_of(names):
    asked.append(list(names))
    return {k: arrays[k] for k in names}

  files = write_safetensors_shards(str(tmp_path), sizes, tensors_of, 100)
  # "b" (120 bytes) is larger than the limit: a shard of its own; "c" may not join it.
  assert asked == [["a"], ["b"], ["c"]]
  assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
  index = json.loads((tmp_path / INDEX_FILE).read_text())
  assert index["metadata"]["total_size"] == 180
  assert index["weight_map"] == dict(zip("abc", files))
  for name, file in index["weight_map"].items():
    np.testing.assert_array_equal(load_file(tmp_path / file)[name], arrays[name])
