r"""A length-bucketed, deterministic, resumable `BatchSource` for instruction tuning.

Batch contract (shared with the training engine): a source has `len(source)` global batches per epoch
and `get_batch(step, *, process_index=0, process_count=1)` returning this process's rows of global
batch `step` (0-based, counting across epochs) as

* `input_ids` int32 `(b, T)`, right-padded with `pad_id`;
* `attention_mask` int32 `(b, T)`: 1 on real tokens, 0 on padding;
* `loss_mask` float32 `(b, T)`: 1 where the token is a response token the loss predicts (from `t - 1`);

with `b = global_batch / process_count` and process `p` getting rows `[p*b, (p+1)*b)`. The loss is the
mean, over all response tokens of the global batch, of the cross-entropy of `logits[:, :-1]` against
`input_ids[:, 1:]` weighted by `loss_mask[:, 1:]`.

Batching by length (not packing), per epoch `e`:

1. the `N` examples are shuffled by `grain.MapDataset.range(N).shuffle(seed)` (grain reseeds each epoch,
   so epoch `e` reads its indices `e*N .. e*N + N - 1`);
2. the shuffled order is cut into pools of `pool_batches * global_batch` examples; each pool is sorted
   by length (stable) and cut into global batches, so a batch holds examples of similar length;
3. the order of the `ceil(N / global_batch)` batches is shuffled again (a second grain shuffle with a
   derived seed), so long and short batches are interleaved through the epoch.

Every example appears exactly once per epoch. Only the last batch of the last pool can be short; it is
filled up to `global_batch` rows with copies of its first row whose `loss_mask` is all 0 (they attend
normally, so no all-masked attention rows, and add nothing to the loss or its token count).

`T` is the longest sequence of the *global* batch rounded up to a multiple of `pad_multiple` and capped
at `max_length`, so every process sees the same shape and the engine compiles at most
`ceil(max_length / pad_multiple)` shapes. Batch `step` is a pure function of `(step, seed)`: resuming
at step `n` needs only `n`. The epoch plan is computed once per epoch (about 1 s per 170K examples)
and cached.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

from anlr_jax.data.formats import OnError, read_examples
from anlr_jax.data.tokenize import TokenizedExamples, tokenize_examples

if TYPE_CHECKING:  # transformers takes most of a second to import: only tokenizers' type
  from transformers import PreTrainedTokenizerBase

_BATCH_ORDER_SEED_OFFSET = 0x9E3779B9
"""Mixed into the seed of the batch-order shuffle so it never equals the example-order stream."""


@runtime_checkable
class BatchSource(Protocol):
  """What the training engine consumes (the contract in the module docstring)."""

  def __len__(self) -> int:
    ...

  def get_batch(
      self, step: int, *, process_index: int = 0, process_count: int = 1
  ) -> dict[str, np.ndarray]:
    ...


def _permutation(n: int, seed: int, epoch: int) -> np.ndarray:
  """Grain's deterministic permutation of `range(n)` for `epoch` (grain reseeds with `seed + epoch`)."""
  import grain  # with orbax, most of a second to import: only when a run's data is shuffled

  shuffled = grain.MapDataset.range(n).shuffle(seed=seed % 2**32)
  return np.fromiter((shuffled[epoch * n + i] for i in range(n)), dtype=np.int64, count=n)


class LengthBucketedSource:
  """Global batches of similar-length examples; see the module docstring for the order and padding."""

  def __init__(
      self,
      examples: TokenizedExamples,
      *,
      global_batch: int,
      seed: int,
      pad_id: int,
      max_length: int,
      pad_multiple: int = 64,
      pool_batches: int = 32,
  ):
    if len(examples) == 0:
      raise ValueError("examples is empty: nothing to batch")
    for name, value in (
        ("global_batch", global_batch),
        ("pad_multiple", pad_multiple),
        ("pool_batches", pool_batches),
        ("max_length", max_length),
    ):
      if not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    if not isinstance(seed, (int, np.integer)) or seed < 0:
      raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    longest = int(examples.lengths.max())
    if longest > max_length:
      raise ValueError(f"max_length={max_length} is shorter than the longest example ({longest})")
    self.examples = examples
    self.global_batch = int(global_batch)
    self.seed = int(seed)
    self.pad_id = int(pad_id)
    self.max_length = int(max_length)
    self.pad_multiple = int(pad_multiple)
    self.pool_batches = int(pool_batches)
    self.records_skipped = 0  # malformed records skipped while reading (set by make_source)
    self.format = ""  # the data format that was read (set by make_source)
    self._num_batches = -(-len(examples) // self.global_batch)
    self._plans: OrderedDict[int, np.ndarray] = OrderedDict()

  def __len__(self) -> int:
    """Global batches per epoch: `ceil(num_examples / global_batch)`."""
    return self._num_batches

  @property
  def num_examples(self) -> int:
    return len(self.examples)

  def epoch_plan(self, epoch: int) -> np.ndarray:
    """Example ids of every global batch of `epoch` in step order, `(len(self), global_batch)`; -1 = filler."""
    if epoch in self._plans:
      self._plans.move_to_end(epoch)
      return self._plans[epoch]
    n, width = len(self.examples), self.global_batch
    order = _permutation(n, self.seed, epoch)
    pool = self.pool_batches * width
    plan = np.full((self._num_batches, width), -1, dtype=np.int64)
    row = 0
    for start in range(0, n, pool):
      chunk = order[start : start + pool]
      chunk = chunk[np.argsort(self.examples.lengths[chunk], kind="stable")]
      for j in range(0, len(chunk), width):
        ids = chunk[j : j + width]
        plan[row, : len(ids)] = ids
        row += 1
    batch_seed = (self.seed + _BATCH_ORDER_SEED_OFFSET) % 2**32
    plan = plan[_permutation(self._num_batches, batch_seed, epoch)]
    self._plans[epoch] = plan
    if len(self._plans) > 2:
      self._plans.popitem(last=False)
    return plan

  def batch_example_ids(self, step: int) -> np.ndarray:
    """Example ids of the rows of global batch `step`, `(global_batch,)`; -1 marks a filler row."""
    if not isinstance(step, (int, np.integer)) or step < 0:
      raise ValueError(f"step must be a non-negative int, got {step!r}")
    epoch, index = divmod(int(step), self._num_batches)
    return self.epoch_plan(epoch)[index]

  def get_batch(
      self, step: int, *, process_index: int = 0, process_count: int = 1
  ) -> dict[str, np.ndarray]:
    """This process's rows of global batch `step` (see the module docstring for the contract)."""
    if not isinstance(process_count, (int, np.integer)) or process_count < 1:
      raise ValueError(f"process_count must be a positive int, got {process_count!r}")
    if self.global_batch % process_count:
      raise ValueError(
          f"global_batch={self.global_batch} is not divisible by process_count={process_count}"
      )
    if not isinstance(process_index, (int, np.integer)) or not 0 <= process_index < process_count:
      raise ValueError(f"process_index must be in [0, {process_count}), got {process_index!r}")
    ids = self.batch_example_ids(step)
    real = ids >= 0
    length = int(self.examples.lengths[ids[real]].max())
    width = min(-(-length // self.pad_multiple) * self.pad_multiple, self.max_length)
    b = self.global_batch // process_count
    rows = ids[process_index * b : (process_index + 1) * b]
    filler = rows < 0
    rows = np.where(filler, ids[0], rows)
    input_ids = np.full((b, width), self.pad_id, dtype=np.int32)
    attention_mask = np.zeros((b, width), dtype=np.int32)
    loss_mask = np.zeros((b, width), dtype=np.float32)
    for r, (example, is_filler) in enumerate(zip(rows, filler)):
      n = int(self.examples.lengths[example])
      input_ids[r, :n] = self.examples.input_ids[example]
      attention_mask[r, :n] = 1
      if not is_filler:
        loss_mask[r, :n] = self.examples.loss_mask[example]
    return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}


def make_source(
    path: str | os.PathLike[str],
    tokenizer: PreTrainedTokenizerBase,
    *,
    format: str | None = None,  # noqa: A002
    max_length: int,
    global_batch: int,
    seed: int,
    on_error: OnError = "raise",
    pad_multiple: int = 64,
    pool_batches: int = 32,
    template: str = "alpaca",
) -> LengthBucketedSource:
  """Reads, tokenises and batches a local JSON/JSONL instruction dataset.

  Args:
    path: the data file (see `anlr_jax.data.formats`).
    tokenizer: a Hugging Face tokenizer with an eos token (pad falls back to eos).
    format: a name from `anlr_jax.data.formats.FORMATS`, or None to detect it.
    max_length: tokens per sequence at most; longer examples are truncated at the end.
    global_batch: rows per global batch (all processes together).
    seed: shuffle seed.
    on_error: "raise" on a malformed record, or "skip" it and count it (`source.records_skipped`).
    pad_multiple: `T` is rounded up to a multiple of this (fewer distinct shapes to compile).
    pool_batches: batches per length-sorting pool (larger: less padding, less randomness).
    template: prompt format, "alpaca" or "chat" (the tokenizer's chat template; see
      `anlr_jax.data.chat`).

  Returns:
    A `LengthBucketedSource`; `source.examples.truncated` / `.dropped` count truncation effects.
  """
  read = read_examples(path, format=format, on_error=on_error)
  try:
    tokenized = tokenize_examples(
        read.examples, tokenizer, max_length=max_length, template=template
    )
  except ValueError as err:
    if template != "chat":
      raise
    raise ValueError(f"{os.fspath(path)}: {err}") from None
  if len(tokenized) == 0:
    raise ValueError(
        f"{os.fspath(path)}: every example lost its response to max_length={max_length}"
    )
  pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
  source = LengthBucketedSource(
      tokenized,
      global_batch=global_batch,
      seed=seed,
      pad_id=int(pad_id),
      max_length=max_length,
      pad_multiple=pad_multiple,
      pool_batches=pool_batches,
  )
  source.records_skipped = read.skipped
  source.format = read.format
  return source
