"""The tiny SD3 pipeline of the shapes world: tokenizers, the shipped weights, the pre-training script's state."""

import os
from pathlib import Path

import numpy as np
import pytest
from repo_files import load_module

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
torch.set_num_threads(1)

from flowrl.worlds.shapes import prompts_of_split, render, score_images, vocabulary  # noqa: E402
from flowrl.worlds.shapes.model import (  # noqa: E402
    LATENT_CHANNELS,
    MAX_SEQUENCE_LENGTH,
    TRANSFORMER_CONFIG,
    VAE_CHANNELS,
    build_t5_tokenizer,
    build_tokenizer,
    learn_bpe_merges,
)

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "samples/shapes/model"
needs_model = pytest.mark.skipif(not (MODEL / "model_index.json").exists(), reason="samples/shapes/model not built yet")


def test_bpe_merges_spell_each_word_as_one_symbol():
    words = ["and", "triangle", "triangles", "an", "left"]  # shared prefixes that naive merges get wrong
    merges = learn_bpe_merges(words)
    for w in words:  # replay the merges, lowest rank first, as a BPE encoder does
        symbols = list(w[:-1]) + [w[-1] + "</w>"]
        rank = {m: i for i, m in enumerate(merges)}
        while len(symbols) > 1:
            pairs = [(rank.get(p, len(rank)), i) for i, p in enumerate(zip(symbols, symbols[1:]))]
            r, i = min(pairs)
            if r == len(rank):
                break
            symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
        assert symbols == [w + "</w>"]


def test_tokenizers_know_every_word_of_the_world():
    clip, t5 = build_tokenizer(), build_t5_tokenizer()
    for w in vocabulary():
        assert len(clip(w, add_special_tokens=False).input_ids) == 1, w
        assert len(t5(w, add_special_tokens=False).input_ids) == 1, w
    longest = max((r["prompt"] for r in prompts_of_split("train") + prompts_of_split("test")), key=len)
    ids = clip(longest).input_ids
    assert ids[0] == clip.bos_token_id and ids[-1] == clip.eos_token_id and len(ids) <= clip.model_max_length
    assert len(t5(longest).input_ids) <= MAX_SEQUENCE_LENGTH
    assert len(clip("a zebra", add_special_tokens=False).input_ids) > 2  # unknown words fall back to letters


@needs_model
def test_shipped_model_loads_as_sd3_and_draws_64px_images():
    from diffusers import StableDiffusion3Pipeline

    size = sum(f.stat().st_size for f in MODEL.rglob("*") if f.is_file())
    assert size <= 30 * 2**20, f"{size / 2**20:.1f} MB"
    pipe = StableDiffusion3Pipeline.from_pretrained(MODEL)
    assert pipe.vae.config.scaling_factor != 1.0 and pipe.vae.config.shift_factor != 0.0
    assert pipe.transformer.config.joint_attention_dim == pipe.text_encoder_3.config.d_model
    # the shipped weights are the architecture the code builds (flowrl.worlds.shapes.model), not an older one
    for key, value in TRANSFORMER_CONFIG.items():
        assert pipe.transformer.config[key] == value, key
    assert tuple(pipe.vae.config.block_out_channels) == VAE_CHANNELS
    assert pipe.vae.config.latent_channels == LATENT_CHANNELS
    pipe.set_progress_bar_config(disable=True)
    out = pipe(
        ["a photo of a red circle", "a photo of two squares"],
        num_inference_steps=2,
        guidance_scale=4.0,
        max_sequence_length=MAX_SEQUENCE_LENGTH,
        generator=torch.Generator().manual_seed(0),
        output_type="np",
    )
    assert out.images.shape == (2, 64, 64, 3)
    assert np.isfinite(out.images).all()

    # the VAE really encodes/decodes the world: the detector still reads its reconstructions
    rng = np.random.default_rng(5)
    records = prompts_of_split("train")
    metas = [records[i] for i in rng.integers(len(records), size=24)]
    x = np.stack([render(m, rng)[0] for m in metas])
    with torch.no_grad():
        t = torch.from_numpy(x).permute(0, 3, 1, 2).float() / 127.5 - 1
        z = pipe.vae.encode(t).latent_dist.mode()
        x0 = (z - pipe.vae.config.shift_factor) * pipe.vae.config.scaling_factor
        assert abs(x0.mean().item()) < 0.2 and abs(x0.std().item() - 1) < 0.2  # SD3's normalisation holds
        recon = pipe.vae.decode(z).sample
    images = ((recon.clamp(-1, 1) + 1) * 127.5).round().byte().permute(0, 2, 3, 1).numpy()
    strict, _, _ = score_images(list(images), metas)
    assert strict.mean() >= 0.9


@needs_model
def test_ode_accuracy_reports_why_images_fail():
    from diffusers import StableDiffusion3Pipeline

    from flowrl.worlds.shapes import FAILURE_KINDS
    from flowrl.worlds.shapes.model import ode_accuracy

    pipe = StableDiffusion3Pipeline.from_pretrained(MODEL)
    pipe.set_progress_bar_config(disable=True)
    records = prompts_of_split("test")
    res = ode_accuracy(pipe, records, n_images=16, steps=4, guidance=3.0, seed=0, batch=8)
    assert set(res["failures"]) == set(FAILURE_KINDS)
    assert set(res["failures_by_family"]) == set(res["by_family"])
    # an image fails strict exactly when it has at least one kind of failure
    for shares, strict in [(res["failures"], res["strict"])] + [
        (res["failures_by_family"][f], res["by_family"][f]) for f in res["by_family"]
    ]:
        assert max(shares.values()) <= 1 - strict + 1e-9
        assert sum(shares.values()) >= 1 - strict - 1e-9
        assert (strict == 1) == (sum(shares.values()) == 0)


def _load_script():
    return load_module("scripts/pretrain_shapes.py", "pretrain_shapes_script")


def test_pretraining_resumes_exactly(tmp_path):
    script = _load_script()
    common = [
        "--vae-steps",
        "2",
        "--vae-batch",
        "2",
        "--batch",
        "2",
        "--stats-images",
        "8",
        "--ckpt-every",
        "1",
        "--snapshot-every",
        "1000",
        "--eval-every",
        "0",
        "--warmup",
        "2",
        "--distractor-prob",
        "0.5",
        "--distractor-from",
        "2",
    ]  # the incomplete captions start after the resume

    def run(workdir, steps, resume=False):
        args = script.parse_args(
            common
            + ["--workdir", str(workdir), "--out", str(workdir / "out"), "--steps", str(steps)]
            + (["--resume"] if resume else [])
        )
        trainer = script.Trainer(args)
        if resume:
            trainer.load()
        if trainer.stage == "vae":
            trainer.train_vae()
        trainer.train_flow()
        return trainer

    straight = run(tmp_path / "a", 3)
    run(tmp_path / "b", 1)
    resumed = run(tmp_path / "b", 3, resume=True)
    assert resumed.step == straight.step == 3
    for name in ("transformer", "text_encoder_3", "vae"):
        a, b = getattr(straight.pipe, name).state_dict(), getattr(resumed.pipe, name).state_dict()
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=f"{name}.{k}")
    for k, v in straight.ema["transformer"].items():
        torch.testing.assert_close(v, resumed.ema["transformer"][k], rtol=0, atol=0)
    assert straight.pipe.vae.config.scaling_factor == resumed.pipe.vae.config.scaling_factor


def test_pretraining_rejects_a_bad_distractor_share_at_once(capsys):
    script = _load_script()
    assert script.parse_args([]).distractor_prob == 0.7  # the shipped model's recipe is the default
    assert script.parse_args([]).distractor_sides == [8]  # small background objects (the asked ones: 12, 16)
    with pytest.raises(SystemExit):
        script.parse_args(["--distractor-prob", "1.5"])
    assert "--distractor-prob must lie in [0, 1]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        script.parse_args(["--distractor-sides", "8", "60"])
    assert "--distractor-sides must lie in [3, 56]" in capsys.readouterr().err
