"""Image models checked before they load (preflight_image_model), and SD3 without its T5 encoder.

A tiny SD3 is saved with diffusers' own save_pretrained, whole and without T5; the checks read its
configuration files only, so a directory holding nothing but those files must pass them.
"""

import json
import os
import shutil
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from flowrl.families import (  # noqa: E402
    ImageModelError,
    family_names,
    load_image_backend,
    preflight_image_model,
    tiny_models,
)
from flowrl.families.sd3 import SD3Backend, tiny_sd3_pipeline  # noqa: E402

torch.set_num_threads(1)

PROMPTS = ["a red cat", "a blue dog"]
SUPPORTED = ("StableDiffusion3Pipeline (sd3)", "FluxPipeline (flux)", "StableDiffusionPipeline (sd15)")


@pytest.fixture(scope="module")
def sd3_dirs(tmp_path_factory):
    """{"full": a tiny SD3 saved whole, "no_t5": the same weights saved without text_encoder_3 / tokenizer_3}."""
    from diffusers import StableDiffusion3Pipeline

    root = tmp_path_factory.mktemp("sd3")
    pipe = tiny_sd3_pipeline(seed=3)
    pipe.save_pretrained(root / "full")
    StableDiffusion3Pipeline(**{**pipe.components, "text_encoder_3": None, "tokenizer_3": None}).save_pretrained(
        root / "no_t5"
    )
    return {"full": str(root / "full"), "no_t5": str(root / "no_t5")}


def configs_only(src: str, dst) -> str:
    """A copy of the pipeline directory `src` with its JSON files only (no weights, no tokenizer files)."""
    for folder, _, files in os.walk(src):
        for name in files:
            if name.endswith(".json"):
                target = dst / os.path.relpath(folder, src)
                target.mkdir(parents=True, exist_ok=True)
                shutil.copy(os.path.join(folder, name), target / name)
    return str(dst)


def rollout(backend, seed=5):
    return backend.rollout(PROMPTS, 2, num_steps=3, seed=seed, height=32, width=32, decode=False)


def test_saved_sd3_passes_preflight_from_its_config_files_alone(sd3_dirs, tmp_path):
    index = json.loads(Path(sd3_dirs["no_t5"], "model_index.json").read_text())
    assert index["text_encoder_3"] == [None, None] and index["tokenizer_3"] == [None, None]
    assert preflight_image_model(sd3_dirs["full"], height=32, width=32) == "sd3"
    bare = configs_only(sd3_dirs["full"], tmp_path / "bare")
    assert not any(name.endswith(".safetensors") for _, _, files in os.walk(bare) for name in files)
    assert preflight_image_model(bare, "sd3", height=64, width=48, drop_t5=True) == "sd3"
    with pytest.raises(ValueError, match=r"a 'sd3' model, not 'flux': set model\.family=sd3"):
        preflight_image_model(bare, "flux", height=32, width=32)
    with pytest.raises(ValueError, match=f"Valid: {', '.join(family_names())}"):
        preflight_image_model(bare, "nosuchfamily", height=32, width=32)
    with pytest.raises(ValueError, match="has no model_index.json: not a diffusers pipeline directory"):
        preflight_image_model(str(tmp_path), height=32, width=32)
    # a component's folder: the pipeline directory above it is named
    with pytest.raises(ValueError, match=rf"it is the transformer folder of the pipeline directory {bare}: set "):
        preflight_image_model(os.path.join(bare, "transformer"), height=32, width=32)
    with pytest.raises(ValueError, match="neither a local directory") as error:
        preflight_image_model(str(tmp_path / "missing" / "dir"), height=32, width=32)
    assert os.getcwd() in str(error.value) and "tiny-sd3" in str(error.value)  # where it looked, what else is valid


def test_unknown_pipeline_class_fails_before_any_weight_is_read(sd3_dirs, tmp_path):
    bare = configs_only(sd3_dirs["full"], tmp_path / "kandinsky")  # no weights: loading them would fail otherwise
    index_file = Path(bare, "model_index.json")
    index = json.loads(index_file.read_text())
    index["_class_name"] = "KandinskyPipeline"
    index_file.write_text(json.dumps(index))
    for check in (
        lambda: preflight_image_model(bare, height=32, width=32),
        lambda: load_image_backend(bare),
    ):
        with pytest.raises(ImageModelError, match="no image backend drives KandinskyPipeline") as error:
            check()
        assert all(s in str(error.value) for s in SUPPORTED), str(error.value)


def test_sizes_are_checked_against_the_multiple_and_the_positional_embedding(sd3_dirs):
    # tiny SD3: VAE factor 2 x patch size 2 = 4; pos_embed_max_size 16 x 4 = 64 px a side at most
    full = sd3_dirs["full"]
    assert preflight_image_model(full, height=64, width=4) == "sd3"
    with pytest.raises(ImageModelError, match=r"divisible by 4, got 30x32; nearest valid: 28x32, 32x32$"):
        preflight_image_model(full, height=30, width=32)
    with pytest.raises(ImageModelError, match=r"divisible by 4, got 2x66; nearest valid: 4x64$"):
        preflight_image_model(full, height=2, width=66)
    message = r"at most 64 px a side \(pos_embed_max_size 16 x patch size 2 x VAE factor 2\), got 96x32; "
    with pytest.raises(ImageModelError, match=message + "nearest valid: 64x32$"):
        preflight_image_model(full, height=96, width=32)
    # the loaded model says the same, where the transformer's PatchEmbed would fail deep in a rollout
    with pytest.raises(ImageModelError, match=message):
        load_image_backend(full).check_image_size(96, 32)


@pytest.mark.parametrize("family", family_names())
def test_tiny_names_are_known_without_building_them(family):
    name = f"tiny-{family}"
    backend = load_image_backend(name)
    denoiser_file = f"{backend.denoiser_attr}/config.json"
    files = tiny_models()[name].tiny_config_files()
    assert set(files) == {"model_index.json", denoiser_file, "vae/config.json"}
    assert files["model_index.json"]["_class_name"] == type(backend.pipe).__name__
    for key, value in files[denoiser_file].items():
        built = backend.denoiser_config[key] if key != "_class_name" else type(backend.denoiser).__name__
        assert json.loads(json.dumps(built)) == json.loads(json.dumps(value)), key
    for height, width in [(32, 32), (30, 32), (32, 34), (64, 48), (96, 64), (66, 64)]:
        try:
            backend.check_image_size(height, width)
            loaded_ok = True
        except ImageModelError:
            loaded_ok = False
        try:
            preflight_image_model(name, height=height, width=width)
            preflight_ok = True
        except ImageModelError:
            preflight_ok = False
        assert preflight_ok == loaded_ok, (height, width)
    assert preflight_image_model(name, height=32, width=32) == family


def test_hub_id_offline_fails_at_once_naming_it_and_uses_the_cache(sd3_dirs, tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))  # read at import: follow HF_HOME
    for check in (
        lambda: preflight_image_model("someorg/some-sd3", height=32, width=32),
        lambda: load_image_backend("someorg/some-sd3"),
    ):
        with pytest.raises(ImageModelError, match=r"someorg/some-sd3: model_index.json .* HF_HUB_OFFLINE=1") as error:
            check()
        assert "download the model once online" in str(error.value) and "local directory" in str(error.value)
        assert f"nor is there a directory someorg/some-sd3 under the working directory, {os.getcwd()}" in str(
            error.value
        )  # an ORG/NAME-shaped relative path that is not there: said, not only the hub
    # the same files in the cache, as a download leaves them: used, offline
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--someorg--some-sd3"
    configs_only(sd3_dirs["full"], repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    assert preflight_image_model("someorg/some-sd3", height=32, width=32) == "sd3"
    with pytest.raises(ImageModelError, match="divisible by 4"):
        preflight_image_model("someorg/some-sd3", height=30, width=32)


def test_sd3_saved_without_t5_loads_and_rolls_out(sd3_dirs):
    backend = load_image_backend(sd3_dirs["no_t5"])
    assert isinstance(backend, SD3Backend)
    assert backend.pipe.text_encoder_3 is None and backend.pipe.tokenizer_3 is None
    traj = backend.rollout(PROMPTS, 2, num_steps=3, seed=5, height=32, width=32)
    assert traj.log_probs.shape == (4, 3) and torch.isfinite(traj.log_probs).all()
    assert len(traj.images) == 4 and traj.images[0].size == (32, 32)
    log_prob = backend.step_log_prob(traj, 1).log_prob
    torch.testing.assert_close(log_prob, traj.log_probs[:, 1], rtol=0, atol=1e-5)
    # T5's part of the embedding is zeros: the model with T5 makes other images from the same noise
    with_t5 = rollout(load_image_backend(sd3_dirs["full"]))
    assert not torch.equal(rollout(backend).latents, with_t5.latents)


def test_drop_t5_never_reads_t5_and_equals_the_t5_less_directory(sd3_dirs, tmp_path):
    full = tmp_path / "full"
    shutil.copytree(sd3_dirs["full"], full)
    for name in os.listdir(full / "text_encoder_3"):
        if name.endswith(".safetensors"):
            (full / "text_encoder_3" / name).write_bytes(b"not weights")  # reading them would fail
    dropped = load_image_backend(str(full), drop_t5=True)
    assert dropped.pipe.text_encoder_3 is None and dropped.pipe.tokenizer_3 is None
    a, b = rollout(dropped), rollout(load_image_backend(sd3_dirs["no_t5"]))
    assert torch.equal(a.latents, b.latents) and torch.equal(a.log_probs, b.log_probs)


def test_drop_t5_for_tiny_sd3_and_pipeline_objects_and_only_sd3():
    full = tiny_sd3_pipeline()
    dropped = load_image_backend("tiny-sd3", drop_t5=True)
    assert dropped.pipe.text_encoder_3 is None and dropped.pipe.tokenizer_3 is None
    assert all(torch.equal(v, full.transformer.state_dict()[k]) for k, v in dropped.denoiser.state_dict().items())
    from_object = load_image_backend(full, drop_t5=True)
    assert full.text_encoder_3 is not None  # the caller's pipeline is left whole
    a, b = rollout(dropped), rollout(from_object)
    assert torch.equal(a.latents, b.latents) and torch.equal(a.log_probs, b.log_probs)
    assert not torch.equal(a.latents, rollout(load_image_backend(full)).latents)
    for check in (
        lambda: preflight_image_model("tiny-flux", height=32, width=32, drop_t5=True),
        lambda: load_image_backend("tiny-flux", drop_t5=True),
        lambda: load_image_backend(load_image_backend("tiny-sd15").pipe, drop_t5=True),
    ):
        with pytest.raises(ImageModelError, match=r"drop_t5 is SD3-only \(families with an optional T5: \['sd3'\]\)"):
            check()


def test_a_directory_saved_as_a_variant_names_it_and_loads_with_it(sd3_dirs, tmp_path):
    """save_pretrained(DIR, variant="fp16") writes *.fp16.safetensors only: without model.variant, diffusers would
    look for the plain files (and then for pickled .bin ones); the check names the variant before any weight is
    read, and with it the directory loads the very weights. A variant the directory lacks is named too."""
    from flowrl.config import load_config
    from flowrl.preflight import PreflightError, check_model

    pipe = tiny_sd3_pipeline(seed=3)
    pipe.save_pretrained(tmp_path / "v16", variant="fp16")
    v16 = str(tmp_path / "v16")
    assert sorted(os.listdir(tmp_path / "v16" / "transformer")) == [
        "config.json",
        "diffusion_pytorch_model.fp16.safetensors",
    ]
    with pytest.raises(
        ImageModelError,
        match=r"text_encoder/, text_encoder_2/, .*transformer/, vae/ hold only the 'fp16' variant .* "
        r"set model\.variant=fp16",
    ):
        preflight_image_model(v16, height=32, width=32)
    assert preflight_image_model(v16, height=32, width=32, variant="fp16") == "sd3"
    with pytest.raises(
        ImageModelError, match=r"has no weight file of variant 'bf16' \(model\.variant\): its variants are fp16"
    ):
        preflight_image_model(v16, height=32, width=32, variant="bf16")
    with pytest.raises(ImageModelError, match=r"holds only plain files: set model\.variant=null"):
        preflight_image_model(sd3_dirs["full"], height=32, width=32, variant="fp16")

    base = ["sample.height=32", "sample.width=32", "model.device=cpu"]
    with pytest.raises(PreflightError, match=rf"model\.path={v16}: .* set model\.variant=fp16"):
        check_model(load_config(None, [f"model.path={v16}", *base]))
    assert check_model(load_config(None, [f"model.path={v16}", "model.variant=fp16", *base])) == "sd3"

    loaded = load_image_backend(v16, variant="fp16", max_sequence_length=16)
    theirs = dict(pipe.transformer.named_parameters())
    for name, p in loaded.denoiser.named_parameters():
        torch.testing.assert_close(p, theirs[name], rtol=0, atol=0)


def test_a_file_as_model_path_says_what_to_do_with_it(tmp_path):
    """A LoRA file is sent to lora.init_path, a single-file checkpoint to a one-time conversion, anything else
    to a pipeline directory; each before anything loads."""
    from safetensors.torch import save_file

    lora = tmp_path / "pytorch_lora_weights.safetensors"
    save_file({"transformer.blocks.0.attn.to_q.lora_A.weight": torch.zeros(2, 8)}, str(lora))
    kohya = tmp_path / "style.safetensors"
    save_file({"lora_unet_down_blocks_0.lora_down.weight": torch.zeros(2, 8)}, str(kohya))
    single = tmp_path / "sd3.5_medium.safetensors"
    save_file({"model.diffusion_model.x_embedder.proj.weight": torch.zeros(2, 8)}, str(single))
    notes = tmp_path / "notes.txt"
    notes.write_text("hello")
    for path, hint in (
        (lora, "lora.init_path"),
        (kohya, "lora.init_path"),
        (single, "from_single_file"),
        (notes, "pipeline directory"),
    ):
        with pytest.raises(ImageModelError, match="is a file") as info:
            preflight_image_model(str(path), "auto", height=32, width=32)
        assert hint in str(info.value), (path.name, str(info.value))
    with pytest.raises(ImageModelError) as info:
        preflight_image_model(str(notes), "auto", height=32, width=32)
    assert "lora.init_path" not in str(info.value) and "from_single_file" not in str(info.value)


def test_a_file_of_a_pipeline_directory_names_the_directory(sd3_dirs, tmp_path):
    """model.path set to a pipeline's model_index.json (or a component's config.json) names the directory to give."""
    bare = configs_only(sd3_dirs["full"], tmp_path / "bare")
    for file in ("model_index.json", "transformer/config.json"):
        with pytest.raises(
            ImageModelError, match=rf"is a file; .* part of the pipeline directory {bare}: set model\.path={bare}$"
        ):
            preflight_image_model(os.path.join(bare, file), height=32, width=32)


def test_a_copy_missing_a_component_folder_names_it_before_loading(sd3_dirs, tmp_path):
    """A directory whose model_index.json names a component it has no folder of (a copy that missed one) is named
    before any weight is read, where diffusers said 'no file named model.safetensors' of the directory; without T5's
    folders alone, model.drop_t5=true runs it."""
    bare = Path(configs_only(sd3_dirs["full"], tmp_path / "bare"))  # no weights: a load would fail on them
    shutil.rmtree(bare / "text_encoder_3")
    shutil.rmtree(bare / "tokenizer_3")
    message = r"model_index\.json names components the directory has no folder for: text_encoder_3/ \(T5EncoderModel\)"
    for check in (
        lambda: preflight_image_model(str(bare), height=32, width=32),
        lambda: load_image_backend(str(bare)),
    ):
        with pytest.raises(ImageModelError, match=message + r", tokenizer_3/ \(T5Tokenizer\); .*model\.drop_t5=true"):
            check()
    assert preflight_image_model(str(bare), height=32, width=32, drop_t5=True) == "sd3"
    shutil.rmtree(bare / "vae")
    with pytest.raises(ImageModelError, match=r"no folder for: vae/ \(AutoencoderKL\); copy the whole") as info:
        preflight_image_model(str(bare), height=32, width=32, drop_t5=True)
    assert "drop_t5" not in str(info.value)


IMG2IMG_FAMILIES = ["sd15", "sdxl", "sd3", "flux", "qwen_image", "zimage"]  # diffusers has their Img2Img pipelines


@pytest.mark.parametrize("family", IMG2IMG_FAMILIES)
def test_an_image_to_image_pipelines_folder_trains_as_its_text_to_image_model(family, tmp_path):
    """A folder saved from the family's Img2Img pipeline (the same components and weights) passes preflight, loads
    as the text-to-image pipeline and rolls out as the folder of the text-to-image pipeline does, to the bit."""
    import diffusers

    from flowrl.families import FAMILIES, tiny_pipeline

    pipe = tiny_pipeline(f"tiny-{family}")
    t2i = FAMILIES.get(family).pipeline_classes[0]
    i2i = getattr(diffusers, t2i.replace("Pipeline", "Img2ImgPipeline")).from_pipe(pipe)
    pipe.save_pretrained(tmp_path / "t2i")
    i2i.save_pretrained(tmp_path / "i2i")
    saved = json.loads((tmp_path / "i2i" / "model_index.json").read_text())["_class_name"]
    assert saved == type(i2i).__name__ and saved != t2i
    size = 32
    assert preflight_image_model(str(tmp_path / "i2i"), height=size, width=size) == family
    backend = load_image_backend(str(tmp_path / "i2i"), max_sequence_length=16)
    assert type(backend.pipe).__name__ == t2i and backend.family == family
    same = load_image_backend(str(tmp_path / "t2i"), max_sequence_length=16)
    kwargs = dict(num_steps=2, seed=5, height=size, width=size, decode=False)
    assert torch.equal(backend.rollout(PROMPTS, 1, **kwargs).latents, same.rollout(PROMPTS, 1, **kwargs).latents)
    # a pipeline object of the image-to-image class too, and a family named for it
    assert type(load_image_backend(i2i, family).pipe).__name__ == t2i


def test_an_inpainting_pipeline_is_not_taken_for_its_text_to_image_model(sd3_dirs, tmp_path):
    folder = Path(configs_only(sd3_dirs["full"], tmp_path / "inpaint"))
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, "_class_name": "StableDiffusion3InpaintPipeline"}))
    with pytest.raises(ImageModelError, match=r"no image backend drives StableDiffusion3InpaintPipeline"):
        preflight_image_model(str(folder), height=32, width=32)
