"""rollout.acceleration: the config's checks (before any model loads), every family x accelerator pair either runs
or says why not, lossless ones keep the rollout's latents and log-probs, lossy ones stay inside the rollout call,
and regional compilation keeps GRPO's first ratio at 1 (one compiled tiny model: compiling costs minutes here)."""

import json

import pytest
import torch
from conditioned import tiny_rollout

from flowrl.config import load_config
from flowrl.errors import ConfigError
from flowrl.families import family, family_names, load_image_backend
from flowrl.sampling.acceleration import ACCELERATORS, accelerated, decoupled_objectives, parse, repeated_blocks

torch.set_num_threads(1)

#: knobs that make every accelerator do something on a 4-step tiny rollout
KNOBS = {
    "attention_backend": {"backend": "_native_math"},
    "first_block_cache": {"threshold": 1.0},
    "taylorseer_cache": {"cache_interval": 2, "disable_cache_before_step": 1},
    "mag_cache": {"mag_ratios": [1.0] * 4, "threshold": 1.0},
}
PAIRS = [(f, a) for f in family_names() for a in ACCELERATORS.names() if a != "compile"]


def _spec(name):
    return parse([{"name": name, **KNOBS.get(name, {})}])


# ------------------------------------------------------------------------------------------- config


def _problems(*overrides):
    with pytest.raises(ConfigError) as e:
        load_config(None, list(overrides))
    return str(e.value)


def test_a_lossy_accelerator_with_a_coupled_objective_is_refused_naming_the_objectives_that_allow_it():
    msg = _problems("rollout.acceleration=[first_block_cache]")
    line = next(x for x in msg.splitlines() if "first_block_cache" in x)
    assert "lossy" in line and "train.objective=grpo" in line
    allowed = decoupled_objectives()
    assert allowed and "grpo" not in allowed and all(f"{n}" in line for n in allowed)
    assert "dpo_offline" not in line  # (it samples nothing: no rollout to accelerate)
    for objective in allowed:  # the decoupled objectives take it
        cfg = load_config(None, [f"train.objective={objective}", "rollout.acceleration=[{name: taylorseer_cache}]"])
        assert cfg.rollout.acceleration == [{"name": "taylorseer_cache"}]
    assert load_config(None, ["rollout.acceleration=[compile, attention_backend]"]).rollout.acceleration


def test_unknown_names_and_knobs_name_the_valid_ones():
    msg = _problems("rollout.acceleration=[compil]")
    assert "Did you mean 'compile'" in msg and all(n in msg for n in ACCELERATORS.names())
    msg = _problems("rollout.acceleration=[{name: first_block_cache, treshold: 0.1}]", "train.objective=nft")
    assert "no knob 'treshold'" in msg and "its knobs: threshold" in msg
    msg = _problems("rollout.acceleration=[{name: attention_backend, backend: nope}]")
    assert "_native_math" in msg and "native" in msg
    msg = _problems("rollout.acceleration=[mag_cache]", "train.objective=dpo")
    assert "mag_ratios" in msg
    msg = _problems("rollout.acceleration=[first_block_cache, taylorseer_cache]", "train.objective=dpo")
    assert "keep one" in msg


def test_the_text_backend_refuses_rollout_acceleration():
    msg = _problems("backend=text", "model.path=tiny-lm", "rollout.acceleration=[compile]")
    assert "backend=text" in msg and "rollout.acceleration=[]" in msg


# ------------------------------------------------------------------------------------------- every family


def _rollout(backend, name):
    # same_noise_per_group: the first steps run one row per group, a cache state of their own
    return tiny_rollout(backend, name, same_noise_per_group=True)


@pytest.mark.parametrize("name,accel", PAIRS)
def test_every_family_runs_an_accelerator_or_says_why_not(name, accel, backends):
    backend = backends(name)
    why = ACCELERATORS.get(accel).problem(backend)
    spec = _spec(accel)
    if why is not None:
        assert "\n" not in why
        with pytest.raises(ValueError, match=f"{accel} is not available for family {name}: "):
            with accelerated(backend, spec, 4):
                pytest.fail("sampled with an accelerator the family cannot take")
        return
    plain = _rollout(backend, name)
    with accelerated(backend, spec, 4):
        fast = _rollout(backend, name)
    with accelerated(backend, spec, 4):  # a cache's state starts afresh with every rollout call
        again = _rollout(backend, name)
    after = _rollout(backend, name)  # and is gone after it
    diff = (fast.final_latents - plain.final_latents).abs().max().item()
    print(f"{name} {accel}: max |final latents - plain| = {diff:.3g}")
    assert torch.isfinite(fast.log_probs).all()
    assert torch.equal(fast.latents, again.latents) and torch.equal(fast.log_probs, again.log_probs)
    assert torch.equal(after.latents, plain.latents) and torch.equal(after.log_probs, plain.log_probs)
    if ACCELERATORS.get(accel).lossless:  # _native_math against torch's default CPU attention kernel
        assert diff <= 1e-5 and (fast.log_probs - plain.log_probs).abs().max().item() <= 1e-5
    else:  # with KNOBS a cache that runs reuses something: one that hooks nothing says so instead
        assert diff > 0


@pytest.mark.parametrize("name", ["sd3", "sana"])
@pytest.mark.parametrize("accel", ["first_block_cache", "mag_cache", "taylorseer_cache"])
def test_the_step_caches_run_on_sd3_and_sana_with_several_blocks(name, accel, monkeypatch):
    """SD3 and SANA have no diffusers CacheMixin; SD3's last block is context_pre_only (no text stream out), SANA's
    block is not in diffusers' block registry. Their tiny models have one block: three here."""
    import importlib

    monkeypatch.setitem(importlib.import_module(f"flowrl.families.{name}").TINY_TRANSFORMER, "num_layers", 3)
    backend = load_image_backend(f"tiny-{name}", max_sequence_length=16)
    why = ACCELERATORS.get(accel).problem(backend)
    if (name, accel) == ("sana", "taylorseer_cache"):  # its attention modules are attn1/attn2: no pattern matches
        assert "TaylorSeer" in why
        return
    assert why is None
    plain = _rollout(backend, name)
    with accelerated(backend, _spec(accel), 4):
        fast = _rollout(backend, name)
    with accelerated(backend, _spec(accel), 4):
        again = _rollout(backend, name)
    after = _rollout(backend, name)
    diff = (fast.final_latents - plain.final_latents).abs().max().item()
    print(f"{name} (3 blocks) {accel}: max |final latents - plain| = {diff:.3g}")
    assert diff > 0 and torch.isfinite(fast.final_latents).all()
    assert torch.equal(fast.latents, again.latents) and torch.equal(after.latents, plain.latents)


def test_the_regional_compile_targets_resolve_for_every_family(backends):
    """What `compile` compiles, without compiling: the repeated blocks, diffusers' `_repeated_blocks` or the
    family's `repeated_blocks` (SD3 and SANA), one class per list."""
    for name in family_names():
        backend = backends(name)
        blocks = repeated_blocks(backend)
        assert blocks and ACCELERATORS.get("compile").problem(backend) is None, name
        den = backend.denoiser
        declared = family(name).repeated_blocks
        if declared:
            assert blocks == [b for a in declared for b in getattr(den, a)]
        else:
            assert {type(b).__name__ for b in blocks} <= set(den._repeated_blocks)


def test_each_accelerator_runs_on_some_family(backends):
    """No accelerator is declared only to be refused everywhere, except those flowrl's loop cannot drive."""
    runs = {a for f, a in PAIRS if ACCELERATORS.get(a).problem(backends(f)) is None}
    assert runs == {"attention_backend", "autocast", "first_block_cache", "taylorseer_cache", "mag_cache"}
    assert ACCELERATORS.get("taylorseer_cache").problem(backends("sd3")) is None  # the demo's family


def test_an_unsupported_accelerator_fails_when_the_policy_loads(tmp_path):
    from flowrl.train import Trainer

    cfg = load_config(
        None,
        [
            "model.path=tiny-sd3",
            "rollout.acceleration=[attention_backend]",
            f"log.run_dir={tmp_path}",
            "model.device=cpu",
        ],
    )
    assert ACCELERATORS.get("attention_backend").problem(load_image_backend("tiny-sd3")) is not None
    with pytest.raises(ValueError, match="attention_backend is not available for family sd3: the attention"):
        Trainer(cfg)


def test_what_no_model_takes_is_refused_with_the_config_and_the_rest_is_one_line(tmp_path, capsys):
    """faster_cache and pyramid_attention_broadcast run on no model (they need diffusers' own pipeline loop): refused
    with the config, before the model loads, and not recommended for the decoupled objectives either; one the loaded
    model cannot take (first_block_cache on tiny-sd3's two blocks) is one line, a config error (exit code 2), not a
    traceback."""
    from imagetiny import TINY_RUN

    from flowrl.cli import main
    from flowrl.errors import ConfigError

    for name in ("faster_cache", "pyramid_attention_broadcast"):
        assert ACCELERATORS.get(name).unavailable() is not None
        for objective in ("dpo", "grpo"):
            with pytest.raises(ConfigError) as e:
                load_config(None, [f"rollout.acceleration=[{name}]", f"train.objective={objective}"])
            assert str(e.value) == (
                f"rollout.acceleration: {name} is not available on flowrl's rollout loop: "
                f"{ACCELERATORS.get(name).unavailable()}"
            )
    assert load_config(None, ["rollout.acceleration=[taylorseer_cache]", "train.objective=dpo"])  # (a usable one)
    assert ACCELERATORS.get("first_block_cache").problem(load_image_backend("tiny-sd3")) is not None
    run = ["train", *TINY_RUN, f"log.run_dir={tmp_path}", "train.objective=dpo", "train.epochs=1"]
    assert main([*run, "rollout.acceleration=[first_block_cache]"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("flowrl train: rollout.acceleration: first_block_cache is not available for family sd3")
    assert not [line for line in err if "Traceback" in line]


# ------------------------------------------------------------------------------------------- compile


COMPILED = "sd3"  # the demo's family, its repeated blocks declared by flowrl (one JointTransformerBlock in tiny-sd3)


@pytest.mark.parametrize("update", [False, True], ids=["update-eager", "update-compiled"])
def test_regional_compile_keeps_the_first_ratio_at_one(tmp_path, backends, update):
    """The rollout compiled and the update eager (the default), or both compiled (`update: true`): GRPO's first
    ratio stays 1 within 1e-5 in float32 either way."""
    from flowrl.train import Trainer

    assert family(COMPILED).tiny_denoiser and ACCELERATORS.get("compile").problem(backends(COMPILED)) is None
    cfg = load_config(
        None,
        [
            f"model.path=tiny-{COMPILED}",
            f"sample.num_frames={family(COMPILED).tiny_num_frames}",
            "sample.height=32",
            "sample.width=32",
            "sample.num_steps=3",
            "sample.max_sequence_length=16",
            "sample.prompts_per_epoch=2",
            "sample.group_size=2",
            "log.progress=false",
            "model.device=cpu",
            "train.epochs=1",
            "eval.before=false",
            "eval.num_steps=2",
            "eval.num_prompts=1",
            f"rollout.acceleration=[{{name: compile, update: {str(update).lower()}}}]",
            f"log.run_dir={tmp_path}",
        ],
    )
    tr = Trainer(cfg)
    blocks = repeated_blocks(tr.policy.backend)
    calls = []
    for b in blocks:  # which forward passes ran compiled
        b.register_forward_pre_hook(lambda m, a: calls.append(m._compiled_call_impl is not None))
    tr.fit()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "policy/ratio_first" in r]
    print(f"compile (update {update}): |ratio_first - 1| = {trained[0]['policy/ratio_first_dev']:.3g}")
    assert trained and trained[0]["policy/ratio_first_dev"] <= 1e-5
    if update:  # every pass compiled: rollout, update, reference, eval; and the blocks stay so
        assert calls and all(calls)
        assert all(b._compiled_call_impl is not None for b in blocks)
    else:
        assert True in calls and False in calls  # the rollout compiled, the update (and eval) eager
        assert all(b._compiled_call_impl is None for b in blocks)


# ------------------------------------------------------------------------------------------- mag_cache calibration


def _three_block_sd3(monkeypatch):
    import importlib

    monkeypatch.setitem(importlib.import_module("flowrl.families.sd3").TINY_TRANSFORMER, "num_layers", 3)
    return load_image_backend("tiny-sd3", max_sequence_length=16)


def _residual_ratios(backend, run) -> list[list[float]]:
    """An independent re-derivation of MagCache's calibration: per denoiser call, the residual of the block stack
    (last block's hidden states out - first block's hidden states in) and, per step, the mean over tokens of
    |residual_t| / |residual_t-1| (1.0 at the first step); one list per call sequence of the same row count."""
    blocks = backend.denoiser.transformer_blocks
    seen, residuals = {}, {}

    def pre(module, args, kwargs):
        seen["in"] = kwargs.get("hidden_states", args[0] if args else None)

    def post(module, args, kwargs, output):
        hidden = output[1] if isinstance(output, tuple) else output  # SD3's blocks: (text, image)
        r = (hidden - seen["in"]).float()
        residuals.setdefault(r.shape[0], []).append(r)

    handles = [
        blocks[0].register_forward_pre_hook(pre, with_kwargs=True),
        blocks[-1].register_forward_hook(post, with_kwargs=True),
    ]
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    out = []
    for rs in residuals.values():
        ratios = [1.0] + [
            (torch.linalg.norm(b, dim=-1) / (torch.linalg.norm(a, dim=-1) + 1e-8)).mean().item()
            for a, b in zip(rs, rs[1:])
        ]
        out.append(ratios)
    return out


def test_mag_cache_calibration_measures_the_residual_ratios_and_leaves_nothing_behind(monkeypatch):
    from flowrl.sampling.acceleration import calibrating_mag_cache

    backend = _three_block_sd3(monkeypatch)

    def run():
        with torch.no_grad():
            return tiny_rollout(backend, "sd3")  # 4 steps, one denoiser call per step

    expected = _residual_ratios(backend, run)
    assert len(expected) == 1 and len(expected[0]) == 4
    plain = run()
    with calibrating_mag_cache(backend, 4) as found:
        during = run()
    got = found.ratios()
    print(f"calibrated {got}, re-derived {expected[0]}")
    assert got[0] == 1.0 and got == pytest.approx(expected[0], rel=1e-5, abs=1e-6)
    assert any(abs(r - 1.0) > 1e-3 for r in got[1:])  # a real measurement, not the flat default
    assert torch.equal(during.latents, plain.latents)  # calibration skips nothing
    assert torch.equal(run().latents, plain.latents)  # and its hooks are gone afterwards
    # the calibrated ratios drive the cache: a threshold that skips nothing gives the plain rollout
    with accelerated(backend, parse([{"name": "mag_cache", "mag_ratios": got, "threshold": 0.0}]), 4):
        assert torch.equal(run().latents, plain.latents)


def test_mag_cache_calibration_over_several_calls_averages_per_step_and_checks_the_step_count(monkeypatch):
    from flowrl.sampling.acceleration import calibrating_mag_cache

    backend = _three_block_sd3(monkeypatch)
    with calibrating_mag_cache(backend, 4) as found, torch.no_grad():
        for seed in (0, 1):
            backend.rollout(["a red cat"], 2, num_steps=4, seed=seed, height=32, width=32, decode=False)
    assert len(found.done) == 2
    mean = [(a + b) / 2 for a, b in zip(*found.done)]
    assert found.ratios() == pytest.approx(mean) and found.done[0] != found.done[1]
    with calibrating_mag_cache(backend, 6) as wrong, torch.no_grad():
        tiny_rollout(backend, "sd3")  # 4 steps, not 6
    with pytest.raises(ValueError, match="no rollout of 6 steps"):
        wrong.ratios()


def test_mag_cache_calibration_refuses_a_model_the_cache_cannot_take(backends):
    from flowrl.sampling.acceleration import calibrating_mag_cache

    with pytest.raises(
        ValueError, match="mag_cache is not available for family sd3: this SD3Transformer2DModel has one"
    ):
        with calibrating_mag_cache(backends("sd3"), 4):
            pass


def test_the_cache_quality_benchmark_scores_each_setting_against_the_plain_rollout(tmp_path):
    """benchmarks/cache_quality.py on a tiny FLUX config: the plain row and one row per setting, mag_cache's ratios
    calibrated first; the same seeds, so a cache that skips nothing scores exactly as the plain rollout."""
    from repo_files import ROOT as root
    from repo_files import load_module

    bench = load_module("benchmarks/cache_quality.py", "cache_quality_bench")
    threads = torch.get_num_threads()
    settings = [{"name": "mag_cache", "threshold": 0.0}, {"name": "mag_cache", "threshold": 1.0}]
    try:
        rows = bench.main(
            [
                str(root / "configs" / "tiny_cpu.yaml"),
                "model.path=tiny-flux",
                "train.objective=dpo",
                "sample.height=32",
                "sample.width=32",
                "sample.num_steps=4",
                "sample.max_sequence_length=16",
                "rewards=[{name: jpeg_compressibility}]",
                "--prompts",
                "2",
                "--images",
                "2",
                "--settings",
                json.dumps(settings),
            ]
        )
    finally:
        torch.set_num_threads(threads)
    assert [r["setting"] if r["setting"] == "none" else r["setting"]["threshold"] for r in rows] == ["none", 0.0, 1.0]
    assert all(len(r["setting"]["mag_ratios"]) == 4 for r in rows[1:])
    key = next(k for k in rows[0] if k not in ("setting", "images", "threads", "images_per_s") and "_se" not in k)
    assert rows[1][key] == rows[0][key]  # threshold 0: nothing skipped, the same images
    assert rows[2][key] != rows[0][key] and all(r["images"] == 4 and r["threads"] == 1 for r in rows)


def test_mag_cache_without_ratios_names_the_command_that_measures_them():
    msg = _problems("rollout.acceleration=[mag_cache]", "train.objective=dpo")
    assert "needs mag_ratios" in msg and "flowrl calibrate CONFIG" in msg


# ------------------------------------------------------------------------------------------- autocast


def test_autocast_runs_the_denoiser_in_bfloat16_and_gives_float32_to_the_step_math(backends):
    """Inside the rollout the denoiser's linear layers compute in bfloat16; what the denoiser returns (and so the
    guidance, the step math and the recorded log-probs) is float32; after the rollout its forward is its own again."""
    backend = backends("sd3")
    den = backend.denoiser
    seen = []
    hooks = [
        m.register_forward_hook(lambda m, a, o: seen.append(o.dtype))
        for m in den.modules()
        if isinstance(m, torch.nn.Linear)
    ]
    outs = []
    top = den.register_forward_hook(lambda m, a, o: outs.append(o[0].dtype))
    try:
        with accelerated(backend, parse(["autocast"]), 4):
            fast = _rollout(backend, "sd3")
            assert "forward" in vars(den)
        assert set(seen) == {torch.bfloat16} and outs and set(outs) == {torch.float32}
        assert fast.log_probs.dtype == torch.float32 and fast.final_latents.dtype == torch.float32
        assert "forward" not in vars(den)  # the class's forward again: the update and the eval run float32
        seen.clear()
        _rollout(backend, "sd3")
        assert set(seen) == {torch.float32}
    finally:
        for h in [*hooks, top]:
            h.remove()


def test_autocast_is_lossy_refuses_a_low_precision_model_and_combines_with_one_step_cache():
    msg = _problems("rollout.acceleration=[autocast]")
    assert "autocast is lossy" in msg and "train.objective=grpo" in msg
    msg = _problems("rollout.acceleration=[{name: autocast, dtype: float8}]", "train.objective=dpo")
    assert "bfloat16, float16" in msg
    both = ["autocast", {"name": "taylorseer_cache"}]
    assert [s.name for s in parse(both)] == ["autocast", "taylorseer_cache"]  # a precision and a cache: allowed
    bf16 = load_image_backend("tiny-sd3", dtype=torch.bfloat16)
    why = ACCELERATORS.get("autocast").problem(bf16)
    assert "already computes in bfloat16" in why and "model.dtype" in why


def test_autocast_is_left_off_on_a_cpu_without_native_low_precision_matrix_products(backends, monkeypatch, tmp_path):
    """Emulated bfloat16 is several times slower than float32 on a CPU (0.18x the demo's rollout speed on an AVX2
    CPU), so where oneDNN reports no native bfloat16 (float16) the policy leaves autocast off with one warning that
    names the knob which keeps it; force=true keeps it, and so does a CPU that has them. The other accelerators of
    the list stay."""
    import warnings

    from flowrl.sampling import acceleration
    from flowrl.train import Trainer

    backend = backends("sd3")
    native = {"bfloat16": False, "float16": True}
    monkeypatch.setattr(acceleration, "native_cpu_dtype", lambda dtype: native[dtype])
    specs = parse(["autocast", {"name": "taylorseer_cache", **KNOBS["taylorseer_cache"]}])
    with pytest.warns(acceleration.AcceleratorWarning) as seen:
        kept = acceleration.usable(backend, specs)
    assert [s.name for s in kept] == ["taylorseer_cache"]
    (line,) = [str(w.message) for w in seen]
    assert "autocast is left off" in line and "AVX-512 or AMX" in line and "force: true" in line
    assert "\n" not in line
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert acceleration.usable(backend, parse([{"name": "autocast", "force": True}]))[0].knobs.force
        assert acceleration.usable(backend, parse([{"name": "autocast", "dtype": "float16"}]))  # native here
        native["bfloat16"] = True
        assert [s.name for s in acceleration.usable(backend, specs)] == ["autocast", "taylorseer_cache"]

    native["bfloat16"] = False
    cfg = load_config(
        None,
        [
            "model.path=tiny-sd3",
            "train.objective=dpo",
            "rollout.acceleration=[autocast]",
            f"log.run_dir={tmp_path}",
            "model.device=cpu",
        ],
    )
    with pytest.warns(acceleration.AcceleratorWarning, match="autocast is left off"):
        tr = Trainer(cfg)
    assert tr.policy.accelerators == []  # the training rollouts run float32


def test_autocast_puts_back_the_forward_it_found_and_runs_under_a_step_cache(backends):
    """A forward already set on the denoiser (a hook's wrapper) is the one autocast wraps and leaves in place; with a
    step cache beside it the rollout runs and, after both, the plain rollout is the same as before."""
    backend = backends("sd3")
    den = backend.denoiser
    plain = _rollout(backend, "sd3")
    calls = []
    own = den.forward

    def wrapper(*args, **kwargs):
        calls.append(1)
        return own(*args, **kwargs)

    den.forward = wrapper
    try:
        with accelerated(backend, parse(["autocast"]), 4):
            _rollout(backend, "sd3")
        assert calls and vars(den)["forward"] is wrapper
    finally:
        del den.forward
    with accelerated(backend, parse(["autocast", {"name": "taylorseer_cache", **KNOBS["taylorseer_cache"]}]), 4):
        both = _rollout(backend, "sd3")
    assert torch.isfinite(both.final_latents).all() and "forward" not in vars(den)
    after = _rollout(backend, "sd3")
    assert torch.equal(after.latents, plain.latents) and torch.equal(after.log_probs, plain.log_probs)
