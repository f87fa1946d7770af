"""Visual tasks in ``eval.tasks`` (``anlr eval`` and the end-of-training evaluation) on a tiny random
LLaVA: the prompts hold the image positions and the images' pixel values, the answers are saved as
records and the score in results.json is the benchmark scorer's on those records; one-line errors
name the key."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil

import numpy as np
import pytest
import transformers
from PIL import Image

from anlr_jax.app import cli, evaluate
from anlr_jax.app.config import load_config
from anlr_jax.app.model import load_base
from anlr_jax.data.llava import VICUNA_V1_SYSTEM
from anlr_jax.evals import visual_tasks
from anlr_jax.evals.visual import read_predictions, score_llava_qa, score_pope
from anlr_jax.models import generate
from anlr_jax.models.llava_image import preprocess_image
from tests.helpers.tiny_llava import save_tiny_llava
from tests.tiny_tokenizer import build_tiny_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  """A tiny random LLaVA (4 image positions) with its tokenizer, the visual task of scikit-image's
  photos (its images moved to a folder of their own) and a text-only model."""
  root = tmp_path_factory.mktemp("visual_eval")
  model_dir = root / "llava"
  _, text = save_tiny_llava(model_dir)
  spec = importlib.util.spec_from_file_location(
      "make_visual_task", os.path.join(REPO, "scripts", "make_visual_task.py")
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  task = module.write_task(str(root / "task"), n_train=4, n_test=3, seed=2, size=32)
  images = root / "photos"
  shutil.move(task["images"], images / "images")  # the records name "images/<file>"
  text_dir = root / "text"
  build_tiny_tokenizer(text_dir)
  transformers.LlamaForCausalLM(text).save_pretrained(text_dir)
  (root / "eval.yaml").write_text("seed: 0\n")
  return root, model_dir, task, images, text_dir


def _overrides(model_dir, task, images, *more):
  return [
      f"model.path={model_dir}",
      "data.template=vicuna_v1",
      f"eval.tasks.qa={{format: llava_qa, questions: {task['test']}, image_folder: {images}}}",
      f"eval.tasks.pope.questions={task['pope']}",
      f"eval.tasks.pope.image_folder={images}",
      "eval.batch_size=4",
      "eval.max_new_tokens=3",
      *more,
  ]


def test_anlr_eval_scores_the_answers_it_saves(setup, tmp_path, capsys):
  _, model_dir, task, images, _ = setup
  out = tmp_path / "eval"
  assert (
      cli.main(
          [
              "eval",
              "--config",
              str(setup[0] / "eval.yaml"),
              "--out",
              str(out),
              *_overrides(model_dir, task, images),
          ]
      )
      == 0
  )
  results = json.loads((out / "results.json").read_text())
  qa = [json.loads(line) for line in (out / "eval_qa.jsonl").read_text().splitlines()]
  assert len(qa) == 3 * 4  # every question of the test file, once
  assert all(r["prompt"].count("<image>") == 1 for r in qa)
  # the scores are the scorers' on the saved answers
  assert (
      results["accuracy"]["qa"]
      == score_llava_qa(read_predictions(out / "eval_qa.jsonl"), task["test"]).score
  )
  pope = score_pope(read_predictions(out / "eval_pope.jsonl"), task["pope"])
  assert results["accuracy"]["pope"] == pope.score and pope.count == 3
  stored = json.loads((out / "eval_pope_score.json").read_text())
  assert stored["metrics"] == pytest.approx(pope.metrics) and stored["primary"] == "f1"
  table = (out / "accuracy.md").read_text()
  assert "| qa | pope |" in table
  captured = capsys.readouterr()
  assert re.search(r"eval pope: f1 [\d.]+% on 3 questions \[accuracy", captured.out + captured.err)


def test_the_score_follows_the_answers(setup, tmp_path, monkeypatch):
  """Answers right for 5 of the 12 questions (the gold one, in other words) score 5/12."""
  _, model_dir, task, images, _ = setup
  real = visual_tasks.generate_answers

  def answers(model, tokenizer, questions, **kw):
    prompts, _ = real(model, tokenizer, questions, **kw)
    if questions[0].question_id == "1":  # pope: "yes" to everything
      return prompts, ["Yes, there is."] * len(questions)
    said = [f"The {q.answer}." if i < 5 else "nothing" for i, q in enumerate(questions)]
    return prompts, said

  monkeypatch.setattr(visual_tasks, "generate_answers", answers)
  out = tmp_path / "eval"
  argv = ["eval", "--config", str(setup[0] / "eval.yaml"), "--out", str(out)]
  assert cli.main(argv + _overrides(model_dir, task, images)) == 0
  results = json.loads((out / "results.json").read_text())
  assert results["accuracy"]["qa"] == pytest.approx(5 / 12)
  records = [json.loads(line) for line in (out / "eval_qa.jsonl").read_text().splitlines()]
  assert [r["score"] for r in records] == [1.0] * 5 + [0.0] * 7
  labels = [json.loads(line)["label"] for line in open(task["pope"])]
  precision = labels.count("yes") / len(labels)  # recall 1: every "yes" is found
  assert 0 < precision < 1, labels  # F1 and accuracy differ: the score is POPE's F1
  assert results["accuracy"]["pope"] == pytest.approx(2 * precision / (precision + 1))


def test_prompts_hold_the_image_positions_and_pixels(setup, monkeypatch):
  _, model_dir, task, images, _ = setup
  config = load_config(None, _overrides(model_dir, task, images, "eval.batch_size=3"))
  model, model_config, tok = load_base(config)
  calls = []

  def spy(model, ids, mask, **kw):
    calls.append((np.asarray(ids), np.asarray(mask), np.asarray(kw["pixel_values"])))
    return generate(model, ids, mask, **kw)

  monkeypatch.setattr("anlr_jax.models.generate", spy)
  questions = visual_tasks.read_visual_questions(task["pope"], "pope", image_folder=images)
  prompts, answers = visual_tasks.generate_answers(
      model, tok, questions, template="vicuna_v1", batch_size=3, max_new_tokens=3
  )
  ((ids, mask, pixels),) = calls
  image_id, n = model_config.image_token_index, model_config.num_image_tokens
  assert n == 4 and pixels.shape == (3, 1, 3, 28, 28)
  for row, q in enumerate(questions):
    tokens = ids[row][mask[row] == 1]
    # bos, the system sentence and "USER:", then the image's n positions, then the question
    text = f"{VICUNA_V1_SYSTEM} USER: <image>\n{q.text} ASSISTANT:"
    expected = [tok.bos_token_id] + tok(text, add_special_tokens=False).input_ids
    expected = np.repeat(expected, np.where(np.asarray(expected) == image_id, n, 1))
    np.testing.assert_array_equal(tokens, expected)
    assert (tokens == image_id).sum() == n
    np.testing.assert_array_equal(
        pixels[row, 0], preprocess_image(Image.open(q.image), model_config)
    )
    if row:
      continue
    # the question alone (no padding, no other rows) gives the same greedy answer
    alone = generate(
        model,
        expected[None].astype(np.int32),
        np.ones((1, len(expected)), np.int32),
        max_new_tokens=3,
        eos_token_id=tok.eos_token_id,
        pad_token_id=0,
        pixel_values=pixels[row : row + 1],
    )
    assert answers[row] == tok.decode(np.asarray(alone)[0], skip_special_tokens=True).strip()
  assert "What" not in prompts[0] and prompts[0].count("<image>") == 1


def _error(capsys, argv):
  assert cli.main(argv) == 2
  err = capsys.readouterr().err
  assert err.count("error:") == 1, err
  return err.strip().splitlines()[-1]


def test_bad_visual_tasks_give_one_line(setup, capsys, tmp_path):
  root, model_dir, task, images, text_dir = setup
  base = ["eval", "--config", str(root / "eval.yaml"), "--out", str(tmp_path / "e")]
  records = json.loads(open(task["test"]).read())
  records[1]["image"] = "images/missing.png"
  bad = tmp_path / "bad.json"
  bad.write_text(json.dumps(records))
  qa = f"eval.tasks.qa={{format: llava_qa, questions: {task['test']}, image_folder: {images}}}"
  cases = [
      (
          [f"model.path={model_dir}", f"eval.tasks.qa.questions={task['test']}"],
          r"eval.tasks.qa.format is not set: name the visual task's scorer",
      ),
      (
          [f"model.path={model_dir}", "eval.tasks.qa={format: nope, questions: q.json}"],
          r"eval.tasks.qa.format: 'nope' is not allowed; must be one of \['vqav2'",
      ),
      (
          [f"model.path={model_dir}", qa, f"eval.tasks.qa.image_folder={tmp_path / 'nowhere'}"],
          r"eval.tasks.qa.image_folder: .*nowhere does not exist",
      ),
      (
          [f"model.path={model_dir}", qa, f"eval.tasks.qa.questions={tmp_path / 'none.json'}"],
          r"eval.tasks.qa.questions: .*none.json does not exist",
      ),
      (
          [f"model.path={model_dir}", qa, f"eval.tasks.qa.questions={bad}"],
          rf"eval.tasks.qa: .*bad.json:\d+: question {records[1]['id']}: image file not found: .*"
          "missing.png",
      ),
      (
          [
              f"model.path={model_dir}",
              f"eval.tasks.vqa={{format: vqav2, questions: {task['pope']}}}",
          ],
          r"eval.tasks.vqa.annotations is not set: vqav2 is scored against its official file",
      ),
      (
          [f"model.path={text_dir}", qa],
          r"eval.tasks.qa: a visual task needs a LLaVA model; model.path .*text is not one",
      ),
      (
          [f"model.path={model_dir}", qa],  # data.template left at alpaca
          r"data.template=alpaca: the visual task qa is prompted in chat or vicuna_v1",
      ),
      (
          [f"model.path={model_dir}", qa, "data.template=vicuna_v1", "eval.tasks.qa.format=pope"],
          r"eval.tasks.qa: .*test.json:1: invalid JSON",  # before any answer is generated
      ),
      (
          [
              f"model.path={model_dir}",
              qa,
              "data.template=vicuna_v1",
              f"eval.tasks.qa.annotations={task['pope']}",
          ],
          r"eval.tasks.qa: .*pope_test.json:1: missing key 'id'",
      ),
  ]
  for overrides, pattern in cases:
    line = _error(capsys, base + overrides)
    assert re.search(pattern, line), (overrides, line)


def test_train_scores_base_and_adapters_on_a_visual_task(setup):
  root, model_dir, task, images, _ = setup
  config = load_config(
      None,
      _overrides(
          model_dir,
          task,
          images,
          f"data.train={task['train']}",
          f"data.image_folder={images}",
          "data.pad_multiple=32",
          "compare=[lora]",
          "method=lora",
          "lora.rank=2",
          "lora.dropout=0.0",
          "trainer.steps=1",
          "trainer.devices=1",
          "trainer.global_batch=8",
          "trainer.progress=false",
          "trainer.compute_dtype=float32",
          "eval.include_base=true",
          "eval.limit=4",
          f"run_dir={root / 'runs' / 'r'}",
      ),
  )
  from anlr_jax.app.train import train_run

  summary = train_run(config)
  assert set(summary["base"]) == {"qa", "pope"}
  (run,) = summary["runs"]
  assert set(run["accuracy"]) == {"qa", "pope"}
  run_dir = root / "runs" / "r"
  for where, scores in ((run_dir, run["accuracy"]), (run_dir / "base", summary["base"])):
    pope = score_pope(read_predictions(where / "eval_pope.jsonl"), task["pope"]).score
    assert scores["pope"] == pope
  table = (run_dir / "accuracy.md").read_text()
  assert "| base |" in table and "| lora |" in table


def test_visual_task_config_round_trips_and_expands_paths(tmp_path):
  from anlr_jax.app.config import save_config
  from anlr_jax.app.paths import expand_paths

  config = load_config(
      None,
      [
          "eval.tasks.boolq=b.json",
          "eval.tasks.POPE={questions: '{run_dir}/p.json', image_folder: '{run_dir}/im'}",
          "eval.tasks.qa.format=llava_qa",
          "eval.tasks.qa.questions=q.json",
          "eval.tasks.qa.instruction=Answer briefly.",
      ],
  )
  pope = config.eval.tasks["POPE"]
  assert pope.format == "pope" and config.eval.tasks["qa"].instruction == "Answer briefly."
  assert config.eval.text_tasks() == {"boolq": "b.json"}
  save_config(config, tmp_path / "c.yaml")
  assert load_config(tmp_path / "c.yaml").eval.tasks == config.eval.tasks
  expanded = expand_paths(config, "lora", "/r").eval.tasks["POPE"]
  assert (expanded.questions, expanded.image_folder) == ("/r/p.json", "/r/im")


def test_question_files_of_each_layout(setup, tmp_path):
  """LLaVA's question JSONL, its conversation format and the MMBench TSV give the questions LLaVA's
  evaluation asks (MMBench: hint, question, one line per option; the image from base64)."""
  import base64
  import io

  _, _, task, images, _ = setup
  image = "images/" + os.listdir(images / "images")[0]
  jsonl = tmp_path / "q.jsonl"
  jsonl.write_text(
      json.dumps({"question_id": 7, "image": image, "text": "What is it?"})
      + "\n"
      + json.dumps({"question_id": 8, "text": "No image here?"})
      + "\n"
  )
  q = visual_tasks.read_visual_questions(jsonl, "gqa", image_folder=images, instruction="Short.")
  assert [(x.question_id, x.text, x.image) for x in q] == [
      ("7", "What is it?\nShort.", str(images / image)),
      ("8", "No image here?\nShort.", None),
  ]
  conv = visual_tasks.read_visual_questions(task["test"], "llava_qa", image_folder=images)
  assert conv[0].answer and "<image>" not in conv[0].text and conv[0].text.endswith("phrase.")

  buffer = io.BytesIO()
  Image.open(images / image).save(buffer, format="PNG")
  cell = base64.b64encode(buffer.getvalue()).decode()
  tsv = tmp_path / "mmbench.tsv"
  header = "index\tquestion\thint\tA\tB\tC\tD\tanswer\tcategory\timage\n"
  tsv.write_text(header + f"3\tWhich?\tLook.\tcat\tdog\tnan\t\tA\tx\t{cell}\n")
  (m,) = visual_tasks.read_visual_questions(tsv, "mmbench", instruction="Letter.")
  assert m.text == "Look.\nWhich?\nA. cat\nB. dog\nLetter." and m.answer == "A"
  assert isinstance(m.image, bytes) and m.image_name == "(base64)"

  jsonl.write_text(json.dumps({"question_id": 1, "image": "images/nope.png", "text": "?"}) + "\n")
  with pytest.raises(ValueError, match=r"q.jsonl:1: question 1: image file not found"):
    visual_tasks.read_visual_questions(jsonl, "gqa", image_folder=images)
  tsv.write_text(header + "3\tWhich?\t\tcat\tdog\t\t\tA\tx\tnot-base64!\n")
  with pytest.raises(ValueError, match=r"mmbench.tsv:2: the 'image' cell is not a base64 image"):
    visual_tasks.read_visual_questions(tsv, "mmbench")
