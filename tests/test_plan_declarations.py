"""The planner asks the registries instead of keeping tables of their names: every model family declares how the
planner reads its denoiser (`plan_layout`) and its activation factors (`plan_calibration`), in its own class body or
shared, by inheritance or by name, with a family of the same denoiser class; a family that declares nothing, or a
subclass that would inherit another denoiser class's layout, fails here. (Every objective's memory terms:
tests/test_objective_modules.py; every reward's memory: tests/test_rewards_memory.py.)"""

import pytest

from flowrl.config import load_config
from flowrl.families import ImageBackend, family, family_names
from flowrl.plan import Calibration, Layout, PlanError, activation_terms, denoiser_layers, pipeline_components, plan

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
                problems.append(f"{cls.family}: {attr} inherited from {owner.__name__}, whose denoiser class "
                                f"{owner.denoiser_class} is not its {cls.denoiser_class}")
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
        "bare: no plan_layout", "bare: no plan_calibration",
        "borrower: plan_layout inherited from FluxBackend, whose denoiser class FluxTransformer2DModel is not its "
        "OtherTransformer",
        "borrower: plan_calibration inherited from FluxBackend, whose denoiser class FluxTransformer2DModel is not "
        "its OtherTransformer",
        "unsaid: its calibration was not measured and its `measured` does not say so"]


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
        2 * (base.update.activations.plain - base.update.terms.lora))
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
