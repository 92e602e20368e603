"""flowrl.plan: the memory planner. Parameter counts of the shipped configurations against the published sizes,
the plan of the tiny models against what the trainer really builds, the activation estimate against a peak
measured by benchmarks/memory.py's tracker, monotonicity, and the errors."""

import json
from pathlib import Path

import pytest
import torch
from repo_files import load_module

from flowrl.config import load_config
from flowrl.plan import (
    GIB,
    PlanError,
    causal_lm,
    config_reader,
    main,
    parse_memory,
    pipeline_components,
    plan,
    shipped_models,
)

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    return load_module("benchmarks/memory.py", "memory_bench")


def _preset(name, *overrides):
    return load_config(ROOT / "configs" / f"{name}.yaml", list(overrides))


# ---------------------------------------------------------------------------------------------- parameter counts

# Published sizes (billions of parameters, as the model cards and papers give them; the SD3.5-Medium figure
# counts its 384 x 384 positional-embedding table, which its checkpoint holds).
PUBLISHED = {
    ("stabilityai/stable-diffusion-3.5-medium", "transformer"): 2.47,
    ("stabilityai/stable-diffusion-3.5-medium", "text_encoder_3"): 4.76,  # T5 v1.1 XXL encoder
    ("stabilityai/stable-diffusion-3.5-medium", "text_encoder_2"): 0.695,  # OpenCLIP bigG text tower
    ("stabilityai/stable-diffusion-3.5-medium", "text_encoder"): 0.124,  # CLIP ViT-L text tower + projection
    ("stabilityai/stable-diffusion-3.5-large", "transformer"): 8.1,
    ("black-forest-labs/FLUX.1-dev", "transformer"): 11.9,
    ("stable-diffusion-v1-5/stable-diffusion-v1-5", "unet"): 0.86,
    ("stable-diffusion-v1-5/stable-diffusion-v1-5", "text_encoder"): 0.123,
    ("stabilityai/stable-diffusion-xl-base-1.0", "unet"): 2.57,
    ("Qwen/Qwen-Image", "transformer"): 20.4,
    ("Qwen/Qwen-Image", "text_encoder"): 8.29,  # Qwen2.5-VL-7B
    ("Qwen/Qwen-Image-Edit-2509", "transformer"): 20.4,  # Qwen-Image's architecture, fine-tuned for editing
    ("black-forest-labs/FLUX.1-Kontext-dev", "transformer"): 11.9,  # FLUX.1-dev's architecture
    ("black-forest-labs/FLUX.2-dev", "transformer"): 32.2,
    ("black-forest-labs/FLUX.2-dev", "text_encoder"): 24.0,  # Mistral Small 3.1
    ("Tongyi-MAI/Z-Image-Turbo", "transformer"): 6.15,
    ("Tongyi-MAI/Z-Image-Turbo", "text_encoder"): 4.02,  # Qwen3-4B
    ("Efficient-Large-Model/Sana_1600M_512px_diffusers", "transformer"): 1.6,
    ("Efficient-Large-Model/Sana_1600M_512px_diffusers", "text_encoder"): 2.61,  # Gemma 2 2B
}


@pytest.mark.parametrize("repo", sorted({r for r, _ in PUBLISHED}))
def test_shipped_pipelines_have_the_published_sizes(repo):
    _, parts, source = pipeline_components(repo, "bfloat16")
    assert "shipped" in source
    sizes = {p.name: p.params / 1e9 for p in parts}
    for (r, component), published in PUBLISHED.items():
        if r == repo:
            assert sizes[component] == pytest.approx(published, rel=0.015), (component, sizes[component])
    # bfloat16 weights: 2 bytes per parameter (and per buffer element, which the parameter count leaves out
    # only where a buffer is not saved)
    for p in parts:
        assert p.weight_bytes >= 2 * p.params * 0.99


def test_shipped_text_model_and_reward_backbones_have_the_published_sizes():
    lm, _ = causal_lm("Qwen/Qwen2.5-0.5B-Instruct", "bfloat16")
    assert lm.params / 1e9 == pytest.approx(0.494, rel=0.01)
    assert lm.weight_bytes == pytest.approx(2 * lm.params, rel=0.01)  # tied embedding counted once
    import transformers

    from flowrl.plan import build_on_meta

    for repo, cls, published in [
        ("yuvalkirstain/PickScore_v1", "CLIPModel", 0.986),
        ("openai/clip-vit-large-patch14", "CLIPModel", 0.428),
        ("facebook/dinov2-small", "Dinov2Model", 0.0221),
    ]:
        read, _ = config_reader(repo)
        module = build_on_meta(getattr(transformers, cls), read("config.json"))
        assert sum(p.numel() for p in module.parameters()) / 1e9 == pytest.approx(published, rel=0.01)


#: preset models whose architecture configs are not shipped yet (not known here reliably enough to write them):
#: `flowrl plan` reads them from the hub cache, and offline it fails naming them (tested below)
#: The editors ship (FLUX.1-dev's and Qwen-Image's architectures under their editing pipelines); the Wan models do
#: not: the planner counts their frames and image tokens when it reads them from the hub (cache).
NOT_SHIPPED = {
    "Qwen/Qwen-Image-2512",
    "black-forest-labs/FLUX.2-klein-9B",
    "black-forest-labs/FLUX.2-klein-base-9B",
    "Wan-AI/Wan2.1-T2V-1.3B-Diffusers",
    "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers",
}


def test_every_shipped_file_names_its_hub_id_and_the_presets_models_are_shipped():
    shipped = shipped_models()
    for preset in ROOT.glob("configs/*.yaml"):
        path = load_config(preset).model.path
        if not (ROOT / path).exists() and not path.startswith("tiny-"):
            assert path in shipped or path in NOT_SHIPPED, f"{preset.name}: {path} has no shipped configuration"
    assert not NOT_SHIPPED & set(shipped), "shipped now: take it off NOT_SHIPPED"
    for file in (ROOT / "flowrl" / "plan_configs").glob("*.json"):
        assert json.loads(file.read_text())["_hub_id"].replace("/", "--") + ".json" == file.name


# ---------------------------------------------------------------------------------------------- tiny models


@pytest.mark.parametrize("family", ["sd3", "flux", "sd15", "wan", "flux_kontext"])
def test_tiny_plan_counts_what_the_trainer_builds(family):
    """The denoiser's size and the LoRA parameters the planner counts are those of the policy the trainer makes."""
    from flowrl.policies.image import ImagePolicy

    cfg = load_config(
        None,
        [
            f"model.path=tiny-{family}",
            "model.device=cpu",
            "sample.height=32",
            "sample.width=32",
            "sample.max_sequence_length=16",
            "train.grpo.beta=0.01",
        ],
    )
    result = plan(cfg)
    policy = ImagePolicy(cfg, "cpu")
    den = policy.backend.denoiser
    saved = sum(t.numel() for n, t in den.state_dict().items() if "lora_" not in n)  # weights + saved buffers
    trained = sum(p.numel() for p in policy.trainable_parameters())
    rows = {r.label.split(" (")[0]: r for r in result.rows}
    assert round(rows[policy.backend.denoiser_attr].params_b * 1e9) == saved
    lora = next(r for r in result.rows if r.label.startswith("LoRA"))
    assert round(lora.params_b * 1e9) == trained
    assert lora.gib["DDP"] * GIB == pytest.approx(4 * trained)  # float32 adapters
    text = result.render()
    assert "ESTIMATES" in text and "largest micro-batch" in text and "tiny test model" in text


def test_tiny_sd3_denoiser_count_includes_its_saved_buffers():
    from flowrl.families import tiny_pipeline

    pipe = tiny_pipeline("tiny-sd3")
    state = pipe.transformer.state_dict()
    _, parts, _ = pipeline_components("tiny-sd3", "float32")
    den = next(p for p in parts if p.name == "transformer")
    assert den.params == sum(t.numel() for t in state.values())


def test_local_directory_is_read_from_its_config_files(tmp_path):
    from flowrl.families import tiny_pipeline

    tiny_pipeline("tiny-sd3").save_pretrained(tmp_path / "m")
    _, from_dir, source = pipeline_components(str(tmp_path / "m"), "float32")
    _, built, _ = pipeline_components("tiny-sd3", "float32")
    assert "local directory" in source
    assert {p.name: p.params for p in from_dir} == {p.name: p.params for p in built}
    result = plan(
        load_config(
            None,
            [f"model.path={tmp_path / 'm'}", "sample.height=32", "sample.width=32", "sample.max_sequence_length=16"],
        )
    )
    assert result.fits["DDP"].fits


def test_text_plan_counts_what_the_text_policy_trains():
    from flowrl.policies.text import TextPolicy

    cfg = load_config(ROOT / "configs" / "text_arith.yaml", ["lora.enabled=true", "lora.rank=4"])
    result = plan(cfg)
    policy = TextPolicy(cfg, "cpu")
    trained = sum(p.numel() for p in policy.trainable_parameters())
    lora = next(r for r in result.rows if r.label.startswith("LoRA"))
    assert round(lora.params_b * 1e9) == trained > 0
    assert "GPT2LMHeadModel" in result.render()


def test_text_plan_cuts_the_sequence_to_the_models_positions(tmp_path):
    """The text policy cuts prompts to the positions max_new_tokens leaves: the planner's sequence is no longer."""
    from conftest import save_tiny_gpt2

    d = save_tiny_gpt2(tmp_path / "lm", n_positions=32)
    cfg = load_config(ROOT / "configs" / "text_arith.yaml", [f"model.path={d}", "text.max_new_tokens=4"])
    assert cfg.text.max_prompt_length + 4 > 32
    text = plan(cfg).render()
    assert "32 tokens (max_prompt_length + max_new_tokens, cut to the model's 32 positions)" in text, text
    short = [f"model.path={d}", "text.max_prompt_length=8", "text.max_new_tokens=4"]  # within the 32: not cut
    assert (
        "12 tokens (max_prompt_length + max_new_tokens), vocabulary"
        in plan(load_config(ROOT / "configs" / "text_arith.yaml", short)).render()
    )


@pytest.mark.parametrize(
    "repo,image_tokens,text_tokens",
    [
        ("stabilityai/stable-diffusion-3.5-medium", 1024, 77 + 128),  # 64x64 latents in 2x2 patches; CLIP + T5
        ("black-forest-labs/FLUX.1-dev", 1024, 128),  # packed 2x2
        ("stable-diffusion-v1-5/stable-diffusion-v1-5", 64 * 64, 77),  # a UNet's level 0: the latent pixels
        ("Qwen/Qwen-Image", 1024, 128),
        ("black-forest-labs/FLUX.1-Kontext-dev", 2 * 1024, 128),  # the source, at the sample's size, appended
        ("Qwen/Qwen-Image-Edit-2509", 1024 + 3 * 4096, 128 + 3 * (189 + 8)),  # 3 sources of ~1024^2 px, 384^2 in text
        ("black-forest-labs/FLUX.2-dev", 1024, 128),
        ("Tongyi-MAI/Z-Image-Turbo", 1024, 128),
        ("Efficient-Large-Model/Sana_1600M_512px_diffusers", 16 * 16, 128),  # a 32x VAE, patch 1
    ],
)
def test_token_counts_of_the_shipped_denoisers_at_512_px(repo, image_tokens, text_tokens):
    from flowrl.plan import activation_terms, denoiser_layers, image_shape

    _, parts, _ = pipeline_components(repo, "bfloat16")
    components = {p.name: p for p in parts}
    attr = "unet" if "unet" in components else "transformer"
    from flowrl.plan import family_of

    fam = family_of(repo, "auto")
    shape = image_shape(components, attr, 512, 512, 128, family=fam)
    assert (shape.image_tokens, shape.text_tokens) == (image_tokens, text_tokens)
    assert components[attr].class_name == fam.denoiser_class
    layers = denoiser_layers(
        components[attr].module,
        fam.plan_layout,
        image_tokens=shape.image_tokens,
        text_tokens=shape.text_tokens,
        levels=shape.levels,
    )
    terms = activation_terms(layers, "bfloat16")
    assert 0 < terms.units_checkpointed < terms.units and terms.kept > 0
    assert {layer.stream for layer in layers} >= {"one", "txt"}  # time embeddings and text layers were found
    assert sum(layer.block is not None for layer in layers) > 0.8 * len(layers)  # the blocks were found


# ---------------------------------------------------------------------------------------------- the activation estimate


@pytest.fixture(scope="module")
def small_sd3(tmp_path_factory):
    """A small SD3 (4 blocks of 256, dual attention in the first two) saved to a directory."""
    bench = _bench()
    directory = tmp_path_factory.mktemp("sd3") / "model"
    bench.save_model(
        "sd3",
        str(directory),
        num_layers=4,
        num_attention_heads=4,
        caption_projection_dim=256,
        dual_attention_layers=(0, 1),
    )
    return bench, str(directory)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_activation_estimate_within_25_percent_of_the_measured_peak(small_sd3, tmp_path, checkpointing):
    """One real trainer update (bfloat16, LoRA, CFG, beta 0.01) at 128 px, micro-batch 1 and 2: what it allocates
    on top of the static memory, measured by LiveTensorBytes, against the planner's estimate of the same."""
    bench, directory = small_sd3
    torch.set_num_threads(1)
    for micro in (1, 2):
        r = bench.measure(
            directory, micro=micro, checkpointing=checkpointing, size=128, work=str(tmp_path / str(micro))
        )
        assert r["planned_static"] == pytest.approx(r["static"], rel=0.02)
        assert r["planned_dynamic"] / r["dynamic"] == pytest.approx(1.0, abs=0.25), r
        assert r["planned_rollout"] / r["rollout"] == pytest.approx(1.0, abs=0.25), r  # the denoiser, no gradients


def test_text_activation_estimate_within_25_percent_of_the_measured_peak(tmp_path):
    """The same for a causal LM (a random 8-layer Qwen2, 64 new tokens, GRPO's beta 0.04), micro-batch 2."""
    bench = _bench()
    torch.set_num_threads(1)
    directory = bench.save_text_model("qwen2-layers", str(tmp_path / "lm"))
    for checkpointing in (False, True):
        r = bench.measure_text(directory, micro=2, checkpointing=checkpointing, work=str(tmp_path / "w"))
        assert r["planned_static"] == pytest.approx(r["static"], rel=0.02)
        assert r["planned_dynamic"] / r["dynamic"] == pytest.approx(1.0, abs=0.25), r


def test_text_rollout_estimate_within_25_percent_of_the_measured_peak(tmp_path):
    """The rollout of a causal LM with a 151,936-entry vocabulary (text.old_log_probs=sampling, the default: the old
    log-probs come from generate's own scores, no forward of the batch after it). The plan once counted that
    forward's logits anyway: 1.68x the peak measured on an H200 (docs/benchmarks.md), ~40x here."""
    bench = _bench()
    torch.set_num_threads(1)
    directory = bench.save_text_model("qwen2-vocab", str(tmp_path / "lm"))
    r = bench.measure_text(directory, micro=2, checkpointing=False, work=str(tmp_path / "w"))
    assert r["planned_rollout"] / r["rollout"] == pytest.approx(1.0, abs=0.25), r


def test_text_rollout_plans_the_forward_of_the_batch_only_where_one_runs():
    from flowrl.plan import LOGITS_PHASE

    base = ["lora.enabled=true", "lora.rank=4"]
    sampling = plan(load_config(ROOT / "configs" / "text_arith.yaml", base)).rollout
    forward = plan(load_config(ROOT / "configs" / "text_arith.yaml", [*base, "text.old_log_probs=forward"])).rollout
    kl = ["train.grpo.beta=0.04", "text.kl_in_reward=true"]
    reference = plan(load_config(ROOT / "configs" / "text_arith.yaml", [*base, *kl])).rollout
    assert LOGITS_PHASE not in sampling.phases
    assert LOGITS_PHASE in forward.phases and LOGITS_PHASE in reference.phases
    assert forward.phases[LOGITS_PHASE][0] > 0 and forward.peak(4) >= sampling.peak(4) > 0


def test_vae_decode_estimate_matches_the_measured_peak():
    bench = _bench()
    torch.set_num_threads(1)
    for images, size in ((1, 64), (2, 96)):
        r = bench.measure_vae_decode(images, size)
        assert r["planned_decode"] / r["decode"] == pytest.approx(1.0, abs=0.1), r


def test_tracker_counts_live_storages_once():
    bench = _bench()
    with bench.LiveTensorBytes() as tracker:
        x = torch.zeros(1000)  # 4000 bytes
        y = x.view(10, 100)  # a view: no new storage
        x.add_(1)  # in place: none either
        z = x * 2  # 4000 more
        assert tracker.now == 8000
        del z
        assert tracker.now == 4000
        w = torch.ones(500, dtype=torch.bfloat16)  # 1000 bytes
    assert tracker.peak == 8000 and tracker.now == 5000
    del x, y, w


# ---------------------------------------------------------------------------------------------- monotonicity


def test_bigger_micro_batch_needs_more_memory_and_checkpointing_less():
    totals = [
        plan(_preset("sd35m_pickscore", f"train.micro_batch_size={m}")).fits["DDP"].configured_gib for m in (1, 2, 4, 8)
    ]
    assert totals == sorted(totals) and len(set(totals)) == 4
    off = plan(_preset("sd35m_pickscore"))
    on = plan(_preset("sd35m_pickscore", "train.gradient_checkpointing=true"))
    for s in on.titles:
        assert on.fits[s].per_sample_gib[True] < off.fits[s].per_sample_gib[False]
        assert on.fits[s].configured_gib < off.fits[s].configured_gib
        assert on.fits[s].largest[True] >= off.fits[s].largest[False]


def test_fsdp_over_more_gpus_needs_less_per_gpu():
    static = [plan(_preset("flux_dev_pickscore"), gpus=g).fits["FSDP"].static_gib for g in (1, 2, 8, 16)]
    assert static == sorted(static, reverse=True) and len(set(static)) == 4
    one, eight = plan(_preset("flux_dev_pickscore"), gpus=1), plan(_preset("flux_dev_pickscore"), gpus=8)
    den = lambda p: p.rows[0].gib  # noqa: E731
    assert den(eight)["FSDP"] == pytest.approx(den(one)["FSDP"] / 8)
    assert den(eight)["DDP"] == den(one)["DDP"]  # DDP replicates


def test_strategies_offload_and_full_fine_tuning():
    lora = plan(_preset("sd35m_pickscore"))
    rows = {r.label: r for r in lora.rows}
    t5 = next(r for r in lora.rows if r.label.startswith("text_encoder_3"))
    assert t5.gib["offload"] is None and t5.gib["DDP"] > 8  # T5-XXL in bfloat16, off the GPU when offloading
    assert rows["AdamW states (2 x float32)"].gib["offload"] is None
    assert rows["reference: the adapter off (no weights)"].gib["DDP"] == 0
    full = plan(_preset("sd35m_pickscore", "lora.enabled=false"))
    ref = next(r for r in full.rows if r.label.startswith("reference"))
    assert ref.gib["DDP"] == pytest.approx(full.rows[0].gib["DDP"])  # a frozen copy of the denoiser
    adam = next(r for r in full.rows if r.label.startswith("AdamW"))
    assert adam.gib["DDP"] == pytest.approx(4 * full.rows[0].gib["DDP"], rel=0.1)  # 2 float32 states of bf16 weights
    masters = next(r for r in full.rows if r.label == "float32 master weights")
    assert masters.gib["DDP"] == pytest.approx(2 * full.rows[0].gib["DDP"], rel=0.1) and masters.gib["offload"] is None
    assert not any(r.label == "float32 master weights" for r in lora.rows)  # the LoRA is float32 already
    eight = plan(_preset("sd35m_pickscore", "lora.enabled=false", "train.optimizer=adamw_8bit"))
    adam8 = next(r for r in eight.rows if r.label.startswith("AdamW8bit"))
    assert adam8.gib["DDP"] == pytest.approx(adam.gib["DDP"] / 4)  # 2 bytes per parameter instead of 8
    assert full.fits["DDP"].static_gib > lora.fits["DDP"].static_gib
    no_t5 = plan(_preset("sd35m_pickscore", "model.drop_t5=true"))
    assert not any(r.label.startswith("text_encoder_3") for r in no_t5.rows)


def test_rows_follow_the_config():
    p = plan(_preset("sd35m_pickscore"))  # 48 x 24 samples, 10 steps at 512 px, 60 + 24 prompts, PickScore, EMA
    gib = {r.label: r.gib for r in p.rows}
    assert gib["trajectory latents (1152 samples x 11)"]["DDP"] == pytest.approx(1152 * 11 * 16 * 64 * 64 * 2 / GIB)
    assert "prompt-encoding cache (84 prompts)" in gib
    lora = next(r for r in p.rows if r.label.startswith("LoRA r32 on 191 layers"))  # 24 blocks x 8, the last has
    assert gib["EMA of the trained parameters (float32)"]["DDP"] == pytest.approx(lora.gib["DDP"])  # no to_add_out
    assert gib["EMA of the trained parameters (float32)"]["offload"] is None
    reward = next(r for r in p.rows if r.label.startswith("reward pickscore"))
    assert reward.gib["DDP"] == pytest.approx(4 * reward.params_b * 1e9 / GIB, rel=0.01)  # float32 by default
    assert gib["FSDP: two blocks gathered at once"]["DDP"] == 0 < gib["FSDP: two blocks gathered at once"]["FSDP"]
    assert p.update.rows_per_sample == 2  # one step, CFG
    assert plan(_preset("sd35m_fast")).update.rows_per_sample == 4  # two steps per forward, CFG
    assert plan(_preset("flux_dev_pickscore")).update.rows_per_sample == 1  # guidance embedding, no CFG batch
    assert not any(r.label.startswith("reward") for r in plan(_preset("sd35m_ocr")).rows)  # Tesseract, no GPU
    full8 = plan(_preset("sd35m_pickscore", "lora.enabled=false"), gpus=8)
    grads = next(r for r in full8.rows if r.label.startswith("gradients")).gib["DDP"]
    assert full8.fits["DDP"].transient_gib == pytest.approx(2 * grads)  # flowrl's flat all-reduce of the gradients


def test_rollout_batch_size_bounds_the_rollout():
    whole = plan(_preset("sd35m_pickscore"))  # rollout_batch_size 0: the 1152 images of the GPU at once
    assert whole.rollout.items == 1152
    decode = whole.rollout.phases["VAE decode"][0]
    assert decode == pytest.approx(6.0 * 2 * 512 * 512 * 128)  # VAE_DECODE_FACTOR x bf16 x 512 x 512 x 128 channels
    assert not whole.rollout_fits["DDP"][1] and not whole.fits_as_configured("DDP")
    largest = whole.rollout_fits["DDP"][2]
    assert 24 < largest < 1152
    chunked = plan(_preset("sd35m_pickscore", f"sample.rollout_batch_size={largest - largest % 24}"))
    assert chunked.rollout_fits["DDP"][1] and chunked.fits_as_configured("DDP")
    assert chunked.rollout_fits["offload"][0] < chunked.rollout_fits["DDP"][0]  # the VAE decodes on the CPU
    # text.old_log_probs=forward: 256 completions' logits in one forward, 151,936 x 1024 tokens each
    text = plan(_preset("text_qwen_gsm8k", "text.old_log_probs=forward"))
    assert text.rollout.phases["old log-probs (logits)"][0] > 1024 * 151936 * 2  # more than the bf16 logits
    assert (
        plan(_preset("text_qwen_gsm8k", "text.old_log_probs=forward", "sample.prompts_per_epoch=8")).rollout_fits[
            "DDP"
        ][0]
        < text.rollout_fits["DDP"][0]
    )


def test_every_preset_plans_at_1_and_8_gpus():
    for preset in sorted(ROOT.glob("configs/*.yaml")):
        for gpus in (1, 8):
            cfg = load_config(preset)
            if cfg.model.path in NOT_SHIPPED:  # offline: a clear error naming the model
                with pytest.raises(PlanError, match=cfg.model.path):
                    plan(cfg, gpus=gpus)
                continue
            total = cfg.sample.prompts_per_epoch * cfg.sample.group_size
            if total % gpus or (total // gpus) % (cfg.train.minibatch_size or 1):  # the trainer refuses it too
                with pytest.raises(PlanError, match="split evenly|does not divide"):
                    plan(cfg, gpus=gpus)
                continue
            text = plan(cfg, gpus=gpus).render()
            assert "largest micro-batch" in text, preset


# ---------------------------------------------------------------------------------------------- errors and the CLI


def test_offline_hub_id_without_a_shipped_config_fails_naming_it(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = load_config(None, ["model.path=some-org/no-such-model"])
    with pytest.raises(PlanError) as info:
        plan(cfg)
    message = str(info.value)
    assert "some-org/no-such-model" in message and "HF_HUB_OFFLINE" in message
    assert "stabilityai/stable-diffusion-3.5-medium" in message  # the shipped ones are listed


def test_local_directory_without_model_index_fails(tmp_path):
    with pytest.raises(PlanError, match="no model_index.json"):
        plan(load_config(None, [f"model.path={tmp_path}"]))


def test_gpus_that_do_not_split_the_batch_fail():
    with pytest.raises(PlanError, match="does not split evenly over 7 GPUs"):
        plan(_preset("sd35m_pickscore"), gpus=7)


@pytest.mark.parametrize(
    "text,gib", [("80GiB", 80), ("80", 80), ("24 GB", 24e9 / 2**30), ("40960MiB", 40), ("80g", 80)]
)
def test_parse_memory(text, gib):
    assert parse_memory(text) == pytest.approx(gib)


@pytest.mark.parametrize("text", ["", "eighty", "80XB", "-5GiB", "0"])
def test_parse_memory_rejects(text):
    with pytest.raises(PlanError, match="80GiB"):
        parse_memory(text)


def test_parse_memory_names_a_size_that_is_not_positive_or_leaves_nothing_usable():
    for text in ("0GiB", "-5GiB", "0"):
        with pytest.raises(PlanError, match="must be positive"):
            parse_memory(text)
    for text in ("1GiB", "0.5"):
        with pytest.raises(PlanError, match="leaves nothing usable: the plan keeps 1 GiB and 5%"):
            parse_memory(text)
    assert parse_memory("2GiB") == 2


def test_main_prints_the_table_and_says_whether_it_fits(capsys):
    assert main(str(ROOT / "configs" / "tiny_cpu.yaml"), [], gpus=1, gpu_memory="80GiB") == 0
    out = capsys.readouterr().out
    assert "tiny-sd3" in out and "DDP" in out and "FSDP" in out and "offload" in out and "ZeRO-2" in out
    assert main(str(ROOT / "configs" / "flux_dev_pickscore.yaml"), ["lora.enabled=false"], gpu_memory="24GiB") == 1
    assert "NO" in capsys.readouterr().out


def test_objectives_rows_references_shadows_and_update_rows():
    """train.objective: NFT keeps a second adapter (LoRA) or a frozen copy (full fine-tuning) and a reference pass
    while its kl_coef > 0; DPO always has a reference; the forward-process objectives keep only the final latents
    and train without CFG (DPO: winner and loser)."""
    grpo = plan(_preset("sd35m_pickscore"))
    lora = next(r for r in grpo.rows if r.label.startswith("LoRA r32"))
    nft = plan(_preset("sd35m_pickscore", "train.objective=nft", "train.nft.timesteps=3"))
    gib = {r.label: r.gib for r in nft.rows}
    assert gib["nft: shadow adapter 'old' (float32)"]["DDP"] == pytest.approx(lora.gib["DDP"])
    assert gib["nft: shadow adapter 'old' (float32)"]["FSDP"] == pytest.approx(lora.gib["DDP"])  # 1 GPU
    assert "reference: the adapter off (no weights)" in gib
    assert gib["trajectory latents (1152 samples x 1)"]["DDP"] == pytest.approx(1152 * 16 * 64 * 64 * 2 / GIB)
    assert nft.update.rows_per_sample == 1  # one time per forward (steps_per_forward 1), no CFG
    no_kl = plan(_preset("sd35m_pickscore", "train.objective=awm", "train.awm.kl_coef=0"))
    assert not any(r.label.startswith("reference") or "shadow" in r.label for r in no_kl.rows)
    ema = plan(_preset("sd35m_pickscore", "train.objective=awm", "train.awm.ema_kl_coef=1", "lora.enabled=false"))
    copy = next(r for r in ema.rows if r.label == "awm: shadow policy 'ema', a frozen copy")
    assert copy.gib["DDP"] == pytest.approx(ema.rows[0].gib["DDP"])
    dpo = plan(_preset("sd35m_pickscore", "train.objective=dpo", "train.steps_per_forward=2"))
    assert dpo.update.rows_per_sample == 4  # 2 times x (winner, loser)
    assert any(r.label.startswith("reference") for r in dpo.rows) and "objective dpo" in dpo.render()
    # a DPO micro-batch counts pairs (the trainer computes only the winners): at most the groups of a GPU's batch
    for gpus, pairs in ((1, 1152 // 24), (8, 1152 // 24 // 8)):
        p = plan(
            _preset("sd35m_pickscore", "train.objective=dpo", "train.minibatch_size=0", "train.micro_batch_size=100"),
            gpus=gpus,
        )
        assert (p.unit, p.minibatch, p.micro_batch) == ("pairs", pairs, pairs)
        assert f"at most the minibatch ({pairs} pairs per GPU)" in p.render()
    # train.cache_reference keeps a float32 velocity per sample and training time for the epoch (with two passes)
    cached = plan(
        _preset("sd35m_pickscore", "train.objective=dpo", "train.inner_epochs=2", "train.cache_reference=true")
    )
    label = "reference velocities kept for the epoch (1152 samples x 10 times, float32)"
    assert {r.label: r.gib for r in cached.rows}[label]["DDP"] == pytest.approx(1152 * 10 * 16 * 64 * 64 * 4 / GIB)
    for off in (["train.inner_epochs=2"], ["train.cache_reference=true"]):
        assert not any(
            "reference velocities" in r.label
            for r in plan(_preset("sd35m_pickscore", "train.objective=dpo", *off)).rows
        )
    # GRPO with a KL term keeps a float32 reference mean per sample and trained step (sd35m at 512 px: 16 x 64 x 64)
    grpo_cached = plan(_preset("sd35m_pickscore", "train.inner_epochs=2", "train.cache_reference=true"))
    label = "reference step means kept for the epoch (1152 samples x 10 steps, float32)"
    assert {r.label: r.gib for r in grpo_cached.rows}[label]["DDP"] == pytest.approx(1152 * 10 * 16 * 64 * 64 * 4 / GIB)
    no_kl = plan(_preset("sd35m_pickscore", "train.inner_epochs=2", "train.cache_reference=true", "train.grpo.beta=0"))
    assert not any("reference step means" in r.label for r in no_kl.rows)
    small = plan(_preset("sd35m_pickscore", "train.objective=dpo", "train.minibatch_size=16"))
    assert (small.minibatch, small.micro_batch) == (16, 16)  # 16 random samples hold at most 16 winners
    assert (grpo.unit, grpo.minibatch) == ("samples", 8)  # the preset's minibatch_size


# ---------------------------------------------------------------------------------------------- video and editing


@pytest.mark.parametrize("name", ["wan", "wan_i2v", "flux_kontext", "qwen_image_edit", "flux", "sd3"])
def test_planned_tokens_are_those_the_denoiser_gets(name):
    """The image and text tokens the planner counts for a row (a video's latent frames x patches; an editor's
    source tokens at the most images it takes; Wan image-to-video's CLIP image tokens) against the tensors the tiny
    family passes its denoiser in a rollout. Qwen-Image-Edit's text tokens are left out: its instruction encoding
    holds the images at the processor's size, which the tiny processor caps far below the real one's."""
    import sys

    from flowrl.families import family, load_image_backend
    from flowrl.plan import image_shape

    sys.path.insert(0, str(Path(__file__).parent))
    from conditioned import source_image

    torch.set_num_threads(1)
    fam = family(name)
    backend = load_image_backend(f"tiny-{name}", max_sequence_length=16)
    seen = []

    def record(module, args, kwargs):
        x = kwargs.get("hidden_states", args[0] if args else None)
        cfg = module.config
        if x.ndim == 3:  # packed tokens [B, L, C]
            tokens = x.shape[1]
        else:  # [B, C, (F,) H, W] in patches
            patch = cfg.get("patch_size") or 1
            pt, ph, pw = tuple(patch) if isinstance(patch, (list, tuple)) else (1, patch, patch)
            tokens = (x.shape[2] // pt if x.ndim == 5 else 1) * (x.shape[-2] // ph) * (x.shape[-1] // pw)
        text = kwargs["encoder_hidden_states"].shape[1]
        image = kwargs.get("encoder_hidden_states_image")
        seen.append((tokens, text + (image.shape[1] if image is not None else 0)))

    handle = backend.denoiser.register_forward_pre_hook(record, with_kwargs=True)
    images = [[source_image(seed=k) for k in range(fam.condition_images[1])]] if fam.condition_images[1] else None
    backend.rollout(
        ["a red cat"],
        1,
        num_steps=1,
        sde_type="ode",
        height=32,
        width=32,
        decode=False,
        num_frames=fam.tiny_num_frames,
        images=images,
    )
    handle.remove()
    _, parts, _ = pipeline_components(f"tiny-{name}", "float32")
    shape = image_shape({p.name: p for p in parts}, fam.denoiser_attr, 32, 32, 16, fam.tiny_num_frames, fam)
    tokens, text = seen[0]
    assert shape.image_tokens == tokens
    if name != "qwen_image_edit":
        assert shape.text_tokens == text
    assert shape.sources == fam.condition_images[1]
    assert (shape.condition_elements > 0) == (fam.condition_images[1] > 0)


def test_an_editors_plan_counts_the_most_images_a_prompt_of_the_data_has(tmp_path):
    """Qwen-Image-Edit takes 1 to 3 sources: with a local .jsonl the planner counts the most a prompt holds (2 here),
    each adding its tokens; without one (a hub dataset) it counts 3, and says so; video frames show in the line."""
    from PIL import Image

    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    rows = [{"prompt": "swap them", "image": ["a.png", "a.png"]}, {"prompt": "blue", "image": "a.png"}]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = ["model.path=tiny-qwen_image_edit", "sample.height=32", "sample.width=32", "sample.max_sequence_length=16"]
    line = lambda cfg: next(ln for ln in plan(cfg).render().splitlines() if ln.startswith("update"))  # noqa: E731
    two = line(load_config(None, [*base, f"data.train_prompts={tmp_path / 'p.jsonl'}"]))
    three = line(load_config(None, base))
    assert "2 conditioning images (the most a prompt has)" in two
    assert "3 conditioning images (the most the family takes)" in three
    tokens = lambda text: int(text.split(" = ")[1].split(" image")[0])  # noqa: E731
    assert (
        tokens(three) - tokens(two)
        == tokens(two) - tokens(line(load_config(None, [*base, f"data.train_prompts={_one_image_prompts(tmp_path)}"])))
        > 0
    )
    video = line(
        load_config(
            None,
            [
                "model.path=tiny-wan",
                "sample.height=32",
                "sample.width=32",
                "sample.max_sequence_length=16",
                "sample.num_frames=9",
            ],
        )
    )
    assert "9 frames of 32x32 px = 12 image + 16 text tokens" in video  # 3 latent frames x 2 x 2 patches


def _one_image_prompts(directory: Path) -> Path:
    path = directory / "one.jsonl"
    path.write_text(json.dumps({"prompt": "blue", "image": "a.png"}) + "\n")
    return path


def test_an_editors_plan_reads_csv_tsv_and_json_prompt_files_as_training_does(tmp_path):
    """The images a prompt holds are counted in every format the prompt loader reads, not only .jsonl: a .json
    array's lists (2 here), a .csv's or .tsv's cells (one path each, under the file's own prompt column); the prompt
    cache counts the file's prompts, not its lines (a header, a quoted prompt over two lines)."""
    from PIL import Image

    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    rows = [{"text": "swap them", "image": ["a.png", "a.png"]}, {"text": "blue", "image": "a.png"}]
    (tmp_path / "p.json").write_text(json.dumps(rows))
    (tmp_path / "p.csv").write_text('text,image\n"a red\ncat",a.png\nblue,a.png\n')
    (tmp_path / "p.tsv").write_text("text\timage\nred\ta.png\n")
    base = ["model.path=tiny-qwen_image_edit", "sample.height=32", "sample.width=32", "sample.max_sequence_length=16"]
    base.append("data.prompt_column=text")
    for name, images, prompts in (("p.json", "2 conditioning images", 2), ("p.csv", "1 conditioning image", 2)):
        result = plan(load_config(None, [*base, f"data.train_prompts={tmp_path / name}"])).render()
        update = next(ln for ln in result.splitlines() if ln.startswith("update"))
        assert f"{images} (the most a prompt has)" in update, update
        assert f"prompt-encoding cache ({prompts} prompts)" in result
    update = plan(load_config(None, [*base, f"data.train_prompts={tmp_path / 'p.tsv'}"])).render()
    assert "1 conditioning image (the most a prompt has)" in update


def test_the_eval_feature_backbone_is_planned_like_a_reward(tmp_path):
    """eval.diversity_features keeps a vision backbone in float32 on the main process's GPU (off it with offload):
    its row has the backbone's size, and the static memory grows by it; a backbone of another kind, or one with no
    configuration here, is a note."""
    from rewardtiny import save_tiny_dinov2

    args = ["eval.images_per_prompt=2"]
    base = plan(_preset("sd35m_pickscore", *args))
    clip = plan(_preset("sd35m_pickscore", *args, "eval.diversity_features=openai/clip-vit-large-patch14"))
    row = next(r for r in clip.rows if r.label.startswith("eval.diversity_features, main process (CLIPModel"))
    assert row.params_b == pytest.approx(0.428, rel=0.01) and row.note == "float32" and row.gib["offload"] is None
    assert row.gib["DDP"] == pytest.approx(4 * row.params_b * 1e9 / GIB, rel=0.01)
    assert clip.fits["DDP"].static_gib == pytest.approx(base.fits["DDP"].static_gib + row.gib["DDP"], rel=1e-6)
    assert clip.fits["offload"].static_gib == pytest.approx(base.fits["offload"].static_gib, rel=1e-6)

    dino = save_tiny_dinov2(tmp_path / "dino")  # a local directory: the parameters the trainer would load
    local = plan(_preset("sd35m_pickscore", *args, f"eval.diversity_features={tmp_path / 'dino'}"))
    row = next(r for r in local.rows if r.label.startswith("eval.diversity_features, main process (Dinov2Model"))
    assert row.params_b * 1e9 == pytest.approx(sum(p.numel() for p in dino.parameters()), abs=0.5)

    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text(json.dumps({"model_type": "bert"}))
    other = plan(_preset("sd35m_pickscore", *args, f"eval.diversity_features={tmp_path / 'bert'}")).render()
    assert "is a 'bert' model, not one of dinov2, clip, clip_vision_model; its memory is not estimated" in other
    (tmp_path / "empty").mkdir()
    missing = plan(_preset("sd35m_pickscore", *args, f"eval.diversity_features={tmp_path / 'empty'}")).render()
    assert f"eval.diversity_features: no configuration for {tmp_path / 'empty'}" in missing


def test_every_reward_is_planned_as_it_declares_itself(tmp_path, monkeypatch):
    """The planner asks the rewards (rewards.memory_spec): a CLIP backbone in the reward's dtype, ImageReward's known
    size, a weighted sum's components, the similarity rewards' DINOv2 (shipped, or a local directory), no row for what
    holds nothing, and a note for what cannot be sized (the paddle OCR engine, a plug-in that declares nothing)."""
    from rewardtiny import save_tiny_dinov2

    def rows(*rewards_list):
        p = plan(_preset("sd35m_pickscore", f"rewards=[{', '.join(rewards_list)}]"))
        return {r.label: r for r in p.rows if r.label.startswith("reward")}, p.render()

    found, _ = rows("{name: clip_score, kwargs: {dtype: fp16}}")  # the note: a dtype other than the model's
    (clip,) = found.values()
    assert clip.label == "reward clip_score (CLIPModel openai/clip-vit-large-patch14)" and clip.note == "float16"
    assert clip.gib["DDP"] == pytest.approx(2 * clip.params_b * 1e9 / GIB, rel=0.01)

    found, _ = rows("{name: imagereward}")
    (blip,) = found.values()
    assert blip.label == "reward imagereward (ImageReward BLIP ViT-L + BERT-base)"
    assert blip.params_b * 1e9 == pytest.approx(446_665_953, abs=1) and blip.note == "float32"
    assert blip.gib["DDP"] == pytest.approx(4 * 446_665_953 / GIB)

    found, text = rows(
        "{name: weighted, kwargs: {components: {pickscore: 1.0, hps: {reward: hpsv2, weight: 0.5}, "
        "jpeg_compressibility: 1.0, text: {reward: ocr, engine: paddle}}}}"
    )
    assert sorted(found) == [
        "reward hpsv2 (CLIPModel laion/CLIP-ViT-H-14-laion2B-s32B-b79K)",
        "reward pickscore (CLIPModel yuvalkirstain/PickScore_v1)",
    ]
    assert "reward ocr: the paddle engine runs in PaddlePaddle's memory; its memory is not estimated" in text

    found, text = rows("{name: edit_consistency}")
    assert (
        list(found) == ["reward edit_consistency (Dinov2Model facebook/dinov2-small)"] and "not estimated" not in text
    )
    dino = save_tiny_dinov2(tmp_path / "dino")
    found, _ = rows(f"{{name: temporal_consistency, kwargs: {{model: {tmp_path / 'dino'}}}}}")
    (local,) = found.values()
    assert local.params_b * 1e9 == pytest.approx(sum(p.numel() for p in dino.parameters()), abs=0.5)

    found, _ = rows("{name: shapes_edit}", "{name: shapes_motion}", "{name: remote, kwargs: {url: 'http://x:1'}}")
    assert found == {}

    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.py").write_text("def score(images, prompts):\n    return [0.0] * len(images)\n")
    found, text = rows("{name: 'mine.py:score'}")
    assert (
        found == {}
        and (
            "reward mine.py:score: it declares nothing (a plug-in's function declares .memory, see "
            "rewards.memory); its memory is not estimated"
        )
        in text
    )


def test_plan_exits_1_only_for_a_config_that_fits_nowhere(capsys):
    """`flowrl plan`'s exit code tells a script the two apart: 1 (said on stderr too) when the config was planned and
    fits under no column, 2 for what it cannot plan (a bad --gpus or --gpu-memory, a batch that does not split)."""
    from pathlib import Path

    from flowrl.cli import main

    configs = Path(__file__).resolve().parents[1] / "configs"
    assert main(["plan", str(configs / "sd35m_pickscore.yaml"), "--gpu-memory", "4GiB"]) == 1
    captured = capsys.readouterr()
    assert "fits under no column of the plan above (1 GPU of 4GiB)" in captured.err and captured.out
    for extra in (["--gpus", "0"], ["--gpu-memory", "abc"], ["--gpus", "3"]):  # tiny_cpu's batch is 8
        assert main(["plan", str(configs / "tiny_cpu.yaml"), *extra]) == 2, extra
        err = capsys.readouterr().err.strip()
        assert err.startswith("flowrl plan: ") and "\n" not in err, err
