"""The AnLR-LoRA optimizer family: optax transformations and diagnostics."""

from anlr_jax.optim.adalora import (
    AdaLoRAConfig,
    AdaLoRAState,
    RankAllocatorState,
    orth_regularization,
    rank_allocator,
    rank_allocator_init,
    rank_pattern,
    update_and_allocate,
)
from anlr_jax.optim.diagnostics import (
    cumulative_energy,
    diagnostics,
    effective_rank,
    find_anlr_state,
    rank_magnitudes,
    singular_values,
)
from anlr_jax.optim.detect import describe
from anlr_jax.optim.dims import (
    AUTO,
    FLAX,
    PEFT,
    QUAX,
    QWIX,
    LoraDims,
    LoraModule,
    find_lora_modules,
)
from anlr_jax.optim.loraplus import loraplus, scale_lora_b
from anlr_jax.optim.lorapro import lorapro
from anlr_jax.optim.transform import DEFAULTS, SIGNALS, AnLRState, Signal, anlr, scale_by_anlr
