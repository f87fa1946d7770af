r"""A quantised frozen base: NF4 with double quantisation (QLoRA) and blockwise int8.

For a Flax kernel ``W`` of shape ``(d_in, d_out)`` the blocks are ``B = 64`` consecutive inputs of
one output unit, ``W[64 m : 64 m + 64, j]``: the same blocks as bitsandbytes's in the torch layout
``(d_out, d_in)`` (``d_in`` must be a multiple of 64).

NF4 (Dettmers et al., 2023, Sec. 3): with ``s_{mj} = max |W[block m, j]|`` (the absmax) every
weight becomes the index of the nearest of the 16 NormalFloat values ``q_k`` (:data:`NF4_CODEBOOK`,
the paper's asymmetric NF4: 7 negative and 8 positive normal quantiles scaled to [-1, 1], with an
exact zero)

.. math::

   c = \arg\min_k |W / s - q_k| \quad\text{(the lower index at an exact tie)}, \qquad
   \hat W = q_c \, \hat s,

stored two codes a byte: byte ``[i, j]`` holds ``c[2 i, j]`` in its high and ``c[2 i + 1, j]`` in
its low nibble (bitsandbytes's order). Double quantisation (the paper's DQ) stores the absmax in 8
bits: with ``mu`` the float32 mean of all of a layer's absmax values and the values read in the
torch order (output unit major, ``t = j * (d_in / 64) + m``), blocks of 256 consecutive ``s - mu``
(the last one shorter) get ``a = max |s - mu| \cdot \mathrm{fl}(1 / 127)`` and the int8 codes
``round(( s - mu) / a)`` (half to even; 0 where ``a = 0``), so ``\hat s = code \cdot a + mu``.
The paper quantises these centred values to FP8; this module uses int8 with the same 8 bits, whose
error is uniform over the range (the centred values' error counts absolutely, since ``mu`` is added
back). Bits per weight: ``4 + 8 / 64 + 32 / (64 \cdot 256) = 4.127``.

int8: ``a_{mj} = s_{mj} \cdot \mathrm{fl}(1 / 127)`` (float32 ``1 / 127``), codes ``round(W / a)`` (half to even) in ``[-127, 127]``,
``\hat W = code \cdot a``; ``8 + 32 / 64 = 8.5`` bits per weight.

Float32 scales are stored as their raw bits (``uint32``), so nothing that casts a model's floating
frozen weights (``trainer.base_dtype``) can round them. Every stored array carries the kernel's
logical axis names where it has the kernel's axes (codes ``(d_in / 2, d_out)`` or
``(d_in, d_out)``, absmax codes ``(d_in / 64, d_out)``) and shards like the kernel; a mesh must not
split a block (``d_in`` a multiple of 64 times the devices on the input axis). The double
quantisation's second-level scales and mean are small and replicated.

:class:`QuantLinear` is a frozen ``nnx.Linear`` holding these arrays. Its forward dequantises inside
the jitted matmul, and its backward (``jax.custom_vjp``) keeps only the packed arrays and
dequantises again, so no dequantised weight is held between the passes. ``layer.kernel`` is a
view: ``kernel[...]`` is the dequantised weight (in ``param_dtype``), and assigning to it
quantises the new value (PiSSA's residual). On a CPU, an input of at most :data:`DECODE_ROWS` rows
(one-token decoding) is multiplied a chunk of output columns at a time
(:func:`_columnwise_matmul`): no float32 buffer of the whole kernel exists; more rows (prefill,
training) dequantise the whole kernel once and take one product.

:class:`QuantEmbed` stores an embedding table the same way, as the kernel of its transpose: a
lookup dequantises only the rows it reads.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

QUANTIZE_MODES = ("none", "int8", "nf4")
"""Accepted values of ``model.quantize``."""

BLOCK = 64
"""Weights per absmax block (along the input axis)."""

DQ_BLOCK = 256
"""Absmax values per block of the double quantisation."""

NF4_CODEBOOK = np.array(
    [
        -1.0,
        -0.6961928009986877,
        -0.5250730514526367,
        -0.39491748809814453,
        -0.28444138169288635,
        -0.18477343022823334,
        -0.09105003625154495,
        0.0,
        0.07958029955625534,
        0.16093020141124725,
        0.24611230194568634,
        0.33791524171829224,
        0.44070982933044434,
        0.5626170039176941,
        0.7229568362236023,
        1.0,
    ],
    np.float32,
)
"""The 16 NF4 values (QLoRA, Appendix E; bitsandbytes's table), ascending."""

_INV_127 = np.float32(1 / 127)  # scales are absmax * float32(1 / 127), a multiplication

_NF4_MIDPOINTS = (NF4_CODEBOOK[1:] + NF4_CODEBOOK[:-1]) / np.float32(2)

BYTES_PER_PARAM = {"none": None, "int8": 8.5 / 8, "nf4": (4 + 8 / 64 + 32 / (64 * 256)) / 8}
"""Stored bytes per base weight of a quantised linear layer (``none``: the weight's dtype)."""


class QuantizedParam(nnx.Param):
  """A packed code or scale array of a quantised frozen kernel (never trained)."""


def check_mode(mode: str, key: str = "model.quantize") -> str:
  if mode not in QUANTIZE_MODES:
    raise ValueError(f"{key}={mode!r} must be one of {', '.join(QUANTIZE_MODES)}")
  return mode


def _bits(x: jax.Array) -> jax.Array:
  return jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)


def _float(bits: jax.Array) -> jax.Array:
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


def block_absmax(w: jax.Array) -> jax.Array:
  """``max |w|`` of every block: ``(d_in / 64, d_out)`` for a kernel ``(d_in, d_out)``."""
  w = jnp.asarray(w).astype(jnp.float32)
  d_in, d_out = w.shape
  return jnp.max(jnp.abs(w.reshape(d_in // BLOCK, BLOCK, d_out)), axis=1)


def _torch_order(s: jax.Array) -> jax.Array:
  """``(d_in / 64, d_out)`` -> flat in the torch order (output unit major)."""
  return s.T.reshape(-1)


def _from_torch_order(flat: jax.Array, shape) -> jax.Array:
  return flat.reshape(shape[1], shape[0]).T


def _double_quantize(s: jax.Array):
  """``(codes int8 like s, scales (n_blocks,) float32, mean float32)`` of the absmax ``s``."""
  mean = jnp.mean(s)
  flat = _torch_order(s) - mean
  n = flat.shape[0]
  pad = -n % DQ_BLOCK
  blocks = jnp.pad(flat, (0, pad)).reshape(-1, DQ_BLOCK)
  scale = jnp.max(jnp.abs(blocks), axis=1) * _INV_127
  safe = jnp.where(scale > 0, scale, 1)[:, None]
  codes = jnp.where(scale[:, None] > 0, jnp.round(blocks / safe), 0)
  codes = jnp.clip(codes, -127, 127).astype(jnp.int8).reshape(-1)[:n]
  return _from_torch_order(codes, s.shape), scale, mean


def _double_dequantize(codes: jax.Array, scale: jax.Array, mean: jax.Array) -> jax.Array:
  flat = _torch_order(codes).astype(jnp.float32)
  n = flat.shape[0]
  # a broadcast, not jnp.repeat: its gather's index constant made XLA:CPU's compiler take GiBs
  blocks = jnp.pad(flat, (0, -n % DQ_BLOCK)).reshape(-1, DQ_BLOCK)
  values = (blocks * scale[:, None] + mean).reshape(-1)[:n]
  return _from_torch_order(values, codes.shape)


def _codes(w: jax.Array, s: jax.Array, mode: str) -> jax.Array:
  """The codes of kernel columns ``w`` ``(d_in, n)`` with their absmax ``s`` ``(d_in / 64, n)``."""
  d_in, d_out = w.shape
  blocks = w.astype(jnp.float32).reshape(d_in // BLOCK, BLOCK, d_out)
  if mode == "int8":
    a = s * _INV_127
    codes = jnp.where(a[:, None] > 0, jnp.round(blocks / jnp.where(a > 0, a, 1)[:, None]), 0)
    return jnp.clip(codes, -127, 127).astype(jnp.int8).reshape(d_in, d_out)
  normed = (blocks / jnp.where(s > 0, s, 1)[:, None]).reshape(d_in, d_out)
  idx = jnp.searchsorted(jnp.asarray(_NF4_MIDPOINTS), normed, side="left").astype(jnp.uint8)
  pairs = idx.reshape(d_in // 2, 2, d_out)
  return (pairs[:, 0] << 4) | pairs[:, 1]


def _scales(s: jax.Array, mode: str) -> dict[str, jax.Array]:
  if mode == "int8":
    return {"scales": _bits(s * _INV_127)}
  s_codes, dq_scales, dq_mean = _double_quantize(s)
  return {"scales": s_codes, "dq_scales": _bits(dq_scales), "dq_mean": _bits(dq_mean)}


def quantize_kernel(w: jax.Array, mode: str) -> dict[str, jax.Array]:
  """The stored arrays of kernel ``w`` ``(d_in, d_out)`` (module doc): ``codes``, ``scales`` and,
  for nf4, ``dq_scales`` and ``dq_mean`` (float32 values as uint32 bits)."""
  if mode not in ("int8", "nf4"):
    raise ValueError(f"quantize_kernel: mode {mode!r} is not one of int8, nf4")
  s = block_absmax(w)
  return {"codes": _codes(jnp.asarray(w), s, mode), **_scales(s, mode)}


class RowBlocks:
  """A host matrix ``(rows, cols)`` that is read a block of rows at a time (``read(start, stop)``
  gives float32 ``(stop - start, cols)``) rather than held whole: a checkpoint tensor that
  :func:`quantize_concrete` (through :class:`QuantLinear` and :class:`QuantEmbed`) quantises a
  block at a time, so its float32 values never exist whole (a 151,936 x 1536 output matrix is
  0.87 GiB of them). ``.T`` is the transposed view, whose column blocks ``[:, a:b]`` read rows
  ``a:b``; ``np.asarray`` reads the whole."""

  ndim = 2
  dtype = np.dtype(np.float32)

  def __init__(self, shape: tuple[int, int], read, transposed: bool = False):
    self._rows_cols, self._read, self._transposed = tuple(shape), read, transposed

  @property
  def shape(self) -> tuple[int, int]:
    rows, cols = self._rows_cols
    return (cols, rows) if self._transposed else (rows, cols)

  @property
  def T(self) -> "RowBlocks":  # pylint: disable=invalid-name
    return RowBlocks(self._rows_cols, self._read, not self._transposed)

  def __array__(self, dtype=None, copy=None):
    del copy  # always a new array
    whole = self._read(0, self._rows_cols[0])
    whole = whole.T if self._transposed else whole
    return whole if dtype is None else whole.astype(dtype, copy=False)

  def __getitem__(self, index) -> np.ndarray:
    """Row blocks ``[a:b]`` of the matrix, or column blocks ``[:, a:b]`` of its transpose."""
    if self._transposed and isinstance(index, tuple) and len(index) == 2:
      everything, block = index
      if everything == slice(None) and isinstance(block, slice) and block.step in (None, 1):
        start, stop, _ = block.indices(self._rows_cols[0])
        return self._read(start, stop).T
    if not self._transposed and isinstance(index, slice) and index.step in (None, 1):
      start, stop, _ = index.indices(self._rows_cols[0])
      return self._read(start, stop)
    raise IndexError(f"RowBlocks reads blocks of rows only, not {index!r}")


QUANTIZE_CHUNK_BYTES = 64 * 2**20
"""Float32 bytes of kernel columns :func:`quantize_concrete` quantises per compiled call."""

_absmax_jit = jax.jit(block_absmax)
_codes_jit = jax.jit(_codes, static_argnums=2)
_scales_jit = jax.jit(_scales, static_argnums=1)


def quantize_concrete(w, mode: str) -> dict[str, jax.Array]:
  """:func:`quantize_kernel` of a concrete kernel, its codes computed for column chunks of
  about :data:`QUANTIZE_CHUNK_BYTES` at a time: the same arrays, while the temporaries of the
  quantisation (several times the float32 kernel: 7.4 GiB for a 151,936 x 1536 output matrix
  in one call) stay those of a chunk."""
  if mode not in ("int8", "nf4"):
    raise ValueError(f"quantize_kernel: mode {mode!r} is not one of int8, nf4")
  d_in, d_out = w.shape
  width = max(1, QUANTIZE_CHUNK_BYTES // (4 * d_in))
  if width >= d_out:
    w = jnp.asarray(w)
    s = _absmax_jit(w)
    codes = _codes_jit(w, s, mode)
  else:
    # a NumPy kernel (a checkpoint's tensor) is copied to the device a chunk at a time: no whole
    # float copy of it exists beside the caller's
    scales, parts = [], []
    for j in range(0, d_out, width):
      chunk = jnp.asarray(w[:, j : j + width])
      scales.append(_absmax_jit(chunk))
      parts.append(_codes_jit(chunk, scales[-1], mode))
      del chunk
    s = jnp.concatenate(scales, axis=1)
    codes = jnp.concatenate(parts, axis=1)
  # waiting here releases the float kernel's buffer now: otherwise the runtime held the last
  # call's input until the next computation ran (0.87 GiB after loading a 1.5B model's output
  # matrix)
  return jax.block_until_ready({"codes": codes, **_scales_jit(s, mode)})


def nf4_indices(codes: jax.Array) -> jax.Array:
  """The 4-bit codes ``(d_in, d_out)`` of packed bytes ``(d_in / 2, d_out)``."""
  pairs = jnp.stack([codes >> 4, codes & 15], axis=1)
  return pairs.reshape(codes.shape[0] * 2, codes.shape[1])


def float_scales(arrays: dict[str, jax.Array], mode: str) -> jax.Array:
  """The float32 absmax scales ``(d_in / 64, d_out)`` of :func:`quantize_kernel`'s arrays."""
  if mode == "int8":
    return _float(arrays["scales"])
  return _double_dequantize(
      arrays["scales"], _float(arrays["dq_scales"]), _float(arrays["dq_mean"])
  )


def _dequantize_codes(codes: jax.Array, scales: jax.Array, mode: str) -> jax.Array:
  """The float32 weights of codes (``(d_in / 2, n)`` bytes or ``(d_in, n)`` int8) and their
  float scales ``(d_in / 64, n)``."""
  if mode == "int8":
    d_in, d_out = codes.shape
    blocks = codes.astype(jnp.float32).reshape(d_in // BLOCK, BLOCK, d_out)
    return (blocks * scales[:, None]).reshape(d_in, d_out)
  idx = nf4_indices(codes)
  d_in, d_out = idx.shape
  values = jnp.asarray(NF4_CODEBOOK)[idx.astype(jnp.int32)]
  return (values.reshape(d_in // BLOCK, BLOCK, d_out) * scales[:, None]).reshape(d_in, d_out)


def dequantize_kernel(arrays: dict[str, jax.Array], mode: str) -> jax.Array:
  """The float32 kernel ``(d_in, d_out)`` of :func:`quantize_kernel`'s arrays."""
  return _dequantize_codes(arrays["codes"], float_scales(arrays, mode), mode)


# ------------------------------------------------------------------------- the jitted matmul
@dataclasses.dataclass(frozen=True)
class _MatmulSpec:
  mode: str
  dtype: Any  # operand dtype of the product (the compute dtype, or matmul_dtype)
  lowp: bool  # matmul_dtype: float32 sums, result in x's dtype
  precision: Any


def _dot(x, w, spec: _MatmulSpec, w_axis: int):
  dims = (((x.ndim - 1,), (w_axis,)), ((), ()))
  if spec.lowp:
    y = jax.lax.dot_general(
        x.astype(spec.dtype), w.astype(spec.dtype), dims, preferred_element_type=jnp.float32
    )
    return y.astype(x.dtype)
  return jax.lax.dot_general(x, w.astype(spec.dtype), dims, precision=spec.precision)


def _tie(x) -> jax.Array:
  """A float32 zero computed from ``x`` (``0 * x[0]``): added to the scales, it makes the
  dequantisation depend on the layer's input (:func:`_dequantize_after`)."""
  return 0 * jax.lax.stop_gradient(x).reshape(-1)[0].astype(jnp.float32)


def _dequantize_after(arrays, x, mode: str) -> jax.Array:
  """The dequantised kernel, computed only once ``x`` exists.

  The weights do not depend on the activations, so XLA may dequantise every layer's at the start
  of a program and keep them all (XLA:CPU does: 3.6 layers' float32 weights alive at once in a
  4-layer forward). The scales pass through ``s + 0 * x[0]`` first: the same values (a
  non-finite ``x``, whose output is not finite either, gives others), computed after ``x``.
  """
  zero = _tie(x)
  tied = dict(arrays)
  tied["scales"] = _bits(_float(arrays["scales"]) + zero) if mode == "int8" else arrays["scales"]
  if mode == "nf4":
    tied["dq_mean"] = _bits(_float(arrays["dq_mean"]) + zero)
  return dequantize_kernel(tied, mode)


DECODE_ROWS = 16
"""Inputs of at most this many rows (one-token decoding) take :func:`_columnwise_matmul`."""

CHUNK_BYTES = 8 * 2**20
"""Bytes of the float32 weights :func:`_columnwise_matmul` dequantises at a time."""


def _chunk_width(d_in: int, d_out: int) -> int:
  """Columns per chunk: at most :data:`CHUNK_BYTES` of float32 weights, a divisor of ``d_out``
  when one of at least half that width exists (no shorter last chunk)."""
  most = max(1, min(d_out, CHUNK_BYTES // (4 * d_in)))
  divisor = next(w for w in range(most, 0, -1) if d_out % w == 0)
  return divisor if 2 * divisor >= most else most


def _columnwise(x, codes, mode: str) -> bool:
  """Whether the forward takes :func:`_columnwise_matmul` (decided at trace time): on a CPU, at
  most :data:`DECODE_ROWS` rows and a float32 kernel over two chunks (smaller ones gained nothing
  measurable from the loop)."""
  d_in = codes.shape[0] * (2 if mode == "nf4" else 1)
  rows = int(np.prod(x.shape[:-1]))
  small = rows <= DECODE_ROWS and 4 * d_in * codes.shape[1] > 2 * CHUNK_BYTES
  return small and jax.default_backend() == "cpu"


def _columnwise_matmul(x, arrays, spec: _MatmulSpec) -> jax.Array:
  """``x @ dequantize(W)`` a chunk of output columns at a time (about :data:`CHUNK_BYTES` of
  float32 weights), in a loop: no ``(d_in, d_out)`` float buffer exists.

  For a few rows the product reads each weight once, and writing the whole dequantised kernel
  costs more than the product: XLA:CPU allocates that buffer afresh at every call (converting a
  1536 x 8960 int8 kernel into a new 55 MB float32 array took about 45 ms on a loaded 2-core VM,
  summing the same conversion without a buffer 6 ms), and the output matrix's is 0.9 GB. The
  chunk's buffer is reused by every iteration. Each output column is the same dot product as on
  the whole-kernel path.
  """
  codes = arrays["codes"]
  d_out = codes.shape[1]
  d_in = codes.shape[0] * (2 if spec.mode == "nf4" else 1)
  scales = float_scales(arrays, spec.mode) + _tie(x)
  width = _chunk_width(d_in, d_out)
  full = d_out // width

  def product(start, size):
    cols = lambda a: jax.lax.dynamic_slice_in_dim(a, start, size, axis=1)  # noqa: E731
    return _dot(x, _dequantize_codes(cols(codes), cols(scales), spec.mode), spec, 0)

  out_dtype = x.dtype if spec.lowp else jnp.result_type(x.dtype, spec.dtype)
  y = jnp.zeros((*x.shape[:-1], d_out), out_dtype)
  body = lambda i, y: jax.lax.dynamic_update_slice_in_dim(  # noqa: E731
      y, product(i * width, width).astype(out_dtype), i * width, axis=y.ndim - 1
  )
  y = jax.lax.fori_loop(0, full, body, y)
  if full * width < d_out:
    tail = product(full * width, d_out - full * width).astype(out_dtype)
    y = jax.lax.dynamic_update_slice_in_dim(y, tail, full * width, axis=y.ndim - 1)
  return y


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _quant_matmul(x, arrays, spec):
  if _columnwise(x, arrays["codes"], spec.mode):
    return _columnwise_matmul(x, arrays, spec)
  return _dot(x, _dequantize_after(arrays, x, spec.mode), spec, 0)


def _quant_matmul_fwd(x, arrays, spec):
  return _quant_matmul(x, arrays, spec), (arrays, jnp.zeros((0,), x.dtype))


def _quant_matmul_bwd(spec, residuals, g):
  arrays, x_like = residuals
  dx = _dot(g, _dequantize_after(arrays, g, spec.mode), spec, 1)
  return dx.astype(x_like.dtype), jax.tree.map(lambda _: None, arrays)


_quant_matmul.defvjp(_quant_matmul_fwd, _quant_matmul_bwd)


# ------------------------------------------------------------------------- the layer
class _KernelView:
  """``QuantLinear.kernel``: reads dequantise, writes quantise (module doc)."""

  def __init__(self, layer: "QuantLinear"):
    self._layer = layer

  shape = property(lambda self: (self._layer.in_features, self._layer.out_features))
  ndim = property(lambda self: 2)
  size = property(lambda self: self._layer.in_features * self._layer.out_features)
  dtype = property(lambda self: jnp.dtype(self._layer.param_dtype))

  def __getitem__(self, index):
    return dequantize_kernel(self._layer.arrays(), self._layer.quantize).astype(self.dtype)[index]

  def __setitem__(self, index, value):
    full = value if index is Ellipsis else self[...].at[index].set(value)
    self._layer.set_kernel(full)

  def get_value(self):
    return self[...]

  def set_value(self, value):
    self[...] = value

  value = property(get_value, set_value)

  def get_metadata(self) -> dict:
    return self._layer.codes.get_metadata()


def _place(value: jax.Array, sharding: Any, spec_axes: bool) -> jax.Array:
  """``value`` with ``sharding``'s spec (when ``spec_axes``; replicated on its mesh otherwise), or
  as is when ``sharding`` is not a named sharding."""
  if not isinstance(sharding, jax.sharding.NamedSharding) or isinstance(value, jax.core.Tracer):
    return value
  spec = sharding.spec if spec_axes else jax.sharding.PartitionSpec()
  mesh = sharding.mesh
  if isinstance(mesh, jax.sharding.AbstractMesh):
    mesh = jax.sharding.get_mesh()
    if mesh is None or getattr(mesh, "empty", False):
      return value
  return jax.device_put(value, jax.sharding.NamedSharding(mesh, spec))


def _sharding_of(array: Any, transpose: bool = False) -> Any:
  """The sharding of ``array`` (an ``nnx.Variable``'s value or an array; None when it has none),
  with its two axes swapped when ``transpose``."""
  array = array.get_value() if isinstance(array, nnx.Variable) else array
  sharding = getattr(array, "sharding", None)
  if not transpose or not isinstance(sharding, jax.sharding.NamedSharding):
    return sharding
  spec = tuple(sharding.spec) + (None,) * (2 - len(sharding.spec))
  return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*reversed(spec)))


def _axis_metadata(variable: nnx.Variable, transpose: bool = False) -> tuple:
  """The sharding metadata of ``variable`` (its logical axis names reversed when ``transpose``),
  as a hashable tuple of items."""
  meta = {
      k: v for k, v in variable.get_metadata().items() if k in ("out_sharding", "eager_sharding")
  }
  if transpose and meta.get("out_sharding") is not None:
    meta["out_sharding"] = tuple(reversed(tuple(meta["out_sharding"])))
  return tuple(sorted(meta.items()))


def _quantize_value(value: Any, mode: str) -> dict[str, jax.Array]:
  """The quantised arrays of a kernel: traced, or concrete (a NumPy value is copied to the device
  a chunk at a time, :func:`quantize_concrete`)."""
  if isinstance(value, jax.core.Tracer):
    return quantize_kernel(value, mode)
  host = isinstance(value, (np.ndarray, RowBlocks))
  return quantize_concrete(value if host else jnp.asarray(value), mode)


def _store(module: nnx.Module, arrays: dict[str, jax.Array], sharding: Any) -> None:
  """Sets ``module``'s quantised arrays: the codes and scales placed by ``sharding`` and carrying
  ``module.kernel_metadata``, the double quantisation's small arrays replicated."""
  for name, array in arrays.items():
    sharded = name in ("codes", "scales")
    array = _place(array, sharding, sharded)
    if isinstance(getattr(module, name, None), QuantizedParam):
      getattr(module, name).set_value(array)
    else:
      meta = dict(module.kernel_metadata) if sharded else {}
      setattr(module, name, QuantizedParam(array, **meta))


class QuantLinear(nnx.Linear):
  """A frozen ``nnx.Linear`` whose kernel is stored quantised (module doc).

  ``bias`` stays an ``nnx.Param`` in ``param_dtype``.
  """

  def __init__(
      self, linear: nnx.Linear, mode: str, kernel: jax.Array | None = None, *, name: str = "layer"
  ):
    """``linear`` quantised (``kernel``: the weight to quantise instead of ``linear``'s own, e.g.
    when that one is abstract).

    Raises:
      ValueError: an unknown mode, ``d_in`` not a multiple of 64, or a layer with a
        ``dot_general`` this module does not know (no quantised path).
    """
    check_mode(mode)
    if mode == "none":
      raise ValueError("QuantLinear.from_linear: mode 'none' keeps the nnx.Linear")
    d_in, d_out = linear.in_features, linear.out_features
    if d_in % BLOCK:
      raise ValueError(
          f"model.quantize={mode}: {name} has input width {d_in}, not a multiple of the block"
          f" size {BLOCK}"
      )
    lowp_dtype = getattr(linear.dot_general, "matmul_dtype", None)
    if linear.dot_general is not jax.lax.dot_general and lowp_dtype is None:
      raise ValueError(
          f"model.quantize={mode}: {name} has no quantised path (a custom dot_general)"
      )
    self.in_features, self.out_features = d_in, d_out
    self.use_bias = linear.bias is not None
    self.dtype, self.param_dtype = linear.dtype, linear.param_dtype
    self.precision = linear.precision
    self.dot_general = linear.dot_general
    self.promote_dtype = linear.promote_dtype
    self.preferred_element_type = linear.preferred_element_type
    self.matmul_dtype = lowp_dtype
    self.quantize = mode
    self.bias = linear.bias
    self.kernel_metadata = _axis_metadata(linear.kernel)  # static: hashable
    like = linear.kernel.get_value()
    self.set_kernel(like if kernel is None else kernel, like=like)

  @property
  def kernel(self) -> _KernelView:
    return _KernelView(self)

  def arrays(self) -> dict[str, jax.Array]:
    names = (
        ("codes", "scales", "dq_scales", "dq_mean")
        if self.quantize == "nf4"
        else ("codes", "scales")
    )
    return {n: getattr(self, n)[...] for n in names}

  def set_kernel(self, value: jax.Array, like: jax.Array | None = None) -> None:
    """Quantise ``value`` ``(d_in, d_out)`` into the layer's arrays (placed like ``like``, or like
    the current codes)."""
    if tuple(value.shape) != (self.in_features, self.out_features):
      raise ValueError(
          f"QuantLinear: kernel shape {value.shape} != {(self.in_features, self.out_features)}"
      )
    like = like if like is not None else getattr(self, "codes", None)
    _store(self, _quantize_value(value, self.quantize), _sharding_of(like))

  def __call__(self, inputs: jax.Array, out_sharding=None) -> jax.Array:
    bias = self.bias[...] if self.bias is not None else None
    dtype = self.dtype
    if dtype is None:
      dtype = jnp.result_type(inputs.dtype, self.param_dtype)
    inputs = inputs.astype(dtype)
    lowp = self.matmul_dtype is not None
    spec = _MatmulSpec(
        self.quantize, jnp.dtype(self.matmul_dtype if lowp else dtype), lowp, self.precision
    )
    y = _quant_matmul(inputs, self.arrays(), spec)
    if bias is not None:
      y = y + jnp.reshape(bias.astype(dtype), (1,) * (y.ndim - 1) + (-1,))
    return y


class _TableView(_KernelView):
  """``QuantEmbed.embedding``: reads dequantise the table ``(V, d)``, writes quantise."""

  shape = property(lambda self: (self._layer.num_embeddings, self._layer.features))
  size = property(lambda self: self._layer.num_embeddings * self._layer.features)

  def __getitem__(self, index):
    table = dequantize_kernel(self._layer.arrays(), self._layer.quantize).T
    return table.astype(self.dtype)[index]

  def __setitem__(self, index, value):
    full = value if index is Ellipsis else self[...].at[index].set(value)
    self._layer.set_table(full)


class QuantEmbed(nnx.Embed):
  """A frozen ``nnx.Embed`` whose table ``E`` ``(V, d)`` is stored quantised.

  The stored arrays are those of the kernel ``E^T`` ``(d, V)`` (module doc): blocks of 64
  consecutive features of one token. A lookup dequantises only the rows it reads; ``attend``
  (a tied output matrix) is ``QuantLinear``'s product with the kernel ``E^T``. The codes and scales
  carry the table's logical axis names reversed and shard like the table would (its
  ``(vocab, embed)`` as ``(embed, vocab)``). ``embedding[...]`` is the dequantised table.
  """

  def __init__(self, embed: nnx.Embed, mode: str, table: jax.Array | None = None):
    """``embed`` quantised (``table``: the ``(V, d)`` values to quantise instead of ``embed``'s
    own, e.g. when those are abstract).

    Raises:
      ValueError: an unknown mode or a feature width that is not a multiple of 64.
    """
    check_mode(mode)
    if mode == "none":
      raise ValueError("QuantEmbed: mode 'none' keeps the nnx.Embed")
    if embed.features % BLOCK:
      raise ValueError(
          f"model.quantize={mode}: the embedding table has width {embed.features}, not a"
          f" multiple of the block size {BLOCK}"
      )
    self.num_embeddings, self.features = embed.num_embeddings, embed.features
    self.dtype, self.param_dtype = embed.dtype, embed.param_dtype
    self.promote_dtype = embed.promote_dtype
    self.quantize = mode
    # the table's (vocab, embed) reversed: the axes of the kernel E^T the arrays hold
    self.kernel_metadata = _axis_metadata(embed.embedding, transpose=True)  # static: hashable
    like = embed.embedding.get_value()
    self.set_table(like if table is None else table, like=like)

  @property
  def embedding(self) -> _TableView:
    return _TableView(self)

  arrays = QuantLinear.arrays

  def set_table(self, value: jax.Array, like: jax.Array | None = None) -> None:
    """Quantise ``value`` ``(V, d)`` into the layer's arrays, placed like the table ``like``
    ``(V, d)`` transposed (default: like the current codes)."""
    if tuple(value.shape) != (self.num_embeddings, self.features):
      raise ValueError(
          f"QuantEmbed: table shape {value.shape} != {(self.num_embeddings, self.features)}"
      )
    if not isinstance(value, (np.ndarray, RowBlocks, jax.core.Tracer)):
      value = jnp.asarray(value)
    sharding = _sharding_of(like, transpose=True) if like is not None else _sharding_of(self.codes)
    _store(self, _quantize_value(value.T, self.quantize), sharding)

  def _dtype(self) -> Any:
    return self.dtype if self.dtype is not None else self.param_dtype

  def __call__(self, inputs: jax.Array, out_sharding=None) -> jax.Array:
    """The dequantised rows of ``inputs`` (integer ids; an id outside the table gives NaN, as
    ``nnx.Embed``'s lookup does)."""
    if not jnp.issubdtype(inputs.dtype, jnp.integer):
      raise ValueError("Input type must be an integer or unsigned integer.")
    arrays = self.arrays()
    v, d = self.num_embeddings, self.features
    ids = jnp.where(inputs < 0, inputs + v, inputs)
    valid = (ids >= 0) & (ids < v)
    flat = jnp.clip(ids, 0, v - 1).reshape(-1)
    codes = jnp.take(arrays["codes"], flat, axis=1)
    scales = _row_scales(arrays, flat, self.quantize, d)
    rows = _dequantize_codes(codes, scales, self.quantize).T.reshape(*inputs.shape, d)
    rows = jnp.where(valid[..., None], rows, jnp.nan)
    return rows.astype(self.param_dtype).astype(self._dtype())

  def attend(self, query: jax.Array, out_sharding=None) -> jax.Array:
    """``query @ E^T`` ``(..., V)``, the quantised product of :class:`QuantLinear`."""
    query = query.astype(self._dtype())
    spec = _MatmulSpec(self.quantize, jnp.dtype(query.dtype), False, None)
    return _quant_matmul(query, self.arrays(), spec)


def _row_scales(arrays, rows: jax.Array, mode: str, d: int) -> jax.Array:
  """The float32 scales ``(d / 64, n)`` of the table rows ``rows`` ``(n,)`` (kernel columns),
  computed for those rows only."""
  scales = jnp.take(arrays["scales"], rows, axis=1)
  if mode == "int8":
    return _float(scales)
  # torch order: the absmax of block m of row j is value j * (d / 64) + m (module doc)
  t = rows[None, :] * (d // BLOCK) + jnp.arange(d // BLOCK)[:, None]
  dq_scales = _float(arrays["dq_scales"])[t // DQ_BLOCK]
  return scales.astype(jnp.float32) * dq_scales + _float(arrays["dq_mean"])


def is_quantized(module: Any) -> bool:
  return isinstance(module, QuantLinear)


__all__ = [
    "BLOCK",
    "BYTES_PER_PARAM",
    "block_absmax",
    "DQ_BLOCK",
    "NF4_CODEBOOK",
    "QUANTIZE_MODES",
    "QuantEmbed",
    "QuantLinear",
    "QuantizedParam",
    "RowBlocks",
    "check_mode",
    "dequantize_kernel",
    "float_scales",
    "is_quantized",
    "nf4_indices",
    "quantize_concrete",
    "quantize_kernel",
]
