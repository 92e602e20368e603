"""A run's files: its directory (claimed, never mixed with another run's), its checkpoints (written atomically, read
back by one loader for resume, eval and sample), its metrics log and its report (curves, before/after)."""
