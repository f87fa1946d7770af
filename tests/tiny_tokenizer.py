"""A tiny byte-level BPE tokenizer for tests, built locally (never from the Hugging Face hub).

Byte-level BPE encodes any text and decodes it back byte for byte, so tests can compare decoded
token spans with the exact source strings. The tokenizer is trained with the `tokenizers` library on a
small built-in corpus (instruction templates, arithmetic, a few sentences), wrapped as a
`transformers.PreTrainedTokenizerFast` with `<s>` (bos), `</s>` (eos), `<pad>` and `<unk>`, and saved
with `save_pretrained` so it also loads with `AutoTokenizer.from_pretrained(directory)`.

Example (run pytest from the repo root; works whether or not `tests/` is a package)::

    from tests.tiny_tokenizer import build_tiny_tokenizer
    tok = build_tiny_tokenizer(tmp_path / "tok")
    tok("hello").input_ids        # no special tokens are added by encoding
    tok.bos_token_id, tok.eos_token_id, tok.pad_token_id   # 1, 2, 0
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")
"""Special tokens in id order: pad = 0, bos = 1, eos = 2, unk = 3."""

DEFAULT_CORPUS = (
    "Below is an instruction that describes a task. Write a response that appropriately completes "
    "the request.\n\n### Instruction:\n### Input:\n### Response:\n",
    "Please choose the correct answer to the question. the correct answer is answer1 answer2 answer3 "
    "option1 option2 solution1 solution2 ending1 ending2 ending3 ending4 true false",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether? The answer is: 72 #### 72",
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog. 0 1 2 3 4 5 6 7 8 9 $ , . - + = ?",
)


def build_tiny_tokenizer(
    directory: str | os.PathLike[str] | None = None,
    *,
    vocab_size: int = 400,
    corpus: Iterable[str] = DEFAULT_CORPUS,
) -> PreTrainedTokenizerFast:
  """Trains a tiny byte-level BPE tokenizer and (optionally) saves it to `directory`.

  Args:
    directory: where to `save_pretrained` the tokenizer; None keeps it in memory only.
    vocab_size: target vocabulary size including the 256 byte symbols and 4 special tokens.
    corpus: training texts for the BPE merges.

  Returns:
    A `PreTrainedTokenizerFast` with pad/bos/eos/unk set; encoding adds no special tokens.
  """
  if vocab_size < 256 + len(SPECIAL_TOKENS):
    raise ValueError(f"vocab_size must be >= {256 + len(SPECIAL_TOKENS)}, got {vocab_size}")
  backend = Tokenizer(models.BPE(unk_token="<unk>"))
  backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  backend.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
      vocab_size=vocab_size,
      special_tokens=list(SPECIAL_TOKENS),
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
      show_progress=False,
  )
  backend.train_from_iterator(list(corpus), trainer=trainer)
  tokenizer = PreTrainedTokenizerFast(
      tokenizer_object=backend,
      pad_token="<pad>",
      bos_token="<s>",
      eos_token="</s>",
      unk_token="<unk>",
  )
  if directory is not None:
    tokenizer.save_pretrained(os.fspath(directory))
  return tokenizer
