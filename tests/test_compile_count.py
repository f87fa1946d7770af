"""Generation and the judge's probability pass compile a number of programs bounded by their
width ladders, whatever the prompt lengths; the compile log tells programs read from the
persistent cache from compiled ones (benchmarks/compile_count.py measures whole phases)."""

import json
import os
import random
import subprocess
import sys

import pytest
from flax import nnx

from anlr_jax import assets
from anlr_jax.app.text_generation import make_generate_fn
from anlr_jax.models.generation import prompt_width
from anlr_jax.compiles import compile_log
from anlr_jax.evals.judge_probs import RATING_CUE, RATINGS, local_probes
from anlr_jax.evals.loglik import bucket_width
from anlr_jax.models import LlamaForCausalLM, ModelConfig, load_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = "the fox jumps over a lazy dog and runs far away".split()


@pytest.fixture(scope="module")
def tiny():
  tok = load_tokenizer(os.path.join(os.path.dirname(assets.__file__), "quickstart"))
  tok.model_max_length = 4096
  config = ModelConfig(
      vocab_size=len(tok),
      hidden_size=32,
      intermediate_size=64,
      num_hidden_layers=1,
      num_attention_heads=2,
      num_key_value_heads=1,
      max_position_embeddings=1024,
  )
  model = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
  model.eval()
  return model, tok


def prompts_of(tok, word_counts, seed):
  rng = random.Random(seed)
  texts = [" ".join(rng.choice(WORDS) for _ in range(n)) for n in word_counts]
  return texts, [len(tok(t).input_ids) + 1 for t in texts]  # + bos


def named(log, name):
  return sum(1 for program, *_ in log.programs if program == f"jit({name})")


def test_answers_of_many_prompt_lengths_compile_a_bounded_number_of_programs(tiny):
  model, tok = tiny
  generate = make_generate_fn(model, tok, max_new_tokens=3, batch_size=2)
  texts, lengths = prompts_of(tok, [3, 9, 17, 26, 41, 57, 77, 99], seed=0)
  widths = {prompt_width(n) for n in lengths}
  assert len(widths) == 4 and len(set(lengths)) == 8  # 8 lengths, 4 widths of the ladder
  with compile_log() as first:
    for text in texts:
      generate([text])
  assert named(first, "_prefill") == named(first, "_decode_step") == len(widths)
  assert len(first.programs) <= 5 * len(widths), first.programs
  others, other_lengths = prompts_of(tok, [4, 12, 20, 30, 50, 70, 90, 110], seed=1)
  assert {prompt_width(n) for n in other_lengths} <= widths
  with compile_log() as again:  # new lengths in the same widths: nothing new
    for text in others:
      generate([text])
  assert again.programs == []


def test_the_probability_pass_compiles_once_per_context_width(tiny):
  model, tok = tiny
  probes = local_probes(model, tok, lambda s, u: s + u, batch_size=2, max_new_tokens=8)
  texts, _ = prompts_of(tok, [5, 6, 30, 32, 34, 70, 74], seed=2)
  judgments = [("Judge.", t, "Fine.") for t in texts]
  ctx = [len(tok(f"Judge.{t}Fine.{RATING_CUE}").input_ids) for t in texts]
  widths = {bucket_width(n - 1) for n in ctx}
  with compile_log() as first:
    for judgment in judgments:
      probes.choice_logprobs([judgment], RATING_CUE, RATINGS)
  assert named(first, "_prefill_chunk") == named(first, "_tail_logprobs") == len(widths)
  assert len(widths) < len(set(ctx))
  with compile_log() as again:
    probes.choice_logprobs(judgments[::-1], RATING_CUE, RATINGS)  # batched differently
  assert named(again, "_tail_logprobs") <= 1 and len(again.programs) <= 3


PROGRAM = """
import jax, jax.numpy as jnp, json, sys
from anlr_jax.compiles import compile_log
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
with compile_log() as log:
  jax.jit(lambda x: jnp.sin(x) @ x.T)(jnp.ones((8, 8))).block_until_ready()
print(json.dumps(log.programs))
"""


def test_the_compile_log_tells_programs_read_from_the_persistent_cache(tmp_path):
  def run():
    proc = subprocess.run(
        [sys.executable, "-c", PROGRAM, str(tmp_path / "xla")],
        env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    programs = json.loads(proc.stdout.strip().splitlines()[-1])
    return {name: loaded for name, _, loaded in programs}

  first, second = run(), run()
  assert first["jit(<lambda>)"] is False and second["jit(<lambda>)"] is True
