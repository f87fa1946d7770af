"""``python -m anlr_jax.evals.visual``: :func:`anlr_jax.evals.visual.command.main`."""

from anlr_jax.evals.visual.command import main

if __name__ == "__main__":
  raise SystemExit(main())
