"""The chunked next-token loss and per-layer remat of the train step.

The chunked loss (``loss_chunk`` > 0) gives the same loss and LoRA gradients as the whole-logits
loss (``loss_chunk=0``: the model's ``(B, T, V)`` logits and ``next_token_loss_sum``) with tied and
untied heads, padded rows, partial loss masks, either LoRA layout, under a sharded mesh and with
bfloat16 head operands; its compiled step holds no array as large as the logits. ``remat`` puts
one rematerialised region (a ``checkpoint`` equation) around each decoder layer, and changes no
number but the memory: XLA's compiled memory analysis on CPU shrinks accordingly.
"""

import collections
import functools
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from anlr_jax.models.config import ModelConfig
from anlr_jax.models.llama import LlamaForCausalLM
from anlr_jax.nn.inject import inject_lora
from anlr_jax.train.loss import chunked_next_token_loss_sum, model_loss_sum, next_token_loss_sum
from anlr_jax.train.step import init_train_state, make_train_step, split_model, stack_layers
from anlr_jax.train.trainer import Trainer, TrainerConfig
from tests.helpers.toy_lm import ToyBatches, make_toy_model

B, T, V = 4, 24, 1000  # distinct sizes, so the logits' shape is recognisable in the program


def _model(tied=False, layers=2, seed=0, dropout=0.0, **config):
  """A tiny LLaMA with LoRA r=4; with ``dropout``, LoRA dropout in train mode."""
  config = ModelConfig.preset(
      'tiny', vocab_size=V, num_hidden_layers=layers, tie_word_embeddings=tied, **config
  )
  model = LlamaForCausalLM(config, rngs=nnx.Rngs(seed))
  model = inject_lora(model, rank=4, alpha=8.0, dropout=dropout, rngs=nnx.Rngs(seed + 1))
  if dropout:
    model.train()
  return model


def _batch(seed=0):
  """Right-padded rows of 24, 17, 9 and 3 tokens; the loss on each row's second half."""
  rng = np.random.default_rng(seed)
  lengths = np.array([T, 17, 9, 3])
  real = np.arange(T)[None, :] < lengths[:, None]
  ids = np.where(real, rng.integers(3, V, (B, T)), 0).astype(np.int32)
  loss_mask = real & (np.arange(T)[None, :] >= lengths[:, None] // 2)
  return {
      'input_ids': jnp.asarray(ids),
      'attention_mask': jnp.asarray(real.astype(np.int32)),
      'loss_mask': jnp.asarray(loss_mask.astype(np.int32)),
  }


def _keep_grads():
  """An optax transform whose state is the last gradient (params unchanged)."""
  return optax.GradientTransformation(
      lambda params: jax.tree.map(jnp.zeros_like, params),
      lambda grads, state, params=None: (jax.tree.map(jnp.zeros_like, grads), grads),
  )


_KEEP_GRADS = _keep_grads()


@functools.cache
def _jitted_step(graphdef, stacked, remat, loss_chunk):
  """One jitted step per program (the graphdef holds the model's static config): the tests that
  run the same program on other values share its compilation."""
  step = make_train_step(
      graphdef, _KEEP_GRADS, stacked_layers=stacked, remat=remat, loss_chunk=loss_chunk
  )
  return jax.jit(step)


def _step(model, batch, *, stacked=False, remat='none', loss_chunk=0):
  """``(metrics, grads)`` of one train step over ``model`` and ``batch``."""
  graphdef, lora, frozen, extra = split_model(model)
  lora = stack_layers(lora) if stacked else lora
  step = _jitted_step(graphdef, stacked, remat, loss_chunk)
  state, metrics = step(init_train_state(lora, extra, _KEEP_GRADS), frozen, batch)
  return jax.device_get(metrics), jax.device_get(state.opt_state)


def _assert_relative(actual, expected, rtol):
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
    scale = max(float(np.max(np.abs(e))), 1e-30)
    assert float(np.max(np.abs(a - e))) <= rtol * scale


@pytest.mark.parametrize('tied, stacked, chunk', [(False, True, 16), (True, False, 7)])
def test_chunked_loss_equals_the_whole_logits_loss(tied, stacked, chunk):
  # the head does not depend on the layer count: one layer where no layers are stacked (two to stack)
  model, batch = _model(tied, layers=2 if stacked else 1), _batch()
  whole, whole_grads = _step(model, batch, stacked=stacked, loss_chunk=0)
  chunked, grads = _step(model, batch, stacked=stacked, loss_chunk=chunk)
  np.testing.assert_allclose(chunked['loss'], whole['loss'], rtol=1e-6)
  assert chunked['loss_tokens'] == whole['loss_tokens'] == float(jnp.sum(batch['loss_mask'][:, 1:]))
  _assert_relative(grads, whole_grads, 1e-6)
  assert max(float(np.max(np.abs(g))) for g in jax.tree.leaves(grads)) > 0


def test_chunked_loss_with_bfloat16_head_operands():
  model, batch = _model(True, layers=1, matmul_dtype=jnp.bfloat16), _batch(1)
  whole, whole_grads = _step(model, batch, loss_chunk=0)
  chunked, grads = _step(model, batch, loss_chunk=32)
  np.testing.assert_allclose(chunked['loss'], whole['loss'], rtol=1e-6)
  _assert_relative(grads, whole_grads, 1e-3)  # a dlogit near a bfloat16 rounding edge may flip


@pytest.mark.parametrize('tied', [False, True])
def test_chunked_loss_gradient_of_the_output_matrix(tied):
  """The custom VJP's gradient of W (used when the head is trained) and of the hidden states."""
  rng = np.random.default_rng(2)
  batch = _batch(2)
  h = jnp.asarray(rng.normal(size=(B, T, 16)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(V, 16) if tied else (16, V)), jnp.float32)

  def whole(h, w):
    logits = h @ (w.T if tied else w)
    return next_token_loss_sum(logits, batch['input_ids'], batch['loss_mask'])[0]

  def chunked(h, w):
    return chunked_next_token_loss_sum(
        h, w, batch['input_ids'], batch['loss_mask'], transposed=tied, chunk_tokens=20
    )[0]

  expected, expected_grads = jax.value_and_grad(whole, (0, 1))(h, w)
  value, grads = jax.jit(jax.value_and_grad(chunked, (0, 1)))(h, w)
  np.testing.assert_allclose(value, expected, rtol=1e-6)
  _assert_relative(grads, expected_grads, 1e-6)
  with pytest.raises(ValueError, match='chunk_tokens=0'):
    chunked_next_token_loss_sum(h, w, batch['input_ids'], batch['loss_mask'], chunk_tokens=0)


def _largest_vocab_array(hlo: str) -> int:
  """Elements of the largest array with a vocabulary axis in an HLO text, the output matrix
  ``(d, V)`` aside."""
  shapes = [tuple(map(int, s.split(','))) for s in re.findall(r'\b[a-z]+\d*\[([\d,]+)\]', hlo)]
  return max(int(np.prod(s)) for s in shapes if V in s and sorted(s) != [64, V])


def test_the_compiled_step_holds_no_logits_array():
  model, batch = _model(layers=1), _batch()
  graphdef, lora, frozen, extra = split_model(model)
  tx = optax.adamw(1e-3)
  state = init_train_state(lora, extra, tx)
  compiled = {}
  for chunk in (0, 32):
    step = jax.jit(make_train_step(graphdef, tx, loss_chunk=chunk))
    compiled[chunk] = step.lower(state, frozen, batch).compile()
  assert _largest_vocab_array(compiled[0].as_text()) >= B * T * V  # the check sees the logits ...
  assert _largest_vocab_array(compiled[32].as_text()) <= B * 8 * V  # ... chunks of 8 positions
  temp = {c: compiled[c].memory_analysis().temp_size_in_bytes for c in compiled}
  assert temp[32] < temp[0] - 4 * B * T * V  # at least one float32 logits array less


def _count_remat_regions(jaxpr) -> int:
  count = 0
  for eqn in jaxpr.eqns:
    count += eqn.primitive.name in ('remat2', 'checkpoint')
    for param in eqn.params.values():
      for sub in param if isinstance(param, (list, tuple)) else [param]:
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          count += _count_remat_regions(sub.jaxpr)
        elif isinstance(sub, jax.extend.core.Jaxpr):
          count += _count_remat_regions(sub)
  return count


@pytest.mark.parametrize('stacked', [True, False])
def test_remat_puts_one_region_around_each_decoder_layer(stacked):
  batch = _batch()
  counts = collections.defaultdict(dict)
  for layers in (2, 3):
    graphdef, lora, frozen, extra = split_model(_model(layers=layers))
    tx = optax.adamw(1e-3)
    lora = stack_layers(lora) if stacked else lora
    state = init_train_state(lora, extra, tx)
    for remat in ('none', 'full', 'dots'):
      step = make_train_step(graphdef, tx, remat=remat, stacked_layers=stacked, micro_batches=2)
      jaxpr = jax.make_jaxpr(step)(state, frozen, batch).jaxpr
      counts[layers][remat] = _count_remat_regions(jaxpr)
  assert counts == {2: {'none': 0, 'full': 2, 'dots': 2}, 3: {'none': 0, 'full': 3, 'dots': 3}}


def test_remat_lowers_the_compiled_step_memory_on_cpu():
  """XLA:CPU's own memory analysis: per-layer remat keeps one layer's activations, not four (with
  LoRA dropout: the next test)."""
  graphdef, lora, frozen, extra = split_model(_model(layers=4))
  tx = optax.adamw(1e-3)
  state = init_train_state(lora, extra, tx)
  batch = {k: jnp.ones((4, 64), jnp.int32) for k in ('input_ids', 'attention_mask', 'loss_mask')}
  temp = {}
  for remat in ('none', 'full', 'dots'):
    step = jax.jit(make_train_step(graphdef, tx, remat=remat, loss_chunk=32))
    temp[remat] = step.lower(state, frozen, batch).compile().memory_analysis().temp_size_in_bytes
  assert temp['full'] < 0.5 * temp['none'] and temp['full'] < temp['dots'] < 0.8 * temp['none']


def test_with_lora_dropout_remat_keeps_about_what_it_keeps_without():
  """Under per-layer remat, LoRA dropout adds one layer's masks, not every layer's: a mask is drawn
  once its layer's input exists, not at the start of the step (a mask depends on the dropout key
  alone; drawn early, all eight layers' random bits stayed alive until their layer ran: 2.6x
  the temporaries of the step without dropout, from 1.4x)."""
  batch = {k: jnp.ones((4, 64), jnp.int32) for k in ('input_ids', 'attention_mask', 'loss_mask')}
  temp = {}
  for dropout in (0.0, 0.1):
    graphdef, lora, frozen, extra = split_model(_model(layers=8, dropout=dropout))
    tx = optax.adamw(1e-3)
    state = init_train_state(lora, extra, tx)
    step = jax.jit(make_train_step(graphdef, tx, remat='full', loss_chunk=32))
    temp[dropout] = step.lower(state, frozen, batch).compile().memory_analysis().temp_size_in_bytes
  assert temp[0.1] < 1.6 * temp[0.0], temp


@pytest.mark.parametrize('dropout', [0.0, 0.2])
def test_remat_gives_the_same_step(dropout):
  """The same loss and gradients with and without remat; with LoRA dropout, the recomputation
  draws the forward pass's masks again."""
  model, batch = _model(layers=2, dropout=dropout), _batch(3)
  plain, plain_grads = _step(model, batch, stacked=True)
  if dropout:  # the masks matter: without dropout the gradients differ
    _, undropped = _step(_model(layers=2), batch, stacked=True)
    gaps = [np.max(np.abs(a - b)) for a, b in zip(*map(jax.tree.leaves, (undropped, plain_grads)))]
    assert max(gaps) > 1e-3 * max(np.max(np.abs(g)) for g in jax.tree.leaves(plain_grads))
  for remat in ('full', 'dots'):
    rematted, grads = _step(model, batch, stacked=True, remat=remat)
    np.testing.assert_allclose(rematted['loss'], plain['loss'], rtol=1e-6)
    _assert_relative(grads, plain_grads, 1e-6)


def test_remat_needs_a_model_with_per_layer_regions():
  graphdef, lora, frozen, extra = split_model(make_toy_model())
  tx = optax.adamw(1e-3)
  step = make_train_step(graphdef, tx, remat='full')
  batch = ToyBatches().get_batch(0)
  with pytest.raises(ValueError, match="remat='full': ToyCausalLM has no per-layer"):
    step(init_train_state(lora, extra, tx), frozen, jax.tree.map(jnp.asarray, batch))
  with pytest.raises(ValueError, match='loss_chunk=-1'):
    make_train_step(graphdef, tx, loss_chunk=-1)


def test_sharded_chunked_loss_and_remat_equal_the_whole_logits_loss():
  """On a (data=2, fsdp=2, tensor=2) mesh of 8 CPU devices, two updates with two micro-batches and
  LoRA dropout: the chunked loss with per-layer remat against the whole logits without."""

  def run(loss_chunk, remat):
    cfg = TrainerConfig(
        steps=2,
        global_batch=8,
        micro_batches=2,
        compute_dtype='float32',
        progress=False,
        mesh_data=2,
        mesh_fsdp=2,
        mesh_tensor=2,
        loss_chunk=loss_chunk,
        remat=remat,
    )
    model = inject_lora(
        LlamaForCausalLM(ModelConfig.preset('tiny', vocab_size=512), rngs=nnx.Rngs(0)),
        rank=4,
        alpha=8.0,
        rngs=nnx.Rngs(1),
    )
    # SGD: the updates are linear in the gradients, so the 1e-5 bound below is on the gradients
    # (Adam's normalisation turns a float-rounding difference of a near-zero gradient into a
    # visible one)
    trainer = Trainer(model, ToyBatches(seq_len=16, vocab=512), cfg, optax.sgd(1e-1))
    losses = [float(trainer.train_step()['loss']) for _ in range(2)]
    return losses, jax.device_get(trainer.state.lora)

  whole, whole_lora = run(0, 'none')
  chunked, lora = run(24, 'full')
  np.testing.assert_allclose(chunked, whole, rtol=1e-6)
  _assert_relative(lora, whole_lora, 1e-5)


@pytest.mark.parametrize('tied', [False, True])
def test_chunked_loss_gradient_scales_with_the_cotangent(tied):
  """The custom VJP multiplies by the incoming cotangent: the gradients of ``2 * loss`` and of
  ``loss / count`` (the mean a caller may differentiate) equal the whole-logits ones, not only the
  gradient of the sum itself (cotangent 1, the only one the train step gives). A dropped scaling
  is off by a factor of 2 or of ``count``; the bound allows the float32 rounding of scaling the
  product rather than its operand."""
  rng = np.random.default_rng(5)
  batch = _batch(5)
  h = jnp.asarray(rng.normal(size=(B, T, 16)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(V, 16) if tied else (16, V)), jnp.float32)

  def whole(h, w):
    return next_token_loss_sum(h @ (w.T if tied else w), batch['input_ids'], batch['loss_mask'])

  def chunked(h, w):
    return chunked_next_token_loss_sum(
        h, w, batch['input_ids'], batch['loss_mask'], transposed=tied, chunk_tokens=20
    )

  for outer in (lambda total, count: 2.0 * total, lambda total, count: total / count):
    expected = jax.grad(lambda h, w: outer(*whole(h, w)), (0, 1))(h, w)
    grads = jax.jit(jax.grad(lambda h, w: outer(*chunked(h, w)), (0, 1)))(h, w)
    _assert_relative(grads, expected, 1e-5)  # the scaling after the product, not before: 1.4e-6


def test_remat_with_lora_dropout_over_updates_and_micro_batches_is_the_same_training():
  """Two updates of two micro-batches each with LoRA dropout: the same losses and LoRA params with
  per-layer remat as without. Each micro-batch draws new masks only if the dropout RNG state the
  rematerialised layer advanced is carried out of it (one step of one micro-batch cannot tell)."""
  batches = [_batch(6), _batch(7)]

  def train(remat):
    graphdef, lora, frozen, extra = split_model(_model(layers=1, dropout=0.3))
    tx = optax.sgd(0.5)  # linear in the gradients: the bound below is on them
    step = jax.jit(make_train_step(graphdef, tx, micro_batches=2, remat=remat, loss_chunk=16))
    state, losses = init_train_state(lora, extra, tx), []
    for batch in batches:
      state, metrics = step(state, frozen, batch)
      losses.append(float(metrics['loss']))
    return losses, jax.device_get(state.lora), jax.device_get(state.extra)

  def raw(x):  # a PRNG key's bits, or the array itself
    return jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x

  plain, plain_lora, plain_extra = train('none')
  losses, lora, extra = train('full')  # 'dots' carries the state out the same way
  np.testing.assert_allclose(losses, plain, rtol=1e-6)
  _assert_relative(lora, plain_lora, 1e-5)
  for a, b in zip(jax.tree.leaves(extra), jax.tree.leaves(plain_extra)):  # the RNG counts
    np.testing.assert_array_equal(raw(a), raw(b))


def test_a_loss_chunk_that_cannot_apply_is_said_not_dropped(caplog, monkeypatch):
  """trainer.loss_chunk on a batch with images (LLaVA merges their features inside its forward
  pass) or a model without an output matrix: a warning, and the whole logits' loss."""
  monkeypatch.setattr(logging.getLogger('anlr_jax'), 'propagate', True)  # the CLI turns it off
  seen = []

  class WholeLogitsOnly:  # a model without output_matrix / hidden_states (as LLaVA's)

    def __call__(self, ids, **kwargs):
      seen.append(sorted(kwargs))
      return jax.nn.one_hot(ids, 5) * 2.0

  ids = jnp.array([[1, 2, 3, 4]])
  batch = {'input_ids': ids, 'loss_mask': jnp.ones((1, 4))}
  want = next_token_loss_sum(jax.nn.one_hot(ids, 5) * 2.0, ids, batch['loss_mask'])
  with caplog.at_level('WARNING', logger='anlr_jax.train.loss'):
    got = model_loss_sum(WholeLogitsOnly(), batch, {}, {'pixel_values': 0}, loss_chunk=64)
  assert 'trainer.loss_chunk=64 does not apply: a batch with images (LLaVA)' in caplog.text
  np.testing.assert_allclose(got, want)
  assert seen == [['pixel_values']]
  caplog.clear()
  with caplog.at_level('WARNING', logger='anlr_jax.train.loss'):
    model_loss_sum(WholeLogitsOnly(), batch, {}, {}, loss_chunk=64)
  assert 'WholeLogitsOnly exposes no output matrix' in caplog.text
  caplog.clear()
  with caplog.at_level('WARNING', logger='anlr_jax.train.loss'):
    model_loss_sum(WholeLogitsOnly(), batch, {}, {}, loss_chunk=0)
  assert caplog.text == ''
