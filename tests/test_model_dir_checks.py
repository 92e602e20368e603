"""Pipeline directories as users have them, checked before any weight is read (preflight_image_model, and `flowrl
plan` sharing its checks): a hub id served from the Hugging Face cache gets a local directory's checks, a damaged
text-encoder file is named, a required component saved as [null, null] or another family's pipeline class is
refused, a broken model_index.json is one line, and Wan2.2's two experts are refused from model_index.json alone.

Most directories hold the configuration files of a tiny SD3 saved with diffusers' save_pretrained and nothing else:
the checks under test read only those (a load would fail on the missing weights otherwise)."""

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from test_backend_loading import configs_only as json_files_only  # noqa: E402

from flowrl.families import ImageModelError, load_image_backend, preflight_image_model  # noqa: E402
from flowrl.families.sd3 import tiny_sd3_pipeline  # noqa: E402

torch.set_num_threads(1)

SIZE = {"height": 32, "width": 32}


@pytest.fixture(scope="module")
def sd3_full(tmp_path_factory):
    """A tiny SD3 saved whole (weights included)."""
    root = tmp_path_factory.mktemp("sd3")
    tiny_sd3_pipeline(seed=3).save_pretrained(root / "full")
    return root / "full"


def configs_only(src: Path, dst: Path) -> Path:
    """A copy of the pipeline directory `src` with its JSON files only."""
    return Path(json_files_only(src, dst))


def with_index(folder: Path, **changes) -> Path:
    """`folder` with its model_index.json updated by `changes` (a value None deletes the key)."""
    file = folder / "model_index.json"
    index = json.loads(file.read_text())
    index.update(changes)
    file.write_text(json.dumps({k: v for k, v in index.items() if v is not None}))
    return folder


def index_only(folder: Path, index: dict) -> Path:
    """A directory holding only `index` as its model_index.json: the checks of the index come first."""
    folder.mkdir(parents=True)
    (folder / "model_index.json").write_text(json.dumps(index))
    return folder


def fake_weights(folder: Path, component: str, name: str) -> None:
    """An empty file named as a weights file: the preflight checks read names, never weights."""
    (folder / component / name).write_bytes(b"")


def plan_of(path):
    from flowrl.config import load_config
    from flowrl.plan import plan

    return plan(load_config(None, [f"model.path={path}", *(f"sample.{k}={v}" for k, v in SIZE.items())]))


# ---- 1. a hub id served from the Hugging Face cache


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """cache(src, "org/name"): `src` laid out as a download leaves it in a fresh offline HF cache (snapshot files
    linked to blobs named by their hash); returns the snapshot directory."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))  # read at import: follow HF_HOME

    def cache(src: Path, repo: str) -> Path:
        root = tmp_path / "hf" / "hub" / f"models--{repo.replace('/', '--')}"
        commit = hashlib.sha1(repo.encode()).hexdigest()
        (root / "refs").mkdir(parents=True)
        (root / "refs" / "main").write_text(commit)
        (root / "blobs").mkdir()
        for folder, _, files in os.walk(src):
            for name in files:
                data = Path(folder, name).read_bytes()
                blob = root / "blobs" / hashlib.sha256(data).hexdigest()
                blob.write_bytes(data)
                link = root / "snapshots" / commit / os.path.relpath(folder, src) / name
                link.parent.mkdir(parents=True, exist_ok=True)
                link.symlink_to(os.path.relpath(blob, link.parent))
        return root / "snapshots" / commit

    return cache


def test_a_cached_hub_id_gets_the_checks_of_its_snapshot_directory(sd3_full, tmp_path, hf_cache):
    """Offline, diffusers loads a hub id from its cached snapshot: the checks a local directory gets run on it, and
    the message names the hub id and the snapshot."""
    no_t5 = configs_only(sd3_full, tmp_path / "no_t5")
    shutil.rmtree(no_t5 / "text_encoder_3")
    shutil.rmtree(no_t5 / "tokenizer_3")
    snapshot = hf_cache(no_t5, "org/sd3-not5")
    with pytest.raises(ImageModelError, match=r"no folder for: text_encoder_3/ .*model\.drop_t5=true") as info:
        preflight_image_model("org/sd3-not5", **SIZE)
    assert f"hub model org/sd3-not5 (its Hugging Face cache snapshot {snapshot})" in str(info.value)
    with pytest.raises(ImageModelError, match=r"org/sd3-not5 .* model\.drop_t5=true"):
        load_image_backend("org/sd3-not5")  # before any weight is read (there are none)

    whole = configs_only(sd3_full, tmp_path / "whole")
    for component in ("text_encoder", "text_encoder_2", "text_encoder_3"):
        fake_weights(whole, component, "model.safetensors")
    for component in ("transformer", "vae"):
        fake_weights(whole, component, "diffusion_pytorch_model.safetensors")
    hf_cache(whole, "org/sd3-plain")
    assert preflight_image_model("org/sd3-plain", **SIZE) == "sd3"
    with pytest.raises(ImageModelError, match=r"org/sd3-plain .*holds only plain files: set model\.variant=null"):
        preflight_image_model("org/sd3-plain", **SIZE, variant="fp16")

    for file in (whole / "vae").glob("*.safetensors"):  # one weights file missing
        file.unlink()
    hf_cache(whole, "org/sd3-novae")
    with pytest.raises(ImageModelError, match=r"org/sd3-novae .*: vae/ holds a config\.json and no weights file"):
        preflight_image_model("org/sd3-novae", **SIZE)


def test_a_cached_hub_id_saved_as_a_variant_names_it(sd3_full, tmp_path, hf_cache):
    v16 = configs_only(sd3_full, tmp_path / "v16")
    for component in ("text_encoder", "text_encoder_2", "text_encoder_3"):
        fake_weights(v16, component, "model.fp16.safetensors")
    for component in ("transformer", "vae"):
        fake_weights(v16, component, "diffusion_pytorch_model.fp16.safetensors")
    hf_cache(v16, "org/sd3-fp16")
    with pytest.raises(ImageModelError, match=r"org/sd3-fp16 .*only the 'fp16' variant .*set model\.variant=fp16"):
        preflight_image_model("org/sd3-fp16", **SIZE)
    assert preflight_image_model("org/sd3-fp16", **SIZE, variant="fp16") == "sd3"


def test_a_dangling_cache_link_is_named(sd3_full, tmp_path, hf_cache):
    """A snapshot's file whose blob is gone (a cache cleaned by hand, a download that stopped) is named."""
    snapshot = hf_cache(configs_only(sd3_full, tmp_path / "c"), "org/sd3-dangling")
    target = snapshot / "tokenizer" / "tokenizer_config.json"
    os.unlink(os.path.join(target.parent, os.readlink(target)))
    with pytest.raises(
        ImageModelError, match=r"org/sd3-dangling .*: tokenizer/tokenizer_config\.json is a link to .*blobs/"
    ):
        preflight_image_model("org/sd3-dangling", **SIZE)


# ---- 2. (and 7.) a damaged file is named


def test_a_damaged_text_encoder_file_and_tokenizer_are_named(sd3_full, tmp_path):
    """safetensors' own error (header too large) and a tokenizer.json that does not parse are one line naming the
    file, as a damaged denoiser's are."""
    lfs = tmp_path / "lfs"
    shutil.copytree(sd3_full, lfs)
    (lfs / "text_encoder_2" / "model.safetensors").write_text(
        "version https://git-lfs.github.com/spec/v1\noid sha256:4d7a\nsize 9876543\n"
    )
    with pytest.raises(ImageModelError, match=r"text_encoder_2/model\.safetensors is a git-lfs pointer") as info:
        load_image_backend(str(lfs))
    assert f"model.path={lfs}: its weights do not load" in str(info.value) and "\n" not in str(info.value)

    cut = tmp_path / "cut"
    shutil.copytree(sd3_full, cut)
    weights = cut / "text_encoder" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ImageModelError, match=r"text_encoder/model\.safetensors is truncated \(\d+ bytes of the"):
        load_image_backend(str(cut))

    tok = tmp_path / "tok"
    shutil.copytree(sd3_full, tok)
    (tok / "tokenizer" / "tokenizer.json").write_text('{"a": 1,')
    with pytest.raises(ImageModelError, match=r"tokenizer/tokenizer\.json is not valid JSON"):
        load_image_backend(str(tok))


# ---- 3. a component the family needs saved as [null, null]


def test_a_required_component_saved_as_none_is_refused_before_loading(sd3_full, tmp_path):
    novae = with_index(configs_only(sd3_full, tmp_path / "novae"), vae=[None, None])
    shutil.rmtree(novae / "vae")
    message = r"saves vae as \[null, null\] .*StableDiffusion3Pipeline \(sd3\) needs vae"
    for check in (lambda: preflight_image_model(str(novae), **SIZE), lambda: load_image_backend(str(novae))):
        with pytest.raises(ImageModelError, match=message):
            check()
    from flowrl.plan import PlanError

    with pytest.raises(PlanError, match=message):
        plan_of(novae)
    # T5, which SD3 runs without, stays allowed as [null, null]
    no_t5 = with_index(
        configs_only(sd3_full, tmp_path / "no_t5"), text_encoder_3=[None, None], tokenizer_3=[None, None]
    )
    assert preflight_image_model(str(no_t5), **SIZE) == "sd3"


def test_an_sd15_without_its_tokenizer_is_refused(tmp_path):
    index = {
        "_class_name": "StableDiffusionPipeline",
        "feature_extractor": [None, None],
        "safety_checker": [None, None],  # (flowrl never runs the safety checker: allowed)
        "scheduler": ["diffusers", "DDIMScheduler"],
        "text_encoder": ["transformers", "CLIPTextModel"],
        "tokenizer": [None, None],
        "unet": ["diffusers", "UNet2DConditionModel"],
        "vae": ["diffusers", "AutoencoderKL"],
    }
    with pytest.raises(ImageModelError, match=r"saves tokenizer as \[null, null\] .*\(sd15\) needs tokenizer"):
        preflight_image_model(str(index_only(tmp_path / "sd15", index)), **SIZE)


# ---- 4. another family's pipeline class


SDXL_INDEX = {
    "_class_name": "StableDiffusionXLPipeline",
    "scheduler": ["diffusers", "EulerDiscreteScheduler"],
    "text_encoder": ["transformers", "CLIPTextModel"],
    "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"],
    "tokenizer": ["transformers", "CLIPTokenizer"],
    "tokenizer_2": ["transformers", "CLIPTokenizer"],
    "unet": ["diffusers", "UNet2DConditionModel"],
    "vae": ["diffusers", "AutoencoderKL"],
}
FLUX_INDEX = {
    "_class_name": "FluxPipeline",
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    "text_encoder": ["transformers", "CLIPTextModel"],
    "text_encoder_2": ["transformers", "T5EncoderModel"],
    "tokenizer": ["transformers", "CLIPTokenizer"],
    "tokenizer_2": ["transformers", "T5TokenizerFast"],
    "transformer": ["diffusers", "FluxTransformer2DModel"],
    "vae": ["diffusers", "AutoencoderKL"],
}


def test_another_familys_pipeline_class_is_refused_naming_both(sd3_full, tmp_path):
    as_flux = with_index(configs_only(sd3_full, tmp_path / "as_flux"), _class_name="FluxPipeline")
    with pytest.raises(
        ImageModelError,
        match=r"_class_name FluxPipeline \(flux\) trains a FluxTransformer2DModel as its transformer, and this "
        r"transformer is a SD3Transformer2DModel: its components are those of StableDiffusion3Pipeline \(sd3\)",
    ):
        preflight_image_model(str(as_flux), **SIZE)
    flux_as_sd3 = index_only(tmp_path / "flux_as_sd3", {**FLUX_INDEX, "_class_name": "StableDiffusion3Pipeline"})
    with pytest.raises(ImageModelError, match=r"this transformer is a FluxTransformer2DModel: .*FluxPipeline \(flux\)"):
        preflight_image_model(str(flux_as_sd3), **SIZE)
    # the same denoiser class: the components tell an SDXL from an SD1.5
    sdxl_as_sd15 = index_only(tmp_path / "sdxl_as_sd15", {**SDXL_INDEX, "_class_name": "StableDiffusionPipeline"})
    message = (
        r"StableDiffusionPipeline \(sd15\), which takes no text_encoder_2, tokenizer_2: .*StableDiffusionXLPipeline"
    )
    for check in (
        lambda: preflight_image_model(str(sdxl_as_sd15), **SIZE),
        lambda: load_image_backend(str(sdxl_as_sd15)),
    ):
        with pytest.raises(ImageModelError, match=message):
            check()
    from flowrl.plan import PlanError

    with pytest.raises(PlanError, match=message):
        plan_of(sdxl_as_sd15)
    # a component no family's pipeline takes is ignored, as diffusers ignores it
    extra = with_index(configs_only(sd3_full, tmp_path / "extra"), my_extra=["diffusers", "AutoencoderKL"])
    shutil.copytree(extra / "vae", extra / "my_extra")
    assert preflight_image_model(str(extra), **SIZE) == "sd3"


def test_a_denoiser_config_of_another_class_is_refused(sd3_full, tmp_path):
    folder = configs_only(sd3_full, tmp_path / "other")
    config = folder / "transformer" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "_class_name": "FluxTransformer2DModel"}))
    with pytest.raises(
        ImageModelError, match=r"transformer/config\.json is a FluxTransformer2DModel's, and model_index"
    ):
        preflight_image_model(str(folder), **SIZE)


# ---- 5. a model_index.json that is not a pipeline's


@pytest.mark.parametrize(
    "text,message",
    [
        ("[]", r"model_index\.json holds a JSON list, not the object a diffusers pipeline writes"),
        ("{}", r"model_index\.json has no `_class_name`"),
        ('{"_class_name": "StableDiffusion3Pipeline",', r"model_index\.json is not valid JSON"),
    ],
)
def test_a_broken_model_index_is_one_line_in_train_and_plan(tmp_path, text, message):
    from flowrl.plan import PlanError

    (tmp_path / "model_index.json").write_text(text)
    with pytest.raises(ImageModelError, match=message):
        preflight_image_model(str(tmp_path), **SIZE)
    with pytest.raises(PlanError, match=message):
        plan_of(tmp_path)


def test_plan_names_drop_t5_for_an_sd3_without_t5(sd3_full, tmp_path):
    from flowrl.plan import PlanError

    folder = configs_only(sd3_full, tmp_path / "no_t5")
    shutil.rmtree(folder / "text_encoder_3")
    shutil.rmtree(folder / "tokenizer_3")
    with pytest.raises(PlanError, match=r"no folder for: text_encoder_3/ .*model\.drop_t5=true"):
        plan_of(folder)


# ---- 6. Wan2.2's two experts


def test_wan22_two_experts_are_refused_from_model_index(tmp_path):
    from flowrl.families import FAMILIES
    from flowrl.plan import PlanError

    index = FAMILIES.get("wan").tiny_config_files()["model_index.json"]
    index = {
        **index,
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "UMT5EncoderModel"],
        "tokenizer": ["transformers", "T5Tokenizer"],
        "transformer_2": ["diffusers", "WanTransformer3DModel"],
        "boundary_ratio": 0.875,
    }
    folder = index_only(tmp_path / "wan22", index)  # nothing else: refused before any other file is read
    message = r"Wan2\.2's two denoising experts \(transformer_2 WanTransformer3DModel, boundary_ratio 0\.875\); "
    message += r"flowrl's wan family trains one transformer: use a one-transformer Wan2\.1 WanPipeline"
    for check in (lambda: preflight_image_model(str(folder), **SIZE), lambda: load_image_backend(str(folder))):
        with pytest.raises(ImageModelError, match=message):
            check()
    with pytest.raises(PlanError, match=message):
        plan_of(folder)


# ---- 7. the messages name the config key and the right class


def test_the_family_mismatch_names_model_family(sd3_full, tmp_path):
    folder = configs_only(sd3_full, tmp_path / "c")
    with pytest.raises(ImageModelError, match=r"a 'sd3' model, not 'flux': set model\.family=sd3 \(or auto\)$"):
        preflight_image_model(str(folder), "flux", **SIZE)


@pytest.mark.parametrize(
    "key,pipeline",
    [
        ("model.diffusion_model.input_blocks.0.0.weight", "StableDiffusionPipeline"),
        ("conditioner.embedders.0.transformer.text_model.embeddings.position_ids", "StableDiffusionXLPipeline"),
        ("double_blocks.0.img_attn.qkv.weight", "FluxPipeline"),
        ("model.diffusion_model.joint_blocks.0.x_block.attn.qkv.weight", "StableDiffusion3Pipeline"),
        ("something.else", "PIPELINE"),
    ],
)
def test_a_single_file_checkpoint_names_its_own_pipeline_class(tmp_path, key, pipeline):
    from safetensors.torch import save_file

    single = tmp_path / "model.safetensors"
    save_file({key: torch.zeros(2, 8)}, str(single))
    with pytest.raises(ImageModelError, match=rf"converted once: {pipeline}\.from_single_file\(") as info:
        preflight_image_model(str(single), **SIZE)
    others = {"StableDiffusionPipeline", "StableDiffusion3Pipeline", "FluxPipeline"} - {pipeline}
    assert not any(f"{o}.from_single_file" in str(info.value) for o in others)


def test_a_model_error_names_model_path_once(sd3_full, tmp_path):
    """The trainer's check of model.path prints the path once: the model's own "PATH: ..." (a missing component's
    folder, a variant, another class) reads "model.path=PATH: ...", not "model.path=PATH: PATH: ..."."""
    from flowrl.config import load_config
    from flowrl.preflight import PreflightError, _named, check_model

    folder = configs_only(sd3_full, tmp_path / "c")
    shutil.rmtree(folder / "vae")
    cfg = load_config(None, [f"model.path={folder}", "sample.height=32", "sample.width=32"])
    with pytest.raises(PreflightError) as info:
        check_model(cfg)
    message = str(info.value)
    assert (
        message.startswith(f"model.path={folder}: model_index.json names components")
        and message.count(str(folder)) == 1
    ), message
    assert _named("model.path=/m/x", "/m/x has no model_index.json: y") == "model.path=/m/x has no model_index.json: y"
    assert _named("model.path=/m/x", "/m/x2: y") == "model.path=/m/x: /m/x2: y"  # another path: not taken for it
    snapshot = "hub model o/x (its Hugging Face cache snapshot /c/s): y"
    assert _named("model.path=o/x", snapshot) == "model.path=o/x (its Hugging Face cache snapshot /c/s): y"
    assert _named("data.train_prompts", "f.jsonl:2: y") == "data.train_prompts: f.jsonl:2: y"


def test_components_saved_as_none_are_them_and_an_unknown_class_over_a_familys_components_is_named(sd3_full, tmp_path):
    """Several components saved as [null, null] are "them"; a _class_name no family drives (a PAG pipeline) over a
    family's components is told the class that drives them, as another family's class over them is."""
    refiner = index_only(tmp_path / "refiner", {**SDXL_INDEX, "text_encoder": [None, None], "tokenizer": [None, None]})
    with pytest.raises(
        ImageModelError,
        match=r"saves text_encoder, tokenizer as \[null, null\] \(the pipeline was saved without them\)",
    ):
        preflight_image_model(str(refiner), **SIZE)
    pag = with_index(configs_only(sd3_full, tmp_path / "pag"), _class_name="StableDiffusion3PAGPipeline")
    message = (
        r"no image backend drives StableDiffusion3PAGPipeline \(model_index\.json's _class_name\), and its components "
        r"are those of StableDiffusion3Pipeline \(sd3\): set model_index\.json's _class_name to it \(supported "
    )
    with pytest.raises(ImageModelError, match=message):
        preflight_image_model(str(pag), **SIZE)
    from flowrl.plan import PlanError

    with pytest.raises(PlanError, match=message):
        plan_of(pag)
    unknown = index_only(tmp_path / "unknown", {"_class_name": "MyPipeline", "unet": ["diffusers", "UNet2DModel"]})
    with pytest.raises(ImageModelError, match=r"no image backend drives MyPipeline .*; supported pipelines: "):
        preflight_image_model(str(unknown), **SIZE)


def _flowrl_run(root: Path, base: str, lora: bool = True) -> Path:
    """A run directory's files as flowrl writes them (no tensors read here): ckpt-000001/state.json naming `base`."""
    ckpt = root / "ckpt-000001"
    ckpt.mkdir(parents=True)
    (ckpt / "state.json").write_text(json.dumps({"config": {"model": {"path": base}}, "counters": {}}))
    (ckpt / "trainable.safetensors").write_bytes(b"")
    if lora:
        (ckpt / "lora").mkdir()
    (root / "metrics.jsonl").write_text("")
    return ckpt


def test_a_flowrl_checkpoint_as_model_path_is_sent_to_checkpoint_and_lora_init_path(tmp_path):
    """model.path naming a flowrl checkpoint (or its run directory) is told it is one, the base model it was trained
    over as model.path, and the checkpoint as --checkpoint or lora.init_path: by train's checks (image and text) and
    by plan."""
    from flowrl.config import load_config
    from flowrl.plan import PlanError
    from flowrl.preflight import PreflightError, check_model, check_text_model

    run = tmp_path / "run"
    ckpt = _flowrl_run(run, "/models/sd15")
    for given, what in ((ckpt, "a flowrl checkpoint"), (run, "a flowrl run directory (its newest checkpoint: ")):
        told = (
            rf"{re.escape(str(given))} has no model_index\.json: it is {re.escape(what)}.*not a base model: set "
            rf"model\.path to the base model it was trained over \(model\.path=/models/sd15\), and give this as "
            rf"--checkpoint {re.escape(str(given))} \(flowrl sample, flowrl eval\) or its LoRA as lora\.init_path="
        )
        with pytest.raises(PreflightError, match=f"^model\\.path={told}"):
            check_model(load_config(None, [f"model.path={given}"]))
        with pytest.raises(PlanError, match=f"^{told}"):
            plan_of(given)
    with pytest.raises(PreflightError, match=r"no config\.json there: it is a flowrl checkpoint, not a base model"):
        check_text_model(str(ckpt))
    full = _flowrl_run(tmp_path / "full", "/models/sd15", lora=False)
    with pytest.raises(PreflightError) as info:
        check_model(load_config(None, [f"model.path={full}"]))
    assert "--checkpoint" in str(info.value) and "lora.init_path" not in str(info.value)  # no LoRA to start from
    with pytest.raises(PreflightError, match=r"not a diffusers pipeline directory"):  # another directory: as before
        check_model(load_config(None, [f"model.path={tmp_path}"]))


def test_plan_refuses_a_variant_directory_as_train_does_and_counts_no_safety_checker(sd3_full, tmp_path):
    """A directory holding only the fp16 variant: plan refuses it without model.variant=fp16, as train does, and
    plans it with it. An SD1.5 saved with its safety checker: the load passes it as None (never read, never moved),
    and plan counts no safety checker."""
    from diffusers import StableDiffusionPipeline
    from diffusers.pipelines.stable_diffusion.safety_checker import StableDiffusionSafetyChecker
    from transformers import CLIPConfig, CLIPImageProcessor

    from flowrl.config import load_config
    from flowrl.families.sd15 import tiny_sd15_pipeline
    from flowrl.plan import PlanError, plan
    from flowrl.preflight import PreflightError, check_model

    v16 = configs_only(sd3_full, tmp_path / "v16")
    for component in ("text_encoder", "text_encoder_2", "text_encoder_3"):
        fake_weights(v16, component, "model.fp16.safetensors")
    for component in ("transformer", "vae"):
        fake_weights(v16, component, "diffusion_pytorch_model.fp16.safetensors")
    told = r"only the 'fp16' variant .*set model\.variant=fp16"
    with pytest.raises(PlanError, match=told):
        plan_of(v16)
    with pytest.raises(PreflightError, match=told):
        check_model(load_config(None, [f"model.path={v16}", "sample.height=32", "sample.width=32"]))
    ok = [f"model.path={v16}", "model.variant=fp16", "sample.height=32", "sample.width=32"]
    assert "transformer (SD3Transformer2DModel)" in plan(load_config(None, ok)).render()

    small = dict(hidden_size=32, intermediate_size=37, num_attention_heads=4, num_hidden_layers=2, projection_dim=32)
    clip = CLIPConfig(
        text_config=dict(**small, vocab_size=100, max_position_embeddings=16),
        vision_config=dict(**small, image_size=32, patch_size=4),
        projection_dim=32,
    )
    extra = dict(safety_checker=StableDiffusionSafetyChecker(clip), feature_extractor=CLIPImageProcessor(size=32))
    pipe = tiny_sd15_pipeline()
    StableDiffusionPipeline(**{**pipe.components, **extra, "requires_safety_checker": True}).save_pretrained(
        tmp_path / "sd15"
    )
    assert (tmp_path / "sd15" / "safety_checker").is_dir()
    backend = load_image_backend(str(tmp_path / "sd15"))
    assert backend.pipe.safety_checker is None and backend.pipe.feature_extractor is None
    assert not any("safety" in name for name, _ in backend.pipe.components.items() if _ is not None)
    rendered = plan_of(tmp_path / "sd15").render()
    assert "unet (UNet2DConditionModel)" in rendered and "safety" not in rendered.lower()
