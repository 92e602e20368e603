"""What each column holds per GPU and whether it fits: the batch a GPU gets, the trained parameters and what the
optimizer keeps of them, the verdict per column, and the Plan made of them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from .models import DTYPE_BYTES, GIB, PlanError
from .report import STRATEGIES, Fit, Plan, RolloutEstimate, Row, UpdateEstimate, usable_gib


def verdicts(static: dict[str, float], transient: dict[str, float], activations: Callable[[int, bool], float],
             micro: int, checkpointing: bool, gpu_memory_gib: float) -> dict[str, Fit]:
    """Each strategy's Fit, from bytes: the peak of a micro-batch of m samples is
    static + max(activations(m, checkpointing), transient)."""
    budget = usable_gib(gpu_memory_gib) * GIB
    fits = {}
    for s in STRATEGIES:
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


def batch_shape(cfg, gpus: int) -> tuple[int, int, int]:
    """(samples per GPU per epoch, minibatch, micro-batch) as the trainer splits them."""
    s, t = cfg.sample, cfg.train
    total = s.prompts_per_epoch * s.group_size
    if total % gpus:
        raise PlanError(f"the epoch batch {total} (sample.prompts_per_epoch x sample.group_size) does not split evenly "
                        f"over {gpus} GPUs: pick a GPU count that divides it")
    local = total // gpus
    minibatch = t.minibatch_size or local
    if local % minibatch:
        raise PlanError(f"train.minibatch_size={minibatch} does not divide the {local} samples per GPU of {gpus} GPUs: "
                        f"pick a GPU count or minibatch size that does")
    return local, minibatch, min(t.micro_batch_size or minibatch, minibatch)



@dataclass(frozen=True)
class Training:
    """What the update trains and keeps besides the model, for `_training_rows`."""

    n_trained: int  # trained parameters
    lora_label: str | None  # "LoRA r32 on 191 layers" (their weights are extra), None: full fine-tuning
    dtype: str  # of the trained parameters and their gradients
    ema: bool
    reference: float | None  # bytes of a frozen reference copy (0: the adapter off), None: no reference pass
    gather: float  # bytes FSDP gathers at once (two blocks)
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


def training_rows(tr: Training, gpus: int) -> list[Row]:
    """The rows of the trained parameters, gradients, AdamW states, EMA, reference and FSDP's gathered blocks
    (bytes per GPU; FSDP shards all but the gathered blocks, offload moves AdamW and the EMA to the CPU)."""
    b = DTYPE_BYTES[tr.dtype]
    sharded = lambda v: {"DDP": v, "FSDP": v / gpus, "offload": v}  # noqa: E731
    in_cpu = lambda v: {"DDP": v, "FSDP": v / gpus, "offload": None}  # noqa: E731
    rows = []
    if tr.lora_label:
        rows.append(Row(f"{tr.lora_label} ({tr.dtype})", tr.n_trained / 1e9, sharded(tr.n_trained * b)))
    rows.append(Row(f"gradients ({tr.dtype})", None, sharded(tr.n_trained * b)))
    if tr.optimizer == "adamw_8bit":
        rows.append(Row("AdamW8bit states (2 x uint8)", None, in_cpu(tr.state_bytes)))
    else:
        rows.append(Row("AdamW states (2 x float32)", None, in_cpu(tr.state_bytes)))
    if tr.master_bytes:
        rows.append(Row("float32 master weights", None, in_cpu(tr.master_bytes)))
    if tr.ema:
        rows.append(Row("EMA of the trained parameters (float32)", None, in_cpu(4 * tr.n_trained)))
    if tr.reference is not None:
        label = "reference: a frozen copy" if tr.reference else "reference: the adapter off (no weights)"
        rows.append(Row(label, None, sharded(tr.reference)))
    rows.append(Row("FSDP: two blocks gathered at once", None, {"DDP": 0.0, "FSDP": tr.gather, "offload": 0.0}))
    return rows


def finish(facts, rows: list[Row], update: UpdateEstimate, rollout: RolloutEstimate, tr: Training, micro: int,
           minibatch: int, local: int, cfg, gpus: int, gpu_memory_gib: float, host_bytes: float, notes: list[str],
           rows_note: str, unit: str = "samples") -> Plan:
    """The Plan from its rows (bytes per GPU) and the update's and rollout's estimates: the verdicts, then
    everything in GiB."""
    t = cfg.train
    static = {k: sum(r.gib[k] or 0.0 for r in rows) for k in STRATEGIES}
    step = tr.state_bytes / 2  # AdamW's foreach step: a temporary the size of a state
    sync = update.grads if gpus > 1 else 0.0  # DDP's gradient buckets: a copy of the gradients
    transient = {"DDP": max(step, sync), "FSDP": step / gpus, "offload": sync}
    update = dataclasses.replace(update, transient=transient["DDP"])
    fits = verdicts(static, transient, update.activation_peak, micro, t.gradient_checkpointing, gpu_memory_gib)
    per_sample = {False: update.rows_per_sample * update.activations.plain,
                  True: update.rows_per_sample * update.activations.checkpointed}
    for r in rows:
        r.gib = {k: (None if v is None else v / GIB) for k, v in r.gib.items()}
    activation_rows = [
        Row("activations / sample, no checkpointing", None, {k: per_sample[False] / GIB for k in STRATEGIES},
            rows_note),
        Row("activations / sample, checkpointing", None, {k: per_sample[True] / GIB for k in STRATEGIES}),
    ]
    if update.vocab:
        activation_rows.append(Row("log-prob row chunks (float32, at most)", None,
                                   {k: update.chunk_bytes(10**9) / GIB for k in STRATEGIES}))
    budget = usable_gib(gpu_memory_gib) * GIB
    rollout_fits = {}
    for k in STRATEGIES:  # the largest number of items per call that fits, up to the whole per-GPU batch
        fitting = [n for n in range(1, local + 1) if static[k] + rollout.peak(n, k) <= budget]
        at_config = static[k] + rollout.peak(rollout.items, k)
        rollout_fits[k] = (at_config / GIB, at_config <= budget, max(fitting, default=0))
    return Plan(facts, rows, activation_rows, fits, micro, minibatch, t.gradient_checkpointing, gpus,
                gpu_memory_gib, host_bytes / GIB, update, rollout, rollout_fits, notes, unit)
