r"""Builds the quickstart assets: a tiny pretrained LLaMA and a question-answering task about its world.

Everything follows from one seed ``s``:

1. **World.** ``N`` fictional animals (made-up one-word names), each with a colour, home town, owner,
   food and size drawn uniformly from small closed sets (8, 8, 8, 8, 4 values).
2. **Pretraining corpus.** Documents ``<s> x_1 ... x_n </s>`` of 1-4 sentences: plain-English
   statements of one animal's facts in varied templates (85%), arithmetic facts ("3 plus 4 is 7.")
   and arithmetic quizzes ("Quiz: what is 3 plus 4? option1: 7 option2: 9. The answer is
   option1.", 15%).
3. **Tokenizer.** Word-level (``\w+`` and punctuation runs), trained on the corpus plus the Alpaca
   template, with ``<pad>=0, <s>=1, </s>=2, <unk>=3``; saved as Hugging Face tokenizer files.
4. **Base model.** A LLaMA (hidden 128, 4 layers, 4/2 heads, SwiGLU 344) pretrained on packed
   length-``T`` windows of the corpus with the full next-token loss

       L(θ) = -(1/(B T)) Σ_b Σ_t log p_θ(x_{b,t+1} | x_{b,≤t})

   by AdamW (warmup-cosine schedule), then saved in bfloat16. Fact recall is measured as the share
   of facts whose value is the argmax next token after a canonical cue ("The colour of the zorbal is").
5. **Task.** Instruction-formatted short-answer questions (Alpaca template): "Please answer the
   question: What colour is the zorbal?" -> "green", the bare attribute value, scored as
   ``exact_match`` (chance 1/8). Each attribute is asked in a few phrasings (``QUESTION_TEMPLATES``),
   every word of which is in the fixed tokenizer's vocabulary. Train questions use the training
   animals, test questions the held-out animals: their facts were pretrained, their questions never
   appear in the fine-tune set, so test accuracy measures whether LoRA learnt to *use* what the base
   model knows in a format it never saw.

``--check`` then LoRA fine-tunes (r=8, alpha=16, q/k/v/up/down) the shipped model with
``optax.adamw`` and with ``anlr_jax.anlr`` and reports test accuracy before and after.
``--task-only`` rewrites only the task files (``world.json``, ``train.json``, ``test.json``) and the
task section of ``build_info.json``, leaving the tokenizer and the weights alone.

Usage::

    python scripts/build_quickstart.py --out anlr_jax/assets/quickstart [--seed 0] [--check]
    python scripts/build_quickstart.py --out anlr_jax/assets/quickstart --task-only [--check]
    python scripts/build_quickstart.py --out anlr_jax/assets/quickstart --check-only
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import random
import sys
import time

if __package__ in (None, ""):  # run as a script: make the repo root importable
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import anlr_jax  # noqa: E402
from anlr_jax import assets  # noqa: E402
from anlr_jax.data import alpaca_prompt, read_examples, tokenize_examples  # noqa: E402
from anlr_jax.data.formats import ALPACA_PREAMBLE, ALPACA_PREAMBLE_WITH_INPUT  # noqa: E402
from anlr_jax.evals import evaluate, load_eval_examples  # noqa: E402
from anlr_jax.models import (  # noqa: E402
    LlamaForCausalLM,
    ModelConfig,
    generate,
    load_hf_model,
    load_tokenizer,
    save_hf_model,
)
from anlr_jax.methods import method_optimizer  # noqa: E402
from anlr_jax.nn import inject_lora  # noqa: E402

# --------------------------------------------------------------------------------------------------
# The world

ATTRIBUTES = {
    "colour": ("red", "blue", "green", "yellow", "purple", "orange", "white", "black"),
    "town": (
        "Ashford",
        "Brightwater",
        "Coldmoor",
        "Dunmere",
        "Eastvale",
        "Fernhill",
        "Greystone",
        "Highbury",
    ),
    "owner": ("Alice", "Boris", "Clara", "Daniel", "Elena", "Felix", "Grace", "Hugo"),
    "food": ("apples", "berries", "carrots", "fish", "honey", "nuts", "rice", "seeds"),
    "size": ("tiny", "small", "large", "huge"),
}
"""Attribute name -> its closed set of values."""

QUESTION_ATTRIBUTES = ("colour", "town", "owner", "food")
"""Attributes the fine-tune task asks about (size is pretraining-only background)."""

# Forward templates put the animal before the value, so the value is predictable from it; the
# reversed ones ("{v} looks after the {e}.") only add variety.
FACT_TEMPLATES = {
    "colour": (
        "The colour of the {e} is {v}.",
        "The {e} has {v} fur.",
        "You can spot the {e} by its {v} fur.",
    ),
    "town": (
        "The {e} lives in {v}.",
        "The home of the {e} is {v}.",
        "In {v} you will find the {e}.",
    ),
    "owner": (
        "The {e} belongs to {v}.",
        "The owner of the {e} is {v}.",
        "{v} looks after the {e}.",
    ),
    "food": (
        "The {e} eats {v}.",
        "The favourite food of the {e} is {v}.",
        "Give {v} to the {e} and it is happy.",
    ),
    "size": ("The size of the {e} is {v}.", "The {e} is a {v} animal."),
}
RECALL_CUES = {
    "colour": "The colour of the {e} is",
    "town": "The {e} lives in",
    "owner": "The {e} belongs to",
    "food": "The {e} eats",
    "size": "The size of the {e} is",
}
"""Canonical cue per attribute: fact recall = argmax next token after the cue equals the value."""

QUESTION_TEMPLATES = {
    "colour": (
        "What colour is the {e}?",
        "What is the colour of the {e}?",
        "What colour is the fur of the {e}?",
    ),
    "town": (
        "Where does the {e} live?",
        "Where is the home of the {e}?",
        "Where can you find the {e}?",
    ),
    "owner": ("Who owns the {e}?", "Who is the owner of the {e}?", "Who looks after the {e}?"),
    "food": (
        "What does the {e} eat?",
        "What is the favourite food of the {e}?",
        "What food does the {e} eat?",
    ),
}
"""Phrasings of the question per attribute; every word is in the shipped tokenizer's vocabulary."""
INSTRUCTION = "Please answer the question: {q}"
"""The instruction of every task record; the response is the bare attribute value."""
NUM_ENTITIES = 160
NUM_TEST_ENTITIES = 50
TEST_PHRASINGS = 1
"""Each (test animal, attribute) is asked in this many phrasings, drawn without replacement."""

MAX_POSITIONS = 128
"""Context length of the base model (every task prompt and answer fits in it)."""
SEQ_LEN = 64
"""Pretraining window length (plus one token for the shifted targets)."""

_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"


@dataclasses.dataclass(frozen=True)
class Entity:
  """One animal of the world and its facts; `split` is ``'train'`` or ``'test'`` (fine-tune split)."""

  name: str
  colour: str
  town: str
  owner: str
  food: str
  size: str
  split: str


def build_world(
    seed: int, num_entities: int = NUM_ENTITIES, num_test: int = NUM_TEST_ENTITIES
) -> list[Entity]:
  """The animals of the world, deterministic in `seed`; the last `num_test` are the test split."""
  if not 0 < num_test < num_entities:
    raise ValueError(f"num_test must be in (0, num_entities={num_entities}), got {num_test}")
  rng = random.Random(f"world-{seed}")
  reserved = {w.lower() for values in ATTRIBUTES.values() for w in values}
  names: list[str] = []
  while len(names) < num_entities:
    name = "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(2))
    name += rng.choice(_CONSONANTS)
    if name not in names and name not in reserved:
      names.append(name)
  world = []
  for i, name in enumerate(names):
    facts = {attr: rng.choice(values) for attr, values in ATTRIBUTES.items()}
    world.append(
        Entity(name=name, split="test" if i >= num_entities - num_test else "train", **facts)
    )
  return world


# --------------------------------------------------------------------------------------------------
# Pretraining corpus and tokenizer


def _arithmetic_sentence(rng: random.Random) -> str:
  a, b = rng.randrange(0, 13), rng.randrange(0, 13)
  if rng.random() < 0.5:
    return f"{a} plus {b} is {a + b}."
  wrong = a + b + rng.choice((-3, -2, -1, 1, 2, 3))
  options = [a + b, max(wrong, 0) if wrong != a + b else a + b + 4]
  if options[1] == options[0]:
    options[1] = a + b + 5
  k = rng.randrange(2)
  if k:
    options.reverse()
  return (
      f"Quiz: what is {a} plus {b}? option1: {options[0]} option2: {options[1]}. "
      f"The answer is option{k + 1}."
  )


def _fact_document(entity: Entity, rng: random.Random) -> str:
  attrs = rng.sample(list(ATTRIBUTES), rng.randint(1, 4))
  return " ".join(
      rng.choice(FACT_TEMPLATES[a]).format(e=entity.name, v=getattr(entity, a)) for a in attrs
  )


def pretraining_documents(world: list[Entity], seed: int, count: int) -> list[str]:
  """`count` corpus documents: 85% facts about one animal, 15% arithmetic (see module docstring)."""
  rng = random.Random(f"corpus-{seed}")
  docs = []
  for _ in range(count):
    if rng.random() < 0.85:
      docs.append(_fact_document(rng.choice(world), rng))
    else:
      docs.append(" ".join(_arithmetic_sentence(rng) for _ in range(rng.randint(1, 3))))
  return docs


# The shipped tokenizer was trained on these strings (the first task's questions). They stay frozen:
# word counts decide token ids, so changing them would change the tokenizer under the shipped weights.
_TOKENIZER_QUESTIONS = (
    "What colour is the {e}?",
    "Where does the {e} live?",
    "Who owns the {e}?",
    "What does the {e} eat?",
)


def _tokenizer_corpus(world: list[Entity]) -> list[str]:
  """Every word the corpus and the task can contain, so the word-level vocabulary is closed."""
  texts = [
      ALPACA_PREAMBLE,
      ALPACA_PREAMBLE_WITH_INPUT,
      "### Instruction:\n### Input:\n### Response:\n",
      "Please choose the correct answer to the question. Answer format: option1/option2 "
      "the correct answer is option1 option2",
      " ".join(str(i) for i in range(0, 40)),
      "Quiz: what is plus ? The answer is .",
  ]
  texts += [t for ts in FACT_TEMPLATES.values() for t in ts] + list(_TOKENIZER_QUESTIONS)
  texts += [" ".join(v) for v in ATTRIBUTES.values()] + [" ".join(e.name for e in world)]
  return texts


def build_tokenizer(world: list[Entity]):
  r"""A word-level tokenizer (``\w+`` / punctuation runs) over the closed vocabulary of the world."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  from transformers import PreTrainedTokenizerFast

  backend = Tokenizer(models.WordLevel(unk_token="<unk>"))
  backend.pre_tokenizer = pre_tokenizers.Whitespace()
  backend.decoder = decoders.WordPiece(prefix="##", cleanup=True)  # joins words with spaces
  trainer = trainers.WordLevelTrainer(
      special_tokens=["<pad>", "<s>", "</s>", "<unk>"], min_frequency=1, show_progress=False
  )
  backend.train_from_iterator(sorted(set(_tokenizer_corpus(world))), trainer=trainer)
  return PreTrainedTokenizerFast(
      tokenizer_object=backend,
      pad_token="<pad>",
      bos_token="<s>",
      eos_token="</s>",
      unk_token="<unk>",
      model_max_length=MAX_POSITIONS,
  )


# --------------------------------------------------------------------------------------------------
# Fine-tune task


def _question_record(entity: Entity, attr: str, phrasing: int) -> dict[str, str]:
  """One exact-match record: `attr` of `entity` asked in phrasing number `phrasing`."""
  question = QUESTION_TEMPLATES[attr][phrasing].format(e=entity.name)
  value = getattr(entity, attr)
  return {
      "instruction": INSTRUCTION.format(q=question),
      "input": "",
      "output": value,
      "answer": value,
  }


def build_task(world: list[Entity], seed: int) -> tuple[list[dict], list[dict]]:
  """Train and test records (LLM-Adapters layout) for the animals of each split.

  Train: every (train animal, attribute, phrasing), shuffled. Test: every (test animal, attribute)
  in `TEST_PHRASINGS` phrasings drawn at random.
  """
  rng = random.Random(f"task-{seed}")
  train, test = [], []
  for entity in world:
    for attr in QUESTION_ATTRIBUTES:
      phrasings = range(len(QUESTION_TEMPLATES[attr]))
      if entity.split == "test":
        test.extend(
            _question_record(entity, attr, k) for k in sorted(rng.sample(phrasings, TEST_PHRASINGS))
        )
      else:
        train.extend(_question_record(entity, attr, k) for k in phrasings)
  rng.shuffle(train)
  return train, test


def check_task_vocabulary(records: list[dict], tokenizer, where: str) -> None:
  """Raises ValueError naming the first record of `where` whose prompt or answer has an unknown word
  or whose prompt plus answer (with bos and eos) exceeds the model's context."""
  for i, record in enumerate(records):
    prompt = alpaca_prompt(record["instruction"], record["input"])
    for part, text in (
        ("prompt", prompt),
        ("output", record["output"]),
        ("answer", record["answer"]),
    ):
      ids = tokenizer(text, add_special_tokens=False).input_ids
      if tokenizer.unk_token_id in ids:
        raise ValueError(
            f"{where}[{i}]: the {part} has a word outside the tokenizer's vocabulary: " f"{text!r}"
        )
    length = 2 + len(tokenizer(prompt + record["output"], add_special_tokens=False).input_ids)
    if length > MAX_POSITIONS:
      raise ValueError(f"{where}[{i}]: {length} tokens exceed the context of {MAX_POSITIONS}")


def world_records(world: list[Entity]) -> list[dict]:
  """The world as JSON-ready dicts (what ``world.json`` holds)."""
  return [dataclasses.asdict(e) for e in world]


# --------------------------------------------------------------------------------------------------
# Base model and pretraining


def base_config(vocab_size: int) -> ModelConfig:
  """The quickstart base model: a ~1M-parameter LLaMA with grouped-query attention."""
  return ModelConfig(
      vocab_size=vocab_size,
      hidden_size=128,
      intermediate_size=344,
      num_hidden_layers=4,
      num_attention_heads=4,
      num_key_value_heads=2,
      rms_norm_eps=1e-5,
      rope_theta=10000.0,
      max_position_embeddings=MAX_POSITIONS,
  )


def packed_windows(docs: list[str], tokenizer, seq_len: int) -> np.ndarray:
  """The documents as ``<s> doc </s>`` token runs, concatenated and cut into ``(n, seq_len)``."""
  ids = tokenizer(docs, add_special_tokens=False)["input_ids"]
  bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
  stream = np.fromiter((t for doc in ids for t in (bos, *doc, eos)), dtype=np.int32)
  n = len(stream) // seq_len
  return stream[: n * seq_len].reshape(n, seq_len)


def _padded(
    rows, width: int, pad_id, *, left: bool, dtype=np.int32
) -> tuple[np.ndarray, np.ndarray]:
  """``(values, mask)``: the rows padded with ``pad_id`` to ``(len(rows), width)`` on the left or
  the right, and the int32 mask of their positions."""
  values = np.full((len(rows), width), pad_id, dtype)
  mask = np.zeros((len(rows), width), np.int32)
  for i, row in enumerate(rows):
    span = slice(width - len(row), width) if left else slice(0, len(row))
    values[i, span], mask[i, span] = row, 1
  return values, mask


def _prompt_batch(texts: list[str], tokenizer) -> tuple[np.ndarray, np.ndarray]:
  """``[bos] + tok(text)`` rows left-padded to the longest, so every text ends at the last position;
  ``(ids, attention_mask)``."""
  rows = [
      [tokenizer.bos_token_id, *ids]
      for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]
  ]
  return _padded(rows, max(map(len, rows)), tokenizer.pad_token_id, left=True)


def _lm_loss(model: LlamaForCausalLM, tokens: jax.Array) -> jax.Array:
  """Pretraining: the mean next-token cross-entropy over every position."""
  logits = model(tokens[:, :-1])
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]))


def _response_loss(model, ids, mask):
  """Fine-tuning: the mean next-token cross-entropy over the response tokens (``mask``)."""
  logits = model(ids[:, :-1])
  token_loss = optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:])
  return jnp.sum(token_loss * mask[:, 1:]) / jnp.maximum(jnp.sum(mask[:, 1:]), 1.0)


@nnx.jit(static_argnums=(0,))
def _update(loss_fn, model, optimizer, *batch):
  """One optimizer step on ``loss_fn(model, *batch)`` w.r.t. the variables the optimizer updates."""
  loss, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, optimizer.wrt))(model, *batch)
  optimizer.update(model, grads)
  return loss


def pretrain(
    model: LlamaForCausalLM,
    windows: np.ndarray,
    *,
    steps: int,
    batch_size: int,
    peak_lr: float,
    seed: int,
) -> list[tuple[int, float]]:
  """Full-weight AdamW pretraining on random batches of `windows`; returns ``(step, loss)`` logs
  (the mean loss of every 100 steps)."""
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, peak_lr, min(100, steps // 10), steps, end_value=peak_lr * 0.1
  )
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.0))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  rng = np.random.default_rng(seed)
  log, running, start = [], [], time.time()
  for step in range(1, steps + 1):
    batch = windows[rng.integers(0, len(windows), batch_size)]
    running.append(_update(_lm_loss, model, optimizer, jnp.asarray(batch)))
    if step % 100 == 0 or step == steps:
      loss = float(jnp.mean(jnp.stack(running)))
      running = []
      log.append((step, loss))
      print(
          f"  pretrain step {step}/{steps} loss {loss:.4f} ({time.time() - start:.0f}s)", flush=True
      )
  return log


def fact_recall(model: LlamaForCausalLM, tokenizer, world: list[Entity]) -> dict[str, float]:
  """Per attribute, the share of animals whose value is the argmax next token after the cue."""
  result = {}
  for attr in ATTRIBUTES:
    ids, mask = _prompt_batch([RECALL_CUES[attr].format(e=e.name) for e in world], tokenizer)
    logits = model(jnp.asarray(ids), attention_mask=jnp.asarray(mask))
    predicted = np.asarray(jnp.argmax(logits[:, -1], axis=-1))
    gold = np.array([tokenizer.convert_tokens_to_ids(getattr(e, attr)) for e in world])
    result[attr] = float(np.mean(predicted == gold))
  return result


# --------------------------------------------------------------------------------------------------
# Optional check: LoRA fine-tune with adamw and anlr, test accuracy before and after

CHECK_TARGETS = ("q_proj", "k_proj", "v_proj", "up_proj", "down_proj")
CHECK_STEPS = 300
CHECK_BATCH_SIZE = 16
CHECK_LR = 2e-3
EVAL_MAX_NEW_TOKENS = 4
"""Greedy tokens generated per test prompt: the answer is one word, then eos."""


def test_accuracy(model, tokenizer, test_path: pathlib.Path) -> float:
  """Greedy-generation accuracy on ``test.json`` scored as ``assets.QUICKSTART_TASK``."""

  def generate_fn(prompts):
    ids, mask = _prompt_batch(prompts, tokenizer)
    out = generate(
        model,
        ids,
        mask,
        max_new_tokens=EVAL_MAX_NEW_TOKENS,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return tokenizer.batch_decode(np.asarray(out), skip_special_tokens=True)

  examples = load_eval_examples(test_path)  # one batch: every prompt padded to the longest
  return evaluate(generate_fn, examples, assets.QUICKSTART_TASK, batch_size=len(examples)).accuracy


def lora_finetune(
    asset_dir: pathlib.Path, method: str, *, steps: int, batch_size: int, lr: float, seed: int
) -> dict:
  """LoRA (r=8, alpha=16) fine-tune of the base model with `method` in {'adamw', 'anlr'}."""
  schedule = optax.warmup_cosine_decay_schedule(0.0, lr, steps // 10, steps, end_value=0.0)
  if method not in ("adamw", "anlr"):
    raise ValueError(f"method must be 'adamw' or 'anlr', got {method!r}")
  knobs = dict(weight_decay=0.0, clip_norm=None, anlr_kwargs={"warmup_steps": steps // 10})
  tx = method_optimizer("lora" if method == "adamw" else "anlr", schedule, **knobs)  # adamw: lora
  tokenizer = load_tokenizer(asset_dir)
  model, _ = load_hf_model(asset_dir, dtype=jnp.float32)
  model = inject_lora(
      model, target_modules=CHECK_TARGETS, rank=8, alpha=16.0, dropout=0.0, rngs=nnx.Rngs(seed)
  )
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)
  # Training ids and response-only loss masks, right-padded to the longest example.
  train = tokenize_examples(
      read_examples(asset_dir / assets.TRAIN_FILE).examples, tokenizer, max_length=MAX_POSITIONS
  )
  width = int(train.lengths.max())
  ids, _ = _padded(train.input_ids, width, tokenizer.pad_token_id, left=False)
  mask, _ = _padded(train.loss_mask, width, 0.0, left=False, dtype=np.float32)
  rng = np.random.default_rng(seed)
  start, losses = time.time(), []
  for _ in range(steps):
    pick = rng.integers(0, len(ids), batch_size)
    losses.append(
        _update(_response_loss, model, optimizer, jnp.asarray(ids[pick]), jnp.asarray(mask[pick]))
    )
  final_loss = float(jnp.mean(jnp.stack(losses[-20:])))
  seconds = time.time() - start
  accuracy = test_accuracy(model, tokenizer, asset_dir / assets.TEST_FILE)
  return dict(
      method=method,
      steps=steps,
      batch_size=batch_size,
      lr=lr,
      warmup_steps=steps // 10 if method == "anlr" else None,
      seconds=round(seconds, 1),
      final_loss=round(final_loss, 4),
      test_accuracy=accuracy,
  )


def run_check(
    asset_dir: pathlib.Path, *, seed: int, steps: int, batch_size: int, lr: float
) -> dict:
  """Test accuracy of the base model, then after a LoRA fine-tune with adamw and with anlr."""
  base, _ = load_hf_model(asset_dir, dtype=jnp.float32)
  result = {
      "settings": dict(
          rank=8,
          alpha=16.0,
          dropout=0.0,
          targets=list(CHECK_TARGETS),
          schedule="warmup-cosine, warmup steps/10, to 0",
          weight_decay=0.0,
          eval_max_new_tokens=EVAL_MAX_NEW_TOKENS,
          task=assets.QUICKSTART_TASK,
      ),
      "base_accuracy": test_accuracy(base, load_tokenizer(asset_dir), asset_dir / assets.TEST_FILE),
  }
  print(f"base model test accuracy: {result['base_accuracy']:.3f}", flush=True)
  for method in ("adamw", "anlr"):
    result[method] = lora_finetune(
        asset_dir, method, steps=steps, batch_size=batch_size, lr=lr, seed=seed
    )
    print(f"{method}: {result[method]}", flush=True)
  return result


# --------------------------------------------------------------------------------------------------
# Writing


def task_info(n_train: int, n_test: int) -> dict:
  """The task section of ``build_info.json``."""
  return dict(
      task=assets.QUICKSTART_TASK,
      train_examples=n_train,
      test_examples=n_test,
      instruction=INSTRUCTION,
      question_templates=QUESTION_TEMPLATES,
      test_phrasings=TEST_PHRASINGS,
  )


def _write_json(path: pathlib.Path, payload) -> None:
  with open(path, "w", encoding="utf-8") as f:
    json.dump(payload, f, indent=1)
    f.write("\n")


def update_build_info(out: pathlib.Path, fields: dict) -> dict:
  """Merges `fields` into ``out/build_info.json`` (created if missing); returns the new record."""
  path = out / assets.BUILD_INFO_FILE
  info = json.loads(path.read_text()) if path.is_file() else {}
  info.update(fields)
  _write_json(path, info)
  return info


def write_task_files(out: pathlib.Path, world: list[Entity], seed: int, tokenizer) -> dict:
  """Writes ``world.json``, ``train.json`` and ``test.json`` after checking every record against
  `tokenizer` (`check_task_vocabulary`); returns their `task_info`."""
  train, test = build_task(world, seed)
  check_task_vocabulary(train, tokenizer, assets.TRAIN_FILE)
  check_task_vocabulary(test, tokenizer, assets.TEST_FILE)
  for name, payload in (
      (assets.WORLD_FILE, world_records(world)),
      (assets.TRAIN_FILE, train),
      (assets.TEST_FILE, test),
  ):
    _write_json(out / name, payload)
  return task_info(len(train), len(test))


def build_task_only(out: pathlib.Path, *, seed: int) -> dict:
  """Rewrites the task files in `out` for the shipped tokenizer and updates ``build_info.json``."""
  if not (out / assets.TOKENIZER_FILE).is_file():
    raise FileNotFoundError(
        f"--task-only needs the built tokenizer at {out / assets.TOKENIZER_FILE}"
    )
  info = update_build_info(out, write_task_files(out, build_world(seed), seed, load_tokenizer(out)))
  print(
      f"task {info['task']}: {info['train_examples']} train / {info['test_examples']} test",
      flush=True,
  )
  return info


def build(
    out: pathlib.Path, *, seed: int, steps: int, batch_size: int, peak_lr: float, num_docs: int
) -> dict:
  """Builds every asset into `out`; returns the build record written to ``build_info.json``."""
  out.mkdir(parents=True, exist_ok=True)
  world = build_world(seed)
  tokenizer = build_tokenizer(world)
  tokenizer.save_pretrained(os.fspath(out))
  task = write_task_files(out, world, seed, tokenizer)
  print(
      f"world: {len(world)} animals; task: {task['train_examples']} train / "
      f"{task['test_examples']} test; vocab {len(tokenizer)}",
      flush=True,
  )

  docs = pretraining_documents(world, seed, num_docs)
  windows = packed_windows(docs, tokenizer, SEQ_LEN + 1)
  config = base_config(len(tokenizer))
  model = LlamaForCausalLM(config, rngs=nnx.Rngs(seed))
  print(
      f"model: {config.num_params():,} parameters; corpus: {windows.size:,} tokens in "
      f"{len(windows)} windows",
      flush=True,
  )
  start = time.time()
  log = pretrain(model, windows, steps=steps, batch_size=batch_size, peak_lr=peak_lr, seed=seed)
  seconds = time.time() - start
  recall = fact_recall(model, tokenizer, world)
  print(f"fact recall: {recall}", flush=True)
  save_hf_model(model, config, out, dtype=jnp.bfloat16)
  info = dict(
      seed=seed,
      steps=steps,
      batch_size=batch_size,
      seq_len=SEQ_LEN,
      peak_lr=peak_lr,
      num_docs=num_docs,
      corpus_tokens=int(windows.size),
      num_params=config.num_params(),
      vocab_size=len(tokenizer),
      pretrain_seconds=round(seconds, 1),
      final_loss=round(log[-1][1], 4),
      loss_log=[[s, round(l, 4)] for s, l in log],
      fact_recall=recall,
      **task,
  )
  (out / assets.BUILD_INFO_FILE).unlink(missing_ok=True)  # a full build starts a fresh record
  return update_build_info(out, info)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", type=pathlib.Path, required=True, help="output directory")
  parser.add_argument("--seed", type=int, default=assets.QUICKSTART_SEED)
  parser.add_argument("--steps", type=int, default=1500, help="pretraining steps")
  parser.add_argument("--batch-size", type=int, default=32)
  parser.add_argument("--lr", type=float, default=3e-3, help="peak pretraining learning rate")
  parser.add_argument("--num-docs", type=int, default=150_000, help="pretraining documents")
  mode = parser.add_mutually_exclusive_group()
  mode.add_argument(
      "--task-only",
      action="store_true",
      help="rewrite only the task files and build_info's task section (keeps the "
      "tokenizer and weights in --out)",
  )
  mode.add_argument(
      "--check-only",
      action="store_true",
      help="skip building; run the fine-tune check on the assets in --out",
  )
  parser.add_argument(
      "--check",
      action="store_true",
      help="after building, LoRA fine-tune with adamw and anlr and report accuracy",
  )
  parser.add_argument("--check-steps", type=int, default=CHECK_STEPS, help="LoRA steps per method")
  parser.add_argument("--check-batch-size", type=int, default=CHECK_BATCH_SIZE)
  parser.add_argument("--check-lr", type=float, default=CHECK_LR, help="peak LoRA learning rate")
  args = parser.parse_args(argv)
  for name in ("steps", "batch_size", "num_docs", "check_steps", "check_batch_size"):
    if getattr(args, name) <= 0:
      parser.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
  if args.check_lr <= 0:
    parser.error(f"--check-lr must be positive, got {args.check_lr}")
  if args.task_only:
    build_task_only(args.out, seed=args.seed)
  elif not args.check_only:
    build(
        args.out,
        seed=args.seed,
        steps=args.steps,
        batch_size=args.batch_size,
        peak_lr=args.lr,
        num_docs=args.num_docs,
    )
  if args.check or args.check_only:
    result = run_check(
        args.out,
        seed=args.seed,
        steps=args.check_steps,
        batch_size=args.check_batch_size,
        lr=args.check_lr,
    )
    update_build_info(args.out, {"lora_check": result})


if __name__ == "__main__":
  main()
