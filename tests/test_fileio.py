"""anlr_jax.fileio: the one JSON / YAML reader (type checked, the file named in every error) that
the eval sets, PEFT adapter configs, results.json, HumanEval problems and run configs share."""

import pytest

from anlr_jax import fileio
from anlr_jax.app.config import ConfigError, read_yaml
from anlr_jax.evals import load_eval_examples
from anlr_jax.nn.peft_io import read_adapter


def test_read_json_checks_the_type_and_names_the_file_and_line(tmp_path):
  path = tmp_path / "doc.json"
  path.write_text('{"a": 1}')
  assert fileio.read_json(path) == {"a": 1}
  with pytest.raises(ValueError, match=r"doc\.json: expected a JSON list, got dict"):
    fileio.read_json(path, list, what="a JSON list")
  path.write_text('{\n  "a": 1,\n  oops\n}')
  with pytest.raises(ValueError, match=r"doc\.json:3: invalid JSON"):
    fileio.read_json(path)
  with pytest.raises(FileNotFoundError):
    fileio.read_json(tmp_path / "absent.json")


def test_parse_json_of_one_line_names_that_line():
  with pytest.raises(ValueError, match=r"^f\.jsonl:7: invalid JSON"):
    fileio.parse_json('{"a": ', "f.jsonl", line=7)
  with pytest.raises(ValueError, match=r"^f\.jsonl:7: expected a JSON object, got list"):
    fileio.parse_json("[1]", "f.jsonl", line=7)


def test_read_yaml_checks_the_type_and_raises_the_callers_error(tmp_path):
  path = tmp_path / "c.yaml"
  path.write_text("a: [1\n")
  with pytest.raises(ConfigError, match=r"c\.yaml:\d+: invalid YAML"):
    fileio.read_yaml(path, error=ConfigError)
  path.write_text("- 1\n")
  with pytest.raises(ValueError, match=r"c\.yaml: expected a mapping, got list"):
    fileio.read_yaml(path)
  path.write_text("")
  assert fileio.read_yaml(path, empty={}) == {}


def test_every_reader_reports_a_wrong_type_the_same_way(tmp_path):
  (tmp_path / "test.json").write_text('{"instruction": "x"}')
  with pytest.raises(ValueError, match=r"test\.json: expected a JSON list of test examples, got"):
    load_eval_examples(tmp_path / "test.json")
  (tmp_path / "adapter_config.json").write_text("[]")
  with pytest.raises(ValueError, match=r"adapter_config\.json: expected a JSON object"):
    read_adapter(tmp_path, "LORA")
  (tmp_path / "run.yaml").write_text("[1, 2]")
  with pytest.raises(ConfigError, match=r"run\.yaml: expected a mapping of keys at the top, got"):
    read_yaml(tmp_path / "run.yaml")


def test_read_jsonl_drops_a_last_line_cut_by_a_crash_and_names_any_other_bad_line(tmp_path):
  path = tmp_path / "records.jsonl"
  path.write_text('{"a": 1}\n\n{"a": 2}\n{"a": 3, "b')  # the last write was cut short
  assert fileio.read_jsonl(path, cut_last="drop") == [{"a": 1}, {"a": 2}]
  assert fileio.read_jsonl_lines(path, cut_last="drop") == [(1, {"a": 1}), (3, {"a": 2})]
  assert path.read_text().endswith('"b')  # "drop" leaves the file as it is
  with pytest.raises(ValueError, match=r"records\.jsonl:4: invalid JSON"):
    fileio.read_jsonl(path)  # an input file: a cut last line is an error like any other
  assert fileio.read_jsonl(path, cut_last="remove") == [{"a": 1}, {"a": 2}]
  assert path.read_text() == '{"a": 1}\n\n{"a": 2}\n'  # the next append starts a fresh line
  path.write_text('{"a": 1}\n{"a": \n{"a": 3}')  # a bad line that is not the last one
  with pytest.raises(ValueError, match=r"records\.jsonl:2: invalid JSON"):
    fileio.read_jsonl(path, cut_last="drop")
  path.write_text('{"a": 1}\n{"a": 2\n')  # a bad last line that did end: not a cut write
  with pytest.raises(ValueError, match=r"records\.jsonl:2: invalid JSON"):
    fileio.read_jsonl(path, cut_last="remove")
  assert path.read_text() == '{"a": 1}\n{"a": 2\n'


def test_read_jsonl_checks_each_value_and_reads_gzip(tmp_path):
  import gzip

  path = tmp_path / "rows.jsonl.gz"
  with gzip.open(path, "wt", encoding="utf-8") as f:
    f.write('{"a": 1}\n[2]\n')
  with pytest.raises(ValueError, match=r"rows\.jsonl\.gz:2: expected a JSON object, got list"):
    fileio.read_jsonl(path)
  assert fileio.read_jsonl(path, None) == [{"a": 1}, [2]]
  with pytest.raises(FileNotFoundError):
    fileio.read_jsonl(tmp_path / "absent.jsonl")


def test_the_readers_of_appended_files_drop_a_cut_last_line_and_name_any_other(tmp_path):
  """metrics.jsonl and the MT-Bench answers file are appended to as a run goes: both read with
  fileio.read_jsonl's rule."""
  from anlr_jax.data.formats import DataFormatError
  from anlr_jax.evals.mtbench import read_records
  from anlr_jax.train.metrics import read_metrics

  metrics = tmp_path / "metrics.jsonl"
  metrics.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')
  assert [row["step"] for row in read_metrics(str(tmp_path))] == [1, 2]
  metrics.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo{"step": 3, "loss": 1.0}\n')
  with pytest.raises(ValueError, match=r"metrics\.jsonl:2: invalid JSON"):
    read_metrics(str(tmp_path))
  answers = tmp_path / "answers.jsonl"
  answers.write_text('{"question_id": 81}\n{"question_id": 82, "cho')
  assert read_records(answers) == [{"question_id": 81}]
  assert answers.read_text() == '{"question_id": 81}\n'
  answers.write_text('{"question_id": 81}\n[82]\n')
  with pytest.raises(DataFormatError, match=r"answers\.jsonl:2: expected a JSON object"):
    read_records(answers)
