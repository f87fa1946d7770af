"""The paper's evaluation protocol: generation, answer extraction, accuracy tables."""

from anlr_jax.evals import humaneval
from anlr_jax.evals.evaluate import (
    EvalExample,
    EvalRecord,
    EvalResult,
    default_prompt,
    evaluate,
    load_eval_examples,
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
from anlr_jax.evals.report import accuracy_table, write_accuracy_table

__all__ = [
    "COMMONSENSE_TASKS",
    "TASKS",
    "EvalExample",
    "EvalRecord",
    "EvalResult",
    "Task",
    "accuracy_table",
    "default_prompt",
    "evaluate",
    "extract_choice",
    "extract_number",
    "extract_prediction",
    "get_task",
    "humaneval",
    "is_correct",
    "load_eval_examples",
    "normalize_text",
    "parse_gold",
    "write_accuracy_table",
]
