"""What each column holds per GPU and whether it fits: the batch a GPU gets, the trained parameters and what the
optimizer keeps of them, the verdict per column, and the Plan made of them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from .columns import Column, replicated, spread
from .models import DTYPE_BYTES, GIB, PlanError
from .report import Fit, Plan, RolloutEstimate, Row, UpdateEstimate, usable_gib


def verdicts(
    cols: list[Column],
    static: dict[str, float],
    transient: dict[str, float],
    activations: Callable[[int, bool], float],
    micro: int,
    checkpointing: bool,
    gpu_memory_gib: float,
) -> dict[str, Fit]:
    """Each column's Fit, from bytes: the peak of a micro-batch of m samples is
    static + max(activations(m, checkpointing), transient)."""
    budget = usable_gib(gpu_memory_gib) * GIB
    fits = {}
    for s in (c.title for c in cols):

        def peak(m: int, ck: bool) -> float:
            return static[s] + max(activations(m, ck), transient[s])

        largest = {}
        for ck in (False, True):
            lo, hi = 0, 1
            while hi <= 2**24 and peak(hi, ck) <= budget:
                lo, hi = hi, hi * 2
            while hi - lo > 1:  # lo fits (or is 0), hi does not
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if peak(mid, ck) <= budget else (lo, mid)
            largest[ck] = lo
        configured = peak(micro, checkpointing)
        per_sample = {ck: activations(1, ck) / GIB for ck in (False, True)}
        fits[s] = Fit(static[s] / GIB, transient[s] / GIB, per_sample, largest, configured / GIB, configured <= budget)
    return fits


def transients(cols: list[Column], tr: Training, grads: float, gpus: int) -> dict[str, float]:
    """What each column allocates after the backward pass, on top of the gradients (bytes): AdamW's foreach step, a
    temporary the size of a state (a GPU's share where the states are sharded; on the CPU under offload), or the
    gradient all-reduce's copy of the gradients (DDP's buckets, with more than one process), the larger."""
    step = tr.state_bytes / 2
    out = {}
    for c in cols:
        on_gpu = 0.0 if c.offload else step / gpus if "optimizer" in c.shards else step
        sync = grads if c.terms.gradient_copy and gpus > 1 else 0.0
        out[c.title] = max(on_gpu, sync)
    return out


def batch_shape(cfg, gpus: int) -> tuple[int, int, int]:
    """(samples per GPU per epoch, minibatch, micro-batch) as the trainer splits them."""
    s, t = cfg.sample, cfg.train
    total = s.prompts_per_epoch * s.group_size
    if total % gpus:
        raise PlanError(
            f"the epoch batch {total} (sample.prompts_per_epoch x sample.group_size) does not split evenly "
            f"over {gpus} GPUs: pick a GPU count that divides it"
        )
    local = total // gpus
    minibatch = t.minibatch_size or local
    if local % minibatch:
        raise PlanError(
            f"train.minibatch_size={minibatch} does not divide the {local} samples per GPU of {gpus} GPUs: "
            f"pick a GPU count or minibatch size that does"
        )
    return local, minibatch, min(t.micro_batch_size or minibatch, minibatch)


@dataclass(frozen=True)
class Training:
    """What the update trains and keeps besides the model, for `training_rows`."""

    n_trained: int  # trained parameters
    lora_label: str | None  # "LoRA r32 on 191 layers" (their weights are extra), None: full fine-tuning
    dtype: str  # of the trained parameters and their gradients
    ema: bool
    reference: float | None  # bytes of a frozen reference copy (0: the adapter off), None: no reference pass
    block: float  # bytes of the largest checkpointed block (what a sharding strategy gathers whole)
    optimizer: str = "adamw"  # train.optimizer

    @property
    def state_bytes(self) -> float:
        """The optimizer's two states per trained parameter: float32 (AdamW) or 8-bit (AdamW8bit)."""
        return (2 if self.optimizer == "adamw_8bit" else 8) * self.n_trained

    @property
    def master_bytes(self) -> float:
        """float32 master copies of trained weights that are not float32 (flowrl steps those in float32)."""
        return 0.0 if self.dtype == "float32" else 4 * self.n_trained

    def host_bytes(self) -> float:
        """What the offload strategy keeps in CPU memory for the update: the optimizer's states, float32 master
        weights of every trained parameter (the CPU step works on them), the EMA."""
        return self.state_bytes + 4 * self.n_trained + (4 * self.n_trained if self.ema else 0)


#: how a row names the blocks a strategy gathers at once
COUNTS = {1: "one block", 2: "two blocks", 3: "three blocks"}


def training_rows(tr: Training, cols: list[Column], gpus: int) -> list[Row]:
    """The rows of the trained parameters, gradients, AdamW states, EMA, reference (bytes per GPU, a GPU's share of
    what each column shards; offload moves AdamW, the master weights and the EMA to the CPU), then each strategy's own:
    the blocks it gathers whole, the buffers it keeps."""
    b = DTYPE_BYTES[tr.dtype]
    rows = []
    if tr.lora_label:
        rows.append(
            Row(f"{tr.lora_label} ({tr.dtype})", tr.n_trained / 1e9, spread(cols, tr.n_trained * b, gpus, "weights"))
        )
    rows.append(Row(f"gradients ({tr.dtype})", None, spread(cols, tr.n_trained * b, gpus, "gradients")))
    states = "AdamW8bit states (2 x uint8)" if tr.optimizer == "adamw_8bit" else "AdamW states (2 x float32)"
    rows.append(Row(states, None, spread(cols, tr.state_bytes, gpus, "optimizer", offloaded=True)))
    if tr.master_bytes:
        rows.append(Row("float32 master weights", None, spread(cols, tr.master_bytes, gpus, "optimizer", True)))
    if tr.ema:
        rows.append(
            Row(
                "EMA of the trained parameters (float32)",
                None,
                spread(cols, 4 * tr.n_trained, gpus, "weights", offloaded=True),
            )
        )
    if tr.reference is not None:
        label = "reference: a frozen copy" if tr.reference else "reference: the adapter off (no weights)"
        rows.append(Row(label, None, spread(cols, tr.reference, gpus, "weights")))
    for c in cols:
        if c.base:  # offload: the rows of the column it is built on are its own too
            continue
        own = [(label, nbytes, False) for label, nbytes in c.terms.kept]
        own += [(label, nbytes, True) for label, nbytes in c.terms.backward]
        if c.terms.gathered_blocks:
            n = c.terms.gathered_blocks
            own.insert(0, (f"{c.title}: {COUNTS.get(n, f'{n} blocks')} gathered at once", n * tr.block, False))
        rows += [
            Row(
                label,
                None,
                {k.title: nbytes if c.title in (k.title, k.base) else 0.0 for k in cols},
                update_only=backward,
            )
            for label, nbytes, backward in own
        ]
    return rows


def finish(
    facts,
    rows: list[Row],
    update: UpdateEstimate,
    rollout: RolloutEstimate,
    tr: Training,
    cols: list[Column],
    micro: int,
    minibatch: int,
    local: int,
    cfg,
    gpus: int,
    gpu_memory_gib: float,
    host_bytes: float,
    notes: list[str],
    rows_note: str,
    unit: str = "samples",
) -> Plan:
    """The Plan from its rows (bytes per GPU) and the update's and rollout's estimates: the verdicts, then
    everything in GiB; the columns' notes and what they refuse after the others."""
    t = cfg.train
    titles = [c.title for c in cols]
    static = {k: sum(r.gib[k] or 0.0 for r in rows) for k in titles}
    rollout_static = {k: sum(r.gib[k] or 0.0 for r in rows if not r.update_only) for k in titles}
    transient = transients(cols, tr, update.grads, gpus)
    update = dataclasses.replace(update, transient=transient[replicated(cols).title])
    fits = verdicts(cols, static, transient, update.activation_peak, micro, t.gradient_checkpointing, gpu_memory_gib)
    per_sample = {
        False: update.rows_per_sample * update.activations.plain,
        True: update.rows_per_sample * update.activations.checkpointed,
    }
    for r in rows:
        r.gib = {k: (None if v is None else v / GIB) for k, v in r.gib.items()}
    activation_rows = [
        Row("activations / sample, no checkpointing", None, dict.fromkeys(titles, per_sample[False] / GIB), rows_note),
        Row("activations / sample, checkpointing", None, dict.fromkeys(titles, per_sample[True] / GIB)),
    ]
    if update.vocab:
        activation_rows.append(
            Row("log-prob row chunks (float32, at most)", None, {k: update.chunk_bytes(10**9) / GIB for k in titles})
        )
    budget = usable_gib(gpu_memory_gib) * GIB
    rollout_fits = {}
    for c in cols:  # the largest number of items per call that fits, up to the whole per-GPU batch
        k = c.title
        fitting = [n for n in range(1, local + 1) if rollout_static[k] + rollout.peak(n, c.offload) <= budget]
        at_config = rollout_static[k] + rollout.peak(rollout.items, c.offload)
        rollout_fits[k] = (at_config / GIB, at_config <= budget, max(fitting, default=0))
    notes = notes + [c.note for c in cols if c.note]
    notes += [f"{c.title} refuses this config: {c.problem}" for c in cols if c.problem]
    return Plan(
        facts,
        rows,
        activation_rows,
        fits,
        micro,
        minibatch,
        t.gradient_checkpointing,
        gpus,
        gpu_memory_gib,
        host_bytes / GIB,
        update,
        rollout,
        rollout_fits,
        notes,
        unit,
        cols,
    )
