"""flowrl.lora_files: what a saved LoRA records of its settings (diffusers' header metadata, peft's
adapter_config.json), which of them a start refuses, and the modules its keys name."""

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from flowrl.config import ConfigError
from flowrl.lora_files import _blocks, adapter_settings, lora_modules, match_state, peft_keys, settings_problem

LORA = SimpleNamespace(rank=8, alpha=16.0, target_modules=None)


def diffusers_file(path, fields: dict) -> None:
    meta = {f"{component}.{k}": v for component, values in fields.items() for k, v in values.items()}
    save_file({"x.lora_A.weight": torch.zeros(8, 4)}, path, metadata={"lora_adapter_metadata": json.dumps(meta)})


def test_settings_come_from_the_header_of_the_named_component_or_the_peft_config(tmp_path):
    f = tmp_path / "pytorch_lora_weights.safetensors"
    diffusers_file(f, {"transformer": {"r": 8, "lora_alpha": 32, "peft_version": "x"}, "text_encoder": {"r": 4}})
    assert adapter_settings(f, "transformer") == {"r": 8, "lora_alpha": 32}
    assert adapter_settings(f, "text_encoder") == {"r": 4}
    assert adapter_settings(f) == {}  # two components and none named: nothing is assumed
    one = tmp_path / "one.safetensors"
    diffusers_file(one, {"unet": {"lora_alpha": 4, "use_dora": False}})
    assert adapter_settings(one) == {"lora_alpha": 4, "use_dora": False}  # the only component it holds

    peft = tmp_path / "peft"
    peft.mkdir()
    save_file({"x.lora_A.weight": torch.zeros(8, 4)}, peft / "adapter_model.safetensors")
    assert adapter_settings(peft / "adapter_model.safetensors") == {}  # records nothing
    (peft / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 8, "target_modules": ["c_attn"]}))
    assert adapter_settings(peft / "adapter_model.safetensors") == {
        "r": 8,
        "lora_alpha": 8,
        "target_modules": ["c_attn"],
    }


@pytest.mark.parametrize(
    "settings, expected",
    [
        ({"r": 8, "lora_alpha": 16}, None),
        ({"r": 8, "lora_alpha": 16.0, "use_rslora": False, "use_dora": False, "alpha_pattern": {}}, None),
        ({}, None),
        (
            {"r": 8, "lora_alpha": 4},
            r"lora alpha 4 \(rank 8: a scale of 0\.5\), this config's lora\.alpha is 16: set lora\.alpha=4",
        ),
        ({"use_dora": True}, r"is a DoRA adapter"),
        ({"use_rslora": True}, r"alpha / sqrt\(r\)"),
        ({"alpha_pattern": {"to_q": 32}}, r"alphas of its own for some modules \(alpha_pattern: \{\"to_q\": 32\}\)"),
        ({"rank_pattern": {"to_q": 4}}, r"ranks of its own"),
    ],
)
def test_settings_problem_names_what_differs(settings, expected):
    problem = settings_problem(settings, LORA, "F")
    if expected is None:
        assert problem is None
    else:
        assert problem.startswith("lora.init_path: F ") and __import__("re").search(expected, problem), problem


def test_a_lora_that_records_no_alpha_is_read_as_diffusers_reads_it(tmp_path):
    """No alpha in a LoRA's file (diffusers' save_lora_weights without metadata, a converted kohya file): diffusers
    loads it with alpha = its rank, a scale of 1, so the config's lora.alpha must be that rank; the premise is
    checked on diffusers itself (a tiny SD3 transformer's load_lora_adapter of such a file)."""
    from diffusers import SD3Transformer2DModel
    from peft import LoraConfig
    from safetensors.torch import save_file

    from flowrl.families.sd3 import TINY_TRANSFORMER

    assert settings_problem({}, LORA, "F", [16]) is None  # LORA: alpha 16; a file of rank 16 (scale 1 both ways)
    problem = settings_problem({}, LORA, "F", [8])
    assert problem.startswith("lora.init_path: F records no lora alpha, which diffusers reads as alpha = its rank (8")
    assert "set lora.alpha=8" in problem
    assert settings_problem({}, LORA, "F", [4, 8]) is None  # ranks of their own: match_state names the rank

    model = SD3Transformer2DModel(**TINY_TRANSFORMER)
    model.add_adapter(LoraConfig(r=4, lora_alpha=12, target_modules=["to_q"]))
    state = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    save_file(
        {"transformer." + k.replace(".default", ""): v for k, v in state.items()}, str(tmp_path / "l.safetensors")
    )
    fresh = SD3Transformer2DModel(**TINY_TRANSFORMER)
    fresh.load_lora_adapter(str(tmp_path / "l.safetensors"), prefix="transformer", adapter_name="x")
    assert fresh.peft_config["x"].r == 4 and fresh.peft_config["x"].lora_alpha == 4  # alpha = rank


def test_lora_modules_are_the_names_after_the_block_index():
    keys = [
        "transformer_blocks.0.attn.to_q.lora_A.weight",
        "transformer_blocks.1.attn.to_q.lora_B.weight",
        "transformer_blocks.0.attn.to_out.0.lora_A.weight",
        "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_k.lora_A.weight",
        "base_model.model.transformer.h.1.attn.c_attn.lora_B.weight",
        "context_embedder.lora_A.weight",
    ]
    assert lora_modules(dict.fromkeys(keys)) == [
        "attn.c_attn",
        "attn.to_out.0",
        "attn.to_q",
        "attn1.to_k",
        "context_embedder",
    ]


def test_match_state_checks_rank_keys_and_shapes():
    own = {"b.0.q.lora_A.weight": (8, 4), "b.0.q.lora_B.weight": (4, 8)}
    good = {"b.0.q.lora_A.weight": torch.zeros(8, 4), "b.0.q.lora_B.weight": torch.zeros(4, 8)}
    assert match_state(good, own, LORA, "F") is good
    with pytest.raises(ConfigError, match=r"rank 2, this config's lora\.rank is 8: set lora\.rank=2"):
        match_state({"b.0.q.lora_A.weight": torch.zeros(2, 4)}, own, LORA, "F")
    wide = {**good, "b.0.k.lora_A.weight": torch.zeros(8, 4), "b.0.k.lora_B.weight": torch.zeros(4, 8)}
    with pytest.raises(ConfigError, match=r"2 of its keys are not the adapter's .* lora\.target_modules=\[k,q\]"):
        match_state(wide, own, LORA, "F")
    with pytest.raises(ConfigError, match=r"lora\.target_modules=\[attn\.to_k,attn\.to_q\]: set that"):
        match_state(wide, own, LORA, "F", ["attn.to_q", "attn.to_k"])  # the file's own record wins
    with pytest.raises(ConfigError, match=r"1 keys differ in shape \(b\.0\.q\.lora_B\.weight\)"):
        match_state({**good, "b.0.q.lora_B.weight": torch.zeros(5, 8)}, own, LORA, "F")
    # diffusers' UNet format, and the old attention processors': read as diffusers reads them (peft's keys)
    unet = {"b.0.q.lora.down.weight": torch.zeros(8, 4), "b.0.q.lora.up.weight": torch.zeros(4, 8)}
    assert sorted(match_state(unet, own, LORA, "F")) == sorted(own)
    processor = {"b.0.processor.to_q_lora.down.weight": torch.zeros(8, 4), "b.0.processor.to_q_lora.up.weight": 0}
    assert sorted(peft_keys(processor)) == ["b.0.to_q.lora_A.weight", "b.0.to_q.lora_B.weight"]
    assert peft_keys(good) is good
    # blocks this model does not have (another model's LoRA): not sent to lora.target_modules, which cannot help
    other = {k.replace("b.0.", "b.7."): v for k, v in good.items()}
    for state in (other, {**other, "b.7.k.lora_A.weight": torch.zeros(8, 4)}):
        with pytest.raises(ConfigError, match=r"adapts blocks this model does not have \(b\.7\)") as e:
            match_state(state, own, LORA, "F")
        assert "it was made for another model" in str(e.value) and "set that" not in str(e.value)
    fewer = {"b.0.q.lora_A.weight": torch.zeros(8, 4), "b.0.q.lora_B.weight": torch.zeros(4, 8)}
    more_own = {
        **own,
        "c.0.q.lora_A.weight": (8, 4),
        "c.0.q.lora_B.weight": (4, 8),
    }  # blocks it has that the LoRA has not
    with pytest.raises(ConfigError, match=r"a LoRA of the modules this config adapts \(q\) and still not") as e:
        match_state(fewer, more_own, LORA, "F")  # (setting lora.target_modules=[q] would change nothing)
    assert "it was made for another model" in str(e.value)
    deep = {"down.1.attn.0.to_out.0.lora_A.weight": 0, "blocks.3.attn.to_q.lora_B.weight": 0, "x.lora_A.weight": 0}
    assert _blocks(deep) == {"down.1.attn.0", "blocks.3"}


def test_an_exported_lora_lists_its_target_modules_sorted(tmp_path):
    """peft keeps target_modules as a set (its order changes with the process's hash seed): the export sorts it, so
    the same weights give the same file in every process, and a start from it reads the same modules."""
    from flowrl.config import load_config
    from flowrl.policies import build_policy

    cfg = load_config(None, ["model.device=cpu", "sample.max_sequence_length=16", f"log.run_dir={tmp_path}"])
    policy = build_policy(cfg, "cpu")
    den = policy.backend.denoiser
    den.peft_config["default"].target_modules = set(den.peft_config["default"].target_modules)  # as peft keeps it
    policy.export(tmp_path / "lora")
    (file,) = (tmp_path / "lora").glob("*.safetensors")
    recorded = adapter_settings(file)["target_modules"]
    assert recorded == sorted(recorded) and len(recorded) > 2


def test_another_components_lora_is_named_and_peft_save_pretrained_keys_are_read(tmp_path):
    """A diffusers LoRA of another component than the denoiser (a UNet's given to a transformer model), or of a
    text encoder besides it, is refused naming them; peft's save_pretrained of the denoiser (keys under
    `base_model.model.`) starts the adapter, while a text model's own peft keys keep that prefix."""
    from flowrl.lora_files import component_problem, init_state

    assert component_problem(["transformer.x.lora_A.weight"], "transformer", tmp_path) is None
    assert component_problem(["base_model.model.x.lora_A.weight"], "transformer", tmp_path) is None
    assert component_problem(["unet.x.lora_A.weight"], None, tmp_path) is None  # text: nothing to name
    message = component_problem(["unet.x.lora_A.weight"], "transformer", tmp_path)
    assert "a LoRA of the pipeline's unet, and this model's trained network is its transformer" in message
    both = component_problem(["transformer.x.lora_A.weight", "text_encoder.y.lora_A.weight"], "transformer", tmp_path)
    assert "of the pipeline's text_encoder besides its transformer's" in both and "transformer_lora_layers" in both

    lora = SimpleNamespace(rank=2, alpha=16.0, target_modules=None)
    own = {"blocks.0.to_q.lora_A.weight": (2, 4), "blocks.0.to_q.lora_B.weight": (4, 2)}
    peft = tmp_path / "adapter_model.safetensors"
    save_file({"base_model.model." + k: torch.zeros(s) for k, s in own.items()}, str(peft))
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 16}))  # peft writes it beside
    assert sorted(init_state(peft, lora, own, "transformer")) == sorted(own)
    text_own = {"base_model.model." + k: s for k, s in own.items()}
    assert sorted(init_state(peft, lora, text_own)) == sorted(text_own)
    unet = tmp_path / "pytorch_lora_weights.safetensors"
    save_file({"unet." + k: torch.zeros(s) for k, s in own.items()}, str(unet))
    with pytest.raises(ConfigError, match="a LoRA of the pipeline's unet"):
        init_state(unet, lora, own, "transformer")


@pytest.mark.parametrize("family", ["sd15", "sdxl"])
def test_a_unet_runs_own_export_starts_the_adapter_it_was(family, tmp_path):
    """An SD1.5 or SDXL run exports its UNet's LoRA in diffusers' UNet format (`unet.<module>.lora.down.weight`,
    convert_state_dict_to_diffusers): as lora.init_path it starts the very adapter that was exported (every lora_A
    and lora_B equal), read as diffusers' load_lora_weights reads it; preflight reads its rank and alpha too."""
    from flowrl.config import load_config
    from flowrl.policies import build_policy
    from flowrl.preflight import PreflightError, check_lora_init, lora_init_file

    base = [f"model.path=tiny-{family}", "model.device=cpu", "sample.max_sequence_length=16"]
    made = build_policy(load_config(None, [*base, f"log.run_dir={tmp_path / 'a'}"]), "cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, p in made.named_trainable_parameters():
            p.copy_(torch.randn(p.shape, generator=generator))
    made.export(tmp_path / "lora")
    path, shapes = lora_init_file(str(tmp_path / "lora"))
    assert all(k.startswith("unet.") and (".lora.down." in k or ".lora.up." in k) for k in shapes)  # diffusers' format

    cfg = load_config(None, [*base, f"log.run_dir={tmp_path / 'b'}", f"lora.init_path={tmp_path / 'lora'}"])
    check_lora_init(cfg, family)
    started = build_policy(cfg, "cpu")
    exported = dict(made.named_trainable_parameters())
    for n, p in started.named_trainable_parameters():
        torch.testing.assert_close(p.detach(), exported[n].detach(), rtol=0, atol=0)
    with pytest.raises(PreflightError, match=r"made with lora alpha 16 .* set lora\.alpha=16"):  # its record is read
        check_lora_init(load_config(None, [*base, f"lora.init_path={tmp_path / 'lora'}", "lora.alpha=8"]), family)


def test_a_kohya_lora_into_a_unet_names_the_unets_conversion():
    """A format flowrl does not read (kohya's) is named once ("format" once), with the conversion of the model's own
    denoiser: unet_lora_layers for a UNet family, transformer_lora_layers for a transformer one."""
    from flowrl.lora_files import foreign_format

    kohya = {"lora_unet_down_blocks_0_attn1_to_q.lora_down.weight": (8, 4)}
    unet = foreign_format(kohya, "F", "unet")
    assert unet.startswith("lora.init_path: F is a LoRA in kohya's (lora_down / lora_up) format (e.g. lora_unet_")
    assert unet.count("format") == 1 and "unet_lora_layers=" in unet and "pipe.unet.peft_config" in unet
    assert "transformer" not in unet
    assert "transformer_lora_layers=" in foreign_format(kohya, "F", "transformer")
    assert "PeftModel.save_pretrained" in foreign_format(kohya, "F")
    assert foreign_format({"unet.x.lora.down.weight": (8, 4)}, "F", "unet") is None  # diffusers' UNet format: read


def test_a_kohya_lora_is_refused_by_the_preflight_before_the_model_loads(tmp_path):
    """lora.init_path of kohya's format is one PreflightError line from the file's header alone (no model built),
    with the conversion of the family's denoiser."""
    from safetensors.torch import save_file

    from flowrl.config import load_config
    from flowrl.preflight import PreflightError, check_lora_init

    file = tmp_path / "style.safetensors"
    save_file({"lora_unet_down_blocks_0_attn1_to_q.lora_down.weight": torch.zeros(4, 8)}, str(file))
    cfg = load_config(None, ["model.path=tiny-sd15", f"lora.init_path={file}"])
    with pytest.raises(PreflightError, match=r"kohya's \(lora_down / lora_up\) format") as info:
        check_lora_init(cfg, "sd15")
    assert "unet_lora_layers=" in str(info.value) and "\n" not in str(info.value)
