"""The planner asks the registries instead of keeping tables of their names. Every model family declares how the
planner reads its denoiser (`plan_layout`) and its activation factors (`plan_calibration`), in its own class body or
shared, by inheritance or by name, with a family of the same denoiser class; every distributed strategy declares what
it shards and its column (`shards`, `plan_column`). An entry that declares nothing, or a family subclass that would
inherit another denoiser class's layout, fails here. (Every objective's memory terms: tests/test_objective_modules.py;
every reward's memory: tests/test_rewards_memory.py.)"""

import pytest

from flowrl.config import load_config
from flowrl.dist import STRATEGIES, Strategy, strategy_names
from flowrl.families import ImageBackend, family, family_names
from flowrl.plan import (
    GIB,
    Calibration,
    Layout,
    PlanError,
    activation_terms,
    denoiser_layers,
    pipeline_components,
    plan,
)
from flowrl.plan.declarations import SHARDABLE

TINY = ["sample.height=32", "sample.width=32", "sample.max_sequence_length=16"]


def undeclared_families(classes) -> list[str]:
    """What each family class fails to declare for the planner: a `plan_layout` (a Layout) and a `plan_calibration`
    (a Calibration saying where its factors come from), set in its own class body, or inherited only from a
    registered family of the same `denoiser_class` (flux_kontext from flux, sdxl from sd15, ...)."""
    registered = {family(n) for n in family_names()}
    problems = []
    for cls in classes:
        for attr, kind in (("plan_layout", Layout), ("plan_calibration", Calibration)):
            owner = next((c for c in cls.__mro__ if attr in vars(c)), None)
            if owner is None:
                problems.append(f"{cls.family}: no {attr}")
            elif owner is not cls and (owner not in registered or owner.denoiser_class != cls.denoiser_class):
                problems.append(
                    f"{cls.family}: {attr} inherited from {owner.__name__}, whose denoiser class "
                    f"{owner.denoiser_class} is not its {cls.denoiser_class}"
                )
            elif not isinstance(getattr(cls, attr), kind):
                problems.append(f"{cls.family}: {attr} is not a {kind.__name__}")
        cal = getattr(cls, "plan_calibration", None)
        if isinstance(cal, Calibration) and not cal.calibrated and not cal.measured.startswith("not "):
            problems.append(f"{cls.family}: its calibration was not measured and its `measured` does not say so")
    return problems


def test_every_family_declares_its_layout_and_calibration():
    assert len(family_names()) >= 12
    assert undeclared_families([family(n) for n in family_names()]) == []
    for attr in ("plan_layout", "plan_calibration"):  # no default a new family would inherit silently
        assert not any(attr in vars(c) for c in ImageBackend.__mro__)


def test_the_declaration_check_finds_what_is_missing():
    from flowrl.families.flux import FluxBackend

    class Bare(ImageBackend):
        family, denoiser_class = "bare", "BareTransformer"

    class Borrower(FluxBackend):  # another denoiser class under FLUX.1's declarations
        family, denoiser_class = "borrower", "OtherTransformer"

    class Unsaid(FluxBackend):
        family = "unsaid"
        plan_calibration = Calibration(1.0, 1.0, 1.0, "a guess", calibrated=False)

    assert undeclared_families([Bare, Borrower, Unsaid]) == [
        "bare: no plan_layout",
        "bare: no plan_calibration",
        "borrower: plan_layout inherited from FluxBackend, whose denoiser class FluxTransformer2DModel is not its "
        "OtherTransformer",
        "borrower: plan_calibration inherited from FluxBackend, whose denoiser class FluxTransformer2DModel is not "
        "its OtherTransformer",
        "unsaid: its calibration was not measured and its `measured` does not say so",
    ]


@pytest.mark.parametrize("name", family_names())
def test_each_layout_finds_the_blocks_and_streams_of_its_tiny_denoiser(name):
    """The declared layout reads the family's denoiser: most layers inside checkpointed blocks (whose inputs
    checkpointing keeps), the per-sample layers (time embedding, modulation) and the layers that see the text."""
    fam = family(name)
    _, parts, _ = pipeline_components(f"tiny-{name}", "float32")
    den = {p.name: p for p in parts}[fam.denoiser_attr]
    assert den.class_name == fam.denoiser_class
    levels = len(den.module.config.get("block_out_channels", [0])) if fam.plan_layout.unet else 1
    layers = denoiser_layers(den.module, fam.plan_layout, image_tokens=64, text_tokens=16, levels=levels)
    assert {layer.stream[:3] for layer in layers} >= {"one", "txt", "img"}
    assert sum(layer.block is not None for layer in layers) >= 0.5 * len(layers)
    assert activation_terms(layers, "float32").kept > 0  # the blocks' inputs: what checkpointing keeps


def test_the_planner_asks_the_family(monkeypatch):
    """The activations follow the family's calibration (twice alpha: twice the activations but the LoRA's), its note
    says where the factors come from; another denoiser class than the family's is read with the generic layout, with a
    note; a family that declares nothing is a PlanError naming it."""
    from flowrl.families.sd3 import SD3Backend

    cfg = load_config(None, ["model.path=tiny-sd3", *TINY])
    base = plan(cfg)
    own = SD3Backend.plan_calibration
    assert base.update.calibration is own and f"activations of SD3Transformer2DModel: {own.measured}" in base.notes
    doubled = Calibration(2 * own.alpha, own.kappa, own.rho, "doubled for the test", gamma=own.gamma)
    monkeypatch.setattr(SD3Backend, "plan_calibration", doubled)
    twice = plan(cfg)
    assert twice.update.activations.plain - twice.update.terms.lora == pytest.approx(
        2 * (base.update.activations.plain - base.update.terms.lora)
    )
    assert "activations of SD3Transformer2DModel: doubled for the test" in twice.notes
    monkeypatch.undo()

    monkeypatch.setattr(SD3Backend, "denoiser_class", "MyOwnTransformer")
    generic = plan(cfg)
    assert not generic.update.calibration.calibrated and not generic.update.activations.calibrated
    assert any("not the MyOwnTransformer the sd3 family declares a layout for" in n for n in generic.notes)
    monkeypatch.undo()

    monkeypatch.delattr(SD3Backend, "plan_layout")
    with pytest.raises(PlanError, match="family 'sd3' declares no plan_layout"):
        plan(cfg)


# ---------------------------------------------------------------------------------------------- distributed strategies


def undeclared_strategies(classes) -> list[str]:
    """What each strategy class fails to declare in its own body: `applies` (which launches it runs) and, for the
    planner, `shards` (a tuple of "weights", "gradients", "optimizer") and `plan_column` (its column's title, at most
    10 characters, or None); a title declared twice."""
    problems, titles = [], []
    for cls in classes:
        problems += [f"{cls.name}: no {attr}" for attr in ("shards", "plan_column", "applies") if attr not in vars(cls)]
        shards = vars(cls).get("shards", ())
        if not isinstance(shards, tuple) or not set(shards) <= set(SHARDABLE):
            problems.append(f"{cls.name}: shards {shards!r} is not a tuple of {', '.join(SHARDABLE)}")
        title = vars(cls).get("plan_column")
        if title is not None and not (isinstance(title, str) and 0 < len(title) <= 10):
            problems.append(f"{cls.name}: plan_column {title!r} is not a title of 1 to 10 characters")
        titles += [title] if title else []
    problems += [f"column {t!r} declared twice" for t in sorted({t for t in titles if titles.count(t) > 1})]
    return problems


def test_every_strategy_declares_what_it_shards_and_its_column():
    strategies = [STRATEGIES.get(n) for n in strategy_names()]
    assert len(strategies) >= 4
    assert undeclared_strategies(strategies) == []
    assert not any(attr in vars(Strategy) for attr in ("shards", "plan_column"))  # nothing to inherit silently
    # the plan's columns are the declared ones, and offload
    titles = plan(load_config(None, ["model.path=tiny-sd3", *TINY])).titles
    assert set(titles) == {s.plan_column for s in strategies if s.plan_column} | {"offload"}


def test_the_strategy_check_finds_what_is_missing():
    class Bare(Strategy):
        name = "bare"

    class Odd(Strategy):
        name, shards, plan_column = "odd", ("activations",), "a very long title"

    class Twin(Strategy):
        name, shards, plan_column = "twin", (), "DDP"

    assert undeclared_strategies([Bare, Odd, Twin, STRATEGIES.get("ddp")]) == [
        "bare: no shards",
        "bare: no plan_column",
        "bare: no applies",
        "odd: no applies",
        "odd: shards ('activations',) is not a tuple of weights, gradients, optimizer",
        "odd: plan_column 'a very long title' is not a title of 1 to 10 characters",
        "twin: no applies",
        "column 'DDP' declared twice",
    ]


def test_the_planner_asks_the_strategies(monkeypatch):
    """A column's title and what it shards are the strategy's; a strategy without them is a PlanError naming it."""
    from flowrl.dist.fsdp import FSDP

    cfg = load_config(
        None,
        ["model.path=tiny-sd3", *TINY, "sample.prompts_per_epoch=4", "sample.group_size=4", "train.minibatch_size=8"],
    )
    monkeypatch.setattr(FSDP, "plan_column", "FSDP2")
    monkeypatch.setattr(FSDP, "shards", ("gradients", "optimizer"))  # no longer the weights
    p = plan(cfg, gpus=2)
    assert "FSDP" not in p.titles and "FSDP2" in p.titles
    assert p.rows[0].gib["FSDP2"] == p.rows[0].gib["DDP"]
    monkeypatch.delattr(FSDP, "plan_column")
    with pytest.raises(PlanError, match="distributed strategy 'fsdp' declares no plan_column"):
        plan(cfg, gpus=2)


def test_zero2_shards_gradients_and_states_and_refuses_what_deepspeed_refuses():
    """Full fine-tuning in float32 on 8 GPUs: under ZeRO-2 the weights are whole, the gradients and AdamW states an
    eighth; ZeRO keeps a float32 copy of its eighth of the trained weights and, in the backward pass only, a gradient
    bucket of DeepSpeed's default 5e8 float32 (not in the rollout). train.optimizer=adamw_8bit and full fine-tuning in
    bfloat16 are refused, as DeepSpeed's strategy refuses them, and the column says so."""
    from flowrl.dist.deepspeed import REDUCE_BUCKET

    base = ["model.path=stabilityai/stable-diffusion-3.5-medium", "lora.enabled=false", "model.dtype=float32"]
    p = plan(load_config(None, base + ["sample.prompts_per_epoch=8", "sample.group_size=8"]), gpus=8)
    gib = {r.label: r.gib for r in p.rows}
    den = gib["transformer (SD3Transformer2DModel)"]
    assert den["ZeRO-2"] == den["DDP"] == 8 * den["FSDP"]
    for label in ("gradients (float32)", "AdamW states (2 x float32)"):
        assert gib[label]["ZeRO-2"] == pytest.approx(gib[label]["DDP"] / 8)
    assert gib["ZeRO-2: float32 partition of the weights"]["ZeRO-2"] == pytest.approx(den["DDP"] / 8)
    bucket = gib["ZeRO-2: gradient bucket, backward only"]
    assert bucket["ZeRO-2"] * GIB == 4 * REDUCE_BUCKET and bucket["DDP"] == bucket["FSDP"] == 0
    update, rollout = p.fits["ZeRO-2"].static_gib, p.rollout_fits["ZeRO-2"][0] - p.rollout.peak(p.rollout.items) / GIB
    assert update - rollout == pytest.approx(bucket["ZeRO-2"])
    assert p.refused == {} and any(n.startswith("ZeRO-2: DeepSpeed ZeRO stage 2") for n in p.notes)

    for override, why in (
        ("train.optimizer=adamw_8bit", "its ZeRO optimizer wraps torch's AdamW"),
        ("model.dtype=bfloat16", "full fine-tuning of bf16/fp16 weights under DeepSpeed"),
    ):
        refused = plan(load_config(None, base + [override]))
        assert why in refused.refused["ZeRO-2"] and not refused.fits_as_configured("ZeRO-2")
        assert f"ZeRO-2 refuses this config: {refused.refused['ZeRO-2']}" in refused.notes
        fits_line = next(ln for ln in refused.render().splitlines() if ln.startswith("  fits in"))
        assert fits_line.split()[-3] == "refused"
