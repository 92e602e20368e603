"""A run directory is one run's at a time (its lock), a checkpoint resumes (or is evaluated) only over the base
weights it was trained over (their fingerprint), and a full disk during a checkpoint write leaves no half-written
folder and ends the run in one line. Tiny SD3 on the CPU."""

import errno
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from imagetiny import TINY_RUN

from flowrl.cli import main
from flowrl.config import load_config
from flowrl.errors import CheckpointError, RunDirError
from flowrl.run import rundir
from flowrl.run.checkpoint import list_checkpoints, read_checkpoint, write_checkpoint
from flowrl.run.lock import LOCK_NAME, RunLock
from flowrl.train import Trainer

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    *TINY_RUN,
    "eval.num_steps=2",
    "eval.num_prompts=2",
    "eval.grid=false",
]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}


def tiny_cfg(run_dir, *extra):
    return load_config(None, [*TINY, f"log.run_dir={run_dir}", *extra])


def one_line_error(capsys, rc) -> str:
    err = capsys.readouterr().err.strip()
    assert rc == 1, err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


def dead_pid() -> int:
    """The pid of a process that has ended (and been reaped)."""
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(proc.stdout)


# ------------------------------------------------------------------------------------------ the run lock


BLOCKING_REWARD = '''
import os, time

def gated(images, prompts, **metadata):
    """Mean pixel, once the file `go` exists (it writes `started` first): the run stays alive until the test says."""
    open("started", "w").close()
    deadline = time.time() + 300
    while not os.path.exists("go") and time.time() < deadline:
        time.sleep(0.05)
    return [sum(im.convert("L").getdata()) / (255.0 * im.width * im.height) for im in images]
'''


def test_a_second_run_into_a_locked_folder_refuses_naming_the_first(tmp_path, capsys, no_model_load):
    """Two `flowrl train` into one log.run_dir: the second (started while the first runs) refuses in one line naming
    the first's pid, before its model loads; the first ends normally, its metrics its own, and its lock goes."""
    (tmp_path / "scores.py").write_text(BLOCKING_REWARD)
    run = tmp_path / "run"
    args = [*TINY, f"log.run_dir={run}", "train.epochs=1", "rewards=[{name: 'scores.py:gated'}]"]
    first = subprocess.Popen(
        [sys.executable, "-m", "flowrl", "train", *args],
        cwd=tmp_path,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.time() + 300
        while not (tmp_path / "started").exists() and first.poll() is None and time.time() < deadline:
            time.sleep(0.1)
        assert (tmp_path / "started").exists(), first.communicate()[1][-2000:]
        holder = json.loads((run / LOCK_NAME).read_text())
        assert holder["pid"] == first.pid and holder["host"] == socket.gethostname()
        err = one_line_error(capsys, main(["train", *TINY, f"log.run_dir={run}", "train.epochs=1"]))
        assert f"is in use by another run (pid {first.pid} on {socket.gethostname()}, since " in err
        assert "pick another log.run_dir, or wait for that run to end" in err
    finally:
        (tmp_path / "go").touch()
        _, stderr = first.communicate(timeout=600)
    assert first.returncode == 0, stderr[-2000:]
    assert not (run / LOCK_NAME).exists()
    rows = [json.loads(r) for r in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows if "policy/loss" in r] == [1] and sum("final" in r for r in rows) == 1


def test_a_lock_of_a_dead_process_is_taken_over_with_a_warning(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    pid = dead_pid()
    stale = {"pid": pid, "host": socket.gethostname(), "started": "2020-01-01 00:00:00"}
    (run / LOCK_NAME).write_text(json.dumps(stale))
    assert rundir.run_files(run) == [] and not rundir.holds_a_run(run)  # a lock is not a run's file
    with pytest.warns(
        UserWarning, match=rf"taking over the lock of a run that is gone \(pid {pid} on this host, since"
    ):
        tr = Trainer(tiny_cfg(run, "train.epochs=1"))
    assert json.loads((run / LOCK_NAME).read_text())["pid"] == os.getpid()
    tr.fit()
    assert not (run / LOCK_NAME).exists()


def test_a_lock_of_another_host_refuses_and_says_how_to_remove_it(tmp_path, no_model_load):
    run = tmp_path / "run"
    run.mkdir()
    other = {"pid": 4242, "host": "gpu-node-7", "started": "2020-01-01 00:00:00"}
    (run / LOCK_NAME).write_text(json.dumps(other))
    with pytest.raises(
        RunDirError,
        match=r"locked by a run on host gpu-node-7 \(pid 4242, since 2020-01-01 00:00:00\).*pick another "
        rf"log\.run_dir.*if you are sure it is gone, delete {run / LOCK_NAME}",
    ):
        Trainer(tiny_cfg(run, "train.epochs=1"))
    assert json.loads((run / LOCK_NAME).read_text()) == other  # left alone


def test_the_lock_is_held_during_a_run_and_removed_after_it_fails_or_ends(tmp_path, monkeypatch):
    run = tmp_path / "run"
    seen = []

    def failing_epoch(self, epoch):
        seen.append(json.loads((run / LOCK_NAME).read_text()))
        seen.append(rundir.run_files(run))
        raise RuntimeError("boom")

    monkeypatch.setattr(Trainer, "train_epoch", failing_epoch)
    with pytest.raises(RuntimeError, match="boom"):
        Trainer(tiny_cfg(run, "train.epochs=1", "eval.before=false")).fit()
    assert seen[0]["pid"] == os.getpid() and seen[1] == []  # held, and not one of the run's files
    assert not (run / LOCK_NAME).exists()
    monkeypatch.undo()
    Trainer(tiny_cfg(run, "train.epochs=1", "log.overwrite=true")).fit()
    assert not (run / LOCK_NAME).exists()


def test_a_lock_is_removed_only_by_its_holder(tmp_path):
    first = RunLock(tmp_path).acquire()
    (tmp_path / LOCK_NAME).unlink()  # (a user removed it) and another run took it
    second = RunLock(tmp_path).acquire()
    first.release()
    assert json.loads((tmp_path / LOCK_NAME).read_text())["token"] == second.info["token"]
    second.release()
    assert not (tmp_path / LOCK_NAME).exists()


# ------------------------------------------------------------------------------------------ the base model


@pytest.fixture(scope="module")
def sd3_dir(tmp_path_factory):
    from flowrl.families import tiny_pipeline

    d = tmp_path_factory.mktemp("sd3") / "model"
    tiny_pipeline("tiny-sd3").save_pretrained(d)
    return d


def perturb(file: Path) -> None:
    """Re-save the safetensors `file` with its weights nudged: same tensors, names, shapes, so the same header."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(file), "pt") as f:
        tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    header = file.read_bytes()[: 8 + int.from_bytes(file.read_bytes()[:8], "little")]
    save_file({k: v + 0.01 if v.is_floating_point() else v for k, v in tensors.items()}, str(file), metadata=meta)
    assert file.read_bytes().startswith(header)


def test_a_resume_or_eval_over_changed_base_weights_refuses_naming_the_file(sd3_dir, tmp_path, capsys, monkeypatch):
    model = tmp_path / "model"
    shutil.copytree(sd3_dir, model)
    run = tmp_path / "run"
    cfg = [f"model.path={model}", "checkpoint.resume=auto"]
    Trainer(tiny_cfg(run, f"model.path={model}", "train.epochs=1")).fit()
    saved = read_checkpoint(run / "ckpt-000001")["state"]["base_model"]
    assert saved["path"] == str(model) and "transformer/diffusion_pytorch_model.safetensors" in saved["files"]
    Trainer(tiny_cfg(run, *cfg, "train.epochs=2")).fit()  # unchanged: resumes
    assert [p.name for p in list_checkpoints(run)] == ["ckpt-000001", "ckpt-000002"]

    perturb(model / "transformer" / "diffusion_pytorch_model.safetensors")
    import flowrl.policies

    build_policy = flowrl.policies.build_policy
    monkeypatch.setattr(flowrl.policies, "build_policy", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(
        CheckpointError,
        match=rf"checkpoint {run / 'ckpt-000002'} was trained over other base weights than model\.path={model} "
        r"holds now \(changed: transformer/diffusion_pytorch_model\.safetensors\); use the base model it was "
        r"trained from, or set checkpoint\.allow_other_base=true",
    ):
        Trainer(tiny_cfg(run, *cfg, "train.epochs=3"))
    capsys.readouterr()  # (the runs' progress bars)
    err = one_line_error(capsys, main(["eval", *TINY, *cfg[:1], "--checkpoint", str(run / "ckpt-000002")]))
    assert "changed: transformer/diffusion_pytorch_model.safetensors" in err and "allow_other_base=true" in err
    assert not (run / LOCK_NAME).exists()  # the refused run let go of the folder

    monkeypatch.setattr(flowrl.policies, "build_policy", build_policy)
    with pytest.warns(UserWarning, match=r"other base weights.*going on, as checkpoint\.allow_other_base=true asks"):
        tr = Trainer(tiny_cfg(run, *cfg, "train.epochs=3", "checkpoint.allow_other_base=true"))
    tr.fit()
    assert tr.state.epochs_done == 3
    assert read_checkpoint(run / "ckpt-000003")["state"]["base_model"] != saved  # the new base's, from now on


def test_a_variant_runs_checkpoint_keeps_the_variants_weights_and_refuses_their_change(sd3_dir, tmp_path):
    """model.variant=fp16 over a directory holding both the plain and the fp16 files: the checkpoint's fingerprint
    holds the fp16 files the run loaded, a change of the plain ones (not loaded) is nothing, and a change of the
    fp16 ones refuses `flowrl eval --checkpoint` before the model loads, naming the file."""
    from flowrl.families import tiny_pipeline

    model = tmp_path / "model"
    shutil.copytree(sd3_dir, model)
    tiny_pipeline("tiny-sd3").save_pretrained(model, variant="fp16")
    run, variant = tmp_path / "run", ["model.variant=fp16", f"model.path={model}"]
    Trainer(tiny_cfg(run, *variant, "train.epochs=1")).fit()
    files = read_checkpoint(run / "ckpt-000001")["state"]["base_model"]["files"]
    assert "transformer/diffusion_pytorch_model.fp16.safetensors" in files
    assert "transformer/diffusion_pytorch_model.safetensors" not in files

    from flowrl.config import load_config
    from flowrl.run.loading import read_checked

    cfg = load_config(None, [*TINY, *variant])
    perturb(model / "transformer" / "diffusion_pytorch_model.safetensors")  # the plain file: not loaded
    read_checked(cfg, run / "ckpt-000001")
    perturb(model / "transformer" / "diffusion_pytorch_model.fp16.safetensors")
    with pytest.raises(CheckpointError, match=r"changed: transformer/diffusion_pytorch_model\.fp16\.safetensors"):
        read_checked(cfg, run / "ckpt-000001")


def test_a_resume_with_model_path_spelt_otherwise_over_the_same_weights_resumes(sd3_dir, tmp_path, monkeypatch):
    """The run trained over model.path=/abs/model resumes with `model/` (relative, a trailing slash) and with a copy
    of the same files elsewhere; another path over other weights is still refused, naming them."""
    run = tmp_path / "run"
    Trainer(tiny_cfg(run, f"model.path={sd3_dir}", "train.epochs=1")).fit()
    copy = tmp_path / "copy"
    shutil.copytree(sd3_dir, copy)
    monkeypatch.chdir(sd3_dir.parent)
    for epochs, path in ((2, "model/"), (3, str(copy))):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            tr = Trainer(tiny_cfg(run, f"model.path={path}", "checkpoint.resume=auto", f"train.epochs={epochs}"))
            tr.fit()
        assert not [w for w in seen if "model.path" in str(w.message)]  # the same model: not even a change
        assert tr.state.epochs_done == epochs
    other = tmp_path / "other"
    shutil.copytree(sd3_dir, other)
    perturb(other / "transformer" / "diffusion_pytorch_model.safetensors")
    # another path over other weights is a change of the model (not a base to allow with allow_other_base)
    for allow in ("false", "true"):
        with pytest.raises(
            CheckpointError,
            match=rf"cannot resume from {run / 'ckpt-000003'}: the config changed what the checkpoint was trained as "
            rf"\(model\.path: '{copy}' -> '{other}', other base weights: changed: "
            r"transformer/diffusion_pytorch_model\.safetensors\); undo that change, or start a new run",
        ):
            Trainer(
                tiny_cfg(
                    run,
                    f"model.path={other}",
                    "checkpoint.resume=auto",
                    "train.epochs=4",
                    f"checkpoint.allow_other_base={allow}",
                )
            ).fit()


def test_a_checkpoint_without_a_fingerprint_or_a_model_without_files_is_not_checked(tmp_path):
    from flowrl.run.basemodel import fingerprint
    from flowrl.run.loading import check_base

    assert fingerprint("tiny-sd3") is None  # built in code
    assert fingerprint("some-org/not-in-the-cache") is None  # a hub id that cannot be resolved offline
    (tmp_path / "m").mkdir()
    current = fingerprint(str(tmp_path / "m"))
    assert current == {"path": str(tmp_path / "m"), "files": {}}
    with pytest.warns(UserWarning, match=r"kept no fingerprint of its base model.*not checked"):
        check_base({}, tmp_path / "ckpt-000001", current, allow=False, note=True)
    check_base({"base_model": {"files": {}}}, tmp_path / "ckpt-000001", None, allow=False)  # nothing to compare


def test_a_fingerprint_names_new_missing_and_changed_files(tmp_path):
    from safetensors.torch import save_file

    from flowrl.run.basemodel import differences, fingerprint

    (tmp_path / "unet").mkdir()
    layers = {f"layer{i:02d}": torch.zeros(64 * 1024) for i in range(40)}  # 10 MiB
    save_file(layers, tmp_path / "unet" / "w.safetensors")
    (tmp_path / "gone.bin").write_bytes(b"a" * 3_000_000)
    (tmp_path / "notes.json").write_text("{}")  # not a weight file (a directory of no model layout: every weight file)
    before = fingerprint(str(tmp_path))
    assert sorted(before["files"]) == ["gone.bin", "unet/w.safetensors"]
    layers["layer20"] = layers["layer20"] + 1  # one tensor in the middle, same header
    save_file(layers, tmp_path / "unet" / "w.safetensors")
    (tmp_path / "gone.bin").rename(tmp_path / "new.bin")
    assert differences(before, fingerprint(str(tmp_path))) == [
        "changed: unet/w.safetensors",
        "missing: gone.bin",
        "new: new.bin",
    ]
    assert differences(before, before) == []


def test_a_fingerprint_holds_the_weights_that_load_and_a_stray_file_changes_nothing(tmp_path):
    """Of a pipeline directory, the fingerprint holds the weight files its load reads: each component model_index.json
    names (not one saved as [null, null]), by diffusers' and transformers' names, of model.variant where the component
    has it (else its plain files), its .safetensors over its .bin. A LoRA copied into the directory, a variant
    downloaded later or a .bin beside the .safetensors changes nothing; a changed loaded file is named. A checkpoint's
    fingerprint from before (of every weight file) is compared on the loaded files alone: its stray entries are not
    differences, a loaded file changed or missing still is."""
    from safetensors.torch import save_file

    from flowrl.run.basemodel import differences, file_digest, fingerprint
    from flowrl.run.loading import check_base

    index = {"_class_name": "StableDiffusionPipeline", "unet": ["diffusers", "UNet2DConditionModel"]}
    index |= {"text_encoder": ["transformers", "CLIPTextModel"], "safety_checker": [None, None]}
    (tmp_path / "model_index.json").write_text(json.dumps(index))
    weights = {"unet/diffusion_pytorch_model.safetensors": 1.0, "unet/diffusion_pytorch_model.fp16.safetensors": 2.0}
    weights |= {"text_encoder/model.safetensors": 3.0, "safety_checker/model.safetensors": 4.0}
    for name, value in weights.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        save_file({"w": torch.full((64,), value)}, tmp_path / name)
    plain, fp16 = fingerprint(str(tmp_path)), fingerprint(str(tmp_path), "fp16")
    assert sorted(plain["files"]) == ["text_encoder/model.safetensors", "unet/diffusion_pytorch_model.safetensors"]
    assert sorted(fp16["files"]) == ["text_encoder/model.safetensors", "unet/diffusion_pytorch_model.fp16.safetensors"]
    assert plain["scope"] == "loaded"

    def old_fingerprint():  # as checkpoints kept it before: every *.safetensors / *.bin under the directory
        files = sorted(f for f in tmp_path.rglob("*") if f.suffix in (".safetensors", ".bin"))
        found = {f.relative_to(tmp_path).as_posix(): f"{f.stat().st_size}:{file_digest(f)}" for f in files}
        return {"path": str(tmp_path), "files": found}

    save_file({"lora_A": torch.zeros(4)}, tmp_path / "pytorch_lora_weights.safetensors")  # a LoRA copied in
    save_file({"lora_A": torch.zeros(4)}, tmp_path / "unet" / "pytorch_lora_weights.safetensors")
    save_file({"w": torch.zeros(64)}, tmp_path / "text_encoder" / "model.fp16.safetensors")  # downloaded later
    (tmp_path / "unet" / "diffusion_pytorch_model.bin").write_bytes(b"a pickle never read")
    old = old_fingerprint()
    assert len(old["files"]) == 8
    assert differences(plain, fingerprint(str(tmp_path))) == []
    assert differences(fp16, fingerprint(str(tmp_path), "fp16")) == [  # a variant run now loads the new fp16 file
        "missing: text_encoder/model.safetensors",
        "new: text_encoder/model.fp16.safetensors",
    ]
    assert differences(old, fingerprint(str(tmp_path))) == []  # an old checkpoint's fingerprint: comparable
    check_base({"base_model": old}, tmp_path / "ckpt-000001", fingerprint(str(tmp_path)), allow=False)

    save_file({"w": torch.full((64,), 9.0)}, tmp_path / "unet" / "diffusion_pytorch_model.safetensors")
    assert differences(plain, fingerprint(str(tmp_path))) == ["changed: unet/diffusion_pytorch_model.safetensors"]
    assert differences(old, fingerprint(str(tmp_path))) == ["changed: unet/diffusion_pytorch_model.safetensors"]
    with pytest.raises(CheckpointError, match=r"other base weights .*changed: unet/diffusion_pytorch_model"):
        check_base({"base_model": old}, tmp_path / "ckpt-000001", fingerprint(str(tmp_path)), allow=False)
    sharded = {**old, "files": {**old["files"], "unet/diffusion_pytorch_model-00002-of-00002.safetensors": "1:x"}}
    assert "missing: unet/diffusion_pytorch_model-00002-of-00002.safetensors" in differences(
        sharded, fingerprint(str(tmp_path))
    )


# ------------------------------------------------------------------------------------------ a full disk


def test_a_full_disk_during_a_checkpoint_write_removes_its_temporary_folder(tmp_path, monkeypatch):
    from safetensors import SafetensorError

    import flowrl.run.checkpoint as checkpoint

    w = {"w": torch.ones(1000)}
    write_checkpoint(tmp_path, 1, trainable=w)

    def full(directory):
        directory.mkdir()
        (directory / "adapter.safetensors").write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(
        CheckpointError,
        match=rf"could not write checkpoint {tmp_path / 'ckpt-000002'}: No space left on device \(it needs at "
        r"least 7\.8 KiB, .* free there\); its temporary folder was removed and the previous checkpoint "
        r"ckpt-000001 is intact; free space and resume with checkpoint\.resume=auto$",
    ):
        write_checkpoint(tmp_path, 2, trainable=w, extra_dirs={"lora": full})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000001"]
    assert torch.equal(read_checkpoint(tmp_path / "ckpt-000001")["trainable"]["w"], w["w"])

    def quota(tensors, filename, metadata=None):  # safetensors names the OS error in its own error type
        raise SafetensorError("Error while serializing: I/O error: Disk quota exceeded (os error 122)")

    monkeypatch.setattr(checkpoint, "save_file", quota)
    with pytest.raises(CheckpointError, match=r"ckpt-000001: Disk quota exceeded .*there is no earlier checkpoint"):
        write_checkpoint(tmp_path / "fresh", 1, trainable=w)
    assert list((tmp_path / "fresh").iterdir()) == []

    def broken(tensors, filename, metadata=None):  # another error stays itself, and leaves no folder either
        raise RuntimeError("a bug")

    monkeypatch.setattr(checkpoint, "save_file", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        write_checkpoint(tmp_path, 3, trainable=w)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000001", "fresh"]


def test_a_full_disk_during_a_runs_checkpoint_stops_it_in_one_line(tmp_path, capsys, monkeypatch):
    """`flowrl train`: the LoRA export of epoch 2's checkpoint hits a full disk: one line, no traceback, no
    temporary folder, epoch 1's checkpoint intact, the lock gone."""
    export = Trainer.export
    calls = []

    def export_then_full(self, directory, exported=None):
        calls.append(directory)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        export(self, directory, exported)

    monkeypatch.setattr(Trainer, "export", export_then_full)
    run = tmp_path / "run"
    rc = main(["train", *TINY, f"log.run_dir={run}", "train.epochs=2", "checkpoint.every=1", "eval.before=false"])
    err = one_line_error(capsys, rc)
    assert err.startswith(f"flowrl train: could not write checkpoint {run / 'ckpt-000002'}: No space left on device")
    assert err.endswith(
        "the previous checkpoint ckpt-000001 is intact; free space and resume with checkpoint.resume=auto"
    )
    assert sorted(p.name for p in run.iterdir() if p.is_dir()) == ["ckpt-000001"]
    assert (run / "ckpt-000001" / "lora").is_dir() and not (run / LOCK_NAME).exists()
    read_checkpoint(run / "ckpt-000001")


def test_a_full_disk_while_plotting_a_finished_run_is_a_warning(tmp_path, capsys, monkeypatch):
    """curves.png is drawn after the run's last checkpoint: a full disk there is one warning, not a failed run (exit
    0), and leaves no temporary file."""
    import matplotlib.figure

    def full(self, fname, *args, **kwargs):
        Path(fname).write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", full)
    run = tmp_path / "run"
    said = (
        f"the run is complete, but its plots (curves.png, before_after.png) were not written to {run}: No space "
        f"left on device; `flowrl report {run}` draws the curves once it can"
    )
    with pytest.warns(UserWarning, match=f"^{re.escape(said)}$"):
        rc = main(["train", *TINY, f"log.run_dir={run}", "train.epochs=1", "eval.before=false"])
    err = capsys.readouterr().err
    assert rc == 0 and "Traceback" not in err, err
    assert (run / "ckpt-000001").is_dir() and not (run / "curves.png").exists()
    assert not (run / ".curves.png.tmp").exists() and not (run / LOCK_NAME).exists()


def test_a_full_disk_while_writing_an_eval_grid_stops_the_run_in_one_line(tmp_path, capsys, monkeypatch):
    """The eval after epoch 1 cannot write its grid: one line naming the file (no traceback), no temporary file left,
    and the epoch done kept in a checkpoint (said on the next line)."""
    from flowrl.policies.image import ImagePolicy

    save, calls = ImagePolicy.save_eval_outputs, []

    def full_on_the_second(self, images, prompts, path, scores=None):
        calls.append(path)
        if len(calls) == 1:
            return save(self, images, prompts, path, scores)
        Path(f"{path}.tmp.png").write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ImagePolicy, "save_eval_outputs", full_on_the_second)
    run = tmp_path / "run"
    rc = main(["train", *TINY, f"log.run_dir={run}", "train.epochs=2", "eval.every=1", "eval.grid=true"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and not any("Traceback" in line for line in err), err
    assert err[0] == (
        f"flowrl train: could not write the eval's outputs {run / 'eval-epoch000001.png'}: No space left on device; "
        "free space there (or set eval.grid=false) and resume with checkpoint.resume=auto"
    )
    assert err[1].startswith(f"flowrl train: the 1 epoch done is in checkpoint {run / 'ckpt-000001'}")
    assert len(err) == 2 and not list(run.glob("*.tmp*")) and (run / "eval-epoch000000.png").is_file()


def test_the_same_base_weights_under_another_path_are_the_same_model_for_an_eval(tmp_path):
    """An eval or a sample of a checkpoint with model.path spelt otherwise (a trailing slash, a copy elsewhere, a hub
    id's cache snapshot) over the very weight files its fingerprint names is the checkpoint's model; other weights
    under another path are still another model."""
    from safetensors.torch import save_file

    from flowrl.config import to_dict
    from flowrl.run.basemodel import fingerprint
    from flowrl.run.loading import check_model

    model, copy, other = tmp_path / "model", tmp_path / "copy", tmp_path / "other"
    for d, value in ((model, 0.0), (copy, 0.0), (other, 1.0)):
        (d / "transformer").mkdir(parents=True)
        save_file({"w": torch.full((4,), value)}, str(d / "transformer" / "diffusion_pytorch_model.safetensors"))
    trained = load_config(None, [f"model.path={model}"])
    ck = {"state": {"config": to_dict(trained), "base_model": fingerprint(str(model))}}
    for path in (f"{model}/", str(copy)):
        cfg = load_config(None, [f"model.path={path}"])
        check_model(ck, tmp_path / "ckpt-000001", cfg, fingerprint(path))
    cfg = load_config(None, [f"model.path={other}"])
    with pytest.raises(CheckpointError, match=rf"another model or adapter .*model\.path: '{model}' -> '{other}'"):
        check_model(ck, tmp_path / "ckpt-000001", cfg, fingerprint(str(other)))
    with pytest.raises(CheckpointError, match="another model or adapter"):  # no fingerprint to compare: refused
        check_model(ck, tmp_path / "ckpt-000001", load_config(None, [f"model.path={copy}"]), None)
