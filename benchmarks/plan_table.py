"""The planner table of docs/scaling.md: `flowrl plan` for every preset at 1 and 8 GPUs of 80 GiB (estimates).

    python benchmarks/plan_table.py > /tmp/table.md

Columns: the update's GiB per GPU at the preset's own micro-batch under each of the plan's columns (the distributed
strategies that declare one, and offload), the columns under which the preset as written fits (update and rollout),
and the largest micro-batch under DDP without and with gradient checkpointing. Offline: a preset whose model has no
shipped architecture config is listed as such.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flowrl.config import load_config  # noqa: E402
from flowrl.plan import PlanError, plan, shipped_models  # noqa: E402


def rows() -> list[str]:
    shipped = set(shipped_models())
    titles = None
    out = []
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        cfg = load_config(str(path), [])
        if cfg.model.path.startswith("tiny") or (ROOT / cfg.model.path).exists():
            continue  # the shipped tiny models: nothing to plan
        for gpus in (1, 8):
            name = f"| `{path.stem}` | {gpus} |"
            if cfg.model.path not in shipped:
                out.append(f"{name} - | no shipped config (reads the hub) | - |")
                continue
            try:
                p = plan(cfg, gpus=gpus, gpu_memory_gib=80.0)
            except PlanError as e:
                if "split" in str(e) or "divide" in str(e):
                    out.append(f"{name} - | batch does not split over {gpus} | - |")
                    continue
                raise
            titles = p.titles
            update = " / ".join(f"{p.fits[s].configured_gib:.1f}" for s in titles)
            fits = ", ".join(s for s in titles if p.fits_as_configured(s)) or "none"
            largest = p.fits["DDP"].largest
            out.append(f"{name} {update} | {fits} | {largest[False]} / {largest[True]} |")
    head = f"| preset | GPUs | update GiB/GPU at the config: {' / '.join(titles or ['-'])} | fits (update and rollout) "
    return [head + "| largest micro-batch DDP (ckpt off / on) |", "| --- | --- | --- | --- | --- |", *out]


if __name__ == "__main__":
    print("\n".join(rows()))
