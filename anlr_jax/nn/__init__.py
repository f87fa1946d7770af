"""LoRA layers for Flax NNX: LoRA/rsLoRA/PiSSA/MiLoRA/DoRA, injection by name, PEFT adapter I/O."""

from anlr_jax.nn.adalora import (
    AdaLoRALinear,
    export_adalora_adapter,
    import_adalora_adapter,
    inject_adalora,
    iter_adalora_layers,
)
from anlr_jax.nn.inject import (
    PAPER_TARGET_MODULES,
    inject_lora,
    iter_lora_layers,
    lora_state,
    merge_all,
    unmerge_all,
)
from anlr_jax.nn.lora import LORA_INITS, LoRALinear, lora_scale, low_rank_product
from anlr_jax.nn.loradash import (
    LORADASH_DEFAULTS,
    DashDirections,
    LoRADashLinear,
    TaskDirections,
    dash_launch_step,
    dash_launched,
    dash_optimizer,
    direction_change_rates,
    inject_loradash,
    iter_loradash_layers,
    launch_dash,
    select_task_directions,
    validate_dash_config,
)
from anlr_jax.nn.peft_io import export_peft_adapter, import_peft_adapter
from anlr_jax.nn.trainable import FullParam, train_in_full, with_full_params

__all__ = [
    "AdaLoRALinear",
    "DashDirections",
    "FullParam",
    "LORADASH_DEFAULTS",
    "LORA_INITS",
    "LoRADashLinear",
    "LoRALinear",
    "PAPER_TARGET_MODULES",
    "TaskDirections",
    "dash_launch_step",
    "dash_launched",
    "dash_optimizer",
    "direction_change_rates",
    "export_adalora_adapter",
    "export_peft_adapter",
    "import_adalora_adapter",
    "import_peft_adapter",
    "inject_adalora",
    "inject_lora",
    "inject_loradash",
    "iter_adalora_layers",
    "iter_lora_layers",
    "iter_loradash_layers",
    "launch_dash",
    "lora_scale",
    "lora_state",
    "low_rank_product",
    "merge_all",
    "select_task_directions",
    "train_in_full",
    "unmerge_all",
    "validate_dash_config",
    "with_full_params",
]
