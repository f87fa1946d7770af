"""LoRA layers for Flax NNX: LoRA/rsLoRA/PiSSA/MiLoRA/DoRA, injection by name, PEFT adapter I/O."""

from anlr_jax.nn.inject import (
    PAPER_TARGET_MODULES,
    inject_lora,
    iter_lora_layers,
    lora_state,
    merge_all,
    unmerge_all,
)
from anlr_jax.nn.lora import LORA_INITS, LoRALinear, lora_scale, low_rank_product
from anlr_jax.nn.peft_io import export_peft_adapter, import_peft_adapter

__all__ = [
    "LORA_INITS",
    "LoRALinear",
    "PAPER_TARGET_MODULES",
    "export_peft_adapter",
    "import_peft_adapter",
    "inject_lora",
    "iter_lora_layers",
    "lora_scale",
    "lora_state",
    "low_rank_product",
    "merge_all",
    "unmerge_all",
]
