"""Write the shapes world's prompt splits and its editing and video task data (deterministic: the same files on
every run).

samples/shapes/{train,test,out_of_template}.jsonl   the text-to-image prompt splits (flowrl.worlds.shapes.prompts)
samples/shapes/{val,train_minus_val}.jsonl  the training prompts held out for choosing settings, and the rest
samples/shapes/edit/{train,test}.jsonl   instructions with their source image (`image`, relative paths),
                                         `edit` and `edit_region` columns (flowrl.worlds.shapes.edit)
samples/shapes/edit/images/*.png         the 64x64 source scenes, rendered by the shapes renderer
samples/shapes/motion/{train,test}.jsonl moving-shape prompts with `objects` and `motion` (flowrl.worlds.shapes.motion)

python scripts/make_shapes_tasks.py [--out samples/shapes] [--per-instruction 4] [--seed 0]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def write_edit_task(out: Path, per_instruction: int, seed: int) -> dict[str, int]:
    """The edit JSONLs and their PNGs under `out`/edit; PNGs of an earlier run not written again are removed."""
    from PIL import Image

    from flowrl.worlds.shapes import draw, write_jsonl
    from flowrl.worlds.shapes.edit import edit_records

    folder = out / "edit"
    (folder / "images").mkdir(parents=True, exist_ok=True)
    written, counts = set(), {}
    for split in ("train", "test"):
        records = []
        for i, (record, scene) in enumerate(edit_records(split, per_instruction, seed)):
            name = f"images/{split}_{i:03d}.png"
            Image.fromarray(draw(scene)).save(folder / name, optimize=True)
            written.add(folder / name)
            records.append(
                {"prompt": record["prompt"], "image": name, **{k: record[k] for k in record if k != "prompt"}}
            )
        write_jsonl(records, folder / f"{split}.jsonl")
        counts[split] = len(records)
    for stale in set((folder / "images").glob("*.png")) - written:
        stale.unlink()
    return counts


def write_prompt_splits(out: Path) -> dict[str, int]:
    from flowrl.worlds.shapes import write_jsonl
    from flowrl.worlds.shapes.prompts import SPLITS, prompts_of_split

    counts = {}
    for split in SPLITS:
        records = prompts_of_split(split)
        write_jsonl(records, out / f"{split}.jsonl")
        counts[split] = len(records)
    return counts


def write_motion_task(out: Path) -> dict[str, int]:
    from flowrl.worlds.shapes import write_jsonl
    from flowrl.worlds.shapes.motion import motion_prompts

    counts = {}
    for split in ("train", "test"):
        records = motion_prompts(split)
        write_jsonl(records, out / "motion" / f"{split}.jsonl")
        counts[split] = len(records)
    return counts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "samples" / "shapes")
    p.add_argument("--per-instruction", type=int, default=4, help="source scenes per edit instruction")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    prompts = write_prompt_splits(args.out)
    edit = write_edit_task(args.out, args.per_instruction, args.seed)
    motion = write_motion_task(args.out)
    print("prompts: " + ", ".join(f"{n} {split}" for split, n in prompts.items()))
    print(f"edit: {edit['train']} train, {edit['test']} test; motion: {motion['train']} train, {motion['test']} test")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
