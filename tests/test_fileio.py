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
