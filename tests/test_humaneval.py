"""HumanEval execution: canonical solutions pass, broken and hostile programs fail, the evaluator
survives and leaves no process or directory behind, pass@k matches a direct computation."""

import gzip
import itertools
import json
import math
import os
import time

import numpy as np
import pytest

from anlr_jax.evals import humaneval

pytestmark = pytest.mark.skipif(
    not os.path.isdir("/proc/self"), reason="the sandbox tests read /proc (Linux)"
)

TASK = "HumanEval/0"  # has_close_elements(numbers, threshold) -> bool


@pytest.fixture(scope="module")
def problems():
  return humaneval.load_problems()


def _proc_start_time(pid):
  """Field 22 of /proc/<pid>/stat, or None when the process is gone or a zombie."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      fields = f.read().rsplit(")", 1)[1].split()
  except (FileNotFoundError, ProcessLookupError):
    return None
  return None if fields[0] in "ZX" else fields[19]


# Top-level code (after the function body) that records this process's pid and start time.
_MARK = """
import os as _os
with open(_os.path.join({marker!r}, str(_os.getpid())), "w") as _f:
    _f.write(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])
"""


def _marked_alive(marker):
  """The recorded processes that still run (same pid and start time, not a zombie)."""
  alive = []
  for name in os.listdir(marker):
    with open(os.path.join(marker, name)) as f:
      start_time = f.read()
    if start_time and _proc_start_time(int(name)) == start_time:
      alive.append(int(name))
  return alive


def _wait_all_dead(marker, seconds=5.0):
  end = time.monotonic() + seconds
  while (alive := _marked_alive(marker)) and time.monotonic() < end:
    time.sleep(0.05)
  return alive


# --- pass@k -------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 5, 10, 37, 100])
def test_pass_at_k_matches_binomials(n):
  for c in range(n + 1):
    for k in range(1, n + 1):
      expected = 1.0 - math.comb(n - c, k) / math.comb(n, k)
      assert humaneval.pass_at_k(n, c, k) == pytest.approx(expected, rel=1e-9, abs=1e-12)


def test_pass_at_k_is_the_chance_that_k_draws_hold_a_correct_one():
  for n, c, k in [(5, 2, 1), (5, 2, 3), (6, 1, 2), (7, 3, 4), (4, 0, 2), (4, 4, 1)]:
    draws = list(itertools.combinations([True] * c + [False] * (n - c), k))
    assert humaneval.pass_at_k(n, c, k) == pytest.approx(np.mean([any(d) for d in draws]))


def test_pass_at_k_rejects_impossible_counts():
  for n, c, k in [(3, 4, 1), (3, -1, 1), (3, 1, 0), (3, 1, 4)]:
    with pytest.raises(ValueError, match="pass_at_k"):
      humaneval.pass_at_k(n, c, k)


# --- the problems file --------------------------------------------------------------------------


def test_save_records_writes_one_json_line_per_sample(tmp_path):
  """``save_records``, as ``EvalResult`` and ``CodeEvalResult`` name it."""
  samples = (
      humaneval.SampleResult("HumanEval/0", "return 1", True, "passed"),
      humaneval.SampleResult("HumanEval/0", "return 2", False, "failed: AssertionError"),
  )
  result = humaneval.HumanEvalResult({"pass@1": 0.5}, samples)
  result.save_records(tmp_path / "samples.jsonl")
  rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
  assert [(r["completion"], r["passed"], r["result"]) for r in rows] == [
      ("return 1", True, "passed"),
      ("return 2", False, "failed: AssertionError"),
  ]


def test_load_problems_reads_the_shipped_file(problems):
  assert len(problems) == 164
  assert list(problems)[:2] == ["HumanEval/0", "HumanEval/1"]
  assert problems[TASK]["entry_point"] == "has_close_elements"


def test_load_problems_reads_plain_and_gzipped_jsonl(tmp_path, problems):
  rows = [problems[t] for t in list(problems)[:3]]
  text = "".join(json.dumps(r) + "\n" for r in rows) + "\n"
  (tmp_path / "p.jsonl").write_text(text)
  with gzip.open(tmp_path / "p.jsonl.gz", "wt") as f:
    f.write(text)
  for name in ["p.jsonl", "p.jsonl.gz"]:
    assert humaneval.load_problems(tmp_path / name) == {r["task_id"]: r for r in rows}


def test_load_problems_bad_files_raise_one_value_error_naming_them(tmp_path, problems):
  good = json.dumps(problems[TASK])
  missing_key = json.dumps({k: v for k, v in problems[TASK].items() if k != "test"})
  gz = gzip.compress(("\n".join(json.dumps(p) for p in problems.values())).encode())
  cases = {
      "absent.jsonl": (None, "does not exist"),
      "truncated.jsonl.gz": (gz[: len(gz) // 2], "truncated or corrupt"),
      "not_gzip.jsonl.gz": (b"\x1f\x8bnot really gzip", "truncated or corrupt"),
      "bad_line.jsonl": (
          (good + "\n" + good[:40] + "\n").encode(),
          "bad_line.jsonl:2: invalid JSON",
      ),
      "missing_key.jsonl": (missing_key.encode(), r"line 1: missing or non-string \['test'\]"),
      "list.jsonl": (b"[1, 2]\n", "list.jsonl:1: expected a JSON object"),
      "twice.jsonl": ((good + "\n" + good).encode(), "line 2: duplicate task_id"),
      "empty.jsonl": (b"\n", "holds no problems"),
  }
  for name, (content, message) in cases.items():
    path = tmp_path / name
    if content is not None:
      path.write_bytes(content)
    with pytest.raises(ValueError, match=message) as error:
      humaneval.load_problems(path)
    assert name in str(error.value)


# --- evaluate: arguments ------------------------------------------------------------------------


def test_unknown_task_id_is_an_error_before_anything_runs(tmp_path, problems):
  ran = tmp_path / "ran"
  completion = f"    pass\nopen({str(ran)!r}, 'w').close()\n"
  samples = [{"task_id": TASK, "completion": completion}, {"task_id": "HumanEval/999"}]
  samples[1]["completion"] = "    pass\n"
  with pytest.raises(ValueError, match="HumanEval/999"):
    humaneval.evaluate(samples, problems)
  assert not ran.exists()
  with pytest.raises(ValueError, match="'task_id' and 'completion'"):
    humaneval.evaluate([{"task_id": TASK}], problems)
  with pytest.raises(ValueError, match="k must be positive"):
    humaneval.evaluate([{"task_id": TASK, "completion": ""}], problems, k=(0,))
  with pytest.raises(ValueError, match="no samples"):
    humaneval.evaluate([], problems)
  with pytest.raises(ValueError, match="timeout must be"):
    humaneval.evaluate([{"task_id": TASK, "completion": ""}], problems, timeout=0)
  with pytest.raises(ValueError, match="lacks the string field"):
    humaneval.evaluate([{"task_id": "t", "completion": ""}], {"t": {"prompt": ""}})


# --- evaluate: correct and wrong programs -------------------------------------------------------


@pytest.mark.slow  # 10 s on 2 idle cores, 20 s on busy ones
def test_all_canonical_solutions_pass(problems):
  samples = [{"task_id": t, "completion": p["canonical_solution"]} for t, p in problems.items()]
  result = humaneval.evaluate(samples, problems, k=(1, 10))
  failed = [(r.task_id, r.result) for r in result.results if not r.passed]
  assert not failed
  assert result.pass_at_k == {"pass@1": 1.0}  # one sample per problem: pass@10 is left out
  assert [r.task_id for r in result.results] == list(problems)


def test_pass_at_k_over_right_and_wrong_samples(problems):
  tasks = list(problems)[:20]
  samples, expected_counts = [], {}
  for i, task in enumerate(tasks):
    n = 2 + i % 2
    c = (i // 2) % (n + 1)  # (samples, correct) per problem: 0/2, 0/3, 1/2, 1/3, 2/2, 2/3, ...
    wrong = "    return None\n" if i % 2 else "    raise ValueError('nope')\n"
    samples += [{"task_id": task, "completion": problems[task]["canonical_solution"]}] * c
    samples += [{"task_id": task, "completion": wrong}] * (n - c)
    expected_counts[task] = (n, c)
  result = humaneval.evaluate(samples, problems, k=(1, 2, 3), progress=False)
  for r in result.results:
    assert r.passed == (r.completion == problems[r.task_id]["canonical_solution"]), r
    if r.completion.startswith("    raise"):
      assert r.result == "failed: ValueError: nope"
  assert result.counts == expected_counts
  assert len({c / n for n, c in expected_counts.values()}) > 3  # a real mixture
  expected = {  # pass@3 is left out: some problems have only 2 samples
      f"pass@{k}": np.mean(
          [1 - math.comb(n - c, k) / math.comb(n, k) for n, c in expected_counts.values()]
      )
      for k in (1, 2)
  }
  assert result.pass_at_k == pytest.approx(expected)
  assert result.pass_at_k.keys() == expected.keys()


def test_exiting_zero_before_check_is_not_a_pass(problems):
  right = problems[TASK]["canonical_solution"]
  samples = [
      {"task_id": TASK, "completion": right},
      {"task_id": TASK, "completion": right + "import sys\nsys.exit(0)\n"},
      {"task_id": TASK, "completion": right + "import os\nos._exit(0)\n"},
      {"task_id": TASK, "completion": "    import os\n    os._exit(0)\n"},  # inside check
      {"task_id": TASK, "completion": right + "import os\nos.fork()\n"},  # the copy passes too
      {"task_id": TASK, "completion": right + "import os\nif os.fork():\n    os._exit(0)\n"},
  ]
  results = humaneval.evaluate(samples, problems, k=(1,)).results
  assert [r.passed for r in results] == [True, False, False, False, True, False]
  assert results[1].result == "failed: SystemExit: 0"
  assert (
      results[2].result == results[3].result == "failed: exited with code 0 before check completed"
  )


def test_the_environment_is_cleared_and_limits_are_set(monkeypatch):
  monkeypatch.setenv("ANLR_HUMANEVAL_SECRET", "do not leak")
  program = """
import os, resource, sys
assert set(os.environ) <= {"PATH", "LANG", "LC_CTYPE"}, sorted(os.environ)
assert sys.flags.isolated == 1 and sys.stdin.read() == ""
assert os.path.basename(os.getcwd()).startswith("anlr-humaneval-")
assert resource.getrlimit(resource.RLIMIT_AS) == (300 * 2**20,) * 2
assert resource.getrlimit(resource.RLIMIT_FSIZE) == (2**20,) * 2
assert resource.getrlimit(resource.RLIMIT_CORE) == (0, 0)
assert resource.getrlimit(resource.RLIMIT_CPU) == (3, 4)
print("x" * 100000)
"""
  outcome = humaneval.run_program(
      program, timeout=1.5, memory_mb=300, file_size_mb=1, max_output_bytes=1000
  )
  assert outcome.result == "passed", outcome.stderr
  assert outcome.stdout.startswith("x" * 500) and "99001 bytes dropped" in outcome.stdout
  assert len(outcome.stdout) < 1100


# --- evaluate: hostile programs -----------------------------------------------------------------


def _hostile(marker, cwd_file):
  """Completions of HumanEval/0 that must all fail without harming the evaluator."""
  mark = _MARK.format(marker=str(marker))
  return {
      "wrong answer": "    return True\n",
      "syntax error": "    return (\n",
      "infinite loop": "    while True:\n        pass\n",
      # 2 GB of address space at once: over the 512 MiB limit at the first allocation, so the
      # verdict does not wait on zero-filling pages (under load that took longer than the timeout)
      "memory bomb": "    x = bytearray(2 * 10**9)\n    while True:\n        x += bytearray(10**7)\n",
      "huge file": (
          f"    open({str(cwd_file)!r}, 'w').write(__import__('os').getcwd())\n"
          "    with open('big', 'wb') as f:\n"
          "        while True:\n"
          "            f.write(b'x' * 2**20)\n"
      ),
      "kill the parent": (
          "    pass\n" + mark + "import signal\n_os.kill(_os.getppid(), signal.SIGKILL)\n"
          "while True:\n    pass\n"
      ),
      "fork bomb": (
          "    pass\nimport os, time\nfor _ in range(5):\n    os.fork()\n"
          + mark
          + "while True:\n    time.sleep(0.05)\n"
      ),
      "stray child": (
          "    pass\nimport subprocess\n_p = subprocess.Popen(['sleep', '60'])\n"
          f"open({str(marker)!r} + '/' + str(_p.pid), 'w').write("
          "open(f'/proc/{_p.pid}/stat').read().rsplit(')', 1)[1].split()[19])\n"
          "import os\nos._exit(0)\n"
      ),
      "kill the group": "    pass\nimport os, signal\nos.killpg(0, signal.SIGKILL)\n",
  }


def test_hostile_programs_fail_and_leave_nothing_behind(tmp_path, problems):
  marker = tmp_path / "pids"
  marker.mkdir()
  cwd_file = tmp_path / "cwd"
  hostile = _hostile(marker, cwd_file)
  samples = [{"task_id": TASK, "completion": c} for c in hostile.values()]
  start = time.monotonic()
  result = humaneval.evaluate(
      samples, problems, k=(1,), timeout=3.0, memory_mb=512, file_size_mb=1, workers=3
  )
  assert time.monotonic() - start < 20
  by_name = dict(zip(hostile, result.results))
  for name, r in by_name.items():
    assert not r.passed, (name, r)
  assert result.pass_at_k == {"pass@1": 0.0}

  assert by_name["wrong answer"].result == "failed: AssertionError"
  assert by_name["syntax error"].result.startswith("failed: SyntaxError")
  assert by_name["infinite loop"].result == "timed out"
  assert by_name["memory bomb"].result == "memory limit"
  assert "File too large" in by_name["huge file"].result
  assert "launcher died (signal SIGKILL)" in by_name["kill the parent"].result
  assert by_name["fork bomb"].result == "timed out"
  assert by_name["stray child"].result == "failed: exited with code 0 before check completed"
  assert by_name["kill the group"].result.startswith("failed: the launcher died")

  workdir = cwd_file.read_text()
  assert os.path.basename(workdir).startswith("anlr-humaneval-")
  assert not os.path.exists(workdir)  # the working directory (and its 1 MiB file) is gone

  recorded = os.listdir(marker)
  assert len(recorded) == 1 + 32 + 1  # kill the parent, fork bomb (2**5), stray child
  assert _wait_all_dead(marker) == []
