"""Speed of one text GRPO step, flowrl beside TRL's GRPOTrainer on the same work, at two settings.

    python benchmarks/text_step.py                        # tiny: configs/text_arith.yaml (samples/arith), 1 thread
    python benchmarks/text_step.py --setting realistic    # a random Qwen2, vocabulary 32768, 128-token completions
    python benchmarks/text_step.py --repeats 20 --threads 2
    python benchmarks/text_step.py --no-trl --profile     # flowrl only, with a cProfile of one more epoch
    python benchmarks/text_step.py --generate-ab          # generate() alone: flowrl's call and TRL's, in turns
    python benchmarks/text_step.py --setting realistic --engine both   # flowrl on hf and on a vLLM server, in turns

Settings (per step: prompts x group completions of at most max_new_tokens tokens):
  tiny       the char-level GPT-2 of samples/arith (0.1M parameters, 19 tokens), 32 prompts x 8, 4 new tokens,
             the `accuracy` reward;
  realistic  a random-weight Qwen2 (the Qwen2.5 architecture: GQA, SwiGLU, RMSNorm, RoPE, tied embeddings; hidden
             256, 4 layers, 12M parameters, vocabulary 32768, built here, nothing downloaded), 2 prompts x 8,
             128 new tokens (random weights never end early), ~120-token prompts, a reward that varies between
             completions (`even_token_share`).
The same work for both frameworks otherwise: the same prompts per step (flowrl's epoch e and TRL's step e draw the
same ones), temperature 1, top_p 1, no top-k, full fine-tuning, AdamW (lr, betas, eps, weight decay as flowrl),
grad-norm clip 1, one optimizer step per batch, no KL (beta 0), clip 0.2, group-normalised advantages,
token-mean loss (TRL's `dapo`). TRL runs when `import trl` works (the `benchmark` extra); otherwise it is
skipped with the reason. TRL's steps and flowrl's epochs take turns in one process (flowrl's epoch e runs after
TRL's step e, outside its timing), so that both see the same load of a shared machine.

Phases (median over `--repeats` steps after `--warmup` steps; every step samples fresh completions):
  generate        the model.generate call alone;
  rollout         flowrl: Trainer.rollout (generate, recording the old log-probs on the way, + decode);
                  TRL: GRPOTrainer._generate (generate + decode; TRL skips the old log-prob forward when
                  generation and optimisation are aligned, as here);
  reward+adv      flowrl: Trainer.score + Trainer.advantages; TRL: the rest of _generate_and_score_completions;
  update          flowrl: Trainer.update; TRL: the step's remainder (forward with grad + entropy, loss,
                  backward, clip, optimizer and scheduler step);
  step            flowrl: rollout + score + advantages + update; TRL: on_step_begin -> on_step_end.
Rollout tokens/s counts the completion tokens through the first EOS over the rollout time. The last column is
TRL time / flowrl time (for tokens/s: flowrl rate / TRL rate): > 1 means flowrl is faster.
Use 1 thread on a shared machine: with 2 threads on 2 busy cores the tiny ops run ~20x slower for both.

--engine vllm | both: flowrl's rollouts on a flowrl vLLM server (text.engine=vllm; the server is started here in
vLLM's environment, `make vllm-env`, on the setting's model); `both` runs an hf trainer and a vllm trainer whose
epochs take turns (TRL skipped) and prints them side by side. For vllm, `generate` is the engine's request (the
server's sampling, the HTTP round trip, the weight push when one is due); vLLM's CPU attention needs head_dim >= 32,
so the tiny setting (head_dim 16) cannot run on it.

Why generate() differed (issue 25 measured flowrl's at 0.84x TRL's, tiny setting): not its configuration. The
same model and inputs, flowrl's former call (do_sample=True with keyword arguments) and TRL's (its
GenerationConfig) taking turns (`--generate-ab`, its last two lines), tiny setting (256 rows x 4 new tokens,
median of 10, 1 thread): 55.5 ms and 57.7 ms under load, 32.3 and 32.1 ms in a quieter run. The two calls build
the same logits processors and run the same steps; a cProfile of single calls inside the benchmark showed the same
call structure with every kernel up to 4x slower in some calls: the load of other jobs on this 2-core machine,
which the former order (all flowrl steps, then all TRL steps) let fall on one side (two back-to-back runs of that
version gave generate ratios of 1.12 and 1.30). The frameworks now take turns.
Two real differences were found and changed: flowrl's keyword call let a model's generation_config.json add its
own processors (Qwen2.5-Instruct's repetition_penalty) to the distribution sampled from, which TRL's call
overrides (flowrl now neutralises them, NEUTRAL_GENERATION); and generate's sampling mode draws with
torch.multinomial, whose CPU kernel fills a [B, V] tensor with exponential random numbers at every step (~85 ms
for 64 x 32768, more than the model's step): flowrl now draws by inverse CDF (InverseCdfSampler in
flowrl/policies/text.py). `--generate-ab` now, realistic setting (16 rows x 128 new tokens, median of 5, 1
thread): flowrl's call 4.64 s (4.88 s with the log-prob recorder), TRL's 6.41 s, flowrl's former call 6.42 s;
tiny setting: 52.8 ms (57.4 ms with the recorder), 57.7 ms, 55.5 ms.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings

import torch

PHASES = ("generate", "rollout", "reward+adv", "update", "step")
#: Each setting's work per step: prompts x group completions of at most max_new_tokens tokens.
SETTINGS = {
    "tiny": {"prompts": 32, "group": 8, "max_new_tokens": 4},
    "realistic": {"prompts": 2, "group": 8, "max_new_tokens": 128},
}

#: The realistic setting's model: a random-weight Qwen2 (the Qwen2.5 family's architecture: GQA, SwiGLU, RMSNorm,
#: RoPE, tied embeddings) at a small width, with a real-sized vocabulary.
REALISTIC = {
    "vocab_size": 32768,
    "hidden_size": 256,
    "intermediate_size": 1024,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
#: Its prompts: an addition in a sentence, ~115 tokens with the character-level tokenizer.
REALISTIC_TEMPLATE = (
    "Question: Tom has some apples and buys more at the market. What is {prompt}? Think it through "
    "and answer with a number."
)


def build_realistic_model(directory: str) -> str:
    """A random Qwen2 (`REALISTIC`) and a tokenizer of its vocabulary saved to `directory`, with prompts.jsonl.

    The tokenizer is byte-level BPE as Qwen2's (transformers loads it as Qwen2Tokenizer whatever is saved) without
    merges: every printable ASCII character is one token (prompts encode character by character) and the rest of
    the vocabulary is word-like tokens, so that every id the model samples decodes to text. No download: the
    weights are random (seed 0).
    """
    import json
    from pathlib import Path

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    specials = ["<|pad|>", "<|endoftext|>"]
    chars = ["\u0120"] + [chr(c) for c in range(33, 127)]  # byte-level BPE writes the space as U+0120
    fillers = [f"\u0120w{i}" for i in range(REALISTIC["vocab_size"] - len(specials) - len(chars))]
    vocab = {t: i for i, t in enumerate(specials + chars + fillers)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<|pad|>", eos_token="<|endoftext|>")
    tok.save_pretrained(d)
    torch.manual_seed(0)
    cfg = Qwen2Config(
        **REALISTIC,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        pad_token_id=vocab["<|pad|>"],
        eos_token_id=vocab["<|endoftext|>"],
        bos_token_id=vocab["<|endoftext|>"],
    )
    Qwen2ForCausalLM(cfg).save_pretrained(d)
    rows = [
        {"prompt": REALISTIC_TEMPLATE.format(prompt=f"{a}+{b}"), "answer": str(a + b)}
        for a in range(10, 50)
        for b in range(10, 50)
    ]
    (d / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(d)


def timed(fn, sink: list):
    """`fn` that appends its wall time to `sink` on every call."""

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        sink.append(time.perf_counter() - t0)
        return out

    return wrapper


def even_token_share(prompts, completions, completion_ids, **kwargs):
    """The realistic setting's reward: the share of a completion's tokens with an even id (random weights write
    no arithmetic; this varies from completion to completion, so the advantages are not all 0)."""
    return [sum(1 for t in ids if t % 2 == 0) / max(len(ids), 1) for ids in completion_ids]


def setting_overrides(args) -> list[str]:
    """flowrl config overrides of the setting (the realistic one builds its model in a temporary directory)."""
    if args.setting == "tiny":
        return []
    d = build_realistic_model(tempfile.mkdtemp(prefix="flowrl-text-bench-model-"))
    return [
        f"model.path={d}",
        f"data.train_prompts={d}/prompts.jsonl",
        f"data.eval_prompts={d}/prompts.jsonl",
        "rewards=[{name: 'benchmarks/text_step.py:even_token_share'}]",
        "text.max_prompt_length=256",
    ]


def build_flowrl(args, engine_overrides=()):
    from flowrl.config import load_config
    from flowrl.train import Trainer

    cfg = load_config(
        args.config,
        [
            f"sample.prompts_per_epoch={args.prompts}",
            f"sample.group_size={args.group}",
            f"text.max_new_tokens={args.max_new_tokens}",
            "text.temperature=1.0",
            "train.grpo.beta=0.0",
            "log.progress=false",
            "log.completions_every=0",
            "log.tensorboard=false",
            "log.wandb=false",
            f"log.run_dir={tempfile.mkdtemp(prefix='flowrl-text-bench-')}",
            *args.setting_overrides,
            *engine_overrides,
            *args.overrides,
        ],
    )
    return Trainer(cfg)


def flowrl_epoch(tr, epoch: int, gen_times: list) -> dict:
    """One whole flowrl epoch (no logging/eval/checkpoint), timed by phase."""
    t0 = time.perf_counter()
    batch = tr.rollout(epoch)
    t1 = time.perf_counter()
    scores, _ = tr.score(batch, epoch)
    adv, keep, _ = tr.advantages(batch, scores, epoch)
    t2 = time.perf_counter()
    tr.update(batch, adv, keep, epoch)
    t3 = time.perf_counter()
    return {
        "generate": gen_times[-1],
        "rollout": t1 - t0,
        "reward+adv": t2 - t1,
        "update": t3 - t2,
        "step": t3 - t0,
        "tokens": float(batch.completion_mask.sum()),
        "samples": len(batch.prompts),
    }


class FlowrlRun:
    """flowrl's trainer with generate() timed; `epoch(e)` runs and records one timed epoch."""

    def __init__(self, args, engine_overrides=()):
        self.args = args
        self.tr = build_flowrl(args, engine_overrides)
        self.gen_times: list[float] = []
        if self.tr.cfg.text.engine == "hf":
            self.tr.policy.model.generate = timed(self.tr.policy.model.generate, self.gen_times)
        else:  # the engine's request: the server's sampling, the round trip, a weight push when one is due
            engine = self.tr.policy.engine
            engine.generate = timed(engine.generate, self.gen_times)
        self.rows: list[dict] = []

    def epoch(self, e: int) -> None:
        self.rows.append(flowrl_epoch(self.tr, e, self.gen_times))

    def result(self) -> dict:
        if self.args.profile:
            import cProfile
            import pstats

            prof = cProfile.Profile()
            prof.enable()
            flowrl_epoch(self.tr, len(self.rows), self.gen_times)
            prof.disable()
            print(f"\ncProfile of one flowrl epoch (threads {torch.get_num_threads()}):")
            pstats.Stats(prof).sort_stats("tottime").print_stats(30)
        return {"rows": self.rows[self.args.warmup :]}


def run_trl(args, flowrl_cfg, train_set, between=None) -> dict | str:
    """TRL's GRPOTrainer on the same work, or the reason it was skipped. `between(e)` runs after TRL's step e
    (outside its timing): flowrl's epoch e, so that both see the same load of a shared machine."""
    try:
        import trl
        from datasets import Dataset
    except ImportError as e:
        return f"`import trl` failed ({e}); install the benchmark extra: pip install 'flowrl[benchmark]'"
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback

    import rewards

    t = flowrl_cfg.train
    steps = args.warmup + args.repeats
    rows = []
    for e in range(steps):  # step e gets flowrl's epoch-e prompts, in the same order (no shuffling)
        prompts, meta = train_set.draw(args.prompts, e, t.seed)
        rows += [{"prompt": p, "answer": m["answer"]} for p, m in zip(prompts, meta)]
    dataset = Dataset.from_list(rows)
    batch = args.prompts * args.group
    out_dir = tempfile.mkdtemp(prefix="trl-text-bench-")
    config = trl.GRPOConfig(
        output_dir=out_dir,
        max_steps=steps,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        num_generations=args.group,
        max_completion_length=args.max_new_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        epsilon=t.clip_low,
        loss_type="dapo",
        scale_rewards="group",
        num_iterations=1,
        learning_rate=t.lr,
        weight_decay=t.weight_decay,
        adam_beta1=t.adam_betas[0],
        adam_beta2=t.adam_betas[1],
        adam_epsilon=t.adam_eps,
        max_grad_norm=t.max_grad_norm,
        lr_scheduler_type="constant",
        warmup_steps=0,
        use_cpu=True,
        bf16=False,
        fp16=False,
        report_to="none",
        logging_strategy="no",
        save_strategy="no",
        disable_tqdm=True,
        shuffle_dataset=False,
        log_completions=False,
        seed=t.seed,
        dataloader_num_workers=0,
    )
    tok = AutoTokenizer.from_pretrained(flowrl_cfg.model.path)
    model = AutoModelForCausalLM.from_pretrained(flowrl_cfg.model.path, dtype=torch.float32)
    reward = rewards.get("accuracy") if args.setting == "tiny" else even_token_share
    trainer = trl.GRPOTrainer(
        model=model, reward_funcs=[reward], args=config, train_dataset=dataset, processing_class=tok
    )
    torch.set_num_threads(args.threads)  # in case the set-up changed it

    gen, rollout, prep, tokens = [], [], [], []
    trainer.model.generate = timed(trainer.model.generate, gen)
    trainer._generate = timed(trainer._generate, rollout)
    inner = trainer._generate_and_score_completions

    def generate_and_score(*a, **kw):
        t0 = time.perf_counter()
        out = inner(*a, **kw)
        prep.append(time.perf_counter() - t0)
        tokens.append(float(out["completion_mask"].sum()))
        return out

    trainer._generate_and_score_completions = generate_and_score
    step_times = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args_, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args_, state, control, **kw):
            step_times.append(time.perf_counter() - self.t0)
            if between is not None:
                between(len(step_times) - 1)

    trainer.add_callback(StepTimer())
    trainer.remove_callback(PrinterCallback)  # no end-of-training metrics dump
    trainer.train()
    if not (len(step_times) == len(gen) == len(rollout) == len(prep) == steps):
        return (
            f"TRL's step structure differs from this script's assumption (steps {len(step_times)}, generate "
            f"{len(gen)}, _generate {len(rollout)}, _generate_and_score {len(prep)}; expected {steps} each)"
        )
    rows = [
        {"generate": g, "rollout": r, "reward+adv": p - r, "update": s - p, "step": s, "tokens": n, "samples": batch}
        for g, r, p, s, n in zip(gen, rollout, prep, step_times, tokens)
    ][args.warmup :]
    return {"rows": rows, "version": trl.__version__}


def generate_ab(args) -> dict:
    """generate() alone, the same model and inputs, the calls taking turns: flowrl's rollout call (with and without
    the log-prob recorder), the call TRL 1.16 makes (its GenerationConfig: do_sample, multinomial draws) and
    flowrl's call before issue 25 (do_sample with keyword arguments)."""
    from transformers import GenerationConfig

    from flowrl.policies.text import SampledLogProbs

    run = FlowrlRun(args)
    pol, t = run.tr.policy, run.tr.policy.text
    tok, model = pol.tokenizer, pol.model
    prompts, _ = run.tr.train_set.draw(args.prompts, 0, run.tr.cfg.train.seed)
    ids, attn = pol.encode_prompts([p for p in prompts for _ in range(args.group)])
    trl_config = GenerationConfig(
        max_new_tokens=t.max_new_tokens,
        do_sample=True,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=[tok.eos_token_id],
        temperature=t.temperature,
        top_p=t.top_p,
        top_k=t.top_k,
        min_p=None,
        repetition_penalty=1.0,
        cache_implementation=None,
        disable_compile=True,
    )
    variants = {
        "flowrl: inverse CDF + recorder": lambda: pol.generate_samples(ids, attn, SampledLogProbs(t.temperature)),
        "flowrl: inverse CDF": lambda: pol.generate_samples(ids, attn),
        "TRL's call: multinomial": lambda: model.generate(
            input_ids=ids, attention_mask=attn, generation_config=trl_config
        ),
        "flowrl's former call: multinomial": lambda: model.generate(
            input_ids=ids,
            attention_mask=attn,
            do_sample=True,
            temperature=t.temperature,
            top_p=t.top_p,
            top_k=t.top_k or None,
            max_new_tokens=t.max_new_tokens,
            use_cache=True,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
            synced_gpus=False,
        ),
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    with torch.no_grad():
        for rep in range(args.warmup + args.repeats):
            for name, call in variants.items():
                torch.manual_seed(rep)
                t0 = time.perf_counter()
                call()
                if rep >= args.warmup:
                    times[name].append(time.perf_counter() - t0)
    out = {k: statistics.median(v) for k, v in times.items()}
    print(
        f"\ngenerate() alone, {ids.shape[0]} rows x {t.max_new_tokens} new tokens, the calls taking turns; median "
        f"of {args.repeats}, threads {torch.get_num_threads()}"
    )
    for name, sec in out.items():
        print(f"{name:34s}{sec:10.4g} s   [threads {torch.get_num_threads()}]")
    return out


def medians(rows: list[dict]) -> dict:
    m = {k: statistics.median(r[k] for r in rows) for k in (*PHASES, "tokens")}
    m["tok/s"] = statistics.median(r["tokens"] / r["rollout"] for r in rows)
    m["update/sample"] = m["update"] / rows[0]["samples"]
    return m


def print_table(fl: dict, tr: dict | None, threads: int, repeats: int) -> None:
    print(f"\nmedian of {repeats} steps, threads {threads}; TRL/flowrl > 1 means flowrl is faster")
    head = f"{'':28s}{'flowrl':>12s}"
    if tr:
        head += f"{'TRL':>12s}{'TRL/flowrl':>12s}"
    print(head)
    lines = [(f"{p} (s)", p, 1.0, True) for p in PHASES] + [
        ("update per sample (ms)", "update/sample", 1e3, True),
        ("rollout tokens/s", "tok/s", 1.0, False),
        ("completion tokens/step", "tokens", 1.0, None),
    ]
    for label, key, scale, time_like in lines:
        s = f"{label:28s}{fl[key] * scale:12.4g}"
        if tr:
            ratio = "" if time_like is None else f"{(tr[key] / fl[key] if time_like else fl[key] / tr[key]):12.2f}"
            s += f"{tr[key] * scale:12.4g}{ratio}"
        print(s + f"   [threads {threads}]")


def engines(args) -> dict:
    """--engine vllm / both: a vLLM server on the setting's model, and flowrl's trainers on it (and on hf)."""
    from flowrl.config import load_config
    from flowrl.engines.vllm_engine import LocalServer

    model = load_config(args.config, [*args.setting_overrides, *args.overrides]).model.path
    log = tempfile.mkdtemp(prefix="flowrl-text-bench-vllm-")
    server = LocalServer(model, os.path.join(log, "server.log")).start()
    try:
        vllm = FlowrlRun(args, ["text.engine=vllm", f"text.vllm_url={server.url}"])
        runs = {"vllm": vllm} if args.engine == "vllm" else {"hf": FlowrlRun(args), "vllm": vllm}
        for e in range(args.warmup + args.repeats):
            for run in runs.values():  # taking turns: the same load falls on both
                run.epoch(e)
        out = {name: medians(run.result()["rows"]) for name, run in runs.items()}
    finally:
        server.stop()
    threads = torch.get_num_threads()
    print(f"\nmedian of {args.repeats} steps, threads {threads} (the trainer's; the vLLM server: vLLM's own)")
    print(f"{'':28s}" + "".join(f"{name:>12s}" for name in out) + ("  hf/vllm" if len(out) == 2 else ""))
    for key in (*PHASES, "tok/s"):
        row = f"{key + (' (s)' if key != 'tok/s' else ''):28s}" + "".join(f"{m[key]:12.4g}" for m in out.values())
        if len(out) == 2:
            ratio = out["hf"][key] / out["vllm"][key] if key != "tok/s" else out["vllm"][key] / out["hf"][key]
            row += f"  {ratio:7.2f}"
        print(row + f"   [threads {threads}]")
    return {**out, "threads": threads}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--config", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", "text_arith.yaml")
    )
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--setting",
        choices=sorted(SETTINGS),
        default="tiny",
        help="tiny: samples/arith; realistic: a random Qwen2, vocabulary 32768, 128-token completions",
    )
    ap.add_argument("--prompts", type=int, help="prompts per step (default: the setting's)")
    ap.add_argument("--group", type=int, help="completions per prompt (default: the setting's)")
    ap.add_argument("--max-new-tokens", type=int, help="default: the setting's")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--no-trl", action="store_true", help="flowrl only")
    ap.add_argument("--profile", action="store_true", help="cProfile one more flowrl epoch")
    ap.add_argument(
        "--generate-ab",
        action="store_true",
        help="time generate() alone: flowrl's call beside TRL's, taking turns (no training)",
    )
    ap.add_argument(
        "--engine",
        choices=["hf", "vllm", "both"],
        default="hf",
        help="flowrl's rollout engine; both: hf and vllm trainers taking turns, TRL skipped (see above)",
    )
    ap.add_argument("overrides", nargs="*", help="flowrl config overrides key=value (flowrl's half only)")
    args = ap.parse_args(argv)
    for key, value in SETTINGS[args.setting].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    from transformers.utils import logging as hf_logging

    cwd, verbosity, bars = os.getcwd(), hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    os.chdir(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # the config's relative paths
    try:
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        print(
            f"text GRPO step, {args.setting} setting: {args.prompts} prompts x {args.group}, "
            f"max_new_tokens {args.max_new_tokens}, "
            f"temperature 1, beta 0, 1 optimizer step per batch; warm-up {args.warmup}, repeats {args.repeats}; "
            f"threads {torch.get_num_threads()}"
        )
        args.setting_overrides = setting_overrides(args)
        if args.generate_ab:
            return {"generate_ab": generate_ab(args), "threads": torch.get_num_threads()}
        if args.engine != "hf":
            return engines(args)
        flowrl = FlowrlRun(args)
        trl_out = (
            "skipped (--no-trl)"
            if args.no_trl
            else run_trl(args, flowrl.tr.cfg, flowrl.tr.train_set, between=flowrl.epoch)
        )
        for e in range(len(flowrl.rows), args.warmup + args.repeats):  # without TRL (or if it failed early)
            flowrl.epoch(e)
        fl_m, tr_m = medians(flowrl.result()["rows"]), None
        if isinstance(trl_out, str):
            print(f"TRL: {trl_out}")
        else:
            tr_m = medians(trl_out["rows"])
            print(
                f"TRL {trl_out['version']} GRPOTrainer on the same prompts, its steps and flowrl's epochs taking "
                f"turns (threads {torch.get_num_threads()})"
            )
        print_table(fl_m, tr_m, torch.get_num_threads(), args.repeats)
    finally:
        os.chdir(cwd)
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    return {"flowrl": fl_m, "trl": tr_m, "threads": torch.get_num_threads()}


if __name__ == "__main__":
    main()
    sys.exit(0)
