"""The embedded worlds the demos and tests train in, offline on a CPU: `shapes` (a GenEval-style world of coloured
shapes with exact detector rewards, editing and motion tasks, and the tiny SD3 pre-trained on it), `arith` (two-digit
additions for a character-level GPT-2) and `toy` (a tabular token policy, GRPO in seconds)."""
