"""Pre-train the tiny character-level GPT-2 of the text default on two-digit additions, on a CPU.

The model learns "<bos>37+45=" -> "82<eos>" by next-token cross-entropy on the ANSWER tokens only (the
digits of the sum and the eos): the operands are uniform random digits, so predicting them teaches
nothing. Batches are drawn with replacement from the 9,005 training prompts of `flowrl.worlds.arith`.

The goal is an IMPERFECT model (held-out greedy exact match in [--low, --high]) that GRPO can improve.
Every `--eval-every` steps the greedy exact-match accuracy on all 995 held-out prompts (and on as many
training prompts) is logged to WORKDIR/log.jsonl; a model in range is kept in WORKDIR/best (the one
closest to --target so far). Training stops at the first evaluation at or above --target, or at --steps;
then WORKDIR/best is copied to --out with the tokenizer and the train/test JSONL files.

Every `--ckpt-every` steps the whole state (weights, AdamW, RNG, step, best so far) is written atomically
to WORKDIR/ckpt-NNNNNN (`flowrl.run.checkpoint`, safetensors + JSON); `--resume` continues from the newest.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python scripts/pretrain_arith.py --threads 1 \
        --workdir /tmp/arith_pretrain --out samples/arith
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", default="/tmp/arith_pretrain", help="checkpoints, best model, log (not the repo)")
    p.add_argument("--out", default="samples/arith", help="where the kept model, tokenizer and JSONL splits go")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on a shared CPU)")
    p.add_argument("--resume", action="store_true", help="continue from the newest WORKDIR/ckpt-*")
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--steps", type=int, default=6000, help="most optimizer steps")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--ckpt-every", type=int, default=250)
    p.add_argument("--low", type=float, default=0.3, help="lowest held-out accuracy worth keeping")
    p.add_argument("--high", type=float, default=0.7, help="highest held-out accuracy worth keeping")
    p.add_argument("--target", type=float, default=0.5, help="stop at the first evaluation at or above this")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- data


def encode_rows(tokenizer, rows: list[dict]):
    """-> (ids[N, L], loss_mask[N, L-1]): "<bos>prompt answer<eos>" right-padded; mask marks answer targets.

    `loss_mask[i, t]` is 1 where token t+1 of row i is an answer digit or the eos (targets of logits[:, t]).
    """

    seqs, n_prompt = [], []
    for r in rows:
        p = tokenizer(r["prompt"])["input_ids"]  # [<bos>, prompt chars]
        a = tokenizer(r["answer"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        seqs.append(p + a)
        n_prompt.append(len(p))
    return right_pad(tokenizer, seqs, [[False] * k + [True] * (len(s) - k) for s, k in zip(seqs, n_prompt)])


def right_pad(tokenizer, seqs: list[list[int]], trained: list[list[bool]]):
    """-> (ids[N, L], loss_mask[N, L-1]): the token sequences right-padded to the longest; `trained[i][t]` says
    whether token t of row i is a target (`loss_mask[i, t - 1]`: the target of logits[:, t - 1])."""
    import torch

    length = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), length), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), length - 1)
    for i, (s, k) in enumerate(zip(seqs, trained)):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s) - 1] = torch.tensor(k[1:], dtype=torch.float32)
    return ids, mask


def answer_loss(model, ids, mask):
    """Mean cross-entropy of the answer tokens. ids: [B, L] (right-padded), mask: [B, L-1] -> scalar."""
    import torch.nn.functional as F

    logits = model(input_ids=ids, attention_mask=(ids != model.config.pad_token_id).long()).logits  # [B, L, V]
    nll = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="none")  # [B*(L-1)]
    return (nll.view_as(mask) * mask).sum() / mask.sum()


# ----------------------------------------------------------------------------- model


def build_model(tokenizer, args, n_positions: int | None = None):
    """A tied-embedding GPT-2 of args' size for `tokenizer`'s vocabulary, without dropout, with n_positions
    positions (default: the arithmetic world's MAX_LENGTH); the calculator world builds its model here too."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from flowrl.worlds.arith import MAX_LENGTH

    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=n_positions or MAX_LENGTH,
        n_embd=args.n_embd,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_inner=4 * args.n_embd,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    model = GPT2LMHeadModel(config)
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def save_dir_atomic(model, tokenizer, target: Path) -> None:
    """save_pretrained (safetensors) model + tokenizer into a temporary dir, then rename it to `target`."""
    tmp = target.with_name(f".tmp-{target.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    old = target.with_name(f".old-{target.name}-{os.getpid()}")
    if target.exists():
        os.replace(target, old)
    os.replace(tmp, target)
    shutil.rmtree(old, ignore_errors=True)


def publish(best: Path, out: Path) -> None:
    """Copy every file of `best` into `out`, each written to a temporary name and renamed (atomic per file)."""
    out.mkdir(parents=True, exist_ok=True)
    for f in sorted(best.iterdir()):
        tmp = out / f".{f.name}.tmp"
        shutil.copyfile(f, tmp)
        os.replace(tmp, out / f.name)


# ----------------------------------------------------------------------------- training


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    from tqdm import tqdm

    from flowrl.run.checkpoint import resolve_resume, set_rng_state, write_checkpoint
    from flowrl.worlds.arith import arith_tokenizer, greedy_accuracy, make_prompts, split_rows, write_splits

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    workdir, out = Path(args.workdir), Path(args.out)
    workdir.mkdir(parents=True, exist_ok=True)

    tokenizer = arith_tokenizer()
    train_rows = split_rows("train")
    test_rows = split_rows("test")
    train_eval_rows = make_prompts("train", len(test_rows), seed=args.seed)
    ids, mask = encode_rows(tokenizer, train_rows)  # [N, L], [N, L-1]
    model = build_model(tokenizer, args)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, args.warmup)))

    step, best, elapsed = 0, None, 0.0  # best: {"step", "test_acc", ...}
    found = resolve_resume("auto", workdir) if args.resume else None
    ckpt = found[0] if found else None
    if found is not None:
        saved = found[1]
        with torch.no_grad():
            params = dict(model.named_parameters())
            for name, value in saved["trainable"].items():
                params[name].copy_(value)
        opt.load_state_dict(saved["optimizer"])
        state = saved["state"]
        sched.load_state_dict(state["scheduler"])
        set_rng_state(saved["rng_tensors"], state["rng"])
        step, best, elapsed = state["step"], state["best"], state["elapsed"]
        print(f"resumed from {ckpt} at step {step} (best so far: {best})")
    if args.resume and ckpt is None:
        print(f"--resume: no checkpoint in {workdir}, starting fresh")
    print(
        f"GPT-2 {args.n_layer} layers x {args.n_embd} dims, {n_params:,} parameters; "
        f"{len(train_rows)} train / {len(test_rows)} held-out prompts"
    )

    def checkpoint():
        write_checkpoint(
            workdir,
            step,
            trainable={k: v.detach().clone() for k, v in model.named_parameters()},
            optimizer=opt.state_dict(),
            keep=1,
            state={"step": step, "best": best, "elapsed": elapsed, "scheduler": sched.state_dict(), "args": vars(args)},
        )

    log = open(workdir / "log.jsonl", "a")
    t0 = time.time() - elapsed
    stop = False
    bar = tqdm(total=args.steps, initial=step, desc="pretrain", dynamic_ncols=True, mininterval=2.0)
    model.train()
    while step < args.steps and not stop:
        idx = torch.randint(len(ids), (args.batch,))
        loss = answer_loss(model, ids[idx], mask[idx])
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
            test_acc = greedy_accuracy(model, tokenizer, test_rows)
            train_acc = greedy_accuracy(model, tokenizer, train_eval_rows)
            elapsed = time.time() - t0
            rec = {
                "step": step,
                "loss": round(loss.item(), 4),
                "test_acc": test_acc,
                "train_acc": train_acc,
                "elapsed_s": round(elapsed, 1),
            }
            log.write(json.dumps(rec) + "\n")
            log.flush()
            bar.set_postfix(loss=f"{loss.item():.3f}", test=f"{test_acc:.3f}", train=f"{train_acc:.3f}")
            if args.low <= test_acc <= args.high and (
                best is None or abs(test_acc - args.target) < abs(best["test_acc"] - args.target)
            ):
                save_dir_atomic(model, tokenizer, workdir / "best")
                best = rec
                tqdm.write(f"kept step {step}: held-out {test_acc:.3f}, train {train_acc:.3f}")
            stop = test_acc >= args.target
        if step % args.ckpt_every == 0 and not stop:
            elapsed = time.time() - t0
            checkpoint()
    bar.close()
    elapsed = time.time() - t0
    checkpoint()
    if best is None:
        print(f"no evaluation landed in [{args.low}, {args.high}] within {step} steps; see {workdir / 'log.jsonl'}")
        return 1
    publish(workdir / "best", out)
    write_splits(out)
    (out / "pretrain_summary.json").write_text(
        json.dumps(
            {
                "kept": best,
                "stopped_at_step": step,
                "wall_clock_s": round(elapsed, 1),
                "parameters": n_params,
                "threads": args.threads,
                "args": vars(args),
            },
            indent=1,
        )
        + "\n"
    )
    print(
        f"kept step {best['step']}: held-out exact match {best['test_acc']:.3f} "
        f"(train {best['train_acc']:.3f}); {elapsed:.0f} s; saved to {out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
