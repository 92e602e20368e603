"""The prompts each epoch samples, and (`data.skip_no_signal`) the prompts left out of the draws for a while
because their last groups carried no signal.

A group whose samples all scored alike (every reward the same on each of its samples: all correct, or all wrong)
gives the update nothing to learn from: a relative advantage of 0 everywhere, no preference pair. Drawing such
a prompt again soon mostly spends a rollout. With `data.skip_no_signal: N`, a prompt whose last N groups had no
signal is not drawn for `data.skip_epochs` epochs (0: for the rest of the run); the draws walk on to the next
prompt of the same order, so the draws of the others are unchanged in kind (with `data.balance_by`, a value of
the column whose prompts are all left out leaves the rounds until one comes back).

The draws stay a function of the run's seed and its history: a resumed run (its checkpoint keeps the walk's
position, the counts and the draws of epochs not yet scored) draws what the uninterrupted run drew, and
`rollout.async`, which asks for epoch k+1's prompts before epoch k is scored, sees one epoch less of history.
With `data.skip_no_signal: 0` the draws are `PromptSet.draw`'s, bit for bit.
"""

from __future__ import annotations

import warnings

import torch

from flowrl.data import PromptSet, round_order, value_member

NEVER = -1  # skipped until this epoch: never again (data.skip_epochs = 0)


def groups_with_signal(scores: torch.Tensor, group_ids: torch.Tensor, n_groups: int) -> list[bool]:
    """Whether each of the `n_groups` groups can teach anything: some reward differs between two of its samples.

    scores: [N, K] per-reward scores of the epoch's samples (NaN: the reward does not apply to that sample, and
        is not compared); group_ids: [N] each sample's group, in [0, n_groups).
    A group with fewer than two scored samples has no signal."""
    signal = [False] * n_groups
    for g in range(n_groups):
        rows = scores[group_ids == g].double()
        for k in range(rows.shape[1] if rows.ndim == 2 else 0):
            col = rows[:, k][torch.isfinite(rows[:, k])]
            if col.numel() >= 2 and bool(col.max() > col.min()):
                signal[g] = True
                break
    return signal


class PromptDraws:
    """Epoch `e`'s prompts (`draw`), and what their groups showed (`observe`), for `data.skip_no_signal`.

    skip_after: N, the groups in a row without signal after which a prompt is left out (0 = never: the draws are
        `PromptSet.draw`'s); skip_epochs: for how many epochs (0 = the rest of the run)."""

    def __init__(
        self,
        prompts: PromptSet,
        per_epoch: int,
        seed: int,
        balance_by: str = "",
        skip_after: int = 0,
        skip_epochs: int = 0,
    ):
        self.prompts, self.per_epoch, self.seed, self.balance_by = prompts, per_epoch, seed, balance_by
        self.skip_after, self.skip_epochs = skip_after, skip_epochs
        self.position: int | None = None  # draws (balanced: value visits) made so far; None = not started
        self.counts: list[int] = []  # balanced: each value's draws so far
        self.streak: dict[int, int] = {}  # prompt -> its groups in a row without signal
        self.skipped: dict[int, int] = {}  # prompt -> the epoch from which it is drawn again (NEVER)
        self.pending: dict[int, list[int]] = {}  # epoch -> the prompts drawn for it, until it is observed
        self.readmitted = 0  # times every prompt was left out, so all were drawn again

    def draw(self, epoch: int) -> tuple[list[str], list[dict]]:
        """Epoch `epoch`'s `per_epoch` prompts and their metadata; asked again before the epoch is observed, the
        same ones."""
        if not self.skip_after:
            return self.prompts.draw(self.per_epoch, epoch, self.seed, self.balance_by)
        if epoch not in self.pending:
            self.pending[epoch] = self._walk(epoch)
        return self.prompts.pick(self.pending[epoch])

    def observe(self, epoch: int, signal: list[bool]) -> dict[str, float]:
        """Epoch `epoch`'s groups (one per drawn prompt, in draw order): which had a signal. Returns the metrics
        `data/prompts_skipped` (left out now) and `data/groups_without_signal` (this epoch's fraction)."""
        metrics = {"data/groups_without_signal": 1.0 - sum(signal) / max(1, len(signal))}
        if not self.skip_after:
            return metrics
        idx = self.pending.pop(epoch, None)
        if idx is None or len(idx) != len(signal):
            raise RuntimeError(f"epoch {epoch}: {len(signal)} groups observed, but its draw is {idx}")
        for i, has_signal in zip(idx, signal):
            if has_signal:
                self.streak.pop(i, None)
                continue
            self.streak[i] = self.streak.get(i, 0) + 1
            if self.streak[i] >= self.skip_after:
                self.streak.pop(i)
                self.skipped[i] = epoch + 1 + self.skip_epochs if self.skip_epochs else NEVER
        metrics["data/prompts_skipped"] = float(sum(self._left_out(i, epoch + 1) for i in self.skipped))
        return metrics

    def _left_out(self, i: int, epoch: int) -> bool:
        until = self.skipped.get(i)
        return until is not None and (until == NEVER or until > epoch)

    def _walk(self, epoch: int) -> list[int]:
        n_values = len(self.prompts.strata(self.balance_by)) if self.balance_by else 0
        if self.position is None:  # a fresh run, or one resumed without this state: where the plain draws are
            self.position = epoch * self.per_epoch
            if n_values:
                rnd, pos = divmod(self.position, n_values)
                before = set(round_order(self.seed, rnd, n_values)[:pos])
                self.counts = [rnd + (v in before) for v in range(n_values)]
        for i in [i for i in self.skipped if not self._left_out(i, epoch)]:
            del self.skipped[i]
        if all(self._left_out(i, epoch) for i in range(len(self.prompts))):
            self.skipped.clear()
            self.readmitted += 1
            warnings.warn(
                f"epoch {epoch + 1}: every training prompt had {self.skip_after} groups in a row without signal (all "
                "samples scored alike), so all are drawn again; lower data.skip_no_signal, or check the reward",
                stacklevel=3,
            )
        return self._balanced(epoch, n_values) if n_values else self._plain(epoch)

    def _plain(self, epoch: int) -> list[int]:
        idx: list[int] = []
        while len(idx) < self.per_epoch:
            i = self.prompts.walk(self.seed, self.position)
            self.position += 1
            if not self._left_out(i, epoch):
                idx.append(i)
        return idx

    def _balanced(self, epoch: int, n_values: int) -> list[int]:
        groups = self.prompts.strata(self.balance_by)
        idx: list[int] = []
        while len(idx) < self.per_epoch:
            rnd, pos = divmod(self.position, n_values)
            value = round_order(self.seed, rnd, n_values)[pos]
            self.position += 1
            members = groups[value]
            if all(self._left_out(i, epoch) for i in members):
                continue  # the value sits this round out
            while True:
                i = value_member(self.seed, value, members, self.counts[value])
                self.counts[value] += 1
                if not self._left_out(i, epoch):
                    break
            idx.append(i)
        return idx

    def state_dict(self) -> dict:
        """What a checkpoint keeps (JSON: string keys)."""
        return {
            "position": self.position,
            "counts": list(self.counts),
            "streak": {str(i): n for i, n in self.streak.items()},
            "skipped": {str(i): e for i, e in self.skipped.items()},
            "pending": {str(e): list(idx) for e, idx in self.pending.items()},
            "readmitted": self.readmitted,
        }

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint's state; one that names prompts this set does not have (the prompt file changed since) is
        not used, with a warning: the draws start over where the plain draws are."""
        named = [int(i) for i in (*state["streak"], *state["skipped"])]
        named += [i for idx in state["pending"].values() for i in idx]
        if any(not 0 <= i < len(self.prompts) for i in named):
            warnings.warn(
                f"the checkpoint's prompt draws name prompts beyond the {len(self.prompts)} of data.train_prompts (the "
                "file changed since): data.skip_no_signal's history starts over",
                stacklevel=2,
            )
            return
        self.position = state["position"]
        self.counts = list(state["counts"])
        self.streak = {int(i): n for i, n in state["streak"].items()}
        self.skipped = {int(i): e for i, e in state["skipped"].items()}
        self.pending = {int(e): list(idx) for e, idx in state["pending"].items()}
        self.readmitted = state.get("readmitted", 0)
