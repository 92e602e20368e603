"""Validation that is complete and early: every numeric field's range, suggestions across sections and from other
tools' names, list-item overrides, YAML errors in one line."""

import dataclasses
import math
import re
import typing
from pathlib import Path

import pytest

from flowrl.config import ALIASES, RANGES, Config, ConfigError, Range, RewardSpec, describe, load_config
from flowrl.config.tree import _hints, field_name


def _numeric_keys() -> list[str]:
    """Every leaf whose type is int or float (or optional / a list of them), plus the reward list items' ones."""
    keys = []
    for key, _, _, _ in describe(Config):
        cls, tp = Config, None
        for part in key.split("."):
            tp = _hints(cls)[field_name(part)]
            cls = tp if dataclasses.is_dataclass(tp) else None
        args = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
        inner = typing.get_args(args[0]) if typing.get_origin(args[0]) is list else args
        if inner and inner[0] in (int, float):
            keys.append(key)
    return keys + [f"rewards.{f.name}" for f in dataclasses.fields(RewardSpec) if f.type in ("int", "float")]


def _outside(r: Range, is_int: bool) -> list[float]:
    """Values just outside range `r` (and NaN / inf for floats)."""
    step = 1 if is_int else 1e-6
    out = []
    if r.lo is not None:
        out.append(r.lo if r.lo_open else r.lo - step)
    if r.hi is not None:
        out.append(r.hi if r.hi_open else r.hi + step)
    if not is_int:
        out += [math.nan, math.inf]
    return out


def test_every_numeric_field_has_a_range():
    numeric = _numeric_keys()
    assert len(numeric) > 50
    assert sorted(set(numeric) - set(RANGES)) == [], "numeric fields without a range in RANGES"
    assert sorted(set(RANGES) - set(numeric)) == [], "RANGES names fields that do not exist"


@pytest.mark.parametrize("key", sorted(RANGES))
def test_each_field_refuses_a_value_outside_its_range(key):
    r = RANGES[key]
    is_int = _is_int(key)
    values = _outside(r, is_int)
    assert values, f"{key}: a range with no bound and no float: nothing can be out of it"
    for bad in values:
        if key.startswith("rewards."):
            name = key.split(".")[1]
            override = f"rewards=[{{name: jpeg_compressibility, {name}: {bad}}}]"
            shown = rf"rewards\[0\]\.{name}"
        elif key == "train.adam_betas":
            override, shown = f"train.adam_betas=[0.9, {bad}]", r"train.adam_betas\[1\]"
        else:
            override, shown = f"{key}={bad}", key.replace(".", r"\.")
        with pytest.raises(ConfigError, match=rf"{shown} must be"):
            load_config(None, [override])


def _is_int(key: str) -> bool:
    if key.startswith("rewards."):
        return _hints(RewardSpec)[key.split(".")[1]] is int
    cls = Config
    for part in key.split("."):
        tp = _hints(cls)[part]
        cls = tp if dataclasses.is_dataclass(tp) else None
    args = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
    return args[0] is int


def test_values_inside_the_ranges_pass_and_the_message_states_the_range():
    cfg = load_config(None, ["train.grpo.noise_level=0.7", "text.top_p=1", "train.ema_decay=0"])
    assert cfg.train.grpo.noise_level == 0.7
    with pytest.raises(ConfigError, match=r"text\.top_p must be in \(0, 1\], got 1\.5"):
        load_config(None, ["text.top_p=1.5"])
    with pytest.raises(ConfigError, match=r"train\.grpo\.clip_low must be in \(0, 1\], got 0\.0"):
        load_config(None, ["train.grpo.clip_low=0"])


def test_relations_between_keys():
    with pytest.raises(ConfigError, match=r"noise_level must be in \(0, 1\] for sde_type=cps"):
        load_config(None, ["train.grpo.sde_type=cps", "train.grpo.noise_level=1.5"])
    with pytest.raises(ConfigError, match="stat_min_count=40 exceeds train.stat_buffer_size=32"):
        load_config(None, ["train.per_prompt_stats=true", "train.stat_min_count=40"])


@pytest.mark.parametrize(
    "override, wanted",
    [
        ("learnig_rate=1", "train.lr"),  # a misspelling of TRL's name
        ("train.learning_rate=1", "train.lr"),  # TRL's name in the right section (was: train.decay_frac)
        ("num_generations=4", "sample.group_size"),
        ("num_train_epochs=3", "train.epochs"),
        ("clip_range=0.2", "train.grpo.clip_low"),
        ("sample.num_inference_steps=20", "sample.num_steps"),
        ("group_size=8", "sample.group_size"),  # a valid key's last part, in no section
        ("train.group_sise=8", "sample.group_size"),  # a misspelling, in the wrong section
    ],
)
def test_unknown_keys_get_a_suggestion_across_sections(override, wanted):
    with pytest.raises(ConfigError, match=rf"Did you mean [^?]*\b{wanted.replace('.', '[.]')}\b"):
        load_config(None, [override])


def test_an_objective_named_by_its_variant_says_which_settings_select_it():
    """Flow-DPPO is GRPO's policy loss, not an objective: the error writes the two settings; names of GRPO itself
    say grpo; an unrelated misspelling still gets the closest objective."""
    with pytest.raises(ConfigError, match=r"'dppo' is not a valid choice.*dppo is train\.objective=grpo "):
        load_config(None, ["train.objective=dppo"])
    with pytest.raises(ConfigError) as error:
        load_config(None, ["train.objective=Flow-DPPO"])
    written = str(error.value).split(" is ")[-1].rstrip(".").split()
    cfg = load_config(None, written)  # what the error says to write is a valid config that selects Flow-DPPO
    assert (cfg.train.objective, cfg.train.grpo.policy_loss) == ("grpo", "dppo")
    with pytest.raises(ConfigError, match=r"Flow-GRPO is train\.objective=grpo\.$"):
        load_config(None, ["train.objective=Flow-GRPO"])
    with pytest.raises(ConfigError, match=r"Did you mean nft\?"):
        load_config(None, ["train.objective=nfts"])


def test_every_alias_points_at_a_real_key():
    from flowrl.config.load import _all_keys

    keys = set(_all_keys()) | {"rewards"}
    assert sorted(t for t in ALIASES.values() if t not in keys) == []


def test_list_items_can_be_overridden(tmp_path):
    yml = tmp_path / "c.yaml"
    yml.write_text("rewards:\n  - name: jpeg_compressibility\n  - name: jpeg_incompressibility\n    weight: 0.5\n")
    cfg = load_config(yml, ["rewards.1.weight=2", "rewards.0.kwargs={quality: 50}"])
    assert [r.weight for r in cfg.rewards] == [1.0, 2.0]
    assert cfg.rewards[0].kwargs == {"quality": 50}
    # without a YAML list, the default list's item 0
    assert load_config(None, ["rewards.0.weight=3"]).rewards[0].weight == 3.0
    with pytest.raises(ConfigError, match=r"rewards\.2: the list rewards has 2 item"):
        load_config(yml, ["rewards.2.weight=1"])
    with pytest.raises(ConfigError, match=r"name an item by its index, e\.g\. rewards\.0\.weight=2"):
        load_config(yml, ["rewards.weight=1"])
    with pytest.raises(ConfigError, match=r"unknown config key 'rewards\.0\.wieght'.*Did you mean rewards\.0\.weight"):
        load_config(yml, ["rewards.0.wieght=1"])


def test_yaml_syntax_error_is_one_line_with_file_and_line(tmp_path):
    yml = tmp_path / "broken.yaml"
    yml.write_text("train:\n  lr: 1e-4\n  epochs: [1, 2\nsample:\n  group_size: 4\n")
    with pytest.raises(ConfigError) as err:
        load_config(yml)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"{yml}:4:")  # the line where the parser gave up
    assert "YAML syntax error" in message
    yml.write_bytes(b"train:\n  lr: \xff\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(yml)


def test_a_vllm_url_that_is_not_an_http_url_of_a_host_is_refused():
    for url, why in (
        ("not-a-url", "is not an http:// or https:// URL of a host"),
        ("127.0.0.1:8100", "is not an http:// or https:// URL of a host"),
        ("http://127.0.0.1:abc", "names a port that is not a number from 1 to 65535"),
        ("http://127.0.0.1:99999", "names a port that is not a number from 1 to 65535"),
    ):
        with pytest.raises(ConfigError, match=re.escape(f"text.vllm_url={url!r} {why}, e.g. text.vllm_url=http://")):
            load_config(None, ["backend=text", "text.engine=vllm", f"text.vllm_url={url}"])
    load_config(None, ["backend=text", "text.engine=vllm", "text.vllm_url=https://gpu-box:8100/"])


def test_a_text_run_without_training_prompts_is_refused_before_the_model_loads(no_model_load):
    from flowrl.preflight import PreflightError, load_prompt_sets

    with pytest.raises(
        PreflightError, match=r"a text run needs data.train_prompts .*the built-in prompts are an image"
    ):
        load_prompt_sets(load_config(None, ["backend=text"]))


def test_an_empty_config_file_is_a_warning(tmp_path):
    from flowrl.errors import ConfigWarning

    for text in ("", "# a comment only\n"):
        (tmp_path / "c.yaml").write_text(text)
        with pytest.warns(ConfigWarning, match=r"c.yaml holds no keys \(empty, or comments only\): the defaults are"):
            assert load_config(tmp_path / "c.yaml") == load_config(None)


def test_a_lora_init_path_without_a_lora_is_refused():
    with pytest.raises(ConfigError, match=r"lora.init_path=x starts a LoRA, and lora.enabled=false trains the model"):
        load_config(None, ["lora.enabled=false", "lora.init_path=x"])
    assert load_config(None, ["lora.init_path=x"]).lora.init_path == "x"


def test_text_engine_keys_are_checked_before_any_model_loads():
    """text.engine belongs to text runs, and its correction to an engine that is not the trainer itself; a bad
    level or cap names the valid ones."""
    with pytest.raises(ConfigError, match="text.engine=vllm samples text rollouts, and backend=image"):
        load_config(None, ["text.engine=vllm"])
    with pytest.raises(ConfigError, match="text.engine=hf samples with the trained model itself"):
        load_config(None, ["backend=text", "text.engine_correction=token"])
    with pytest.raises(ConfigError, match="hf, vllm"):
        load_config(None, ["backend=text", "text.engine=sglang"])
    with pytest.raises(ConfigError, match="engine_correction_cap"):
        load_config(None, ["backend=text", "text.engine=vllm", "text.engine_correction_cap=0"])
    cfg = load_config(None, ["backend=text", "text.engine=vllm", "text.engine_correction=sequence"])
    assert (cfg.text.engine, cfg.text.engine_correction, cfg.text.engine_correction_cap) == ("vllm", "sequence", 2.0)
    # vLLM's log-probs under top-k / top-p are the truncated distribution's, not the update's whole-vocabulary ones
    for truncation in ("text.top_k=5", "text.top_p=0.9"):
        for source in (
            [],
            ["text.engine_correction=token"],
            ["text.old_log_probs=forward", "text.engine_correction=token"],
        ):
            with pytest.raises(ConfigError, match="vLLM's log-probs are those of the truncated distribution") as e:
                load_config(None, ["backend=text", "text.engine=vllm", truncation, *source])
            assert "set text.old_log_probs=forward text.engine_correction=none" in str(e.value)
        load_config(None, ["backend=text", "text.engine=vllm", truncation, "text.old_log_probs=forward"])
        load_config(None, ["backend=text", truncation])  # transformers' generate() records the update's log-probs


def test_an_unreachable_engine_server_is_one_line_before_the_model_loads(tmp_path, no_model_load):
    """preflight asks the server's /health first (no vLLM environment needed: nothing listens there)."""
    import socket

    from flowrl.errors import EngineError
    from flowrl.preflight import check_engine_server

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = load_config(None, ["backend=text", "text.engine=vllm", f"text.vllm_url=http://127.0.0.1:{port}"])
    with pytest.raises(EngineError) as e:
        check_engine_server(cfg)
    msg = str(e.value)
    assert "\n" not in msg and f"cannot reach the vLLM server at http://127.0.0.1:{port}" in msg
    assert f"vllm_server.py --model {cfg.model.path} --port {port}" in msg


def test_an_engine_server_holding_another_model_is_one_line_before_the_model_loads(tmp_path, no_model_load):
    """/health names the server's model architecture (config.json's entries): one that differs from model.path's
    is refused, naming the entries; the same model, or a server that reports none, passes."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from transformers import GPT2Config

    from flowrl.errors import EngineError
    from flowrl.preflight import check_engine_server

    GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=100).save_pretrained(tmp_path / "ours")
    health = {}

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps(health).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        cfg = load_config(
            None, ["backend=text", "text.engine=vllm", f"text.vllm_url={url}", f"model.path={tmp_path / 'ours'}"]
        )
        same = {"model_type": "gpt2", "architectures": None, "n_layer": 2, "n_embd": 64, "vocab_size": 100}
        for config in (same, None):
            health.clear()
            health.update(kind="flowrl-vllm", model="elsewhere/gpt2", config=config)
            check_engine_server(cfg)
        health["config"] = {**same, "n_layer": 4, "vocab_size": 120}
        with pytest.raises(EngineError) as e:
            check_engine_server(cfg)
        msg = str(e.value)
        assert "\n" not in msg and f"the vLLM server at {url} holds another model than model.path=" in msg
        assert "n_layer 2 here, 4 there" in msg and "vocab_size 100 here, 120 there" in msg
        assert "vllm_server.py --model" in msg
    finally:
        server.shutdown()


def test_a_vllm_engine_with_several_processes_is_refused_before_the_model_loads(tmp_path, no_model_load, monkeypatch):
    from types import SimpleNamespace

    import torch

    import flowrl.preflight
    from flowrl.train import Trainer

    monkeypatch.setattr(flowrl.preflight, "check_engine_server", lambda cfg: None)  # no server needed here
    root = Path(__file__).resolve().parents[1]
    cfg = load_config(
        root / "configs" / "text_arith.yaml",
        ["text.engine=vllm", f"log.run_dir={tmp_path}", f"model.path={root / 'samples' / 'arith'}"]
        + [
            f"data.train_prompts={root / 'samples/arith/train.jsonl'}",
            f"data.eval_prompts={root / 'samples/arith/test.jsonl'}",
        ],
    )
    two = SimpleNamespace(
        num_processes=2, is_main_process=True, process_index=0, device=torch.device("cpu"), wait_for_everyone=lambda: 0
    )
    with pytest.raises(ConfigError, match="text.engine=vllm pushes the weights .* this run has 2: set text.engine=hf"):
        Trainer(cfg, accelerator=two)


def test_one_reward_kwarg_can_be_overridden_by_its_dotted_key(tmp_path):
    yml = tmp_path / "c.yaml"
    yml.write_text("rewards:\n  - name: jpeg_compressibility\n    kwargs: {quality: 50, other: 1}\n")
    cfg = load_config(yml, ["rewards.0.kwargs.quality=80", "rewards.0.kwargs.nested.depth=2"])
    # the named key replaced, its siblings kept, a deeper key made a mapping
    assert cfg.rewards[0].kwargs == {"quality": 80, "other": 1, "nested": {"depth": 2}}
    # a mapping override and then one of its keys: both apply
    cfg = load_config(yml, ["rewards.0.kwargs={a: 1}", "rewards.0.kwargs.b=2"])
    assert cfg.rewards[0].kwargs == {"quality": 50, "other": 1, "a": 1, "b": 2}
    # an empty mapping clears the options
    assert load_config(yml, ["rewards.0.kwargs={}"]).rewards[0].kwargs == {}
    assert load_config(yml, ["rewards=[{name: jpeg_compressibility, kwargs: {}}]"]).rewards[0].kwargs == {}
    with pytest.raises(ConfigError, match=r"another override set rewards\.0\.kwargs to a value, not a mapping"):
        load_config(yml, ["rewards.0.kwargs=5", "rewards.0.kwargs.b=2"])
    with pytest.raises(ConfigError, match=r"an empty key inside rewards\.0\.kwargs"):
        load_config(yml, ["rewards.0.kwargs..b=2"])
    # a plain value still names itself a value
    with pytest.raises(ConfigError, match=r"rewards\.0\.weight is a value, not a section"):
        load_config(yml, ["rewards.0.weight.x=2"])


def test_settings_the_backend_does_not_read_are_warned_once(tmp_path, monkeypatch):
    """An image setting changed in a text run, a text.* one in an image run: one warning naming them; the shipped
    presets, and a full dump of a text config's defaults, are not warned about."""
    import warnings

    import yaml

    from flowrl.config import to_dict
    from flowrl.errors import ConfigWarning

    with pytest.warns(
        ConfigWarning,
        match=r"^sample\.height=128, eval\.num_steps=4: image settings, which this text run \(backend: text\) does "
        r"not read \(its lengths are text\.max_prompt_length",
    ):
        load_config(None, ["backend=text", "sample.height=128", "eval.num_steps=4", "text.max_new_tokens=4"])
    with pytest.warns(
        ConfigWarning,
        match=r"^text\.temperature=0\.7: a text run's setting, which this image run does not read \(a language "
        r"model trains with backend: text\)$",
    ):
        load_config(None, ["text.temperature=0.7"])
    root = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(root)
    dump = tmp_path / "dump.yaml"
    dump.write_text(yaml.safe_dump(to_dict(Config(backend="text"))))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        for preset in sorted((root / "configs").glob("*.yaml")):
            load_config(preset, [])
        load_config(dump, [])


def test_a_seed_torch_cannot_take_is_refused_in_the_config_and_on_the_command_line(capsys):
    """train.seed / eval.seed / --seed above 2**63 - 1 (or below 0) would end in torch's overflow traceback after the
    model loaded: refused first, one line each; one problem is one line, several are listed."""
    from flowrl.cli import main

    with pytest.raises(ConfigError, match=r"^train\.seed must be an integer from 0 to 2\*\*63 - 1, got 99999999999"):
        load_config(None, ["train.seed=99999999999999999999"])
    with pytest.raises(ConfigError, match=r"^invalid config \(2 problems\):\n  - train\.seed .*\n  - eval\.seed must"):
        load_config(None, ["train.seed=-1", "eval.seed=-1"])
    assert load_config(None, [f"eval.seed={2**63 - 1}"]).eval.seed == 2**63 - 1
    for command in (["sample", "configs/tiny_cpu.yaml", "--prompt", "a"], ["calibrate", "configs/tiny_cpu.yaml"]):
        with pytest.raises(SystemExit) as code:
            main([*command, "--seed", str(2**63)])
        assert code.value.code == 2
        assert "argument --seed: a seed is an integer from 0 to 2**63 - 1, got 9223372036854775808" in (
            capsys.readouterr().err
        )


def test_settings_of_another_objective_are_warned_as_not_read():
    """train.dpo.* in a grpo run, train.grpo.* in a dpo run (changed from their defaults): one warning naming
    them; a text run's image-sampler settings of GRPO (its kernel, window) too."""
    from flowrl.errors import ConfigWarning

    with pytest.warns(
        ConfigWarning,
        match=r"^train\.dpo\.beta=100\.0: a setting of another objective, which this "
        r"train\.objective=grpo run does not read$",
    ):
        load_config(None, ["train.dpo.beta=100"])
    with pytest.warns(
        ConfigWarning,
        match=r"^train\.grpo\.beta=0\.1, train\.grpo\.window=\{'kind': 'fixed', .*\}: "
        r"settings of another objective, which this train\.objective=dpo run",
    ):
        load_config(None, ["train.objective=dpo", "train.grpo.window.kind=fixed", "train.grpo.beta=0.1"])
    with pytest.warns(
        ConfigWarning,
        match=r"^train\.grpo\.sde_type='cps': an image setting, which this text run "
        r"\(backend: text\) does not read \(an image sampler's\)$",
    ):
        load_config(None, ["backend=text", "train.grpo.sde_type=cps"])
