"""anlr-jax: adaptive anisotropic per-rank learning rates for LoRA (AnLR-LoRA) in JAX.

The optimizer API lives at the top level (``anlr_jax.anlr``, ``anlr_jax.scale_by_anlr``,
``anlr_jax.loraplus``, ``anlr_jax.diagnostics``, ...). Layers, models, the trainer and the data
pipeline are in the subpackages ``anlr_jax.nn``, ``anlr_jax.models``, ``anlr_jax.train``,
``anlr_jax.data`` and ``anlr_jax.evals``.
"""

from anlr_jax.optim import (
    AUTO,
    DEFAULTS,
    FLAX,
    PEFT,
    QUAX,
    QWIX,
    SIGNALS,
    AdaLoRAConfig,
    AdaLoRAState,
    AnLRState,
    LoraDims,
    LoraModule,
    anlr,
    cumulative_energy,
    describe,
    diagnostics,
    effective_rank,
    find_anlr_state,
    find_lora_modules,
    loraplus,
    lorapro,
    orth_regularization,
    rank_allocator,
    rank_magnitudes,
    scale_by_anlr,
    scale_lora_b,
    singular_values,
)

__version__ = "0.1.0"
