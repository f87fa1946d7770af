"""Tests for anlr_jax.data.llava: LLaVA-format records, image checks, prompts with expanded image
tokens, answer-only loss masks and batches of mixed image counts, on a tiny tokenizer with <image>.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from anlr_jax.data.formats import DataFormatError
from anlr_jax.data.llava import (
    VICUNA_V1_SYSTEM,
    generation_prompt_ids,
    image_token_id,
    make_llava_source,
    read_llava_examples,
    tokenize_llava_examples,
)
from tests.tiny_tokenizer import DEFAULT_CORPUS, build_tiny_tokenizer

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
N = 4  # image positions per image ((image_size // patch_size) ** 2 of a tiny vision tower)
SIZE = 8
COLOURS = {"red.png": (255, 0, 0), "green.png": (0, 255, 0), "blue.png": (0, 0, 255)}


def preprocess(image):
  """A stand-in image processor: resize to SIZE x SIZE, scale to [0, 1], normalise, CHW."""
  pixels = np.asarray(image.resize((SIZE, SIZE), Image.BICUBIC), dtype=np.float32) / 255.0
  return ((pixels - 0.5) / 0.25).transpose(2, 0, 1)


@pytest.fixture(scope="module")
def tok():
  tok = build_tiny_tokenizer()
  tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<image>"]})
  tok.chat_template = CHATML
  return tok


@pytest.fixture
def folder(tmp_path):
  images = tmp_path / "images"
  images.mkdir()
  for i, (name, colour) in enumerate(COLOURS.items()):
    Image.new("RGB", (16 + 4 * i, 12), colour).save(images / name)
  (images / "notes.png").write_text("not an image", encoding="utf-8")
  noise = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
  Image.fromarray(noise).save(images / "noise.jpg")
  good = (images / "noise.jpg").read_bytes()
  (images / "truncated.jpg").write_bytes(good[: len(good) // 2])  # a valid header, broken data
  return images


def human(text):
  return {"from": "human", "value": text}


def gpt(text):
  return {"from": "gpt", "value": text}


RECORDS = [
    {
        "id": "img-1",
        "image": "red.png",
        "conversations": [
            human("<image>\nWhat colour is it?"),
            gpt("Red."),
            human("Is it a square?"),
            gpt("No."),
        ],
    },
    {"id": "text-1", "conversations": [human("Say hi."), gpt("hi")]},
    {
        "id": "img-2",
        "image": "green.png",
        "conversations": [human("<image>\nColour?"), gpt("Green.")],
    },
    {
        "id": "img-3",
        "image": ["blue.png", "red.png"],
        "conversations": [human("<image> and <image>: which is red?"), gpt("The second.")],
    },
    {"id": "text-2", "conversations": [human("Count to 3."), gpt("1 2 3")]},
]


def write(tmp_path, records, name="data.json"):
  path = tmp_path / name
  path.write_text(json.dumps(records, indent=1), encoding="utf-8")
  return path


def test_read_records_and_image_paths(tmp_path, folder):
  read = read_llava_examples(write(tmp_path, RECORDS), image_folder=folder)
  assert [e.id for e in read.examples] == ["img-1", "text-1", "img-2", "img-3", "text-2"]
  assert read.examples[0].messages == (
      ("user", "<image>\nWhat colour is it?"),
      ("assistant", "Red."),
      ("user", "Is it a square?"),
      ("assistant", "No."),
  )
  assert read.examples[3].images == (str(folder / "blue.png"), str(folder / "red.png"))
  assert read.examples[1].images == ()
  # Without image_folder, paths are relative to the data file's folder.
  (folder / "data.json").write_text(json.dumps(RECORDS[:1]), encoding="utf-8")
  assert read_llava_examples(folder / "data.json").examples[0].images == (str(folder / "red.png"),)


def _spans(mask):
  """(start, end) of the runs of 1 in a 0/1 vector."""
  padded = np.concatenate([[0], mask, [0]])
  edges = np.flatnonzero(np.diff(padded))
  return list(zip(edges[::2], edges[1::2]))


def test_chat_template_tokens_image_blocks_and_loss(tmp_path, folder, tok):
  read = read_llava_examples(write(tmp_path, RECORDS), image_folder=folder)
  out = tokenize_llava_examples(read.examples, tok, max_length=512, num_image_tokens=N)
  image_id, end = image_token_id(tok), tok.convert_tokens_to_ids("<|im_end|>")
  x, m = out.input_ids[0], out.loss_mask[0]
  # One block of N image ids where "<image>" was, carrying no loss.
  at = len(tok("<|im_start|>user\n", add_special_tokens=False).input_ids)
  assert _spans(x == image_id) == [(at, at + N)]
  assert not m[x == image_id].any()
  # Collapsing the block back to one token gives the chat template's text of the conversation.
  collapsed = np.concatenate([x[:at], x[at + N - 1 :]])
  expected = tok.apply_chat_template(
      [{"role": r, "content": c} for r, c in read.examples[0].messages], tokenize=False
  )
  assert tok.decode(collapsed) == expected.rstrip(
      "\n"
  )  # the text after the last <|im_end|> is not trained
  # The loss covers the two answers and the end-of-turn token after each, nothing else.
  answers = [tok.decode(x[a:b]) for a, b in _spans(m)]
  assert answers == ["Red.<|im_end|>", "No.<|im_end|>"]
  assert x[_spans(m)[0][1] - 1] == end
  # The text-only record has no image id; the two-image record two blocks.
  assert not (out.input_ids[1] == image_id).any()
  assert len(_spans(out.input_ids[3] == image_id)) == 2
  assert (out.input_ids[3] == image_id).sum() == 2 * N
  assert out.images[3] == read.examples[3].images


def test_vicuna_v1_template(tmp_path, folder):
  # A tokenizer that merges " Red" and " No" into one token each, as LLaMA's does ("▁Red").
  corpus = (*DEFAULT_CORPUS, "ASSISTANT: Red. ASSISTANT: No. " * 20)
  tok = build_tiny_tokenizer(corpus=corpus)
  tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
  read = read_llava_examples(write(tmp_path, RECORDS[:1]), image_folder=folder)
  out = tokenize_llava_examples(
      read.examples, tok, max_length=512, num_image_tokens=N, template="vicuna_v1"
  )
  x, m = out.input_ids[0], out.loss_mask[0]
  text = (
      f"{VICUNA_V1_SYSTEM} USER: <image>\nWhat colour is it? ASSISTANT: Red.</s>"
      "USER: Is it a square? ASSISTANT: No.</s>"
  )
  # The whole text tokenised at once, after bos, with the image token expanded.
  expected = [tok.bos_token_id] + tok(text, add_special_tokens=False).input_ids
  image_id = image_token_id(tok)
  expanded = [t for t in expected for _ in range(N if t == image_id else 1)]
  assert x.tolist() == expanded
  # The loss covers each answer's tokens, the space-led first one included, and the eos after it.
  assert [tok.decode(x[a:b]) for a, b in _spans(m)] == [" Red.</s>", " No.</s>"]
  assert tok.convert_ids_to_tokens(int(x[_spans(m)[0][0]])) == "ĠRed"


def test_truncation_keeps_image_blocks_whole(tmp_path, folder, tok):
  record = {
      "id": "late-image",
      "image": "red.png",
      "conversations": [human("Hi."), gpt("Hello."), human("<image>\nColour?"), gpt("Red.")],
  }
  read = read_llava_examples(write(tmp_path, [record]), image_folder=folder)
  full = tokenize_llava_examples(read.examples, tok, max_length=512, num_image_tokens=N)
  image_id = image_token_id(tok)
  start = int(np.flatnonzero(full.input_ids[0] == image_id)[0])
  cut = tokenize_llava_examples(read.examples, tok, max_length=start + 2, num_image_tokens=N)
  assert cut.truncated == 1 and len(cut.input_ids[0]) == start  # cut before the block, not in it
  assert not (cut.input_ids[0] == image_id).any() and cut.images[0] == ()
  assert [tok.decode(cut.input_ids[0][a:b]) for a, b in _spans(cut.loss_mask[0])] == [
      "Hello.<|im_end|>"
  ]


BAD_RECORDS = [
    (
        {"image": "missing.png", "conversations": [human("<image>\nx"), gpt("y")]},
        "image file not found",
    ),
    ({"image": "notes.png", "conversations": [human("<image>\nx"), gpt("y")]}, "unreadable image"),
    ({"image": "red.png", "conversations": [human("What is it?"), gpt("y")]}, "no <image> token"),
    ({"conversations": [human("<image>\nWhat is it?"), gpt("y")]}, r"1 <image> token\(s\) but 0"),
    (
        {"image": "red.png", "conversations": [human("<image><image>\nx"), gpt("y")]},
        r"2 <image> token\(s\) but 1 image",
    ),
    (
        {"image": ["red.png", "blue.png"], "conversations": [human("<image>\nx"), gpt("y")]},
        r"2 images but only 1 <image>",
    ),
    ({"image": "red.png", "conversations": [human("<image>"), gpt("<image>")]}, r"\(gpt\) holds"),
    ({"conversations": [human("x")]}, "no gpt message"),
    ({"conversations": [{"from": "bot", "value": "x"}]}, "from is 'bot'"),
]


@pytest.mark.parametrize("record,reason", BAD_RECORDS)
def test_bad_records_name_file_line_and_id(tmp_path, folder, record, reason):
  records = [RECORDS[1], {"id": "bad-7"} | record]
  path = write(tmp_path, records)
  line = path.read_text().splitlines().index(" {", 2) + 1  # where the second record starts
  with pytest.raises(DataFormatError, match=rf"data\.json:{line}: record bad-7: .*{reason}"):
    read_llava_examples(path, image_folder=folder)
  read = read_llava_examples(path, image_folder=folder, on_error="skip")
  assert [e.id for e in read.examples] == ["text-1"] and read.skipped == 1


def test_tokenizer_without_the_image_token(tmp_path, folder):
  plain = build_tiny_tokenizer()
  plain.chat_template = CHATML
  read = read_llava_examples(write(tmp_path, RECORDS[:1]), image_folder=folder)
  with pytest.raises(ValueError, match="does not encode '<image>' as one token"):
    tokenize_llava_examples(read.examples, plain, max_length=512, num_image_tokens=N)


def _expected_pixels(source, rows):
  return [preprocess(Image.open(p).convert("RGB")) for r in rows for p in source.examples.images[r]]


def test_batches_of_mixed_image_counts(tmp_path, folder, tok):
  source = make_llava_source(
      write(tmp_path, RECORDS),
      tok,
      preprocess=preprocess,
      num_image_tokens=N,
      max_length=256,
      global_batch=4,
      seed=0,
      image_folder=folder,
      pad_multiple=16,
  )
  assert len(source) == 2 and source.format == "llava"
  image_id = image_token_id(tok)
  assert source.images_per_process(1) == 4 * 2  # 4 rows x at most 2 images per example
  seen = []
  for step in range(len(source)):
    batch = source.get_batch(step)
    rows = source.batch_example_ids(step)
    real = np.where(rows < 0, rows[0], rows)  # a filler row repeats the first row, images too
    expected = _expected_pixels(source, real)
    assert batch["pixel_values"].shape == (8, 3, SIZE, SIZE)
    assert batch["pixel_values"].dtype == np.float32
    assert batch["image_mask"].tolist() == [1] * len(expected) + [0] * (8 - len(expected))
    np.testing.assert_array_equal(batch["pixel_values"][: len(expected)], np.stack(expected))
    assert not batch["pixel_values"][len(expected) :].any()
    # As many image blocks in input_ids as valid images, in the same order.
    assert (batch["input_ids"] == image_id).sum() == N * len(expected)
    seen += [int(r) for r in rows if r >= 0]
  assert sorted(seen) == list(range(5))
  # Two processes: each gets its rows' images, in the same order.
  ids = source.batch_example_ids(0)
  for p in range(2):
    half = source.get_batch(0, process_index=p, process_count=2)
    rows = np.where(ids[2 * p : 2 * p + 2] < 0, ids[0], ids[2 * p : 2 * p + 2])
    expected = _expected_pixels(source, rows)
    assert half["pixel_values"].shape == (4, 3, SIZE, SIZE)
    assert half["image_mask"].sum() == len(expected)
    if expected:
      np.testing.assert_array_equal(half["pixel_values"][: len(expected)], np.stack(expected))


def test_broken_image_data_is_reported_when_loaded(tmp_path, folder, tok):
  record = {
      "id": "trunc-1",
      "image": "truncated.jpg",
      "conversations": [human("<image>\nx"), gpt("y")],
  }
  path = write(tmp_path, [record])
  source = make_llava_source(
      path,
      tok,
      preprocess=preprocess,
      num_image_tokens=N,
      max_length=64,
      global_batch=1,
      seed=0,
      image_folder=folder,
  )
  with pytest.raises(
      DataFormatError, match=r"data\.json:2: record trunc-1: unreadable image .*truncated\.jpg"
  ):
    source.get_batch(0)


def test_a_template_that_writes_image_tokens_itself(tmp_path, folder, tok):
  # A chat template that puts an <image> of its own in the prompt breaks the token/image pairing.
  odd = build_tiny_tokenizer()
  odd.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<image>"]})
  odd.chat_template = "<image>" + CHATML
  path = write(tmp_path, RECORDS[:1])
  with pytest.raises(
      DataFormatError, match=r"data\.json:2: record img-1: the prompt has 2 <image>"
  ):
    make_llava_source(
        path,
        odd,
        preprocess=preprocess,
        num_image_tokens=N,
        max_length=512,
        global_batch=1,
        seed=0,
        image_folder=folder,
    )


@pytest.mark.parametrize("template", ["chat", "vicuna_v1"])
def test_generation_prompt_is_the_start_of_the_training_sequence(tmp_path, folder, template):
  corpus = (*DEFAULT_CORPUS, "ASSISTANT: Red. ASSISTANT: No. " * 20)
  tok = build_tiny_tokenizer(corpus=corpus)
  tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<image>"]})
  tok.chat_template = CHATML
  # (vicuna_v1: the prompt ends in "ASSISTANT:", the answer's first token " Red" has its space.)
  read = read_llava_examples(write(tmp_path, RECORDS[:1]), image_folder=folder)
  train = tokenize_llava_examples(
      read.examples, tok, max_length=512, num_image_tokens=N, template=template
  )
  x, m = train.input_ids[0], train.loss_mask[0]
  prompt = generation_prompt_ids(
      tok, read.examples[0].messages[:1], num_image_tokens=N, template=template
  )
  first_answer_token = int(np.flatnonzero(m)[0])
  assert prompt.tolist() == x[:first_answer_token].tolist()
  assert (prompt == image_token_id(tok)).sum() == N


def test_llava_placement_of_the_image_and_a_leading_gpt_message(tmp_path, folder):
  records = [
      {
          "id": "late",
          "image": "red.png",
          "conversations": [human("Describe this photo: <image>"), gpt("A red square.")],
      },
      {
          "id": "two",
          "image": ["red.png", "blue.png"],
          "conversations": [human("Compare <image> with <image>."), gpt("Red, blue.")],
      },
      {"id": "gpt-first", "conversations": [gpt("Hello!"), human("Hi."), gpt("How can I help?")]},
  ]
  read = read_llava_examples(write(tmp_path, records), image_folder=folder)
  assert read.examples[0].messages[0] == ("user", "<image>\nDescribe this photo:")
  assert read.examples[1].messages[0] == ("user", "Compare <image> with <image>.")  # kept
  assert read.examples[2].messages == (("user", "Hi."), ("assistant", "How can I help?"))
