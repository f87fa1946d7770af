"""Instruction-tuning data: file formats, tokenisation with response-only loss masks, batch sources."""

from anlr_jax.data.chat import TEMPLATES, chat_prompt, chat_turns, end_of_turn_id
from anlr_jax.data.formats import (
    FORMATS,
    DataFormatError,
    EvalExample,
    Example,
    ReadResult,
    alpaca_prompt,
    detect_format,
    read_examples,
    user_message,
)
from anlr_jax.data.source import BatchSource, LengthBucketedSource, make_source
from anlr_jax.data.llava import LlavaSource, make_llava_source, read_llava_examples
from anlr_jax.data.tokenize import TokenizedExamples, tokenize_examples

__all__ = [
    "BatchSource",
    "FORMATS",
    "DataFormatError",
    "EvalExample",
    "Example",
    "LengthBucketedSource",
    "LlavaSource",
    "ReadResult",
    "TEMPLATES",
    "TokenizedExamples",
    "alpaca_prompt",
    "chat_prompt",
    "chat_turns",
    "detect_format",
    "end_of_turn_id",
    "make_llava_source",
    "make_source",
    "read_examples",
    "read_llava_examples",
    "tokenize_examples",
    "user_message",
]
