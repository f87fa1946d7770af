"""Low-precision GEMM operands (ModelConfig.matmul_dtype / model.matmul_dtype): the forward and both
backward products equal NumPy's on bfloat16-rounded operands (float64 sums), the backward products
run on bfloat16 operands, frozen weights cost no gradient product, and a model built with it stays
close to the float32 model while differing from it."""

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from anlr_jax.app.config import ConfigError, load_config
from anlr_jax.app.model import load_base
from anlr_jax.app.identity import run_identity
from anlr_jax.models import ModelConfig
from anlr_jax.models.llama import LlamaForCausalLM
from anlr_jax.models.matmul import lowp_dot_general, lowp_matmul
from tests.helpers.tiny_llama import save_tiny_llama
from tests.tiny_tokenizer import build_tiny_tokenizer


def _bf16(a):
  """``a`` rounded to bfloat16 (round to nearest even), as float64."""
  return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


@pytest.mark.parametrize("transpose_w", [False, True])
def test_forward_and_gradients_match_numpy_on_rounded_operands(transpose_w):
  rng = np.random.default_rng(0)
  x = rng.standard_normal((3, 5, 16)).astype(np.float32)
  w = rng.standard_normal((7, 16) if transpose_w else (16, 7)).astype(np.float32)
  g = rng.standard_normal((3, 5, 7)).astype(np.float32)  # the cotangent of the output

  def f(x, w):
    return jnp.sum(lowp_matmul(x, w, jnp.bfloat16, transpose_w=transpose_w) * g)

  y = lowp_matmul(jnp.asarray(x), jnp.asarray(w), jnp.bfloat16, transpose_w=transpose_w)
  dx, dw = jax.grad(f, (0, 1))(jnp.asarray(x), jnp.asarray(w))
  w_kn = _bf16(w.T if transpose_w else w)  # (k, n)
  xb, gb = _bf16(x).reshape(-1, 16), _bf16(g).reshape(-1, 7)
  want_y = (xb @ w_kn).reshape(3, 5, 7)
  want_dx = (gb @ w_kn.T).reshape(3, 5, 16)
  want_dw = xb.T @ gb
  want_dw = want_dw.T if transpose_w else want_dw
  assert y.dtype == dx.dtype == dw.dtype == jnp.float32
  # float32 sums of exactly representable products: ~1e-6 relative; rounding the cotangent or the
  # result to bfloat16 (what the custom backward avoids) would be ~4e-3
  for got, want in ((y, want_y), (dx, want_dx), (dw, want_dw)):
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
  # and it is not the float32 product: the operands were rounded
  assert (
      np.max(
          np.abs(np.asarray(y) - (x.reshape(-1, 16) @ (w.T if transpose_w else w)).reshape(3, 5, 7))
      )
      > 1e-3
  )


def test_backward_products_take_bfloat16_operands_and_frozen_weights_cost_nothing():
  x, w = jnp.ones((64, 32)), jnp.ones((32, 48))

  def loss(x, w):
    return jnp.sum(jnp.tanh(lowp_matmul(x, w, jnp.bfloat16)))

  def dots(fn, *args):
    text = jax.jit(fn).lower(*args).as_text()
    return re.findall(r"stablehlo\.dot_general .*?: \((tensor<[^>]*>), (tensor<[^>]*>)\)", text)

  both = dots(jax.grad(loss, (0, 1)), x, w)
  assert len(both) == 3 and all("bf16" in a and "bf16" in b for a, b in both), both
  # only dx needed (w frozen): XLA drops the dW product
  compiled = jax.jit(jax.grad(loss)).lower(x, w).compile()
  flops = compiled.cost_analysis()
  flops = (flops[0] if isinstance(flops, list) else flops)["flops"]
  assert flops < 2.5 * 2 * 64 * 32 * 48, flops  # two products (forward, dx), not three


def test_a_model_with_bfloat16_matmuls_is_close_to_float32_and_not_equal():
  base = dict(
      vocab_size=97,
      hidden_size=32,
      intermediate_size=64,
      num_hidden_layers=2,
      num_attention_heads=4,
      num_key_value_heads=2,
  )
  ids = jnp.asarray(np.random.default_rng(0).integers(0, 97, (2, 9)), jnp.int32)
  for tied in (True, False):
    exact = LlamaForCausalLM(ModelConfig(**base, tie_word_embeddings=tied), rngs=nnx.Rngs(0))
    config = ModelConfig(**base, tie_word_embeddings=tied, matmul_dtype="bfloat16")
    assert config.matmul_dtype == jnp.bfloat16
    lowp = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
    assert lowp.model.layers[0].self_attn.q_proj.dot_general is lowp_dot_general(jnp.bfloat16)
    a, b = np.asarray(exact(ids)), np.asarray(lowp(ids))
    assert b.dtype == np.float32
    err = np.max(np.abs(a - b)) / np.max(np.abs(a))
    assert 1e-5 < err < 3e-2, (tied, err)


def test_bad_settings_are_named():
  with pytest.raises(ValueError, match="ModelConfig.matmul_dtype must be a floating dtype"):
    ModelConfig(8, 8, 8, 1, 2, 2, matmul_dtype="int8")
  with pytest.raises(ConfigError, match="model.matmul_dtype"):
    load_config(None, ["model.matmul_dtype=float16"])
  with pytest.raises(ValueError, match="do not contract"):
    lowp_matmul(jnp.ones((2, 3)), jnp.ones((4, 5)), jnp.bfloat16)
  dot = lowp_dot_general(jnp.bfloat16)
  with pytest.raises(ValueError, match="precision"):
    dot(jnp.ones((2, 3)), jnp.ones((3, 4)), (((1,), (0,)), ((), ())), precision="highest")


def test_model_matmul_dtype_reaches_the_loaded_model_and_the_run_identity(tmp_path):
  tok = build_tiny_tokenizer(tmp_path / "model")
  save_tiny_llama(tmp_path / "model", len(tok), tie_word_embeddings=True)
  (tmp_path / "train.json").write_text("[]")
  identities = []
  for setting in ([], ["model.matmul_dtype=bfloat16"]):
    config = load_config(None, [f"model.path={tmp_path / 'model'}", *setting])
    model, model_config, _ = load_base(config)
    assert (model_config.matmul_dtype is None) == (not setting)
    linear = model.model.layers[0].mlp.down_proj
    assert (linear.dot_general is lowp_dot_general(jnp.bfloat16)) == bool(setting)
    identities.append(
        run_identity(
            config,
            model_path=str(tmp_path / "model"),
            fingerprint="f",
            data_path=str(tmp_path / "train.json"),
        )
    )
  # a checkpoint of a float32-GEMM run does not resume a bfloat16-GEMM one (and the other way)
  assert "model.matmul_dtype" not in identities[0]
  assert identities[1]["model.matmul_dtype"] == "bfloat16"
