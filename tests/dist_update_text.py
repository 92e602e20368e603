"""Run by tests/test_text_fsdp.py under `accelerate launch --num_processes 2` (text backend, usually sharded):

1. generation: each process greedily completes its own prompts with its own max_new_tokens (so one process ends
   its generation steps before the other), then rolls out its share of epoch 0; the outputs and the recorded
   log-probs go to `<out>.json`;
2. the update: each process takes its half of a recorded global batch and runs the trainer's update on it; the
   trained weights go to `<out>.safetensors` (gathered from the shards);
3. a checkpoint with the export (the LoRA, or the full model) in the run dir, written by `Trainer.save`.
"""

import json
import os
import sys

import torch
from safetensors.torch import save_file

from flowrl.config import load_config
from flowrl.policies.base import TextBatch, full_tensor
from flowrl.train import Trainer

GREEDY = {0: (["10+20="], 2), 1: (["11+21=", "12+22=", "13+20="], 6)}  # rank -> (prompts, max_new_tokens)


def rows_of(saved: dict, rows: list[int]) -> TextBatch:
    """Rows `rows` of a whole batch saved as a dict of TextBatch fields (`epoch_prompts`, the epoch's prompts that
    group ids index, is the whole batch's)."""
    fields = {}
    for key, value in saved["batch"].items():
        if torch.is_tensor(value) and value.ndim:
            fields[key] = value[rows]
        elif isinstance(value, list) and key != "epoch_prompts":
            fields[key] = [value[i] for i in rows]
        else:
            fields[key] = value
    return TextBatch(**fields)


def everyones(value):
    """Every process's `value`, in rank order (a collective)."""
    from accelerate.utils import gather_object

    return gather_object([value])


torch.set_num_threads(1)
batch_file, out, *overrides = sys.argv[1:]
tr = Trainer(load_config(None, overrides))
rank, n = tr.acc.process_index, tr.batch_local
# sharded, every weight of the policy and of a reference copy is a DTensor shard: count those that are not
whole = sum(
    not hasattr(p, "device_mesh")
    for model in (tr.policy.model, tr.policy.ref_copy)
    if model is not None
    for p in model.parameters()
)

prompts, max_new = GREEDY[rank]
texts, _ = tr.policy.generate_greedy(prompts, max_new_tokens=max_new)
rolled = tr.rollout(epoch=0)
generated = {
    "greedy": {"prompts": prompts, "max_new_tokens": max_new, "texts": texts},
    "rollout": {
        key: getattr(rolled, key).tolist()
        for key in ("input_ids", "attention_mask", "completion_mask", "old_log_probs")
    }
    | {"prompt_len": rolled.prompt_len},
}
generated = everyones(generated)

saved = torch.load(batch_file, weights_only=False)  # written by the test itself
rows = list(range(rank * n, rank * n + n))
metrics = tr.update(rows_of(saved, rows), saved["adv"][rows], saved["keep"][rows], epoch=0)
weights = {k: full_tensor(v.detach()).contiguous() for k, v in tr.named_params.items()}  # every process: FSDP
tr.state.epochs_done = 1
tr.save()
if tr.main:
    save_file(weights, out + ".safetensors")
    with open(out + ".json", "w") as f:
        json.dump(generated, f)
    print("sharded", tr.policy.sharded, "optimizer steps", tr.state.optimizer_steps)
    print("whole parameters", whole)
tr.acc.wait_for_everyone()
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)  # no interpreter finalization: gloo's threads can abort a finished rank there (flowrl.cli._leave)
