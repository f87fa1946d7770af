r"""LLaVA's visual instruction data: records, image checks, prompts, loss masks and image batches.

A data file is a JSON list (or JSONL) of records in LLaVA's format::

    {"id": "000000033471",
     "image": "coco/train2017/000000033471.jpg",          # optional; a list for several images
     "conversations": [{"from": "human", "value": "<image>\nWhat colour is the bus?"},
                       {"from": "gpt", "value": "Red."},
                       {"from": "human", "value": "Where is it?"},
                       {"from": "gpt", "value": "On a street."}]}

Records without ``image`` are text-only and mix freely with the others. Image paths are relative to
the image folder (``image_folder``; by default the data file's folder). Roles are ``human``/``user``,
``gpt``/``assistant`` and an optional leading ``system``. Every ``gpt`` turn is a response the loss
covers (with the end-of-turn token after it); everything else is context (as
:mod:`anlr_jax.data.tokenize` describes).

Each ``<image>`` of a prompt stands for the next image of the record, in order. As in LLaVA's
training code, the token of a record with one image is moved to the start of its turn and followed
by a newline (``"Describe <image>"`` -> ``"<image>\nDescribe"``), and a ``gpt`` message before the
first ``human`` one is dropped. A record is
malformed, and reported like the other formats' bad records (``DataFormatError`` naming the file,
the 1-based line where the record starts and its ``id``; or skipped and counted with
``on_error="skip"``), when an image file is missing or is not an image PIL can open, when it gives an
image but its human turns hold no ``<image>`` token, when they hold more ``<image>`` tokens than it
gives images (or fewer, with several images), or when a ``gpt`` turn holds one. Reading checks each
image's header; an image whose data turns out to be broken when a batch loads it raises the same
error then.

Prompt templates (``template``):

* ``"chat"`` — the tokenizer's chat template (:mod:`anlr_jax.data.chat`), no bos added.
* ``"vicuna_v1"`` — LLaVA-1.5's own conversation format: bos, then ``"{system} USER: {q_1}
  ASSISTANT: {a_1}</s>USER: {q_2} ASSISTANT: {a_2}</s>..."`` with LLaVA's system sentence. As in
  LLaVA, the text is tokenised as a whole (so an answer's first token keeps the space before it, as
  when the model continues a prompt that ends in "ASSISTANT:"), and the loss covers the tokens that
  overlap an answer or the eos after it (a fast tokenizer's character offsets tell which).

Image tokens: the tokenizer must know ``<image>`` (``image_token``) as one token, whose id is the
``image_token_index``. After tokenisation each ``<image>`` id is repeated ``num_image_tokens`` times
(``(image_size // patch_size) ** 2``, 576 for LLaVA-1.5's 336-pixel ViT-L/14), as transformers'
``LlavaProcessor`` does, so the language model sees one position per patch feature. Those positions
carry no loss. Truncation to ``max_length`` never splits an image's block: a block that does not fit
is cut off whole, with the images from it on; an example left without a response token is dropped.

Batches (:class:`LlavaSource`) follow :mod:`anlr_jax.data.source`'s contract (length-bucketed,
deterministic, resumable; ``input_ids``, ``attention_mask``, ``loss_mask``) and add

* ``pixel_values`` float32 ``(max_images, 3, H, W)``: the images of this process's rows in order of
  appearance (row by row, each row's images in order), each made by ``preprocess`` (a PIL RGB image
  -> ``(3, H, W)`` float32 array, e.g. the model's CLIP preprocessing), then zero padding;
* ``image_mask`` int32 ``(max_images,)``: 1 for the real images, which come first, 0 for padding.

``max_images`` is fixed per source (rows per process x the most images of one example, unless
given), so every batch has one shape for ``jit``. A model that fills the image positions with the
images' features in order (as transformers' LLaVA does) takes the padded ``pixel_values`` as they
are under ``jit``: the padding images' features are computed but never used. Outside ``jit``, or
to save that compute, pass ``pixel_values[image_mask == 1]``. The filler rows that complete a short last batch
repeat its first row and so also repeat its images.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import tqdm

from anlr_jax.data.chat import render_chat
from anlr_jax.data.images import Preprocess, image_problem, load_image
from anlr_jax.data.formats import (
    DataFormatError,
    Example,
    OnError,
    check_on_error,
    check_read,
    scan_records,
)
from anlr_jax.data.source import LengthBucketedSource
from anlr_jax.data.tokenize import tokenize_examples

if TYPE_CHECKING:  # transformers takes most of a second to import: only tokenizers' type
  from transformers import PreTrainedTokenizerBase


IMAGE_TOKEN = "<image>"
"""LLaVA's image placeholder in prompts."""

LLAVA_TEMPLATES = ("chat", "vicuna_v1")
"""Prompt templates of visual instruction data (see the module docstring)."""

VICUNA_V1_SYSTEM = (
    "A chat between a curious user and an artificial intelligence assistant. "
    "The assistant gives helpful, detailed, and polite answers to the user's questions."
)
"""The system sentence of LLaVA-1.5's ``vicuna_v1`` conversation format."""


_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
}


@dataclasses.dataclass(frozen=True)
class LlavaExample:
  """One record: its conversation `messages` of `(role, content)`, the full paths of its images in
  order, its 1-based `source_line` and its `id` (or "")."""

  messages: tuple[tuple[str, str], ...]
  images: tuple[str, ...]
  source_line: int
  id: str = ""


@dataclasses.dataclass(frozen=True)
class LlavaReadResult:
  """Examples read from a file and the records skipped as `(line, reason)`."""

  examples: list[LlavaExample]
  skipped_records: tuple[tuple[int, str], ...] = ()

  @property
  def skipped(self) -> int:
    return len(self.skipped_records)


class _RecordError(Exception):
  """A malformed record; the reader adds the file, line and id."""


def _image_paths(record: Mapping[str, Any], folder: str) -> tuple[str, ...]:
  image = record.get("image")
  if image is None:
    return ()
  names = [image] if isinstance(image, str) else image
  if not isinstance(names, list) or not names or not all(isinstance(n, str) and n for n in names):
    raise _RecordError("'image' must be a file name or a non-empty list of file names")
  paths = []
  for name in names:
    path = os.path.join(folder, name)
    problem = image_problem(path)
    if problem is not None:
      raise _RecordError(problem)
    paths.append(path)
  return tuple(paths)


def _messages(
    record: Mapping[str, Any], image_token: str
) -> tuple[tuple[tuple[str, str], ...], int]:
  conversations = record.get("conversations")
  if not isinstance(conversations, list) or not conversations:
    raise _RecordError("'conversations' must be a non-empty list of {from, value} messages")
  messages: list[tuple[str, str]] = []
  tokens = 0
  for i, message in enumerate(conversations):
    if not isinstance(message, Mapping):
      raise _RecordError(f"conversations[{i}] must be an object, got {type(message).__name__}")
    role = _ROLES.get(message.get("from"))
    if role is None:
      raise _RecordError(
          f"conversations[{i}].from is {message.get('from')!r}; expected one of {sorted(_ROLES)}"
      )
    content = message.get("value")
    if not isinstance(content, str):
      raise _RecordError(f"conversations[{i}].value must be a string")
    count = content.count(image_token)
    if count and role == "assistant":
      raise _RecordError(f"conversations[{i}] (gpt) holds {image_token}: only prompts may")
    if role == "system" and messages:
      raise _RecordError(f"conversations[{i}]: a system message must come first")
    if role == "assistant" and not content.strip():
      raise _RecordError(f"conversations[{i}]: empty gpt message")
    tokens += count
    if role == "assistant" and not any(r == "user" for r, _ in messages):
      continue  # a gpt message before any human one has nothing to answer: LLaVA drops it
    if messages and messages[-1][0] == role == "user":
      messages[-1] = ("user", messages[-1][1] + "\n\n" + content)
    else:
      messages.append((role, content))
  last = max((i for i, (role, _) in enumerate(messages) if role == "assistant"), default=-1)
  if last < 0:
    raise _RecordError("the conversation has no gpt message to train on")
  return tuple(messages[: last + 1]), tokens


def _convert(
    record: Any, folder: str, image_token: str
) -> tuple[tuple[tuple[str, str], ...], tuple[str, ...]]:
  if not isinstance(record, Mapping):
    raise _RecordError(f"a record must be a JSON object, got {type(record).__name__}")
  messages, tokens = _messages(record, image_token)
  images = _image_paths(record, folder)
  if images and tokens == 0:
    raise _RecordError(f"gives an image but no {image_token} token marks where it goes")
  if tokens > len(images):
    raise _RecordError(
        f"has {tokens} {image_token} token(s) but {len(images)} image(s)"
        + ("" if images else " (no 'image' key)")
    )
  if tokens < len(images):
    raise _RecordError(f"has {len(images)} images but only {tokens} {image_token} token(s)")
  if len(images) == 1:
    messages = tuple(_image_first(m, image_token) for m in messages)
  return messages, images


def _image_first(message: tuple[str, str], image_token: str) -> tuple[str, str]:
  """LLaVA's placement of a record's one image: its token, a newline, then the rest of the turn."""
  role, content = message
  if image_token not in content:
    return message
  return role, f"{image_token}\n" + content.replace(image_token, "").strip()


def read_llava_examples(
    path: str | os.PathLike[str],
    *,
    image_folder: str | os.PathLike[str] | None = None,
    image_token: str = IMAGE_TOKEN,
    on_error: OnError = "raise",
) -> LlavaReadResult:
  """Reads a LLaVA-format file (see the module docstring), checking every record and image.

  Args:
    path: a JSON list or JSONL file of LLaVA records.
    image_folder: the folder image paths are relative to; None: the data file's folder.
    image_token: the image placeholder of the prompts.
    on_error: "raise" (a `DataFormatError` naming file, line and id) or "skip" (count and log it).
  """
  check_on_error(on_error)
  path = os.fspath(path)
  folder = os.fspath(image_folder) if image_folder is not None else os.path.dirname(path)
  if not os.path.isdir(folder):
    raise FileNotFoundError(f"image folder not found: {folder}")
  examples: list[LlavaExample] = []
  skipped: list[tuple[int, str]] = []
  records = tqdm.tqdm(
      scan_records(path), desc=f"checking {os.path.basename(path)}", unit=" records", leave=False
  )
  for line, record in records:
    record_id = str(record.get("id", "")) if isinstance(record, Mapping) else ""
    try:
      if isinstance(record, Exception):
        raise _RecordError(str(record))
      messages, images = _convert(record, folder, image_token)
      examples.append(LlavaExample(messages, images, source_line=line, id=record_id))
    except _RecordError as err:
      reason = f"record {record_id}: {err}" if record_id else str(err)
      if on_error == "raise":
        raise DataFormatError(f"{path}:{line}: {reason}") from None
      skipped.append((line, reason))
  check_read(path, examples, skipped)
  return LlavaReadResult(examples, tuple(skipped))


def vicuna_v1_text(
    messages: Sequence[tuple[str, str]], eos: str = "</s>"
) -> tuple[str, tuple[tuple[int, int], ...]]:
  """A conversation in LLaVA-1.5's ``vicuna_v1`` format, and the character spans `[start, end)` of
  its answers, each with the `eos` text that closes it."""
  system = VICUNA_V1_SYSTEM
  text = ""
  spans: list[tuple[int, int]] = []
  users: list[str] = []
  for role, content in messages:
    if role == "system":
      system = content
    elif role == "user":
      users.append(content)
    else:
      head = f"{system} " if not spans else ""
      question = "\n\n".join(users)
      text += f"{head}USER: {question} ASSISTANT: "
      spans.append((len(text), len(text) + len(content) + len(eos)))
      text += content + eos
      users = []
  return text, tuple(spans)


def _tokenize_vicuna_v1(
    examples: Sequence[LlavaExample], tokenizer: PreTrainedTokenizerBase
) -> list[tuple[np.ndarray, np.ndarray]]:
  """Each example's ids (bos first) and loss mask: 1 on the tokens that overlap an answer span."""
  if tokenizer.eos_token is None:
    raise ValueError("template=vicuna_v1 needs a tokenizer with an eos token")
  if not getattr(tokenizer, "is_fast", False):
    raise ValueError("template=vicuna_v1 needs a fast tokenizer (for its character offsets)")
  texts, spans = zip(*(vicuna_v1_text(e.messages, tokenizer.eos_token) for e in examples))
  encoded = tokenizer(list(texts), add_special_tokens=False, return_offsets_mapping=True)
  head = [] if tokenizer.bos_token_id is None else [int(tokenizer.bos_token_id)]
  out = []
  for ids, offsets, answer_spans in zip(encoded["input_ids"], encoded["offset_mapping"], spans):
    starts = np.asarray([o[0] for o in offsets], dtype=np.int64)
    ends = np.asarray([o[1] for o in offsets], dtype=np.int64)
    mask = np.zeros(len(ids), dtype=np.float32)
    for a, b in answer_spans:
      mask[(starts < b) & (ends > a)] = 1.0
    out.append(
        (
            np.asarray(head + list(ids), dtype=np.int32),
            np.concatenate([np.zeros(len(head), np.float32), mask]),
        )
    )
  return out


def image_token_id(tokenizer: PreTrainedTokenizerBase, image_token: str = IMAGE_TOKEN) -> int:
  """The id of `image_token`, which the tokenizer must encode as one token."""
  ids = tokenizer(image_token, add_special_tokens=False).input_ids
  if len(ids) != 1 or ids[0] == tokenizer.unk_token_id:
    raise ValueError(
        f"the tokenizer does not encode {image_token!r} as one token (got {ids}); add it with"
        f" tokenizer.add_special_tokens({{'additional_special_tokens': [{image_token!r}]}}) and"
        " resize the model's embeddings, as LLaVA's tokenizers have it"
    )
  return int(ids[0])


@dataclasses.dataclass(frozen=True)
class LlavaTokenized:
  """Tokenised examples with their image blocks expanded (the `TokenizedExamples` fields, plus the
  image paths each example keeps after truncation and the record ids)."""

  input_ids: list[np.ndarray]
  loss_mask: list[np.ndarray]
  lengths: np.ndarray
  source_lines: np.ndarray
  images: list[tuple[str, ...]]
  ids: list[str]
  truncated: int
  dropped: int

  def __len__(self) -> int:
    return len(self.input_ids)


def tokenize_llava_examples(
    examples: Sequence[LlavaExample],
    tokenizer: PreTrainedTokenizerBase,
    *,
    max_length: int,
    num_image_tokens: int,
    template: str = "chat",
    image_token: str = IMAGE_TOKEN,
    data_path: str = "",
) -> LlavaTokenized:
  """Tokenises `examples` (see the module docstring): prompts in `template`, response-only loss,
  each image token repeated `num_image_tokens` times, truncation that keeps image blocks whole;
  `data_path` names the file in errors."""
  if template not in LLAVA_TEMPLATES:
    raise ValueError(f"template must be one of {list(LLAVA_TEMPLATES)}, got {template!r}")
  if not isinstance(num_image_tokens, int) or num_image_tokens < 1:
    raise ValueError(f"num_image_tokens must be a positive int, got {num_image_tokens!r}")
  if not isinstance(max_length, int) or max_length < 2:
    raise ValueError(f"max_length must be an int >= 2, got {max_length!r}")
  image_id = image_token_id(tokenizer, image_token)
  if template == "vicuna_v1":
    pairs = _tokenize_vicuna_v1(examples, tokenizer)
  else:
    base = [Example((), source_line=e.source_line, messages=e.messages) for e in examples]
    tokenized = tokenize_examples(base, tokenizer, max_length=2**62, template="chat")
    if tokenized.dropped:  # cannot happen without truncation: every example has a response
      raise AssertionError("an untruncated example lost its response")
    pairs = list(zip(tokenized.input_ids, tokenized.loss_mask))
  input_ids, loss_mask, lines, images, ids = [], [], [], [], []
  truncated = dropped = 0
  for example, (x, m) in zip(examples, pairs):
    where = np.flatnonzero(x == image_id)
    if len(where) != len(example.images):
      record = f"record {example.id}: " if example.id else ""
      raise DataFormatError(
          f"{data_path}:{example.source_line}: {record}the prompt has {len(where)} {image_token}"
          f" token(s) after tokenisation for {len(example.images)} image(s)"
      )
    repeats = np.where(x == image_id, num_image_tokens, 1)
    x, m = np.repeat(x, repeats), np.repeat(m, repeats)
    m[x == image_id] = 0.0
    starts = where + np.arange(len(where)) * (num_image_tokens - 1)
    kept = len(example.images)
    if len(x) > max_length:
      truncated += 1
      cut = max_length
      split = [i for i, s in enumerate(starts) if s < cut < s + num_image_tokens]
      if split:
        cut = int(starts[split[0]])
      kept = int(np.sum(starts + num_image_tokens <= cut))
      x, m = x[:cut], m[:cut].copy()
    if len(m):
      m[0] = 0.0
    if not m.any():
      dropped += 1
      continue
    input_ids.append(x.astype(np.int32))
    loss_mask.append(m.astype(np.float32))
    lines.append(example.source_line)
    images.append(example.images[:kept])
    ids.append(example.id)
  return LlavaTokenized(
      input_ids=input_ids,
      loss_mask=loss_mask,
      lengths=np.asarray([len(x) for x in input_ids], dtype=np.int64),
      source_lines=np.asarray(lines, dtype=np.int64),
      images=images,
      ids=ids,
      truncated=truncated,
      dropped=dropped,
  )


def generation_prompt_ids(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[tuple[str, str]],
    *,
    num_image_tokens: int,
    template: str = "chat",
    image_token: str = IMAGE_TOKEN,
) -> np.ndarray:
  """The int32 ids of a prompt for generation: the conversation `messages` (ending with the user's
  turn) in `template`, up to where the answer starts, image tokens expanded; the same ids that
  start a training sequence of the same conversation (``"vicuna_v1"``: ending in "ASSISTANT:")."""
  if template not in LLAVA_TEMPLATES:
    raise ValueError(f"template must be one of {list(LLAVA_TEMPLATES)}, got {template!r}")
  if not messages or messages[-1][0] != "user":
    raise ValueError("the conversation must end with a user message")
  image_id = image_token_id(tokenizer, image_token)
  if template == "vicuna_v1":
    text, _ = vicuna_v1_text([*messages, ("assistant", "")], eos="")
    head = [] if tokenizer.bos_token_id is None else [int(tokenizer.bos_token_id)]
    ids = head + tokenizer(text.rstrip(" "), add_special_tokens=False).input_ids
  else:
    text = render_chat(tokenizer, messages, generation=True)
    ids = tokenizer(text, add_special_tokens=False).input_ids
  ids = np.asarray(ids, dtype=np.int32)
  return np.repeat(ids, np.where(ids == image_id, num_image_tokens, 1)).astype(np.int32)


class LlavaSource(LengthBucketedSource):
  """`LengthBucketedSource` batches plus each row's images (see the module docstring)."""

  def __init__(
      self,
      examples: LlavaTokenized,
      *,
      preprocess: Preprocess,
      global_batch: int,
      seed: int,
      pad_id: int,
      max_length: int,
      max_images: int | None = None,
      pad_multiple: int = 64,
      pool_batches: int = 32,
      data_path: str = "",
  ):
    super().__init__(
        examples,
        global_batch=global_batch,
        seed=seed,
        pad_id=pad_id,
        max_length=max_length,
        pad_multiple=pad_multiple,
        pool_batches=pool_batches,
    )
    if not callable(preprocess):
      raise TypeError("preprocess must be a callable: PIL image -> (3, H, W) float32 array")
    self.preprocess = preprocess
    self.data_path = data_path
    self.per_example_max = max((len(i) for i in examples.images), default=0)
    self.max_images = max_images
    self._shape: tuple[int, ...] | None = None

  def images_per_process(self, process_count: int) -> int:
    """`max_images`: as given, else rows per process x the most images of one example (at least 1)."""
    if self.max_images is not None:
      return int(self.max_images)
    return max(1, self.global_batch // process_count * self.per_example_max)

  def _pixels(self, example: int) -> list[np.ndarray]:
    out = []
    for path in self.examples.images[example]:
      try:
        pixels = load_image(path, self.preprocess)
      except (OSError, SyntaxError) as err:  # PIL's UnidentifiedImageError is an OSError
        line, rid = self.examples.source_lines[example], self.examples.ids[example]
        record = f"record {rid}: " if rid else ""
        raise DataFormatError(
            f"{self.data_path}:{line}: {record}unreadable image {path}: {err}"
        ) from None
      if self._shape is None:
        self._shape = pixels.shape
      elif pixels.shape != self._shape:
        raise ValueError(
            f"preprocess gave {path} the shape {pixels.shape}, other images {self._shape}: every"
            " image must come out the same size"
        )
      out.append(pixels)
    return out

  def _image_shape(self) -> tuple[int, ...]:
    if self._shape is None:
      for example in range(len(self.examples)):
        if self.examples.images[example]:
          self._pixels(example)
          break
    if self._shape is None:
      raise ValueError("no example has an image, so the image size is unknown")
    return self._shape

  def get_batch(
      self, step: int, *, process_index: int = 0, process_count: int = 1
  ) -> dict[str, np.ndarray]:
    """This process's rows of global batch `step`, with `pixel_values` and `image_mask`."""
    batch = super().get_batch(step, process_index=process_index, process_count=process_count)
    ids = self.batch_example_ids(step)
    b = self.global_batch // process_count
    rows = ids[process_index * b : (process_index + 1) * b]
    rows = np.where(rows < 0, ids[0], rows)
    capacity = self.images_per_process(process_count)
    images = [p for example in rows for p in self._pixels(int(example))]
    if len(images) > capacity:
      raise ValueError(
          f"batch {step} holds {len(images)} images on process {process_index}, more than"
          f" max_images={capacity}"
      )
    pixel_values = np.zeros((capacity, *self._image_shape()), dtype=np.float32)
    image_mask = np.zeros((capacity,), dtype=np.int32)
    for i, pixels in enumerate(images):
      pixel_values[i] = pixels
      image_mask[i] = 1
    batch["pixel_values"] = pixel_values
    batch["image_mask"] = image_mask
    return batch


def make_llava_source(
    path: str | os.PathLike[str],
    tokenizer: PreTrainedTokenizerBase,
    *,
    preprocess: Preprocess,
    num_image_tokens: int,
    max_length: int,
    global_batch: int,
    seed: int,
    image_folder: str | os.PathLike[str] | None = None,
    template: str = "chat",
    image_token: str = IMAGE_TOKEN,
    max_images: int | None = None,
    on_error: OnError = "raise",
    pad_multiple: int = 64,
    pool_batches: int = 32,
) -> LlavaSource:
  """Reads, checks, tokenises and batches a LLaVA-format file (see the module docstring).

  Args:
    path: the data file.
    tokenizer: a tokenizer that has `image_token` as one token (and a chat template for "chat").
    preprocess: PIL RGB image -> `(3, H, W)` float32 pixel values (the model's image processor).
    num_image_tokens: positions per image, `(image_size // patch_size) ** 2`.
    max_length: tokens per sequence at most, image positions included.
    global_batch: rows per global batch (all processes together).
    seed: shuffle seed.
    image_folder: the folder of the images; None: the data file's folder.
    template: "chat" (the tokenizer's chat template) or "vicuna_v1" (LLaVA-1.5's format).
    image_token: the image placeholder of the prompts.
    max_images: images per process and batch (padding included); None: rows per process x the most
      images of one example.
    on_error: "raise" on a malformed record, or "skip" it and count it (`source.records_skipped`).
    pad_multiple: the sequence length is rounded up to a multiple of this.
    pool_batches: batches per length-sorting pool.
  """
  path = os.fspath(path)
  read = read_llava_examples(
      path, image_folder=image_folder, image_token=image_token, on_error=on_error
  )
  try:
    tokenized = tokenize_llava_examples(
        read.examples,
        tokenizer,
        max_length=max_length,
        num_image_tokens=num_image_tokens,
        template=template,
        image_token=image_token,
        data_path=path,
    )
  except DataFormatError:
    raise
  except ValueError as err:
    raise ValueError(f"{path}: {err}") from None
  if len(tokenized) == 0:
    raise ValueError(f"{path}: every example lost its response to max_length={max_length}")
  pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
  source = LlavaSource(
      tokenized,
      preprocess=preprocess,
      global_batch=global_batch,
      seed=seed,
      pad_id=int(pad_id),
      max_length=max_length,
      max_images=max_images,
      pad_multiple=pad_multiple,
      pool_batches=pool_batches,
      data_path=path,
  )
  source.records_skipped = read.skipped
  source.format = "llava"
  return source


__all__ = [
    "IMAGE_TOKEN",
    "LLAVA_TEMPLATES",
    "LlavaExample",
    "LlavaReadResult",
    "LlavaSource",
    "LlavaTokenized",
    "VICUNA_V1_SYSTEM",
    "generation_prompt_ids",
    "image_token_id",
    "load_image",
    "make_llava_source",
    "read_llava_examples",
    "tokenize_llava_examples",
    "vicuna_v1_text",
]
