"""anlr-jax: adaptive anisotropic per-rank learning rates for LoRA (AnLR-LoRA) in JAX."""

__version__ = "0.1.0"
