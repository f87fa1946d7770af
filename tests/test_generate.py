"""KV-cached generation against transformers' generate, compile-once and sampling checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from anlr_jax.models.generation import TRACE_COUNTS, filter_logits, generate
from anlr_jax.models.hf_io import load_hf_model
from tests.helpers.tiny_llama import left_padded_batch, make_hf_model

PROMPT_LEN = 9


@pytest.fixture(scope="module", params=["llama", "qwen2_tied"])
def hf_and_flax(request, tmp_path_factory):
  hf = make_hf_model(request.param, seed=7)
  path = tmp_path_factory.mktemp(request.param)
  hf.save_pretrained(path)
  model, _ = load_hf_model(path)
  ids, mask = left_padded_batch(hf.config.vocab_size, seed=3, length=PROMPT_LEN)
  mask[2] = 0
  mask[2, -1] = 1  # a one-token prompt too
  ids[2, -1] = 5
  ids[mask == 0] = 0
  return hf, model, ids, mask


def hf_greedy(hf, ids, mask, n, eos=None):
  with torch.no_grad():
    out = hf.generate(
        torch.tensor(ids),
        attention_mask=torch.tensor(mask),
        max_new_tokens=n,
        min_new_tokens=n if eos is None else 0,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=eos,
    )
  return out[:, ids.shape[1] :].numpy()


def test_greedy_matches_transformers_generate(hf_and_flax):
  hf, model, ids, mask = hf_and_flax
  expected = hf_greedy(hf, ids, mask, 20)
  got = np.asarray(generate(model, ids, mask, max_new_tokens=20))
  assert got.shape == (3, 20) and got.dtype == np.int32
  assert len(np.unique(expected)) > 5  # not a degenerate repeat
  np.testing.assert_array_equal(got, expected)


def test_eos_then_pad_matches_transformers(hf_and_flax):
  hf, model, ids, mask = hf_and_flax
  free = np.asarray(generate(model, ids, mask, max_new_tokens=20))
  eos = int(free[0, 3])  # row 0 ends at its 4th token (maybe earlier if repeated)
  got = np.asarray(generate(model, ids, mask, max_new_tokens=20, eos_token_id=eos, pad_token_id=0))
  first = int(np.argmax(free[0] == eos))
  np.testing.assert_array_equal(got[0, : first + 1], free[0, : first + 1])
  assert (got[0, first + 1 :] == 0).all()
  expected = hf_greedy(hf, ids, mask, 20, eos=eos)
  expected = np.pad(expected, ((0, 0), (0, 20 - expected.shape[1])))  # HF stops when all ended
  np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("chunk, first, slots", [(4, 6, 24), (7, 0, 35)])
def test_chunked_prefill_matches_transformers_generate(hf_and_flax, chunk, first, slots):
  """Prefilled ``chunk`` columns at a time, greedy tokens equal transformers'. The 30 columns
  start at column ``first`` in some row: with 4, the six columns of padding in every row are
  skipped (6 chunks); with 7, five pad columns are added on the left (5 chunks)."""
  hf, model, _, _ = hf_and_flax
  ids, mask = left_padded_batch(hf.config.vocab_size, seed=5, length=30)
  mask[:, :first] = 0
  ids[mask == 0] = 0
  expected = hf_greedy(hf, ids, mask, 12)
  got, cache, prompt_slots = generate(
      model, ids, mask, max_new_tokens=12, prefill_chunk=chunk, cache_reserve=3, return_cache=True
  )
  np.testing.assert_array_equal(np.asarray(got), expected)
  assert prompt_slots == slots
  assert cache.max_length == max(30, slots) + 12 + 3
  assert int(cache.index) == slots + 11  # the 11 tokens fed back after the first
  written = np.asarray(cache.mask)[:, :slots]
  np.testing.assert_array_equal(written[:, -(30 - first) :], np.asarray(mask)[:, first:])
  assert not written[:, : slots - (30 - first)].any()


def test_prefill_chunk_is_checked(hf_and_flax):
  _, model, ids, mask = hf_and_flax
  with pytest.raises(ValueError, match="prefill_chunk"):
    generate(model, ids, mask, max_new_tokens=2, prefill_chunk=0)
  with pytest.raises(ValueError, match="cache_reserve"):
    generate(model, ids, mask, max_new_tokens=2, cache_reserve=-1)


def test_decode_step_compiles_once(hf_and_flax):
  _, model, ids, mask = hf_and_flax
  n = 20  # the length the other tests use, so the compiled functions are shared
  generate(model, ids, mask, max_new_tokens=n)  # warm up this model / shape
  traces = dict(TRACE_COUNTS)
  out = generate(model, ids, mask, max_new_tokens=n)
  generate(model, ids, mask, max_new_tokens=n, eos_token_id=int(out[0, 1]), pad_token_id=3)
  assert TRACE_COUNTS == traces  # 19 more decode steps per call, new eos/pad ids: no new trace
  # Sampling compiles once more, whatever the temperature / top_k / top_p.
  generate(model, ids, mask, max_new_tokens=n, temperature=0.5, rng=jax.random.key(0))
  sampled = dict(TRACE_COUNTS)
  assert sampled["decode_step"] <= traces["decode_step"] + 1
  generate(
      model, ids, mask, max_new_tokens=n, temperature=2.0, top_k=3, top_p=0.5, rng=jax.random.key(1)
  )
  assert TRACE_COUNTS == sampled


def test_sampling_is_reproducible_and_seed_dependent(hf_and_flax):
  _, model, ids, mask = hf_and_flax
  kw = dict(max_new_tokens=20, temperature=1.5, top_k=40, top_p=0.95)
  a = generate(model, ids, mask, rng=jax.random.key(1), **kw)
  b = generate(model, ids, mask, rng=jax.random.key(1), **kw)
  c = generate(model, ids, mask, rng=jax.random.key(2), **kw)
  np.testing.assert_array_equal(a, b)
  assert (np.asarray(a) != np.asarray(c)).any()
  greedy = generate(model, ids, mask, max_new_tokens=20)
  top1 = generate(
      model, ids, mask, max_new_tokens=20, temperature=0.7, top_k=1, rng=jax.random.key(3)
  )
  np.testing.assert_array_equal(top1, greedy)  # top_k=1 sampling is greedy


def test_filter_logits_against_numpy():
  logits = jnp.log(jnp.asarray([[0.05, 0.4, 0.1, 0.3, 0.15], [0.2, 0.2, 0.2, 0.2, 0.2]]))
  kept = np.asarray(filter_logits(logits, None, 0.75)) > -1e30
  # Row 0 sorted: 0.4, 0.3 (mass 0.7 < 0.75), 0.15 reaches 0.85 -> keep {1, 3, 4}.
  np.testing.assert_array_equal(kept[0], [False, True, False, True, True])
  kept_k = np.asarray(filter_logits(logits, 2, None)) > -1e30
  np.testing.assert_array_equal(kept_k[0], [False, True, False, True, False])
  # Sampling under top_p never leaves the nucleus.
  draws = jax.random.categorical(
      jax.random.key(0), filter_logits(logits, None, 0.75)[:1], shape=(2000,)
  )
  assert set(np.unique(np.asarray(draws))) == {1, 3, 4}


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(max_new_tokens=3, temperature=1.0), "rng"),
        (dict(max_new_tokens=3, top_k=0), "top_k"),
        (dict(max_new_tokens=3, top_p=1.5), "top_p"),
        (dict(max_new_tokens=3, temperature=-1.0), "temperature"),
    ],
)
def test_bad_arguments(hf_and_flax, kwargs, match):
  _, model, ids, mask = hf_and_flax
  with pytest.raises(ValueError, match=match):
    generate(model, ids, mask, **kwargs)
  with pytest.raises(ValueError, match="prompt_mask"):
    generate(model, ids, mask[:, 1:], max_new_tokens=2)


def test_logits_to_keep_computes_only_the_last_positions(hf_and_flax):
  """``logits_to_keep=k`` gives the full call's last ``k`` positions, and the prompt pass that
  generation compiles makes no ``(B, T, V)`` logits array: its output matrix multiplies one row per
  prompt (a vocabulary-wide array per prompt position is what a long judge prompt cannot afford)."""
  _, model, ids, mask = hf_and_flax
  full = model(jnp.asarray(ids), attention_mask=jnp.asarray(mask))
  for k in (1, 3):
    kept = model(jnp.asarray(ids), attention_mask=jnp.asarray(mask), logits_to_keep=k)
    np.testing.assert_array_equal(np.asarray(kept), np.asarray(full[:, -k:]))
  with pytest.raises(ValueError, match="logits_to_keep=-1"):
    model(jnp.asarray(ids), logits_to_keep=-1)

  from flax import nnx

  from anlr_jax.models import generation

  graphdef, state = nnx.split(model)
  cache = generation.init_cache(model.config, ids.shape[0], ids.shape[1] + 2)
  params = generation.SamplingParams(
      temperature=jnp.float32(1.0),
      top_k=jnp.int32(0),
      top_p=jnp.float32(1.0),
      eos_token_id=jnp.int32(-1),
      pad_token_id=jnp.int32(0),
  )
  hlo = (
      generation._prefill.lower(
          graphdef=graphdef,
          state=state,
          prompt_ids=jnp.asarray(ids, jnp.int32),
          prompt_mask=jnp.asarray(mask, jnp.int32),
          cache=cache,
          rng=jax.random.key(0),
          params=params,
          greedy=True,
      )
      .compile()
      .as_text()
  )
  b, t, v = ids.shape[0], ids.shape[1], model.config.vocab_size
  assert f"f32[{b},{t},{v}]" not in hlo and f"f32[{b * t},{v}]" not in hlo
  assert f"f32[{b},{v}]" in hlo or f"f32[{b},1,{v}]" in hlo


def _repeats(row, n):
  grams = [tuple(row[i : i + n]) for i in range(len(row) - n + 1)]
  return len(grams) - len(set(grams))


def _reference_no_repeat(hf, ids, mask, steps, n):
  """Greedy decoding with repeated n-grams of the new tokens banned, written out: at each step
  the transformers model's last logits over the whole sequence, every token that followed an
  earlier occurrence of the row's last n - 1 new tokens struck out, then the argmax."""
  rows = []
  for prompt, keep in zip(ids, mask):
    new = []
    for _ in range(steps):
      seq = torch.tensor([list(prompt) + new])
      att = torch.tensor([list(keep) + [1] * len(new)])
      with torch.no_grad():
        logits = hf(input_ids=seq, attention_mask=att).logits[0, -1].numpy().astype(np.float64)
      if len(new) >= n - 1:
        last = new[len(new) - (n - 1) :]
        for i in range(len(new) - n + 1):
          if new[i : i + n - 1] == last:
            logits[new[i + n - 1]] = -np.inf
      new.append(int(np.argmax(logits)))
    rows.append(new)
  return np.asarray(rows)


@pytest.mark.parametrize("n, steps", [(1, 16), (2, 24), (3, 48)])
def test_no_repeat_ngram_equals_the_written_out_rule_and_never_repeats(hf_and_flax, n, steps):
  hf, model, ids, mask = hf_and_flax
  free = np.asarray(generate(model, ids, mask, max_new_tokens=steps))
  assert max(_repeats(list(r), n) for r in free) > 0  # plain greedy repeats: the rule has work
  got = np.asarray(generate(model, ids, mask, max_new_tokens=steps, no_repeat_ngram=n))
  assert all(_repeats(list(r), n) == 0 for r in got)
  np.testing.assert_array_equal(got, _reference_no_repeat(hf, ids, mask, steps, n))
  short = generate(model, ids, mask, max_new_tokens=n + 1, no_repeat_ngram=n + 3)
  np.testing.assert_array_equal(np.asarray(short), free[:, : n + 1])  # too short to repeat
  with pytest.raises(ValueError, match="no_repeat_ngram"):
    generate(model, ids, mask, max_new_tokens=3, no_repeat_ngram=-1)
