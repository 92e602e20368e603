"""flowrl: GRPO for image generators and text LLMs on one RL core."""

import logging as _logging

__version__ = "0.1.0"

# bitsandbytes (flowrl[bnb], imported by peft and diffusers when installed) warns on every import that its
# optional 4-bit CPU inference kernel is missing; flowrl uses only its 8-bit optimizer, which does not need it
_logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(_logging.ERROR)
