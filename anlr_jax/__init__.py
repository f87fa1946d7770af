"""anlr-jax: adaptive anisotropic per-rank learning rates for LoRA (AnLR-LoRA) in JAX.

The optimizer API lives at the top level (``anlr_jax.anlr``, ``anlr_jax.scale_by_anlr``,
``anlr_jax.loraplus``, ``anlr_jax.diagnostics``, ...). Layers, models, the trainer and the data
pipeline are in the subpackages ``anlr_jax.nn``, ``anlr_jax.models``, ``anlr_jax.train``,
``anlr_jax.data``, ``anlr_jax.evals`` and ``anlr_jax.analysis``; the ``anlr`` application is
``anlr_jax.app``, on top of them all.

Five modules sit at the root because readers in several layers share them, and the root is the
one place every layer may import (each imports nothing of the package but the others listed
here and, for ``methods``, ``nn`` and ``optim``):

- ``anlr_jax.methods``: the method table (each ``method:``'s adapter layer and optimizer) and its
  two builders, ``method_optimizer`` and ``inject_method``, the library's own API next to the
  optimizers; ``anlr_jax.app.assemble`` builds a run from a config with them, and the benchmarks and
  scripts call them too;
- ``anlr_jax.settings``: the settings machinery (``setting``, its rules, ``ConfigError``) of the
  trainer's ``TrainerConfig``, the optimizer's knobs and the run config's sections;
- ``anlr_jax.naming``: the one module-naming rule (``module_name``, ``adapter_key``) of the
  optimizer state, the LoRA layers, the adapter files, the trainer and the analysis;
- ``anlr_jax.fileio``: atomic writes and the JSON / JSON Lines / YAML readers of every layer;
- ``anlr_jax.rundir``: the names of the files of a run directory, written by ``train`` and ``app``,
  read by ``analysis``.
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
