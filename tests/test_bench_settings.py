"""benchmarks/common.py's driver of per-setting worker processes (judge_speed.py, judge_real.py)."""

import json
import os
import textwrap

from benchmarks import common

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_each_setting_runs_in_its_own_worker_and_a_failed_one_is_named(tmp_path, capsys):
  script = tmp_path / "bench.py"
  script.write_text(textwrap.dedent(f"""
      import os, sys
      sys.path.insert(0, {ROOT!r})
      from benchmarks import common
      setting = sys.argv[sys.argv.index("--setting") + 1]
      if setting == "bad":
        sys.exit("bad: no such setting")
      common.emit_result({{"setting": setting, "argv": sys.argv[1:], "pid": os.getpid()}})
      """))
  results = common.run_settings(str(script), ["a", "bad", "b"], ["--batch", "8"])
  assert [r["setting"] for r in results] == ["a", "bad", "b"]
  a, bad, b = results
  assert a["argv"] == ["--worker", "--setting", "a", "--batch", "8"] and a["wall_s"] >= 0
  assert a["pid"] != b["pid"] != os.getpid()
  assert "error" in bad and "bad: no such setting" in bad["error"] and "wall_s" not in bad
  printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
  assert printed == results  # each printed as it came

  common.write_record(str(tmp_path / "out.json"), results)
  record = json.loads((tmp_path / "out.json").read_text())
  assert record["results"] == results
  assert {"machine", "date", "command"} <= set(record) and "load average" in record["machine"]
  common.write_record(None, results)  # no file asked for: nothing written, no error
