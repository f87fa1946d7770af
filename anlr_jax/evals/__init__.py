"""The paper's evaluation protocol: generation then answer extraction (``generative``), log-likelihood
ranking of choices (``loglik``), code execution (``code``, ``humaneval``), accuracy tables
(``accuracy``), MT-Bench answers and judge (``mtbench``, ``judge``) and the visual benchmarks'
scorers (``visual``, a package: normalisation, files, scorers, command line)."""

from anlr_jax.evals import humaneval
from anlr_jax.evals.code import CodeEvalResult, evaluate_code, load_code_problems
from anlr_jax.evals.generative import (
    EvalExample,
    EvalRecord,
    EvalResult,
    default_prompt,
    evaluate,
    load_eval_examples,
    template_prompt_fn,
)
from anlr_jax.evals.extract import (
    COMMONSENSE_TASKS,
    TASKS,
    Task,
    extract_choice,
    extract_number,
    extract_prediction,
    get_task,
    is_correct,
    normalize_text,
    parse_gold,
)
from anlr_jax.evals.accuracy import accuracy_table, write_accuracy_table
from anlr_jax.evals import visual
from anlr_jax.evals.visual import VisualScore, read_predictions

__all__ = [
    "COMMONSENSE_TASKS",
    "TASKS",
    "CodeEvalResult",
    "EvalExample",
    "EvalRecord",
    "EvalResult",
    "Task",
    "accuracy_table",
    "default_prompt",
    "evaluate",
    "evaluate_code",
    "extract_choice",
    "extract_number",
    "extract_prediction",
    "get_task",
    "humaneval",
    "is_correct",
    "load_code_problems",
    "load_eval_examples",
    "normalize_text",
    "parse_gold",
    "template_prompt_fn",
    "visual",
    "VisualScore",
    "read_predictions",
    "write_accuracy_table",
]
