"""The plan of a text run: the causal LM built on meta, its LoRA, one completion's activations (its output head
and the log-prob's row chunks), and the rollout: generate()'s KV cache, then (text.old_log_probs=forward, or a reference
forward for text.kl_in_reward) the old log-probs in one forward."""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping

import torch

from .activations import Layer, activation_bytes, activation_terms, block_params
from .budget import Training, batch_shape, finish, training_rows
from .columns import columns, spread
from .declarations import Calibration
from .models import DTYPE_BYTES, causal_lm, inject_lora, lora_parameters
from .report import LOGITS_PHASE, Plan, RolloutEstimate, Row, UpdateEstimate

#: the decoder layers of a causal LM, which transformers' gradient checkpointing recomputes one at a time
LM_BLOCKS = r"(?:.*\.)?(?:layers|h|blocks)\.\d+"

#: The activation factors of a causal LM (the text backend: any transformers causal LM, not a family), set by
#: `python benchmarks/memory.py --fit` on random Qwen2s (CPU, bfloat16, LoRA r16 on peft's default, beta 0.04, 64 new
#: tokens, ~69 tokens in all); the measured activations (MiB, on top of the static memory) for micro-batch 2 / 4 / 8,
#: without and with gradient checkpointing: 4 layers of 256 with a 151,936 vocabulary: 313.1 / 498.7 / 742.4 and
#: 307.1 / 486.6 / 718.2; 8 layers of 512, vocabulary 1,024: 27.7 / 55.4 / 110.9 and 6.1 / 12.2 / 24.4; 24 layers
#: of 256: 41.1 / 82.2 / 164.3 and 4.2 / 8.4 / 16.9. Over micro-batch 1 to 16 (the benchmark's default run) within 14%
#: without checkpointing (at micro-batch 1 the logits' slice is contiguous and the log-prob makes one copy fewer) and
#: 19% with it.
#: The rollout (generate, then the old log-probs of 2 / 4 / 8 completions in one forward), vocabulary 151,936:
#: 205.8 / 284.0 / 440.5 MiB: 39.1 MiB per completion = 1.95 x its bf16 logits (they and the copy the log-prob makes
#: of their slice) and 128 MiB once = 2 float32 row chunks of 2^24 elements; within 2% up to 16 completions. With a
#: 1,024 vocabulary the hidden states, left out, matter: 32% under.
#: float32 [vocabulary] rows per completion that generate() holds at a step: the step's logits, the processed scores,
#: the sampling probabilities and the recorder's log-softmax (text.old_log_probs=sampling), with one to spare
GENERATE_SCORES = 5

LM_CALIBRATION = Calibration(
    0.849,
    0.52,
    1.42,
    "calibrated on measured Qwen2s of 4 x 256 (vocabulary 151,936), 8 x 512 and 24 x 256 layers (benchmarks/memory.py)",
    head=3.437,
    chunk=2.714,
    gamma=1.95,
    gamma_chunk=2.0,
)


def lm_layers(module: torch.nn.Module, tokens: int, lora_targets: Mapping[str, int]) -> tuple[list[Layer], int]:
    """(the Linear / Conv1D layers of a causal LM but its output head, all seeing `tokens` tokens; the vocabulary
    size of the head)."""
    from transformers.pytorch_utils import Conv1D

    head = module.get_output_embeddings()
    vocab = head.out_features if head is not None else 0
    layers = []
    for name, mod in module.named_modules():
        if ".lora_" in name or mod is head:
            continue
        name = name.removeprefix("base_model.model.").removesuffix(".base_layer")
        if isinstance(mod, torch.nn.Linear):
            fan_in, fan_out = mod.in_features, mod.out_features
        elif isinstance(mod, Conv1D):  # GPT-2's transposed linear: weight [fan_in, fan_out]
            fan_in, fan_out = mod.weight.shape
        else:
            continue
        block = re.match(rf"({LM_BLOCKS})(\.|$)", name)
        layers.append(
            Layer(
                name,
                "tok",
                tokens,
                tokens,
                fan_in,
                fan_out,
                block.group(1) if block else None,
                lora_targets.get(name, 0),
            )
        )
    return layers, vocab


def plan_text(cfg, gpus: int, gpu_memory_gib: float) -> Plan:
    """The plan of a text run (a causal LM) on `gpus` GPUs of `gpu_memory_gib` GiB."""
    m, t, x = cfg.model, cfg.train, cfg.text
    local, minibatch, micro = batch_shape(cfg, gpus)
    dtype, b = m.dtype, DTYPE_BYTES[m.dtype]
    model, source = causal_lm(m.path, dtype)
    if cfg.lora.enabled:  # the adapters go into a copy: the built module is shared
        module, adapted = inject_lora(
            copy.deepcopy(model.module), cfg.lora.rank, cfg.lora.alpha, cfg.lora.target_modules, causal_lm=True
        )
        n_trained = lora_parameters(module)
    else:
        module, adapted, n_trained = model.module, {}, model.params
    from flowrl.objectives import get_objective

    obj = get_objective(t.objective).memory_terms(cfg, 1)
    tr = Training(
        n_trained,
        f"LoRA r{cfg.lora.rank} on {len(adapted)} layers" if cfg.lora.enabled else None,
        "float32" if cfg.lora.enabled else dtype,
        t.ema_decay > 0,
        (0.0 if cfg.lora.enabled else model.weight_bytes) if obj.reference else None,
        block_params(model.module, LM_BLOCKS) * b,
        t.optimizer,
    )
    cols = columns(cfg, n_trained, gpus)
    tokens = x.max_prompt_length + x.max_new_tokens  # prompts are left-padded to the batch's longest
    config = getattr(model.module, "config", None)
    positions = getattr(config.get_text_config(), "max_position_embeddings", None) if config is not None else None
    cut = isinstance(positions, int) and positions < tokens  # the policy cuts prompts to the positions left
    tokens = positions if cut else tokens
    layers, vocab = lm_layers(module, tokens, adapted)
    terms = activation_terms(layers, dtype)
    update = UpdateEstimate(
        "causal LM",
        LM_CALIBRATION,
        dtype,
        1,
        terms,
        activation_bytes(terms, LM_CALIBRATION, dtype, head_units=tokens * vocab),
        n_trained * DTYPE_BYTES[tr.dtype],
        0.0,
        tokens * vocab,
        vocab,
        x.max_new_tokens,
    )
    rows = [Row(f"model ({model.class_name})", model.params / 1e9, spread(cols, model.weight_bytes, gpus, "weights"))]
    rows += training_rows(tr, cols, gpus)
    within = f", cut to the model's {positions} positions" if cut else ""
    rows_note = f"{tokens} tokens (max_prompt_length + max_new_tokens{within}), vocabulary {vocab}"
    targets = ", ".join(cfg.lora.target_modules) if cfg.lora.target_modules else "peft's default for the model"
    lora = (
        f"LoRA r{cfg.lora.rank} alpha {cfg.lora.alpha:g} on {targets}"
        if cfg.lora.enabled
        else f"full fine-tuning (weights, gradients, AdamW in {dtype})"
    )
    facts = [
        ("model", f"{m.path} ({model.class_name}; configuration: {source})"),
        ("update", f"{lora}; {dtype}; {rows_note}; {obj.reference_note}"),
        (
            "batch",
            f"{local} completions per GPU per epoch, minibatch {minibatch}, micro-batch {micro}, "
            f"gradient checkpointing {'on' if t.gradient_checkpointing else 'off'}",
        ),
        ("GPUs", f"{gpus} x {gpu_memory_gib:g} GiB"),
    ]
    notes = [f"activations of the causal LM: {LM_CALIBRATION.measured}"]
    # the rollout: generate() with its KV cache, then the old log-probs of the whole per-GPU batch in one forward
    config = model.module.config.get_text_config()
    heads = getattr(config, "num_attention_heads", 1)
    kv = 2 * config.num_hidden_layers * (getattr(config, "num_key_value_heads", None) or heads)  # keys and values
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    logits = LM_CALIBRATION.gamma * b * tokens * vocab
    gamma_chunk = LM_CALIBRATION.gamma_chunk
    # generate() also holds each step's scores over the vocabulary in float32 (the sampler's and, with
    # text.old_log_probs=sampling, the recorder's log-softmax): a few [vocabulary] rows per completion
    phases = {"generate (KV cache)": (kv * head_dim * tokens * b + GENERATE_SCORES * 4 * vocab, False)}
    if x.old_log_probs == "forward" or (t.grpo.beta > 0 and x.kl_in_reward):  # a forward of the whole batch after it
        phases[LOGITS_PHASE] = (logits, False)
    rollout = RolloutEstimate(local, phases, lambda n: gamma_chunk * 4 * update.chunk_units(n))
    host = tr.host_bytes()
    return finish(
        facts,
        rows,
        update,
        rollout,
        tr,
        cols,
        micro,
        minibatch,
        local,
        cfg,
        gpus,
        gpu_memory_gib,
        host,
        notes,
        rows_note,
    )
