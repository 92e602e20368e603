"""What each reward declares it keeps on the accelerator (rewards.memory), which the memory planner asks for: every
reward of the package declares it, the declarations read the reward's options over its defaults, a sum of rewards
holds its components', and plug-ins declare it or are noted as not declaring."""

from __future__ import annotations

import textwrap

import pytest

import rewards
import rewards.registry as registry
from rewards.imagereward import PARAMETERS as IMAGEREWARD_PARAMETERS

#: the options a reward cannot do without (no default)
REQUIRED = {"weighted": {"components": {"jpeg_compressibility": 1.0}}, "remote": {"url": "http://localhost:1"}}


def package_rewards() -> list[str]:
    """The rewards of `rewards.available()` that a module of the `rewards` package registers (not the tests' own,
    nor another package's)."""
    return [
        name
        for name in rewards.available()
        if name in registry.REWARDS and registry.REWARDS.get(name).__module__.startswith("rewards.")
    ]


def undeclared_rewards() -> list[str]:
    """The rewards of the package that declare nothing about their memory."""
    return [name for name in package_rewards() if getattr(registry.REWARDS.get(name), "reward_memory", None) is None]


def test_every_reward_of_the_package_declares_what_it_holds():
    """A new reward that declares nothing would silently drop out of `flowrl plan`: it fails here."""
    assert len(package_rewards()) >= 19
    assert undeclared_rewards() == []
    for name in package_rewards():
        held = rewards.memory_spec(name, REQUIRED.get(name, {}))  # with its default options
        assert all(isinstance(h, (rewards.HubModel, rewards.Parameters)) for h in held), (name, held)
        assert all(h.reward == name for h in held)


def test_an_undeclared_reward_is_found_and_noted(monkeypatch):
    monkeypatch.setattr(registry.REWARDS, "_items", dict(registry.REWARDS._items))  # undone after the test

    def bare():
        return lambda images, prompts: [0.0] * len(images)

    bare.__module__ = "rewards.bare_for_test"  # as if it were a file of the package
    rewards.register("bare_for_test", kind="image")(bare)
    assert undeclared_rewards() == ["bare_for_test"]
    assert rewards.memory_spec("bare_for_test") == [
        rewards.NotEstimated(
            "it declares nothing (register(..., memory=...), see rewards.memory)", reward="bare_for_test"
        )
    ]


def test_a_backbone_is_read_from_the_options_over_the_defaults():
    assert rewards.memory_spec("pickscore") == [
        rewards.HubModel("yuvalkirstain/PickScore_v1", "CLIPModel", "float32", reward="pickscore")
    ]
    assert rewards.memory_spec("clip_score", {"model": "/models/clip", "dtype": "bf16"}) == [
        rewards.HubModel("/models/clip", "CLIPModel", "bfloat16", reward="clip_score")
    ]
    import torch

    (aesthetic,) = rewards.memory_spec("aesthetic", {"dtype": torch.float16})
    assert (aesthetic.source, aesthetic.dtype) == ("openai/clip-vit-large-patch14", "float16")
    with pytest.raises(
        rewards.RewardConfigError,
        match=r"^reward 'pickscore': its memory declaration failed on "
        r"options \{'dtype': 'fp8'\}: ValueError: unknown dtype 'fp8'",
    ):
        rewards.memory_spec("pickscore", {"dtype": "fp8"})


def test_the_similarity_rewards_pick_their_class_by_the_checkpoints_model_type():
    for name in ("edit_consistency", "temporal_consistency"):
        (held,) = rewards.memory_spec(name)
        assert held.source == "facebook/dinov2-small"
        assert held.class_for({"model_type": "dinov2"}) == "Dinov2Model"
        assert held.class_for({"model_type": "clip_vision_model"}) == "CLIPVisionModelWithProjection"
        with pytest.raises(
            ValueError,
            match=r"^facebook/dinov2-small is a 'bert' model, not one of dinov2, clip, "
            r"clip_vision_model$",
        ):
            held.class_for({"model_type": "bert"})


def test_what_the_other_rewards_hold():
    for name in (
        "accuracy",
        "think_format",
        "soft_overlong",
        "jpeg_compressibility",
        "jpeg_incompressibility",
        "shapes_geneval",
        "shapes_soft",
        "shapes_edit",
        "shapes_motion",
        "ocr",
    ):
        assert rewards.memory_spec(name) == [], name
    assert rewards.memory_spec("remote", {"url": "http://scorer:8000", "kind": "text"}) == []  # the server's
    assert rewards.memory_spec("ocr", {"engine": "paddle"}) == [
        rewards.NotEstimated("the paddle engine runs in PaddlePaddle's memory", reward="ocr")
    ]
    assert rewards.memory_spec("hpsv2", {"dtype": "bf16"}) == [
        rewards.HubModel("laion/CLIP-ViT-H-14-laion2B-s32B-b79K", "CLIPModel", "bfloat16", reward="hpsv2")
    ]
    (other,) = rewards.memory_spec("hpsv2", {"architecture": "ViT-B-32"})
    assert isinstance(other, rewards.NotEstimated) and "'ViT-B-32'" in other.reason
    assert rewards.memory_spec("imagereward", {"dtype": "fp16"}) == [
        rewards.Parameters(446_665_953, "ImageReward BLIP ViT-L + BERT-base", "float16", reward="imagereward")
    ]


def test_a_weighted_sum_holds_its_components_models():
    components = {
        "pickscore": 1.0,
        "style": {"reward": "aesthetic", "weight": 0.5, "dtype": "fp16"},
        "jpeg_compressibility": 2.0,
        "text": {"reward": "ocr", "engine": "paddle"},
    }
    assert rewards.memory_spec("weighted", {"components": components}) == [
        rewards.HubModel("yuvalkirstain/PickScore_v1", "CLIPModel", "float32", reward="pickscore"),
        rewards.HubModel("openai/clip-vit-large-patch14", "CLIPModel", "float16", reward="aesthetic"),
        rewards.NotEstimated("the paddle engine runs in PaddlePaddle's memory", reward="ocr"),
    ]
    with pytest.raises(rewards.RewardConfigError, match=r"unknown reward 'pickscor'\. Did you mean 'pickscore'"):
        rewards.memory_spec("weighted", {"components": {"pickscor": 1.0}})


def test_imagereward_parameters_match_transformers_vit_and_bert():
    """An independent count: transformers' ViT-L/16 (224 px, no pooler) is BLIP's vision tower; BERT-base with
    cross-attention and no token-type embeddings is its text encoder, except that BLIP's cross-attention keys and
    values read the 1024-wide image tokens (transformers' read 768: 12 layers x 2 x 256 x 768 more)."""
    import transformers

    from flowrl.plan import build_on_meta

    def count(module):
        return sum(p.numel() for p in module.parameters())

    vit = build_on_meta(
        transformers.ViTModel,
        dict(
            hidden_size=1024,
            num_hidden_layers=24,
            num_attention_heads=16,
            intermediate_size=4096,
            patch_size=16,
            image_size=224,
        ),
    )
    vision = count(vit) - count(vit.pooler)
    bert = build_on_meta(
        transformers.BertModel, dict(vocab_size=30524, type_vocab_size=0, is_decoder=True, add_cross_attention=True)
    )
    text = count(bert) - count(bert.pooler) + 12 * 2 * (1024 - 768) * 768
    projections = (1024 * 256 + 256) + (768 * 256 + 256)
    head = sum(i * o + o for i, o in [(768, 1024), (1024, 128), (128, 64), (64, 16), (16, 1)])
    assert (vision, text, projections, head) == (303_301_632, 141_977_088, 459_264, 927_969)
    assert IMAGEREWARD_PARAMETERS == vision + text + projections + head


PLUGIN = """\
import rewards

def brightness(images, prompts):
    return [0.0] * len(images)
brightness.memory = rewards.hub_model("backbone", "CLIPModel")

def bare(images, prompts):
    return [0.0] * len(images)

def wrong(images, prompts):
    return [0.0] * len(images)
wrong.memory = "cuda"
"""


def test_plugins_declare_it_in_an_attribute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "scores.py").write_text(textwrap.dedent(PLUGIN))
    assert rewards.memory_spec("scores.py:brightness", {"backbone": "/my/clip"}) == [
        rewards.HubModel("/my/clip", "CLIPModel", "float32", reward="scores.py:brightness")
    ]
    assert rewards.memory_spec("scores.py:bare") == [
        rewards.NotEstimated(
            "it declares nothing (a plug-in's function declares .memory, see rewards.memory)", reward="scores.py:bare"
        )
    ]
    with pytest.raises(
        rewards.RewardConfigError,
        match=r"^reward 'scores.py:wrong': its memory declaration failed "
        r"on options \{\}: TypeError: a memory declaration gives "
        r"NOTHING, a HubModel",
    ):
        rewards.memory_spec("scores.py:wrong")


def test_register_refuses_what_is_not_a_declaration():
    with pytest.raises(
        ValueError,
        match=r"reward 'x': memory must be NOTHING, a HubModel, Parameters or "
        r"NotEstimated, a list of them, or a function",
    ):
        rewards.register("x", kind="image", memory="cuda")
    with pytest.raises(rewards.RewardConfigError, match=r"unknown reward 'pickscor'\. Did you mean 'pickscore'"):
        rewards.memory_spec("pickscor")
