"""``python -m anlr_jax.evals.score_visual BENCHMARK PREDICTIONS OFFICIAL_FILE [options]``: scores a
model's answers on one of LLaVA-1.5's seven visual benchmarks (see :mod:`anlr_jax.evals.visual`)."""

from anlr_jax.evals.visual import main

if __name__ == "__main__":
  raise SystemExit(main())
