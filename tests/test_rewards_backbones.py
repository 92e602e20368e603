"""The model-based image rewards on tiny random-weight backbones of the real architecture classes,
saved to a directory and loaded back through the rewards' own loading code. Each score is recomputed
here from the saved model's own sub-modules (not through the reward's code path)."""

from __future__ import annotations

import os
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from rewardtiny import block_non_loopback, random_images, save_tiny_clip, save_tiny_hps
from safetensors.torch import save_file

import rewards

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(1)

PROMPTS = ["a red cat", "two dogs on a mat", "an empty room"]


@pytest.fixture(autouse=True)
def _no_network(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    block_non_loopback(monkeypatch)


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny_clip")
    return str(directory), save_tiny_clip(directory)


def reference_clip_embeddings(model, processor, images, prompts):
    """Projected embeddings straight from the towers: vision/text transformer pooled output -> projection."""
    pixels = processor(images=images, return_tensors="pt")["pixel_values"]
    tokens = processor.tokenizer(prompts, padding=True, return_tensors="pt")
    with torch.no_grad():
        img = model.visual_projection(model.vision_model(pixel_values=pixels).pooler_output)
        txt = model.text_projection(
            model.text_model(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"]).pooler_output
        )
    return img, txt


def test_clip_score_is_scaled_cosine_of_the_saved_model(tiny_clip):
    directory, model = tiny_clip
    reward = rewards.get("clip_score", model=directory, scale=2.5, device="cpu")
    images = random_images(3, (40, 30))
    scores = reward(images, PROMPTS)
    img, txt = reference_clip_embeddings(model, reward.processor, images, PROMPTS)
    expected = 2.5 * F.cosine_similarity(img, txt, dim=-1)
    assert scores.dtype == torch.float32 and scores.shape == (3,)
    torch.testing.assert_close(scores, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(reward.last_components["cosine"], expected / 2.5, atol=1e-5, rtol=1e-5)
    assert reward.kind == "image"


def test_pickscore_is_exp_logit_scale_times_cosine(tiny_clip):
    directory, model = tiny_clip
    reward = rewards.get("pickscore", model=directory, processor=directory, device="cpu")
    images = random_images(3, (32, 48), seed=1)
    scores = reward(images, PROMPTS)
    img, txt = reference_clip_embeddings(model, reward.processor, images, PROMPTS)
    # logit_scale_init_value=3.0 in the tiny config: exp(3) = 20.0855...
    assert model.logit_scale.item() == pytest.approx(3.0)
    expected = torch.exp(torch.tensor(3.0)) * F.cosine_similarity(img, txt, dim=-1)
    torch.testing.assert_close(scores, expected, atol=1e-4, rtol=1e-5)
    # a different prompt changes the score: the text tower is really used
    assert not torch.allclose(reward(images, ["zzz"] * 3), scores)


def test_clip_reward_scores_a_batch_like_single_images(tiny_clip):
    directory, _ = tiny_clip
    reward = rewards.get("pickscore", model=directory, processor=directory, device="cpu")
    images = random_images(3, (40, 40), seed=2)
    batch = reward(images, PROMPTS)
    single = torch.cat([reward([im], [p]) for im, p in zip(images, PROMPTS)])
    torch.testing.assert_close(batch, single, atol=1e-4, rtol=1e-5)


def _random_head(input_size: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sizes = [(1024, input_size), (128, 1024), (64, 128), (16, 64), (1, 16)]
    state = {}
    for index, (out_f, in_f) in zip((0, 2, 4, 6, 7), sizes):
        state[f"layers.{index}.weight"] = torch.randn(out_f, in_f, generator=g) / in_f**0.5
        state[f"layers.{index}.bias"] = torch.randn(out_f, generator=g) * 0.1
    return state


@pytest.mark.parametrize("fmt", ["pth", "safetensors"])
def test_aesthetic_is_linear_mlp_on_normalised_embedding(tiny_clip, tmp_path, fmt):
    directory, model = tiny_clip
    head = _random_head(16)
    path = tmp_path / f"head.{fmt}"
    torch.save(head, path) if fmt == "pth" else save_file(head, str(path))
    reward = rewards.get("aesthetic", model=directory, head=str(path), device="cpu")
    images = random_images(2, (36, 36), seed=3)
    scores = reward(images, PROMPTS[:2])
    img, _ = reference_clip_embeddings(model, reward.processor, images, PROMPTS[:2])
    x = img / img.norm(dim=-1, keepdim=True)  # [2, 16]
    for index in (0, 2, 4, 6, 7):  # five affine maps, no activation in between
        x = x @ head[f"layers.{index}.weight"].T + head[f"layers.{index}.bias"]
    torch.testing.assert_close(scores, x.squeeze(-1), atol=1e-4, rtol=1e-4)


def test_aesthetic_head_of_wrong_size_is_a_clear_error(tiny_clip, tmp_path):
    directory, _ = tiny_clip
    torch.save(_random_head(768), tmp_path / "head.pth")  # a ViT-L/14 head on a 16-dim CLIP
    with pytest.raises(ValueError, match="does not fit the MLP 16→1024"):
        rewards.get("aesthetic", model=directory, head=str(tmp_path / "head.pth"), device="cpu")


def test_missing_weights_offline_name_what_was_tried(tiny_clip, tmp_path):
    directory, _ = tiny_clip
    with pytest.raises(FileNotFoundError, match="nor a directory|neither a local file"):
        rewards.get("aesthetic", model=directory, head="no-such-org/no-such-head", device="cpu")


def test_hps_preprocessing_matches_the_original_transform():
    """Resize longest side (bicubic) + centred black pad, via torchvision as HPSv2 does, vs ours."""
    import torchvision.transforms.functional as TF
    from torchvision.transforms import InterpolationMode

    from rewards.hpsv2 import OPENAI_MEAN, OPENAI_STD, hps_pixels

    image = random_images(1, (64, 30), seed=4)[0]  # w=64, h=30
    # scale 32/64 = 0.5 -> (h, w) = (15, 32); pad_h = 17 -> 8 on top, 9 at the bottom
    resized = TF.resize(image, [15, 32], InterpolationMode.BICUBIC)
    padded = TF.pad(resized, [0, 8, 0, 9], fill=0)  # left, top, right, bottom
    expected = TF.normalize(TF.to_tensor(padded), OPENAI_MEAN, OPENAI_STD)
    ours = hps_pixels([image], 32)[0]
    assert ours.shape == (3, 32, 32)
    torch.testing.assert_close(ours, expected, atol=1e-6, rtol=0)
    black = -torch.tensor(OPENAI_MEAN) / torch.tensor(OPENAI_STD)  # a padded pixel
    torch.testing.assert_close(ours[:, 0, 0], black)
    torch.testing.assert_close(ours[:, 31, 31], black)


def test_hpsv2_is_cosine_of_normalised_features(tmp_path):
    import open_clip

    from rewards.hpsv2 import hps_pixels

    model, checkpoint = save_tiny_hps(tmp_path)
    reward = rewards.get("hpsv2", checkpoint=checkpoint, architecture=str(tmp_path), device="cpu")
    images = random_images(3, (48, 24), seed=5)
    scores = reward(images, PROMPTS)
    with torch.no_grad():
        f_img = model.encode_image(hps_pixels(images, 32))
        f_txt = model.encode_text(open_clip.tokenize(PROMPTS))
    expected = F.cosine_similarity(f_img, f_txt, dim=-1)
    torch.testing.assert_close(scores, expected, atol=1e-5, rtol=1e-5)
    # the directory also works as `checkpoint` (the file is found by version)
    again = rewards.get("hpsv2", checkpoint=str(tmp_path), architecture=str(tmp_path), device="cpu")
    torch.testing.assert_close(again(images, PROMPTS), scores)
    with pytest.raises(ValueError, match="valid: v2.0, v2.1"):
        rewards.get("hpsv2", version="v3")


def test_imagereward_missing_package_names_the_extra():
    if "ImageReward" in sys.modules or __import__("importlib").util.find_spec("ImageReward"):
        pytest.skip("image-reward is installed")
    with pytest.raises(ImportError, match=r"flowrl\[imagereward\].*image-reward"):
        rewards.get("imagereward", device="cpu")


class _PatchEncoder(torch.nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, dim, 8, 8)

    def forward(self, pixels):  # [B, 3, 16, 16] -> [B, 4, dim]
        return self.conv(pixels).flatten(2).transpose(1, 2)


class _CrossEncoder(torch.nn.Module):
    """Token embeddings (masked) plus the mean image token: enough to tie text and image together."""

    def __init__(self, vocab: int, dim: int):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)

    def forward(self, input_ids, attention_mask, encoder_hidden_states, encoder_attention_mask, return_dict):
        assert return_dict and encoder_attention_mask.shape == encoder_hidden_states.shape[:2]
        hidden = self.embed(input_ids) * attention_mask[..., None] + encoder_hidden_states.mean(1, keepdim=True)
        hidden = hidden + hidden.mean(1, keepdim=True)  # the [CLS] position sees the whole prompt
        return types.SimpleNamespace(last_hidden_state=hidden)


def test_imagereward_batches_the_packages_model(monkeypatch, tiny_clip):
    """With a stand-in for the ``ImageReward`` package (the real one is an optional extra), one batched
    forward equals ImageReward.score's per-image rule ``(mlp(cls) - mean) / std``."""
    from transformers import CLIPTokenizer

    tokenizer = CLIPTokenizer.from_pretrained(tiny_clip[0])
    torch.manual_seed(0)
    fake = torch.nn.Module()
    fake.blip = torch.nn.Module()
    fake.blip.tokenizer = tokenizer
    fake.blip.visual_encoder = _PatchEncoder(8)
    fake.blip.text_encoder = _CrossEncoder(len(tokenizer), 8)
    fake.mlp = torch.nn.Linear(8, 1)
    fake.mean, fake.std = 0.16717362830052426, 1.0333394966054072
    fake.preprocess = lambda im: torch.from_numpy(
        __import__("numpy").asarray(im.resize((16, 16)), "float32") / 255
    ).permute(2, 0, 1)
    module = types.ModuleType("ImageReward")
    module.load = lambda name, device, download_root: fake
    monkeypatch.setitem(sys.modules, "ImageReward", module)

    reward = rewards.get("imagereward", device="cpu")
    images = random_images(3, (20, 20), seed=6)
    scores = reward(images, PROMPTS)
    expected = []
    for image, prompt in zip(images, PROMPTS):  # ImageReward.score, one image at a time
        text = tokenizer(prompt, padding="max_length", truncation=True, max_length=35, return_tensors="pt")
        with torch.no_grad():
            embeds = fake.blip.visual_encoder(fake.preprocess(image)[None])
            out = fake.blip.text_encoder(
                text.input_ids,
                attention_mask=text.attention_mask,
                encoder_hidden_states=embeds,
                encoder_attention_mask=torch.ones(embeds.shape[:-1], dtype=torch.long),
                return_dict=True,
            )
            expected.append(((fake.mlp(out.last_hidden_state[:, 0]) - fake.mean) / fake.std).item())
    torch.testing.assert_close(scores, torch.tensor(expected), atol=1e-5, rtol=1e-5)
