"""Write the shapes world's preference pairs for offline Diffusion-DPO (deterministic: the same files on every run).

samples/shapes_pairs/pairs.jsonl   one pair per line: `prompt`, `chosen` and `rejected` (64x64 PNGs, relative
                                   paths), `flaw` (what is wrong with the rejected image), and the prompt's
                                   metadata (`family`, `objects`, `relation`, ...) so that the shapes rewards and
                                   data.balance_by read the rows as they read samples/shapes/train.jsonl
samples/shapes_pairs/images/*.png  the chosen image (the prompt rendered correctly by the shapes renderer) and the
                                   rejected one (a variant with one flaw: a wrong colour, a wrong count, the
                                   opposite position, or an object the prompt does not ask for)

The prompts are the training split's less the validation split (samples/shapes/train_minus_val.jsonl, so that
settings chosen on val.jsonl never trained on its prompts), taken round the six GenEval families in turn (a seeded
order within each), so each family has a sixth of the pairs. Every chosen image scores 1 and every rejected one 0
on the strict shapes_geneval detector (the script checks it).

python scripts/make_shapes_pairs.py [--out samples/shapes_pairs] [--pairs 64] [--seed 0]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

OPPOSITE = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}


def flaws_of(meta: dict) -> list[str]:
    """The flaws a rejected image of this prompt may have: each makes the strict detector fail."""
    flaws = ["extra"]  # an object the prompt does not ask for (what the shipped model does most)
    if any(o["color"] for o in meta["objects"]):
        flaws.append("colour")
    if meta.get("relation"):
        flaws.append("position")
    else:
        flaws.append("count")
    return flaws


def rejected_scene(meta: dict, flaw: str, rng: np.random.Generator):
    """A scene of `meta`'s prompt with one `flaw`."""
    from flowrl.worlds.shapes import COLORS, add_distractor, sample_scene

    objects = [dict(o) for o in meta["objects"]]
    relation = meta.get("relation")
    if flaw == "extra":
        scene = sample_scene(objects, relation, rng)
        return add_distractor(scene, rng)
    if flaw == "position":
        return sample_scene(objects, OPPOSITE[relation], rng)
    if flaw == "count":
        k = int(rng.integers(len(objects)))
        count = objects[k]["count"]
        objects[k]["count"] = count + 1 if count == 1 or rng.random() < 0.5 else count - 1
        return sample_scene(objects, relation, rng)
    if flaw == "colour":
        named = [k for k, o in enumerate(objects) if o["color"]]
        k = named[int(rng.integers(len(named)))]
        others = [c for c in COLORS if c != objects[k]["color"]]
        objects[k]["color"] = others[int(rng.integers(len(others)))]
        return sample_scene(objects, relation, rng)
    raise ValueError(f"unknown flaw {flaw!r}")


def make_pairs(n: int, seed: int) -> list[tuple[dict, np.ndarray, np.ndarray, str]]:
    """n (prompt record, chosen image, rejected image, flaw), the prompts round the families in turn."""
    from flowrl.worlds.shapes import FAMILIES, draw, prompts_of_split, render, score_images

    rng = np.random.default_rng(seed)
    train = prompts_of_split("train_minus_val")
    queues = {f: [r for r in train if r["family"] == f] for f in FAMILIES}
    order = {f: [] for f in FAMILIES}
    pairs = []
    for i in range(n):
        family = FAMILIES[i % len(FAMILIES)]
        if not order[family]:  # the family's prompts in a seeded order, again when used up
            order[family] = [queues[family][j] for j in rng.permutation(len(queues[family]))]
        meta = order[family].pop()
        flaws = flaws_of(meta)
        flaw = flaws[int(rng.integers(len(flaws)))]
        for _ in range(100):
            chosen, _ = render(meta, rng)
            rejected = draw(rejected_scene(meta, flaw, rng))
            strict, _, _ = score_images([chosen, rejected], [meta, meta])
            if strict.tolist() == [1.0, 0.0]:
                break
        else:
            raise RuntimeError(f"no clear pair for {meta['prompt']!r} ({flaw}) in 100 tries")
        pairs.append((meta, chosen, rejected, flaw))
    return pairs


def write_pairs(out: Path, n: int, seed: int) -> int:
    """pairs.jsonl and its PNGs under `out`; PNGs of an earlier run not written again are removed."""
    from PIL import Image

    from flowrl.worlds.shapes import write_jsonl

    (out / "images").mkdir(parents=True, exist_ok=True)
    written, records = set(), []
    for i, (meta, chosen, rejected, flaw) in enumerate(make_pairs(n, seed)):
        names = {}
        for side, image in (("chosen", chosen), ("rejected", rejected)):
            names[side] = f"images/{i:03d}_{side}.png"
            Image.fromarray(image).save(out / names[side], optimize=True)
            written.add(out / names[side])
        records.append({"prompt": meta["prompt"], **names, "flaw": flaw, **{k: meta[k] for k in meta if k != "prompt"}})
    write_jsonl(records, out / "pairs.jsonl")
    for stale in set((out / "images").glob("*.png")) - written:
        stale.unlink()
    return len(records)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "samples" / "shapes_pairs")
    p.add_argument("--pairs", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    print(f"{write_pairs(args.out, args.pairs, args.seed)} pairs in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
