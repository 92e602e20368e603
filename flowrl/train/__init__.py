"""Training: the trainer (wiring and the epoch loop, `trainer`), the update of an epoch (`update`), the rewards and
advantages (`scoring`), stopping on signals (`signals`) and the optimizer side (`optim`)."""

from .trainer import State, Trainer, progress_postfix, train

__all__ = ["State", "Trainer", "progress_postfix", "train"]
