"""An objective is one module: its config section, its checks, its memory terms and its progress fields are asked of
it, so that switching a preset's objective is one key, and the keys that moved into an objective's section are
still read with a one-line hint."""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

import pytest

from flowrl.config import MOVED_KEYS, Config, ConfigError, ConfigWarning, describe, load_config
from flowrl.objectives import MemoryTerms, Objective, get_objective, objective_names

ROOT = Path(__file__).resolve().parents[1]
PRESETS = sorted((ROOT / "configs").glob("*.yaml"))
TINY = [
    "model.path=tiny-sd3",
    "model.device=cpu",
    "sample.height=32",
    "sample.width=32",
    "sample.num_steps=3",
    "sample.max_sequence_length=16",
    "sample.prompts_per_epoch=2",
    "sample.group_size=2",
    "eval.num_steps=2",
    "eval.num_prompts=1",
    "eval.grid=false",
    "log.progress=false",
    "checkpoint.every=0",
]


def test_every_objective_declares_what_the_loop_the_config_and_the_planner_ask():
    names = objective_names()
    assert names[0] == "grpo" and set(names) >= {"grpo", "nft", "awm", "dpo"}
    keys = {key for key, _, _, _ in describe()}
    for name in names:
        cls = get_objective(name)
        assert issubclass(cls, Objective) and cls.name == name and cls.title, name
        assert cls.backends and set(cls.backends) <= {"image", "text"}, name
        if cls.Settings is not None:  # its section is train.<name>, every field documented
            fields = [f.name for f in dataclasses.fields(cls.Settings)]
            assert all(
                any(k == f"train.{name}.{f}" or k.startswith(f"train.{name}.{f}.") for k in keys) for f in fields
            ), name
        cfg = load_config(None, [f"train.objective={name}"])
        terms = cls.memory_terms(cfg, 2)
        assert isinstance(terms, MemoryTerms) and terms.rows >= 1 and terms.rows_note, name
        assert cls.check(cfg) == [] and isinstance(cls.progress({"reward/total_mean": 0.0}), dict), name
    assert get_objective("grpo").coupled and not any(get_objective(n).coupled for n in ("nft", "awm", "dpo"))
    with pytest.raises(ValueError, match="Did you mean 'nft'"):
        get_objective("nfr")


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_every_preset_switches_objective_with_one_key(preset):
    """`flowrl train PRESET train.objective=X` validates for every objective that trains the preset's backend: no
    key of the preset belongs to one objective's rules but another's section. (An objective with group-level terms
    refuses (mini/micro-)batch sizes that split groups: with those it validates once they are whole batches. A
    coupled objective refuses the preset's lossy rollout accelerator, naming it: without it, it validates.)"""
    from flowrl.sampling.acceleration import parse

    base = load_config(preset)
    lossy = [s.name for s in parse(base.rollout.acceleration) if not s.accelerator.lossless]
    for name in objective_names():
        if base.backend not in get_objective(name).backends:
            with pytest.raises(ConfigError, match=f"train.objective={name} trains"):
                load_config(preset, [f"train.objective={name}"])
            continue
        sizes = []
        if lossy and get_objective(name).coupled:
            with pytest.raises(ConfigError, match=f"rollout.acceleration: {lossy[0]} is lossy"):
                load_config(preset, [f"train.objective={name}"])
            sizes = ["rollout.acceleration=[]"]
        if get_objective(name).group_batches and any(
            getattr(base.train, key) % base.sample.group_size for key in ("minibatch_size", "micro_batch_size")
        ):
            with pytest.raises(ConfigError, match="multiple of sample.group_size"):
                load_config(preset, [f"train.objective={name}"])
            sizes += ["train.minibatch_size=0", "train.micro_batch_size=0"]
        cfg = load_config(preset, [f"train.objective={name}", *sizes])
        assert cfg.train.objective == name
        assert cfg.train.grpo == base.train.grpo  # GRPO's section kept as it is, ignored by the others


def test_old_spellings_are_read_with_a_one_line_hint(tmp_path):
    with pytest.warns(ConfigWarning) as seen:
        cfg = load_config(
            None, ["train.beta=0.1", "sample.window.kind=fixed", "sample.window.size=2", "sample.noise_level=0.5"]
        )
    assert (cfg.train.grpo.beta, cfg.train.grpo.window.kind, cfg.train.grpo.window.size) == (0.1, "fixed", 2)
    assert cfg.train.grpo.noise_level == 0.5
    hints = [str(w.message) for w in seen]
    assert "override train.beta is now train.grpo.beta: read as train.grpo.beta (rename it to silence this)" in hints
    assert any("sample.window.kind is now train.grpo.window.kind" in h for h in hints)
    assert all("\n" not in h for h in hints)
    # a YAML file: the whole section moves; old and new spelling of one key is an error naming both
    old = tmp_path / "old.yaml"
    old.write_text(
        "sample:\n  window: {kind: fixed, start: 1, size: 2}\n  same_noise_per_group: true\n"
        "train:\n  clip_low: 0.2\n  objective: grpo\n"
    )
    with pytest.warns(ConfigWarning, match=r"old.yaml: sample.window is now train.grpo.window"):
        cfg = load_config(old)
    assert (cfg.train.grpo.window.start, cfg.train.grpo.same_noise_per_group, cfg.train.grpo.clip_low) == (1, True, 0.2)
    both = tmp_path / "both.yaml"
    both.write_text("train:\n  beta: 0.1\n  grpo: {beta: 0.2}\n")
    with pytest.raises(ConfigError, match="both train.beta and train.grpo.beta are set"):
        load_config(both)
    # an override in the new spelling wins over the file's old one
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        assert load_config(old, ["train.grpo.clip_low=0.3"]).train.grpo.clip_low == 0.3
    # every moved key is a key of the tree now
    keys = {key for key, _, _, _ in describe(Config)}
    assert all(any(k == new or k.startswith(new + ".") for k in keys) for new in MOVED_KEYS.values())


def test_the_cli_prints_an_old_spelling_as_one_line(tmp_path):
    """As a user sees it: `flowrl plan` with an old key prints one line naming the new one, then the plan."""
    import os
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "flowrl.cli", "plan", "configs/tiny_cpu.yaml", "train.beta=0.2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "default"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    hints = [line for line in out.stderr.splitlines() if "train.beta" in line]
    assert hints == [
        "flowrl: override train.beta is now train.grpo.beta: read as train.grpo.beta (rename it to silence this)"
    ], out.stderr[-2000:]
    assert "beta 0.2" in out.stdout  # the plan read it as train.grpo.beta


def test_another_objectives_section_changes_nothing_in_a_run(tmp_path):
    """A forward-process run with GRPO's section set (a window, one noise per group, a KL, another kernel) trains
    exactly as one without: the keys are not its own."""
    from flowrl.train import Trainer

    rows = {}
    for tag, extra in (
        ("plain", []),
        (
            "grpo_keys",
            [
                "train.grpo.window.kind=fixed",
                "train.grpo.window.size=1",
                "train.grpo.same_noise_per_group=true",
                "train.grpo.beta=0.5",
                "train.grpo.sde_type=cps",
            ],
        ),
    ):
        run = tmp_path / tag
        Trainer(load_config(None, [*TINY, "train.objective=awm", "train.epochs=2", f"log.run_dir={run}", *extra])).fit()
        rows[tag] = [
            {k: v for k, v in json.loads(line).items() if k.partition("/")[0] not in ("time", "perf")}
            for line in (run / "metrics.jsonl").read_text().splitlines()
        ]
    assert len(rows["plain"]) >= 3 and rows["plain"] == rows["grpo_keys"]
    assert any(r.get("policy/grad_norm", 0) > 0 for r in rows["plain"])  # it trained


def test_a_checkpoint_of_the_old_layout_resumes(tmp_path):
    """A checkpoint written before GRPO's keys moved (its saved config spells them the old way) resumes, the old
    keys read where they are now: no refusal, no change reported."""
    from flowrl.train import Trainer

    run = tmp_path / "run"
    args = [
        *TINY,
        "train.grpo.beta=0.01",
        "train.grpo.window.kind=fixed",
        "train.grpo.window.size=2",
        f"log.run_dir={run}",
    ]
    Trainer(load_config(None, [*args, "train.epochs=1"])).fit()
    (ckpt,) = sorted(run.glob("ckpt-*"))
    state = json.loads((ckpt / "state.json").read_text())
    saved = state["config"]
    grpo = saved["train"].pop("grpo")
    saved["train"].update(
        {k: grpo[k] for k in ("beta", "clip_low", "clip_high", "policy_loss", "kl_std", "step_weighting", "dual_clip")}
    )
    saved["sample"].update({k: grpo[k] for k in ("window", "sde_type", "noise_level", "same_noise_per_group")})
    saved["train"].pop("nft"), saved["train"].pop("awm"), saved["train"].pop("dpo")
    (ckpt / "state.json").write_text(json.dumps(state))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        resumed = Trainer(load_config(None, [*args, "train.epochs=2", "checkpoint.resume=auto"]))
        resumed.fit()
    assert resumed.state.epochs_done == 2
    hints = [w for w in seen if issubclass(w.category, ConfigWarning) and " is now " in str(w.message)]
    assert not hints  # no moved-key hint: the saved config is data
    changed = [str(w.message) for w in seen if "with a changed config" in str(w.message)]
    assert not changed, changed  # train.epochs is what a resume changes to train on: not reported
    # a checkpoint of another objective is still refused, in one line
    from flowrl.errors import CheckpointError

    with pytest.raises(CheckpointError, match="train.objective: 'grpo' -> 'awm'"):
        Trainer(load_config(None, [*args, "train.epochs=3", "checkpoint.resume=auto", "train.objective=awm"])).fit()


NEW_OBJECTIVE = '''
"""Reward-weighted regression, a test's objective: the flow-matching loss weighted by softmax(A / temperature)."""

from dataclasses import dataclass
from typing import ClassVar

import torch

from flowrl.objectives import register
from flowrl.objectives._forward import ForwardProcessObjective
from flowrl.ranges import POSITIVE


@dataclass
class RWRSettings:
    RANGES: ClassVar[dict] = {"temperature": POSITIVE}

    temperature: float = 1.0
    """The weights' temperature: softmax(A / temperature), scaled to mean 1."""
    timesteps: int = 2
    """Training times per sample."""


@register
class RWR(ForwardProcessObjective):
    name = "rwr"
    title = "reward-weighted regression"
    Settings = RWRSettings

    @classmethod
    def times_per_sample(cls, settings, num_steps):
        return settings.timesteps

    @classmethod
    def reference_note(cls, settings):
        return False, f"rwr temperature {settings.temperature:g}"

    def row_losses(self, batch, idx, unit, adv):
        rows, t, noise = self.inputs(batch, idx, unit)
        pred = self.policy.flow_prediction(batch, rows, t, noise)
        w = torch.softmax(adv[rows].to(noise.device).float() / self.settings.temperature, 0) * len(rows)
        err = ((pred.velocity - pred.target) ** 2).flatten(1).mean(1)
        return w.detach() * err, {"weight_max": w.max().detach()}
'''


def test_an_objective_is_one_module(tmp_path):
    """One module in the objectives package, nothing else edited: the config takes train.objective=rwr and its
    section train.rwr (checked against its ranges), `flowrl train` trains it and `flowrl plan` plans it. (The module
    sits in a folder put on the package's path, in a fresh process, as if it were a file of flowrl/objectives/.)"""
    import os
    import subprocess
    import sys

    (tmp_path / "objectives").mkdir()
    (tmp_path / "objectives" / "rwr.py").write_text(NEW_OBJECTIVE)
    run = tmp_path / "run"
    code = f"""
import flowrl.objectives
flowrl.objectives.__path__.append({str(tmp_path / "objectives")!r})
from flowrl.config import ConfigError, describe, load_config
from flowrl.plan import plan
from flowrl.train import Trainer
args = {[*TINY, "train.objective=rwr", "train.rwr.temperature=0.5", "train.epochs=1", f"log.run_dir={run}"]!r}
assert "train.rwr.temperature" in {{k for k, _, _, _ in describe()}}
try:
    load_config(None, [*args, "train.rwr.temperature=-1"])
    raise SystemExit("a temperature of -1 was taken")
except ConfigError as e:
    assert "train.rwr.temperature must be > 0" in str(e), e
cfg = load_config(None, args)
metrics = Trainer(cfg).fit()
print("weight_max", metrics["policy/rwr_weight_max"], "grad_norm", metrics["policy/grad_norm"])
print(plan(cfg).render())
"""
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    stats = out.stdout.split("weight_max ", 1)[1].split()
    assert float(stats[0]) >= 1.0 and float(stats[2]) > 0  # weighted by the advantages, and it trained
    assert "objective rwr: 1 model rows: 1 time(s)" in out.stdout and "rwr temperature 0.5" in out.stdout


def test_grpo_loss_moves_the_scorers_cpu_tensors_to_the_units_device():
    """The scorer's advantages and kept samples live on the CPU; the unit's log-probs on the model's device (the GPU
    check found the loss mixing them). The meta device stands in for a GPU here: any op mixing it with a CPU tensor
    fails as a CUDA one does."""
    import torch

    from flowrl.objectives.grpo import GRPOSettings, grpo_loss
    from flowrl.policies.base import UnitOutput

    b, k = 3, 2
    out = UnitOutput(
        log_prob=torch.zeros(b, k, device="meta"),
        old_log_prob=torch.zeros(b, k, device="meta"),
        mask=torch.ones(b, k, device="meta"),
        kl=torch.zeros(b, k, device="meta"),
    )
    loss, stats = grpo_loss(out, torch.ones(b), torch.ones(b, dtype=torch.bool), GRPOSettings(beta=0.1), "token-mean")
    assert loss.device.type == "meta" and stats["kl"].device.type == "meta"


def test_cudnn_attention_is_off_on_cuda_unless_asked(monkeypatch):
    """model.cudnn_attention: on a CUDA device the trainer turns PyTorch's cuDNN attention backend off (its backward
    failed for FLUX.1-dev on an H200) unless the config asks for it; on the CPU it touches nothing."""
    import torch

    from flowrl.train.trainer import attention_backends

    calls = []
    monkeypatch.setattr(torch.backends.cuda, "enable_cudnn_sdp", calls.append)
    attention_backends(torch.device("cpu"), cudnn=False)
    assert calls == []
    attention_backends(torch.device("cuda", 0), cudnn=False)
    attention_backends(torch.device("cuda"), cudnn=True)
    assert calls == [False, True]
    assert load_config(None, []).model.cudnn_attention is False
    assert load_config(None, ["model.cudnn_attention=true"]).model.cudnn_attention is True
