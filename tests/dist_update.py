"""Run by tests/test_trainer_image.py under `accelerate launch --num_processes 2`: each process takes its half of a
recorded global batch and runs the trainer's update on it; rank 0 saves the trained weights. As `fit` does, it first
resumes from a checkpoint with checkpoint.resume set, and after the update writes one with DIST_UPDATE_SAVE=1;
DIST_UPDATE_POISON=rank makes that process's first model call give NaN log-probs."""

import os
import sys

import torch
from safetensors.torch import save_file

from flowrl.config import load_config
from flowrl.policies.base import ImageBatch, full_tensor
from flowrl.run.checkpoint import resolve_resume
from flowrl.train import Trainer

torch.set_num_threads(1)
batch_file, out_file, *overrides = sys.argv[1:]
tr = Trainer(load_config(None, overrides))
saved = torch.load(batch_file, weights_only=False)  # written by the test itself
rank, n = tr.acc.process_index, tr.batch_local
rows = list(range(rank * n, rank * n + n))
traj = saved["traj"].select(rows)
batch = ImageBatch(
    traj=traj, prompts=[saved["prompts"][i] for i in rows], metadata=[saved["metadata"][i] for i in rows], images=[]
)
keep = saved.get("keep", torch.ones(len(saved["adv"]), dtype=torch.bool))[rows]
if os.environ.get("DIST_UPDATE_POISON") == str(rank):  # this process's first model call gives NaN log-probs
    unit_log_probs, calls = tr.policy.unit_log_probs, []

    def poisoned(*args, **kwargs):
        out = unit_log_probs(*args, **kwargs)
        if not calls:
            out.log_prob = out.log_prob * float("nan")
        calls.append(1)
        return out

    tr.policy.unit_log_probs = poisoned
found = resolve_resume(tr.cfg.checkpoint.resume, tr.run_dir)
if found is not None:
    tr.load(*found)
metrics = tr.update(batch, saved["adv"][rows], keep, epoch=tr.state.epochs_done)
if os.environ.get("DIST_UPDATE_SAVE") == "1":
    tr.state.epochs_done += 1
    tr.save()
weights = {k: full_tensor(v).detach().contiguous() for k, v in tr.named_params.items()}  # every process: FSDP, ZeRO-3
if tr.main:
    save_file(weights, out_file)
    print(
        "optimizer steps",
        tr.state.optimizer_steps,
        "ratio_first_dev",
        metrics.get("policy/ratio_first_dev"),
        "skipped",
        metrics["policy/skipped_nonfinite"],
        "engine",
        type(getattr(tr.dist, "engine", None)).__name__,
    )
tr.acc.wait_for_everyone()
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)  # no interpreter finalization: gloo's threads can abort a finished rank there (flowrl.cli._leave)
