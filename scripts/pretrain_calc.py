"""Pre-train the tiny character-level GPT-2 of the calculator world on a CPU (`flowrl.worlds.calc`).

The model learns "<bos>34*57=" -> a completion drawn afresh each time a prompt is drawn, from a mixture:

- with probability 1 - --p-tool, a direct answer: "1938<eos>" (the correct product);
- with probability --p-tool, a tool trace: "<calc>34*57</calc><out>1938</out>1938<eos>", where in --p-wrong of
  them the copy after </out> has one digit changed ("...</out>1988<eos>").

Loss: next-token cross-entropy on the completion tokens only, and not on "<out>...</out>" (in a rollout the
environment writes those). A tiny model multiplies badly, so its direct answers are often wrong; greedy decoding
calls the tool where the model is unsure of the product's leading digit, and RL has room: call it more, copy well.

Every `--eval-every` steps the greedy figures WITH the calculator on all 795 held-out prompts (accuracy, tool-use
share, wrong copies) go to WORKDIR/log.jsonl. A model is worth keeping when its accuracy is in [--low, --high] and
its tool use in [--tool-low, --tool-high], at --min-steps or later (before that the copy after </out> is still
being learned); the one closest to --target accuracy so far is kept in WORKDIR/best
(written atomically). Training stops at the first evaluation in range at or above --target, or at --steps; then
the kept model is measured once more (with the tool, without it, with calls forbidden, with the tool sampled at
temperature 1, on as many training prompts) and
copied to --out with the tokenizer, the train/test JSONL files and pretrain_summary.json.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python scripts/pretrain_calc.py --threads 1 \
        --workdir /tmp/calc_pretrain --out samples/calc
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.pretrain_arith import answer_loss, build_model, publish, right_pad, save_dir_atomic  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", default="/tmp/calc_pretrain", help="best model and log (not the repo)")
    p.add_argument("--out", default="samples/calc", help="where the kept model, tokenizer and JSONL splits go")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on a shared CPU)")
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--n-head", type=int, default=4, help="n_embd / n_head >= 32 suits vLLM's CPU kernels")
    p.add_argument("--p-tool", type=float, default=0.4, help="share of traces that call the calculator")
    p.add_argument("--p-wrong", type=float, default=0.25, help="share of tool traces whose copy has a wrong digit")
    p.add_argument("--steps", type=int, default=6000, help="most optimizer steps")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--min-steps", type=int, default=1000, help="no evaluation before this step is kept")
    p.add_argument("--low", type=float, default=0.25, help="lowest held-out accuracy (with the tool) worth keeping")
    p.add_argument("--high", type=float, default=0.55, help="highest held-out accuracy (with the tool) worth keeping")
    p.add_argument("--tool-low", type=float, default=0.25, help="lowest held-out tool-use share worth keeping")
    p.add_argument("--tool-high", type=float, default=0.6, help="highest held-out tool-use share worth keeping")
    p.add_argument("--target", type=float, default=0.45, help="stop at the first in-range evaluation at or above")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- data


def draw_completion(row: dict, rng, p_tool: float, p_wrong: float) -> str:
    """One completion text (without eos) for `row`, drawn from the trace mixture with the numpy Generator `rng`."""
    from flowrl.worlds.calc import tool_trace

    answer = row["answer"]
    if rng.random() >= p_tool:
        return answer
    copy = answer
    if rng.random() < p_wrong:  # one digit changed (never to a leading zero)
        k = int(rng.integers(len(answer)))
        choices = [d for d in "0123456789" if d != answer[k] and (k > 0 or d != "0")]
        copy = answer[:k] + choices[int(rng.integers(len(choices)))] + answer[k + 1 :]
    return tool_trace(row["prompt"], answer, copy)


def encode_traces(tokenizer, prompts: list[str], completions: list[str]):
    """-> (ids[N, L], loss_mask[N, L-1]): "<bos>prompt completion<eos>" right-padded; the mask marks the targets
    the model is trained on: the completion's tokens and the eos, less "<out>...</out>" (the environment's)."""
    from flowrl.worlds.calc import OUT, OUT_END

    out_id, out_end_id = tokenizer.convert_tokens_to_ids([OUT, OUT_END])
    seqs, trained = [], []
    for prompt, completion in zip(prompts, completions):
        p = tokenizer(prompt)["input_ids"]  # [<bos>, prompt chars]
        c = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        keep, env = [], False
        for t in c:
            env = env or t == out_id
            keep.append(not env)
            env = env and t != out_end_id
        seqs.append(p + c)
        trained.append([False] * len(p) + keep)
    return right_pad(tokenizer, seqs, trained)


# ----------------------------------------------------------------------------- training


def in_range(rec: dict, args) -> bool:
    """Whether an evaluation's model is worth keeping (see the module docstring)."""
    acc_ok = args.low <= rec["test_acc"] <= args.high
    return rec["step"] >= args.min_steps and acc_ok and args.tool_low <= rec["test_tool"] <= args.tool_high


def main(argv=None) -> int:
    args = parse_args(argv)
    import numpy as np
    import torch
    from tqdm import tqdm

    from flowrl.worlds.calc import MAX_LENGTH, calc_tokenizer, evaluate, make_prompts, split_rows, write_splits

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    workdir, out = Path(args.workdir), Path(args.out)
    workdir.mkdir(parents=True, exist_ok=True)

    tokenizer = calc_tokenizer()
    train_rows, test_rows = split_rows("train"), split_rows("test")
    model = build_model(tokenizer, args, n_positions=MAX_LENGTH)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, args.warmup)))
    print(
        f"GPT-2 {args.n_layer} layers x {args.n_embd} dims, {n_params:,} parameters; "
        f"{len(train_rows)} train / {len(test_rows)} held-out prompts"
    )

    log = open(workdir / "log.jsonl", "w")
    t0 = time.time()
    step, best, stop = 0, None, False
    bar = tqdm(total=args.steps, desc="pretrain", dynamic_ncols=True, mininterval=2.0)
    model.train()
    while step < args.steps and not stop:
        rows = [train_rows[i] for i in rng.integers(len(train_rows), size=args.batch)]
        completions = [draw_completion(r, rng, args.p_tool, args.p_wrong) for r in rows]
        ids, mask = encode_traces(tokenizer, [r["prompt"] for r in rows], completions)
        loss = answer_loss(model, ids, mask)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        step += 1
        bar.update(1)
        if not math.isfinite(loss.item()):
            raise FloatingPointError(f"loss is {loss.item()} at step {step}; lower --lr (now {args.lr})")
        if step % args.eval_every == 0 or step == args.steps:
            fig = evaluate(model, tokenizer, test_rows)
            rec = {
                "step": step,
                "loss": round(loss.item(), 4),
                "test_acc": fig["accuracy"],
                "test_tool": fig["tool_use"],
                "test_wrong_copy": fig["wrong_copy"],
                "elapsed_s": round(time.time() - t0, 1),
            }
            log.write(json.dumps(rec) + "\n")
            log.flush()
            bar.set_postfix(loss=f"{loss.item():.3f}", acc=f"{fig['accuracy']:.3f}", tool=f"{fig['tool_use']:.3f}")
            if in_range(rec, args) and (
                best is None or abs(rec["test_acc"] - args.target) < abs(best["test_acc"] - args.target)
            ):
                save_dir_atomic(model, tokenizer, workdir / "best")
                best = rec
                tqdm.write(f"kept step {step}: held-out {rec['test_acc']:.3f}, tool use {rec['test_tool']:.3f}")
            stop = in_range(rec, args) and rec["test_acc"] >= args.target
    bar.close()
    elapsed = time.time() - t0
    if best is None:
        print(f"no evaluation was in range within {step} steps; see {workdir / 'log.jsonl'}")
        return 1

    from transformers import AutoModelForCausalLM

    kept = AutoModelForCausalLM.from_pretrained(workdir / "best")
    train_eval_rows = make_prompts("train", len(test_rows), seed=args.seed)
    figures = {
        "held_out_with_tool": evaluate(kept, tokenizer, test_rows),
        "held_out_without_tool": evaluate(kept, tokenizer, test_rows, tool=False),
        "held_out_calls_forbidden": evaluate(kept, tokenizer, test_rows, calls=False),
        "held_out_with_tool_sampled_t1": evaluate(kept, tokenizer, test_rows, temperature=1.0, seed=args.seed),
        "train_with_tool": evaluate(kept, tokenizer, train_eval_rows),
    }
    publish(workdir / "best", out)
    write_splits(out)
    summary = {
        "kept": best,
        "figures": figures,
        "stopped_at_step": step,
        "wall_clock_s": round(elapsed, 1),
        "parameters": n_params,
        "threads": args.threads,
        "args": vars(args),
    }
    tmp = out / ".pretrain_summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=1) + "\n")
    os.replace(tmp, out / "pretrain_summary.json")
    w = figures["held_out_with_tool"]
    print(
        f"kept step {best['step']}: held-out accuracy {w['accuracy']:.3f} with the tool "
        f"({figures['held_out_without_tool']['accuracy']:.3f} without), tool use {w['tool_use']:.3f}; "
        f"{elapsed:.0f} s; saved to {out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
