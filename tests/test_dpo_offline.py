"""Offline Diffusion-DPO (train.objective=dpo_offline, issue 39): preference pairs read from a .jsonl file or a `hf:`
dataset, as images or latents; each bad input a one-line error before the model loads (the latents' shape once it
has); images encoded into the space of the sampler's final latents; a resumed run equals an uninterrupted one; and
on the shipped shapes model the shipped pairs move the implicit reward margin up. (One epoch on every tiny family:
tests/test_objectives_loop.py's family loop.)"""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conditioned import source_image
from PIL import Image
from safetensors.torch import save_file

from flowrl.cli import main
from flowrl.config import load_config
from flowrl.data import load_pairs
from flowrl.errors import DataError
from flowrl.families import family, family_names
from flowrl.train import Trainer

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "model.path=tiny-sd3",
    "model.device=cpu",
    "sample.height=32",
    "sample.width=32",
    "sample.num_steps=4",
    "sample.max_sequence_length=16",
    "sample.prompts_per_epoch=2",
    "sample.group_size=2",
    "eval.num_steps=2",
    "eval.num_prompts=1",
    "eval.before=false",
    "eval.grid=false",
    "log.progress=false",
    "train.lr=3e-3",
    "train.objective=dpo_offline",
]


def tiny_cfg(run_dir, pairs, *extra):
    return load_config(None, [*TINY, f"log.run_dir={run_dir}", f"train.dpo_offline.pairs={pairs}", *extra])


def write_pairs(directory: Path, rows: list[dict], name: str = "pairs.jsonl") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def image_pairs(directory: Path, n: int = 3, size: int = 32) -> Path:
    """n pairs of generated size x size PNGs in directory/img, the .jsonl in `directory`."""
    (directory / "img").mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        for j, side in enumerate(("chosen", "rejected")):
            source_image(size, seed=10 * i + j).save(directory / "img" / f"{i}{side}.png")
        rows.append({"prompt": f"prompt {i}", "chosen": f"img/{i}chosen.png", "rejected": f"img/{i}rejected.png"})
    return write_pairs(directory, rows)


# ------------------------------------------------------------------------------------------ reading pairs


def test_a_jsonl_file_of_images_and_latents(tmp_path):
    d = tmp_path / "pairs"
    (d / "img").mkdir(parents=True)
    source_image(32, 1).save(d / "img" / "good.png")
    save_file({"latents": torch.ones(4, 4, 4)}, d / "bad.safetensors")
    rows = [{"prompt": "a red circle", "chosen": "img/good.png", "rejected": "bad.safetensors", "family": "colors"}]
    pairs = load_pairs(write_pairs(d, rows), size=(32, 32))
    assert pairs.prompts == ["a red circle"] and pairs.origins == [f"{d / 'pairs.jsonl'}:1"]
    meta = pairs.metadata[0]  # paths relative to the file's folder, made absolute; other keys are metadata
    assert meta == {"chosen": str(d / "img" / "good.png"), "rejected": str(d / "bad.safetensors"), "family": "colors"}


def test_a_local_hf_dataset_of_images_and_latents(tmp_path):
    """A dataset written by save_to_disk: an Image column (the images written once to the cache as files, pixels
    kept) and latents paths relative to the dataset's folder."""
    datasets = pytest.importorskip("datasets")
    d = tmp_path / "ds"
    d.mkdir()
    save_file({"latents": torch.zeros(4, 4, 4)}, d / "r0.safetensors")
    save_file({"latents": torch.ones(4, 4, 4)}, d / "r1.safetensors")
    images = [source_image(32, 5), source_image(32, 6)]
    table = datasets.Dataset.from_dict(
        {
            "prompt": ["a red circle", "a blue square"],
            "chosen": images,
            "rejected": ["r0.safetensors", "r1.safetensors"],
            "family": ["colors", "colors"],
        },
        features=datasets.Features(
            {
                "prompt": datasets.Value("string"),
                "chosen": datasets.Image(),
                "rejected": datasets.Value("string"),
                "family": datasets.Value("string"),
            }
        ),
    )
    table.save_to_disk(str(d))
    pairs = load_pairs(f"hf:{d}", size=(32, 32))
    assert pairs.prompts == ["a red circle", "a blue square"]
    for meta, image, k in zip(pairs.metadata, images, range(2)):
        assert meta["rejected"] == str(d / f"r{k}.safetensors") and meta["family"] == "colors"
        with Image.open(meta["chosen"]) as im:
            assert np.array_equal(np.asarray(im.convert("RGB")), np.asarray(image))


def one_line_error(capsys, rc) -> str:
    err = capsys.readouterr().err.strip()
    assert rc != 0 and "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


def test_each_bad_input_is_one_line_before_the_model_loads(tmp_path, capsys, no_model_load):
    run = [f"log.run_dir={tmp_path / 'run'}", *TINY]

    def error(*extra) -> str:
        return one_line_error(capsys, main(["train", str(ROOT / "configs" / "tiny_cpu.yaml"), *run, *extra]))

    good = image_pairs(tmp_path / "good")
    assert "train.dpo_offline.pairs is unset" in error()
    assert "sample.group_size=2 (now 4)" in error(f"train.dpo_offline.pairs={good}", "sample.group_size=4")
    err = error(f"train.dpo_offline.pairs={tmp_path / 'none.jsonl'}")
    assert "none.jsonl" in err and "does not exist" in err
    (tmp_path / "empty.jsonl").write_text("\n")
    assert "empty.jsonl: no pairs: the file is empty" in error(f"train.dpo_offline.pairs={tmp_path / 'empty.jsonl'}")
    bad = write_pairs(tmp_path / "keys", [{"prompt": "a cat", "chosen": "x.png", "loser": "y.png"}])
    err = error(f"train.dpo_offline.pairs={bad}")
    assert f"{bad}:1: no 'rejected'" in err and "'prompt', 'chosen' and 'rejected'" in err and "'loser'" in err
    (tmp_path / "keys" / "broken.png").write_bytes(b"not a png")
    rows = [{"prompt": "a cat", "chosen": "broken.png", "rejected": "broken.png"}]
    err = error(f"train.dpo_offline.pairs={write_pairs(tmp_path / 'keys', rows, 'broken.jsonl')}")
    assert "broken.jsonl:1" in err and "is not an image Pillow can read" in err
    err = error(f"train.dpo_offline.pairs={image_pairs(tmp_path / 'big', size=64)}")
    assert "is 64x64 pixels and the run trains at 32x32" in err
    save_file({"x0": torch.zeros(4, 4, 4)}, tmp_path / "keys" / "x.safetensors")
    rows = [{"prompt": "a cat", "chosen": "x.safetensors", "rejected": "x.safetensors"}]
    err = error(f"train.dpo_offline.pairs={write_pairs(tmp_path / 'keys', rows, 'latents.jsonl')}")
    assert "hold no tensor 'latents'" in err and "['x0']" in err


def test_latents_of_another_shape_are_refused_once_the_model_loads(tmp_path):
    d = tmp_path / "pairs"
    d.mkdir()
    save_file({"latents": torch.zeros(4, 8, 8)}, d / "small.safetensors")  # 32 px with the tiny SD3's VAE: 16 x 16
    pairs = write_pairs(d, [{"prompt": "a cat", "chosen": "small.safetensors", "rejected": "small.safetensors"}])
    with pytest.raises(DataError, match=r"have shape \[4, 8, 8\], and the model's samples .* \[4, 16, 16\]"):
        Trainer(tiny_cfg(tmp_path / "run", pairs))


# ------------------------------------------------------------------------------------------ images -> latents


def _image_family(name: str) -> bool:
    return not family(name).video


@pytest.mark.parametrize("name", [n for n in family_names() if _image_family(n)])
def test_images_are_encoded_as_the_vae_encodes_them(name, backends):
    """The encoded latents are the VAE's mode brought into the sampler's space: undone by the decoder's own
    transform (`_to_vae_latents`) they equal the VAE's encoding done here; for SD3 and SD1.5 the pipelines'
    scale (and shift) by hand; for an editing family, what it encodes a source image to; and `decode` of them
    gives the images back (the tiny VAE is untrained: compared with decoding the VAE's own encoding)."""
    backend = backends(name)
    images = [source_image(32, 1), source_image(32, 2)]
    latents = backend.encode_images(images, height=32, width=32)
    assert tuple(latents.shape) == (2, *backend.latent_shape(32, 32))
    vae = backend.pipe.vae
    pixels = backend.pipe.image_processor.preprocess(images, 32, 32)
    with torch.no_grad():
        if name.startswith("qwen_image"):
            pixels = pixels[:, :, None]
        out = vae.encode(pixels)
        mode = out.latent_dist.mode() if hasattr(out, "latent_dist") else out.latent
    back = backend._to_vae_latents(latents, 32, 32).float().reshape(mode.shape)
    torch.testing.assert_close(back, mode, rtol=0, atol=1e-5 * max(1.0, mode.abs().max().item()))
    config = vae.config
    if name == "sd3":
        torch.testing.assert_close(latents, (mode - config.shift_factor) * config.scaling_factor)
    if name == "sd15":
        torch.testing.assert_close(latents, mode * config.scaling_factor)
    if name == "flux_kontext":
        from flowrl.sampling import SamplerSettings

        settings = SamplerSettings(name, "ode", 0.0, 2.5, "mean", 32, 32)
        source = backend._encode_conditions([[images[0]]], settings)["image_latents"]
        torch.testing.assert_close(latents[:1], source)
    if name == "qwen_image_edit":
        torch.testing.assert_close(latents[:1], backend._source_latents(pixels[:1]))
    with torch.no_grad():
        again = vae.decode(mode.to(vae.dtype), return_dict=False)[0]
    decoded = backend.decode(latents, height=32, width=32)
    if name.startswith("qwen_image"):
        again = again[:, :, 0]
    want = backend.pipe.image_processor.postprocess(again, output_type="pil")
    for a, b in zip(decoded, want):
        assert np.abs(np.asarray(a, dtype=int) - np.asarray(b, dtype=int)).max() <= 1


def test_the_batch_holds_the_chosen_and_rejected_latents_in_pair_order(tmp_path):
    """Rows 2k and 2k + 1 of an epoch's batch are pair k's chosen and rejected samples: an image VAE-encoded (as
    `encode_images` does it), a latents file as it is; the chosen samples win."""
    d = tmp_path / "pairs"
    (d / "img").mkdir(parents=True)
    source_image(32, 3).save(d / "img" / "c.png")
    x = torch.randn(4, 16, 16, generator=torch.Generator().manual_seed(0))
    save_file({"latents": x}, d / "r.safetensors")
    pairs = write_pairs(d, [{"prompt": "a red cat", "chosen": "img/c.png", "rejected": "r.safetensors"}])
    tr = Trainer(tiny_cfg(tmp_path / "run", pairs, "sample.prompts_per_epoch=1", "train.minibatch_size=2"))
    batch = tr.rollout(0)
    assert batch.prompts == ["a red cat"] * 2 and batch.group_ids.tolist() == [0, 0]
    final = batch.traj.final_latents
    torch.testing.assert_close(final[0], tr.policy.encode_images([source_image(32, 3)])[0])
    torch.testing.assert_close(final[1], x)
    assert batch.traj.num_steps == 4 and not batch.traj.records_steps
    winners = tr.objective.prepare(batch, torch.zeros(2), torch.ones(2, dtype=torch.bool), epoch=0, process_index=0)
    assert winners.tolist() == [True, False] and tr.objective.partner.tolist() == [1, -1]


# ------------------------------------------------------------------------------------------ the loop


def trained(tr) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in tr.named_params.items()}


def test_resume_equals_an_uninterrupted_run(tmp_path):
    """3 pairs, 2 an epoch: the third epoch's draw spans two passes of the seeded shuffle; a run resumed after the
    first epoch draws and trains what the uninterrupted one did."""
    pairs = image_pairs(tmp_path / "pairs", n=3)
    extra = ["train.epochs=3", "checkpoint.every=1", "checkpoint.keep=0", "train.minibatch_size=2"]
    straight = Trainer(tiny_cfg(tmp_path / "a", pairs, *extra))
    draws = [straight.rollout_request(e)["epoch_prompts"] for e in range(3)]
    assert sorted(draws[0] + draws[1][:1]) == ["prompt 0", "prompt 1", "prompt 2"]  # each once per pass
    straight.fit()
    resumed = Trainer(tiny_cfg(tmp_path / "b", pairs, *extra, f"checkpoint.resume={tmp_path / 'a' / 'ckpt-000001'}"))
    resumed.fit()
    assert resumed.state.epochs_done == 3 and resumed.state.optimizer_steps == straight.state.optimizer_steps == 6
    a, b = trained(straight), trained(resumed)
    assert max((a[n] - b[n]).abs().max().item() for n in a) <= 1e-6
    rows = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    epoch = next(r for r in rows if "policy/loss" in r)
    assert epoch["objective/dpo_pairs"] == 2 and "reward/total_mean" not in epoch  # nothing scores the pairs
    assert any("eval/jpeg_compressibility_mean" in r for r in rows)  # the evals still do


def test_the_shipped_pairs_raise_the_implicit_reward_margin_on_the_shapes_model(tmp_path):
    """A few epochs on the shipped shapes model and pair set: on the pairs (at fixed noise and times), the chosen
    images' flow-matching error falls below the rejected ones' relative to the reference: the implicit reward
    margin, 0 before training (the LoRA starts as the reference), turns positive, for most pairs and times
    (measured: 55% of them after 4 epochs of 8 pairs at lr 1e-3)."""
    cfg = load_config(
        ROOT / "configs" / "shapes_dpo_offline.yaml",
        [
            f"log.run_dir={tmp_path}",
            "sample.num_steps=4",
            "train.epochs=4",
            "train.lr=1e-3",
            "train.ema_decay=0",
            "eval.before=false",
            "eval.num_prompts=1",
            "eval.num_steps=2",
            "eval.group_by=",
            "eval.images_per_group=0",
            "eval.grid=false",
            "log.progress=false",
            "checkpoint.resume=null",
        ],
    )
    assert cfg.train.dpo_offline.pairs == "samples/shapes_pairs/pairs.jsonl"
    cfg.train.dpo_offline.pairs = str(ROOT / cfg.train.dpo_offline.pairs)
    cfg.model.path = str(ROOT / cfg.model.path)
    cfg.data.eval_prompts = str(ROOT / cfg.data.eval_prompts)
    tr = Trainer(cfg)
    assert len(tr.train_set) == 64
    obj = tr.objective

    prompts = [p for p in tr.train_set.prompts[:16] for _ in range(2)]
    metadata = [m for m in tr.train_set.metadata[:16] for _ in range(2)]

    def margin():
        """The mean implicit reward margin over the first 16 pairs (every family's), and the share of (pair, time)
        with a positive one, at the noise and times of an epoch that is not trained: computed here from the
        model's and the reference's velocities at the chosen (even rows) and rejected (odd rows) samples."""
        batch = obj.rollout(prompts, metadata, epoch=99, generator=None)
        obj.prepare(batch, torch.zeros(32), torch.ones(32, dtype=torch.bool), epoch=99, process_index=0)
        chosen, t, noise = obj.inputs(batch, torch.arange(0, 32, 2), [0, 1, 2, 3])
        rejected = chosen + 1
        errors = []
        with torch.no_grad():
            for rows in (chosen, rejected):
                pred = tr.policy.flow_prediction(batch, rows, t, noise)
                with tr.policy.reference():
                    ref = tr.policy.flow_prediction(batch, rows, t, noise)
                err = (pred.velocity - pred.target).square().flatten(1).mean(1)
                errors.append(err - (ref.velocity - ref.target).square().flatten(1).mean(1))
        inside = errors[1] - errors[0]  # the rejected's error rise minus the chosen's (relative to the reference)
        return float(inside.mean()), float((inside > 0).float().mean())

    assert margin() == (0.0, 0.0)
    tr.fit()
    after, accuracy = margin()
    assert after > 0 and accuracy > 0.5, (after, accuracy)


def test_the_shipped_pairs_are_what_the_script_writes(tmp_path):
    """samples/shapes_pairs: 64 training prompts' pairs (none of the validation split's), a sixth of each GenEval
    family, every chosen image correct and every rejected one wrong on the strict detector, under 100 KB; and a fresh
    run of the script writes them."""

    from repo_files import load_module

    from flowrl.worlds.shapes import FAMILIES, load_jsonl, prompts_of_split, score_images

    script = load_module("scripts/make_shapes_pairs.py", "make_shapes_pairs")
    shipped = ROOT / "samples" / "shapes_pairs"
    assert script.write_pairs(tmp_path, 64, seed=0) == 64
    assert (tmp_path / "pairs.jsonl").read_text() == (shipped / "pairs.jsonl").read_text()
    names = sorted(p.name for p in (shipped / "images").glob("*.png"))
    assert names == sorted(p.name for p in (tmp_path / "images").glob("*.png")) and len(names) == 128
    rows = load_jsonl(shipped / "pairs.jsonl")
    train = {r["prompt"] for r in prompts_of_split("train_minus_val")}  # never a validation prompt
    assert {r["prompt"] for r in rows} <= train and [r["family"] for r in rows[:6]] == list(FAMILIES)
    for side, want in (("chosen", 1.0), ("rejected", 0.0)):
        images = []
        for r in rows:
            with Image.open(shipped / r[side]) as a, Image.open(tmp_path / r[side]) as b:
                assert np.array_equal(np.asarray(a), np.asarray(b)), r[side]
                assert a.size == (64, 64)
                images.append(np.asarray(a.convert("RGB")))
        assert score_images(images, rows)[0].tolist() == [want] * 64, side
    assert sum(p.stat().st_size for p in shipped.rglob("*") if p.is_file()) < 100_000
