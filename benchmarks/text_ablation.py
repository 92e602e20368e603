"""Issue 25's changes to the text step one at a time, flowrl only, the variants' epochs taking turns in one process.

    python benchmarks/text_ablation.py                       # realistic setting (benchmarks/text_step.py), 1 thread
    python benchmarks/text_ablation.py --setting tiny --repeats 10

Each variant is its own Trainer on the same work (benchmarks/text_step.py's setting); epoch e of every variant runs
before epoch e + 1 of any, so that the load of a shared machine falls on all alike (sequential runs of this
2-core machine differed by 1.5x from one minute to the next). The former behaviours are put back per variant:
  before            old log-probs from a second forward (text.old_log_probs=forward), generate's multinomial
                    sampling, token_log_probs as before issue 25 (logsumexp, then exp per chunk in the backward),
                    the LM head over every position of prompt + completion;
  + sampling lp     text.old_log_probs=sampling: no second forward;
  + inverse CDF     the rollout's draw by inverse CDF instead of torch.multinomial;
  + fused lp        token_log_probs with fused (log-)softmax per chunk, gradient written in place;
  after             + the LM head over the completion's positions only, no [B, T, V] logits copy (HEAD).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import statistics
import sys
import warnings

import torch

_SPEC = importlib.util.spec_from_file_location("text_step", os.path.join(os.path.dirname(__file__), "text_step.py"))
text_step = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(text_step)


class _FormerTokenLogProb(torch.autograd.Function):
    """token_log_probs as it was before issue 25 (commit d40ca1b), for the `before` variants."""

    @staticmethod
    def forward(ctx, logits, tokens, temperature):
        from flowrl.core.logprobs import _row_chunks

        v = logits.shape[-1]
        flat = logits.reshape(-1, v)
        idx = tokens.reshape(-1, 1)
        out_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        lse = torch.empty(flat.shape[0], dtype=out_dtype, device=logits.device)
        for rows in _row_chunks(flat.shape[0], v):
            lse[rows] = torch.logsumexp(flat[rows].to(out_dtype) / temperature, dim=-1)
        picked = flat.gather(1, idx).squeeze(1).to(out_dtype) / temperature
        ctx.save_for_backward(logits, tokens, lse)
        ctx.temperature = temperature
        return (picked - lse).view(tokens.shape)

    @staticmethod
    def backward(ctx, grad_out):
        from flowrl.core.logprobs import _row_chunks

        logits, tokens, lse = ctx.saved_tensors
        tau = ctx.temperature
        v = logits.shape[-1]
        flat = logits.reshape(-1, v)
        g = grad_out.reshape(-1).to(lse.dtype)
        idx = tokens.reshape(-1, 1)
        grad = torch.empty_like(flat)
        for rows in _row_chunks(flat.shape[0], v):
            p = torch.exp(flat[rows].to(lse.dtype) / tau - lse[rows, None])
            gr = -p * (g[rows, None] / tau)
            gr.scatter_add_(1, idx[rows], (g[rows, None] / tau))
            grad[rows] = gr.to(grad.dtype)
        return grad.view_as(logits), None, None


def former_token_log_probs(logits, tokens, temperature=1.0):
    return _FormerTokenLogProb.apply(logits, tokens.long(), float(temperature))


def former_generate(policy):
    """The rollout's generate() call before issue 25: sampling mode (torch.multinomial), keyword arguments."""

    def generate_samples(input_ids, attn, recorder=None):
        t, tok = policy.text, policy.tokenizer
        return policy.model.generate(
            input_ids=input_ids,
            attention_mask=attn,
            do_sample=True,
            temperature=t.temperature,
            top_p=t.top_p,
            top_k=t.top_k or None,
            max_new_tokens=t.max_new_tokens,
            use_cache=True,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
            logits_processor=[recorder] if recorder is not None else None,
        )

    return generate_samples


#: name -> (text.old_log_probs, inverse-CDF draw, fused token_log_probs, LM head on the completion only)
VARIANTS = {
    "before": ("forward", False, False, False),
    "+ sampling lp": ("sampling", False, False, False),
    "+ inverse CDF": ("sampling", True, False, False),
    "+ fused lp": ("sampling", True, True, False),
    "after": ("sampling", True, True, True),
}


@contextlib.contextmanager
def former_functions(fused_lp: bool, keep: bool):
    """flowrl.core.token_log_probs and the LM-head restriction put back as they were, for one epoch."""
    import flowrl.core
    import flowrl.policies.text as text_policy

    saved = flowrl.core.token_log_probs, text_policy.logits_kept
    if not fused_lp:
        flowrl.core.token_log_probs = former_token_log_probs
    if not keep:
        text_policy.logits_kept = lambda model, n: {}
    try:
        yield
    finally:
        flowrl.core.token_log_probs, text_policy.logits_kept = saved


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--setting", choices=sorted(text_step.SETTINGS), default="realistic")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    os.chdir(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    bench_args = argparse.Namespace(
        config="configs/text_arith.yaml",
        setting=args.setting,
        profile=False,
        warmup=args.warmup,
        repeats=args.repeats,
        **text_step.SETTINGS[args.setting],
    )
    runs = {}
    for name, (source, icdf, _, _) in VARIANTS.items():
        bench_args.overrides = [f"text.old_log_probs={source}"]
        run = text_step.FlowrlRun(bench_args)
        if not icdf:
            run.tr.policy.generate_samples = former_generate(run.tr.policy)
        runs[name] = run
    print(
        f"text step ablation, {args.setting} setting, {bench_args.prompts} prompts x {bench_args.group}, "
        f"max_new_tokens {bench_args.max_new_tokens}; variants in turns, median of {args.repeats} epochs after "
        f"{args.warmup}; threads {torch.get_num_threads()}"
    )
    for e in range(args.warmup + args.repeats):
        for name, run in runs.items():
            _, _, fused_lp, keep = VARIANTS[name]
            with former_functions(fused_lp, keep):
                run.epoch(e)
    table = {
        name: {k: statistics.median(r[k] for r in run.rows[args.warmup :]) for k in text_step.PHASES}
        for name, run in runs.items()
    }
    print(f"{'':16s}" + "".join(f"{p + ' (s)':>16s}" for p in text_step.PHASES))
    for name, row in table.items():
        print(f"{name:16s}" + "".join(f"{row[p]:16.4g}" for p in text_step.PHASES) + f"   [threads {args.threads}]")
    before = table["before"]
    print(f"{'before/after':16s}" + "".join(f"{before[p] / table['after'][p]:16.2f}" for p in text_step.PHASES))
    return table


if __name__ == "__main__":
    main()
    sys.exit(0)
