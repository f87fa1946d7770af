"""The batch engine of ``anlr serve`` on a tiny random model: a shared prompt prefix prefilled once
and reused (replies equal to those of prompts prefilled whole, alone or together), and the model's
graph not hashed again at every decoding step."""

import numpy as np
import pytest
from flax import nnx
from flax.nnx import graphlib

from anlr_jax.app.batch_engine import BatchEngine, Generation
from anlr_jax.compiles import compile_log
from anlr_jax.models.config import ModelConfig
from anlr_jax.models.llama import LlamaForCausalLM

PREFIX = [5, 6, 7, 8, 9, 10, 11]


@pytest.fixture(scope="module")
def model():
  model = LlamaForCausalLM(ModelConfig.preset("tiny", vocab_size=64), rngs=nnx.Rngs(0))
  model.eval()
  return model


def prompts():
  rng = np.random.default_rng(0)
  rows = [PREFIX + rng.integers(3, 64, n).tolist() for n in (1, 4, 9, 17, 3, 12)]
  return rows + [PREFIX[:4], [9, 9] + PREFIX]  # the prefix's start alone; no prefix at the start


def replies(engine, rows, together=True, max_tokens=10):
  gens = [Generation(list(ids), max_tokens=max_tokens) for ids in rows]
  if together:  # queued before the engine takes any: admitted at one turn
    with engine._cond:
      for g in gens:
        engine.submit(g)
    return [list(g.tokens(timeout=120)) for g in gens]
  return [list(engine.submit(g).tokens(timeout=120)) for g in gens]


def test_the_prefix_is_run_once_and_replies_equal_prompts_prefilled_whole(model):
  rows = prompts()
  whole = BatchEngine(model, pad_id=0, max_batch=8)
  shared = BatchEngine(model, pad_id=0, max_batch=8, prefix=PREFIX)
  try:
    expected = replies(whole, rows, together=False)
    assert shared.prefix_passes == 0
    together = replies(shared, rows)
    assert shared.prefix_passes == 1
    before = shared.prefilled_tokens
    alone = replies(shared, rows, together=False)
    assert shared.prefilled_tokens - before < whole.prefilled_tokens  # prefixes not prefilled
    with compile_log() as log:  # the same arrivals again: no new prefill or decoding program
      again = replies(shared, rows)
    engine_programs = [p for p, *_ in log.programs if p.startswith(("jit(_prefill", "jit(_decode"))]
    assert together == alone == again == expected
    assert all(len(r) == 10 for r in expected)
    assert shared.prefix_passes == 1 and engine_programs == []
  finally:
    whole.close()
    shared.close()


def test_the_models_graph_is_not_hashed_at_each_step(model, monkeypatch):
  engine = BatchEngine(model, pad_id=0, max_batch=2)
  try:
    replies(engine, prompts()[:2], max_tokens=3)  # compiles
    hashes = []
    plain = graphlib.GraphDef.__hash__
    monkeypatch.setattr(graphlib.GraphDef, "__hash__", lambda g: hashes.append(1) or plain(g))
    before = engine.tokens_made
    replies(engine, prompts()[:2], max_tokens=12)
    assert engine.tokens_made - before == 24
    assert hashes == []
  finally:
    engine.close()


def test_a_step_computes_the_rows_in_use_and_rows_move_down_as_requests_end(model):
  rows, lengths = prompts()[:5], [2, 3, 4, 12, 12]
  engine = BatchEngine(model, pad_id=0, max_batch=8)
  try:
    alone = [
        list(engine.submit(Generation(list(ids), max_tokens=n)).tokens(timeout=120))
        for ids, n in zip(rows, lengths)
    ]
    shapes = []  # the cache's rows after each step that leaves a request in flight
    engine.step_hook = lambda: engine.active and shapes.append(engine._cache[2].shape[0])
    assert replies(engine, rows[:2]) == replies(engine, rows[:2], together=False)
    assert set(shapes) == {2, 1}  # two requests together: a two-row step, not eight rows
    shapes.clear()
    gens = [Generation(list(ids), max_tokens=n) for ids, n in zip(rows, lengths)]
    with engine._cond:
      for g in gens:
        engine.submit(g)
    together = [list(g.tokens(timeout=120)) for g in gens]
  finally:
    engine.close()
  assert together == alone and [len(r) for r in together] == lengths
  # five rows, then four after the first ends (row 4 moved to row 0), then two (row 3 to row 1);
  # the eleventh step ends the last two
  assert shapes == [8, 4, 4] + [2] * 7
