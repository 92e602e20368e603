"""An objective with group-level terms (`Objective.group_batches`, e.g. DGPO's group preference) gets whole groups in
every minibatch and micro-batch: the update shuffles groups, micro-batches are cut at group boundaries, and a
minibatch or micro-batch size that is not a multiple of the group size is refused before the model loads."""

import pytest
import torch
from imagetiny import TINY_RUN

from flowrl.config import ConfigError, load_config
from flowrl.objectives import get_objective
from flowrl.train import Trainer

torch.set_num_threads(1)

ARGS = [*TINY_RUN, "eval.num_steps=2", "eval.num_prompts=1", "sample.prompts_per_epoch=3", "sample.group_size=4"]


@pytest.fixture
def whole_groups(monkeypatch):
    """The forward-process objective dpo, declared as one with group-level terms."""
    monkeypatch.setattr(get_objective("dpo"), "group_batches", True)


def groups_of(batch, idx: torch.Tensor) -> list[int]:
    return batch.group_ids[idx].tolist()


def test_the_update_shuffles_groups_and_cuts_micro_batches_at_their_boundaries(whole_groups, tmp_path):
    tr = Trainer(
        load_config(
            None,
            [*ARGS, f"log.run_dir={tmp_path}", "train.objective=dpo", "train.micro_batch_size=8"],
        )
    )
    batch = tr.rollout(0)
    gids = batch.group_ids
    orders = set()
    for seed in range(6):
        perm = tr.updater.shuffle(batch, torch.Generator().manual_seed(seed))
        assert sorted(perm.tolist()) == list(range(len(gids)))
        runs = groups_of(batch, perm)
        # each group's 4 samples are adjacent, in batch order
        for start in range(0, len(runs), 4):
            assert len(set(runs[start : start + 4])) == 1
            assert perm[start : start + 4].tolist() == sorted(perm[start : start + 4].tolist())
        orders.add(tuple(runs[::4]))
        chunks = tr.updater.micro_batches(perm, batch)
        assert [len(c) for c in chunks] == [8, 4]  # two groups, then the third
        # a dropped sample shortens its group; the cut stays at a group boundary
        dropped = torch.cat([perm[:3], perm[4:]])
        chunks = tr.updater.micro_batches(dropped, batch)
        assert [len(c) for c in chunks] == [7, 4]
        assert all(set(groups_of(batch, a)).isdisjoint(groups_of(batch, b)) for a, b in zip(chunks, chunks[1:]))
    assert len(orders) > 1  # the groups' order is shuffled


def test_other_objectives_still_shuffle_samples(tmp_path):
    tr = Trainer(load_config(None, [*ARGS, f"log.run_dir={tmp_path}", "train.objective=dpo"]))
    batch = tr.rollout(0)
    perm = tr.updater.shuffle(batch, torch.Generator().manual_seed(0))
    assert torch.equal(perm, torch.randperm(len(batch.group_ids), generator=torch.Generator().manual_seed(0)))


@pytest.mark.parametrize(("key", "value"), [("minibatch_size", 6), ("micro_batch_size", 2)])
def test_sizes_that_split_groups_are_refused_before_the_model_loads(whole_groups, key, value):
    with pytest.raises(ConfigError, match=rf"train.{key}={value}: .*multiple of sample.group_size=4"):
        load_config(None, [*ARGS, "train.objective=dpo", f"train.{key}={value}"])
    load_config(None, [*ARGS, "train.objective=dpo", f"train.{key}={value * 2 if value == 2 else 12}"])
