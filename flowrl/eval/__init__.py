"""The held-out eval: one evaluator for `flowrl train` and `flowrl eval` (`evaluator`), what it samples and how its
scores are summed up (`summary`), and the diversity metrics against the base model's eval (`diversity`)."""

from .evaluator import EvalBaseError, Evaluator, base_for_eval, build_feature_encoder, merge_eval_shares
from .summary import eval_plan, eval_summary, group_prompt_counts, grouped_means

__all__ = [
    "EvalBaseError",
    "Evaluator",
    "base_for_eval",
    "build_feature_encoder",
    "eval_plan",
    "eval_summary",
    "group_prompt_counts",
    "grouped_means",
    "merge_eval_shares",
]
