"""What a plan says: its rows (GiB per GPU under each column), each column's verdict, the update's and the rollout's
estimates, and the table `flowrl plan` prints."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .activations import Activations, ActivationTerms
from .columns import Column
from .declarations import Calibration
from .models import GIB

#: kept free on every GPU: the CUDA context and kernel workspaces (RESERVE_GIB) and allocator fragmentation
#: (RESERVE_FRACTION of the memory)
RESERVE_GIB = 1.0
RESERVE_FRACTION = 0.05


@dataclass
class Row:
    """One line of the plan: GiB per GPU under each strategy (None: not on the GPU under it)."""

    label: str
    params_b: float | None  # billions of parameters, where it is a model
    gib: dict[str, float | None]
    note: str = ""
    update_only: bool = False  # held by the update's backward pass only, not while the rollout runs


@dataclass
class Fit:
    """One strategy's verdict. static: everything but the activations (GiB per GPU); per_sample: the activations
    of one micro-batch sample, without and with checkpointing; largest: the largest micro-batch that fits,
    without and with checkpointing (0: none); configured: the total at the config's micro-batch and
    checkpointing."""

    static_gib: float
    transient_gib: float
    per_sample_gib: dict[bool, float]
    largest: dict[bool, int]
    configured_gib: float
    fits: bool


@dataclass(frozen=True)
class UpdateEstimate:
    """The pieces of the update's estimate (bytes), for checking it against a measurement: the model rows per
    micro-batch sample, the activation terms of one row and their bytes (with the factors of `calibration`), the
    gradients, and the transient after the backward pass (DDP)."""

    class_name: str
    calibration: Calibration
    dtype: str
    rows_per_sample: int
    terms: ActivationTerms
    activations: Activations
    grads: float
    transient: float  # DDP's
    head_units: int = 0  # a causal LM: tokens x vocabulary of its output head
    vocab: int = 0  # a causal LM: its vocabulary, and the completion tokens of a sample
    completion_tokens: int = 0

    def chunk_units(self, micro_batch: int) -> int:
        """A causal LM's log-prob row chunks: float32 elements of one [rows, vocabulary] buffer (flowrl.core's
        token_log_probs works in chunks of at most CHUNK_FLOATS elements)."""
        if not self.vocab:
            return 0
        from flowrl.core.logprobs import CHUNK_FLOATS

        return self.vocab * min(micro_batch * self.completion_tokens, max(1, CHUNK_FLOATS // self.vocab))

    def chunk_bytes(self, micro_batch: int) -> float:
        return self.calibration.chunk * 4 * self.chunk_units(micro_batch)

    def activation_peak(self, micro_batch: int, checkpointing: bool) -> float:
        """The activations of a micro-batch at their peak (bytes); a causal LM's log-prob chunks come with its
        head."""
        a, rows, chunk = self.activations, micro_batch * self.rows_per_sample, self.chunk_bytes(micro_batch)
        plain = rows * a.plain + chunk
        if not checkpointing:
            return plain
        return min(plain, rows * a.kept + max(rows * a.recompute, rows * a.head + chunk))

    def dynamic(self, micro_batch: int, checkpointing: bool) -> float:
        """What the update allocates on top of the static memory: the gradients and the activations of a
        micro-batch (or the transient after the backward pass, if larger)."""
        return self.grads + max(self.activation_peak(micro_batch, checkpointing), self.transient)


@dataclass(frozen=True)
class RolloutEstimate:
    """The rollout's peak on top of the static memory: `items` images (completions) per call, and per phase
    (bytes per item, whether offload moves it off the GPU); the phases run one after another. `chunk(n)`: a
    causal LM's log-prob row chunks for n completions, in the old log-probs' phase."""

    items: int
    phases: dict[str, tuple[float, bool]]
    chunk: Callable[[int], float] = lambda n: 0.0

    def peak(self, items: int, offload: bool = False) -> float:
        """The peak of a call of `items` (bytes): its largest phase, but those the offload lever (`offload`) moves off
        the GPU."""
        return max(
            (
                items * per + (self.chunk(items) if name == LOGITS_PHASE else 0.0)
                for name, (per, offloaded) in self.phases.items()
                if not (offloaded and offload)
            ),
            default=0.0,
        )


LOGITS_PHASE = "old log-probs (logits)"


@dataclass
class Plan:
    """What `plan` found: the header facts, the memory rows, each column's verdict (keyed by its title), notes, and
    the columns (the distributed strategies' and offload)."""

    facts: list[tuple[str, str]]
    rows: list[Row]
    activation_rows: list[Row]
    fits: dict[str, Fit]
    micro_batch: int
    minibatch: int
    checkpointing: bool
    gpus: int
    gpu_memory_gib: float
    host_gib: float  # CPU memory the offload column needs per GPU process
    update: UpdateEstimate
    rollout: RolloutEstimate
    rollout_fits: dict[str, tuple[float, bool, int]]  # column -> (GiB at the config, fits, largest items per call)
    notes: list[str] = field(default_factory=list)
    unit: str = "samples"  # what micro_batch and minibatch count: DPO's micro-batches count pairs
    columns: list[Column] = field(default_factory=list)

    @property
    def titles(self) -> list[str]:
        """The columns' titles, in the table's order: the keys of `fits` and `rollout_fits`."""
        return [c.title for c in self.columns]

    @property
    def refused(self) -> dict[str, str]:
        """Column -> what in the config its strategy cannot train, for the columns that refuse it."""
        return {c.title: c.problem for c in self.columns if c.problem}

    def fits_as_configured(self, column: str) -> bool:
        """The config as it is, its update and its rollout, fits under `column`, whose strategy trains it."""
        return column not in self.refused and self.fits[column].fits and self.rollout_fits[column][1]

    @property
    def usable_gib(self) -> float:
        return usable_gib(self.gpu_memory_gib)

    def render(self) -> str:
        """The plan as a text table (every memory figure in GiB per GPU; estimates, not measurements)."""
        width = max(44, *(len(r.label) + 2 for r in self.rows + self.activation_rows))
        titles, refused = self.titles, self.refused
        out = ["flowrl plan: ESTIMATES (models built without weights; nothing was measured on a GPU)"]
        out += [f"{k:<9}{v}" for k, v in self.facts]
        out.append("")
        head = f"{'GiB per GPU':<{width}}{'params':>9}" + "".join(f"{s:>10}" for s in titles)
        out += [head, "-" * len(head)]

        def line(row: Row) -> str:
            params = (
                ""
                if row.params_b is None
                else f"{row.params_b:.2f} B"
                if row.params_b >= 0.01 or not row.params_b
                else f"{row.params_b * 1e3:.2f} M"
            )
            cells = "".join(f"{'-' if row.gib[s] is None else _gib(row.gib[s]):>10}" for s in titles)
            return f"{row.label:<{width}}{params:>9}{cells}" + (f"   {row.note}" if row.note else "")

        out += [line(r) for r in self.rows]
        out.append("-" * len(head))
        out.append(
            f"{'all but the activations':<{width}}{'':>9}"
            + "".join(f"{_gib(self.fits[s].static_gib):>10}" for s in titles)
        )
        out += [line(r) for r in self.activation_rows]
        ckpt = "checkpointing" if self.checkpointing else "no checkpointing"
        out.append(
            f"{f'at micro-batch {self.micro_batch}, {ckpt} (the config)':<{width}}{'':>9}"
            + "".join(f"{_gib(self.fits[s].configured_gib):>10}" for s in titles)
        )
        out.append(
            f"{'  fits in ' + _gib(self.usable_gib) + ' GiB usable?':<{width}}{'':>9}"
            + "".join(f"{_verdict(self.fits[s].fits, s in refused):>10}" for s in titles)
        )
        for ck in (False, True):
            label = "largest micro-batch, " + ("checkpointing" if ck else "no checkpointing")
            cells = [self.fits[s].largest[ck] for s in titles]
            cells = [f"all {self.minibatch}" if n >= self.minibatch else str(n) for n in cells]
            out.append(f"{label:<{width}}{'':>9}" + "".join(f"{c:>10}" for c in cells))
        out.append("-" * len(head))
        what = "images" if "denoiser" in self.rollout.phases else "completions"
        for name, (per, offloaded) in self.rollout.phases.items():
            out.append(
                line(
                    Row(
                        f"rollout, per {what[:-1]}: {name}",
                        None,
                        {c.title: (None if offloaded and c.offload else per / GIB) for c in self.columns},
                    )
                )
            )
        out.append(
            f"{f'rollout of {self.rollout.items} {what} per call':<{width}}{'':>9}"
            + "".join(f"{_gib(self.rollout_fits[s][0]):>10}" for s in titles)
        )
        out.append(
            f"{'  fits?':<{width}}{'':>9}"
            + "".join(f"{_verdict(self.rollout_fits[s][1], s in refused):>10}" for s in titles)
        )
        label = "largest sample.rollout_batch_size" if what == "images" else "largest completions per GPU"
        out.append(f"{label:<{width}}{'':>9}" + "".join(f"{self.rollout_fits[s][2]:>10}" for s in titles))
        out.append("")
        out.append(
            f"usable = {self.gpu_memory_gib:g} GiB x {1 - RESERVE_FRACTION:g} - {RESERVE_GIB:g} GiB (CUDA "
            f"context, workspaces, fragmentation). A micro-batch is at most the minibatch "
            f"({self.minibatch} {self.unit} per GPU). offload keeps {_gib(self.host_gib)} GiB in CPU memory per "
            f"GPU process."
        )
        out += [f"note: {n}" for n in self.notes]
        return "\n".join(out)


def _verdict(fits: bool, refused: bool) -> str:
    """A column's answer to "fits?": "refused" when its strategy cannot train the config at all."""
    return "refused" if refused else "yes" if fits else "NO"


def _gib(gib: float) -> str:
    return f"{gib:.2f}" if gib >= 0.005 or gib == 0 else "<0.01"


def usable_gib(gpu_memory_gib: float) -> float:
    """What the plan lets the run use of a GPU of `gpu_memory_gib`."""
    return gpu_memory_gib * (1 - RESERVE_FRACTION) - RESERVE_GIB
