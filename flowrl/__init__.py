"""flowrl: GRPO for image generators and text LLMs on one RL core."""
__version__ = "0.1.0"
