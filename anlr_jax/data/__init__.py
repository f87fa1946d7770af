"""Instruction-tuning data: file formats, tokenisation with response-only loss masks, batch sources."""

from anlr_jax.data.formats import (
    FORMATS,
    DataFormatError,
    Example,
    ReadResult,
    alpaca_prompt,
    detect_format,
    read_examples,
)
from anlr_jax.data.source import BatchSource, LengthBucketedSource, make_source
from anlr_jax.data.tokenize import TokenizedExamples, tokenize_examples

__all__ = [
    "BatchSource",
    "FORMATS",
    "DataFormatError",
    "Example",
    "LengthBucketedSource",
    "ReadResult",
    "TokenizedExamples",
    "alpaca_prompt",
    "detect_format",
    "make_source",
    "read_examples",
    "tokenize_examples",
]
