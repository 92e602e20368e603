"""Run by tests/test_trainer_image.py under `accelerate launch --num_processes 2`: each process takes its half of a
recorded global batch and runs the trainer's update on it; rank 0 saves the trained weights."""

import sys

import torch
from safetensors.torch import save_file

from flowrl.config import load_config
from flowrl.policy import ImageBatch, full_tensor
from flowrl.trainer import Trainer

torch.set_num_threads(1)
batch_file, out_file, *overrides = sys.argv[1:]
tr = Trainer(load_config(None, overrides))
saved = torch.load(batch_file, weights_only=False)  # written by the test itself
rank, n = tr.acc.process_index, tr.batch_local
rows = list(range(rank * n, rank * n + n))
traj = saved["traj"].select(rows)
batch = ImageBatch(traj=traj, prompts=[saved["prompts"][i] for i in rows],
                   metadata=[saved["metadata"][i] for i in rows], images=[])
keep = saved.get("keep", torch.ones(len(saved["adv"]), dtype=torch.bool))[rows]
metrics = tr.update(batch, saved["adv"][rows], keep, epoch=0)
weights = {k: full_tensor(v.detach()).contiguous() for k, v in tr.named_params.items()}  # every process: FSDP
if tr.main:
    save_file(weights, out_file)
    print("optimizer steps", tr.state.optimizer_steps, "ratio_first_dev", metrics.get("policy/ratio_first_dev"))
tr.acc.wait_for_everyone()
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()
