"""A Hugging Face causal LM as the policy. A step is a token; the mask is the completion mask.

The same trainer loop drives it: `rollout` samples `n` completions per prompt (KV cache, temperature / top-p /
top-k; the draw itself by inverse CDF, `InverseCdfSampler`) and records the old token log-probs under the same
temperature, from the sampling pass's own logits (`text.old_log_probs=sampling`, `SampledLogProbs`) or from a
second forward pass (`forward`); `unit_log_probs`
recomputes them with gradients for a minibatch; the reference is the model with its LoRA adapter disabled
(or a frozen copy). Log-probs, KL and entropy come from `flowrl.core`. With `train.sharding=fsdp` the model is
sharded over the processes with FSDP2 (`shard`); every forward pass is then a collective, so generation runs with
`synced_gpus` (a process whose completions have ended keeps stepping until every process's have).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import json
import logging
import math
import warnings
from pathlib import Path

import torch
from torch import Tensor

from flowrl import core
from flowrl.errors import FlowrlError
from flowrl.policies.base import DTYPES, ReferenceCache, TextBatch, UnitOutput, full_tensor, shard_blocks
from flowrl.seeding import derive_seed


class TextModelError(FlowrlError, ValueError):
    """A causal LM directory (model.path) whose tokenizer or config the text backend cannot run with; the message
    names what is missing and how to fix it."""


class _DroppedMaskFilter(logging.Filter):
    """transformers' generate() drops an all-ones attention mask (a batch without padding) after the prefill, and
    then GPT-2's forward warns "We strongly recommend passing in an `attention_mask`" whenever a decode step's token
    is the pad id (which is the EOS id of most causal LMs): a false alarm for flowrl, which passes its mask."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("We strongly recommend passing in an `attention_mask`")


@contextlib.contextmanager
def _mask_passed():
    """While flowrl's own generate() runs (it always passes the attention mask): `_DroppedMaskFilter`."""
    log, quiet = logging.getLogger("transformers.modeling_utils"), _DroppedMaskFilter()
    log.addFilter(quiet)
    try:
        yield
    finally:
        log.removeFilter(quiet)


def read_back(tokenizer, text: str, ids: list[int]) -> str | None:
    """How `text`, tokenized as `ids`, reads back through `tokenizer`'s decode, when that is another text than
    `text` (whitespace aside, which decoders tidy): characters outside the vocabulary dropped or turned into the
    unknown token. None when it reads back whole."""
    back = tokenizer.decode(ids, skip_special_tokens=True)
    return back if "".join(back.split()) != "".join(text.split()) else None


def _first_line(e: BaseException, most: int = 240) -> str:
    """An exception's first non-empty line, cut to `most` characters (transformers' load errors say the fact
    first and then their advice)."""
    line = next((x.strip() for x in str(e).splitlines() if x.strip()), type(e).__name__)
    return line if len(line) <= most else line[: most - 3] + "..."


def stop_token_ids(tokenizer, model) -> list[int]:
    """The ids that end a completion: the tokenizer's EOS first, then the other ids of the model's
    generation_config.eos_token_id (from its generation_config.json, else its config.json), as generate() and
    vLLM stop at each of them by default: Qwen2.5-Instruct's lists <|im_end|> (its tokenizer's EOS) and
    <|endoftext|>, Llama-3-Instruct's <|eot_id|> and <|end_of_text|>. Ids outside the vocabulary are left out."""
    ids = [tokenizer.eos_token_id]
    declared = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    vocab = getattr(model.config.get_text_config(), "vocab_size", None) or len(tokenizer)
    for i in [declared] if isinstance(declared, int) else list(declared or []):
        if isinstance(i, int) and 0 <= i < vocab and i not in ids:
            ids.append(i)
    return ids


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Positions counted over the real tokens only (left padding gets position 0), as generate() does."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def completion_mask_from_ids(completion_ids: Tensor, eos_token_id: int | list[int]) -> tuple[Tensor, Tensor]:
    """[B, T] ids -> (mask [B, T] float: 1 up to and including the first EOS, truncated [B] bool). `eos_token_id`:
    one id, or a list of ids any of which ends a completion (`TextPolicy.stop_ids`)."""
    eos = torch.as_tensor(eos_token_id, dtype=completion_ids.dtype, device=completion_ids.device).reshape(-1)
    is_eos = torch.isin(completion_ids, eos)
    seen_before = torch.cumsum(is_eos.long(), dim=1) - is_eos.long()  # EOS strictly before position t
    mask = (seen_before == 0).float()
    truncated = ~is_eos.any(dim=1)
    return mask, truncated


def logits_kept(model, n: int) -> dict:
    """The forward keyword that makes `model` (a transformers causal LM) compute the logits of its last `n`
    positions only: `logits_to_keep` (transformers >= 4.50), `num_logits_to_keep` (4.45-4.49), or none (all)."""
    name = _logits_kept_name(type(model))
    return {name: n} if name else {}


@functools.lru_cache(maxsize=None)
def _logits_kept_name(cls) -> str | None:
    params = inspect.signature(cls.forward).parameters
    return next((name for name in ("logits_to_keep", "num_logits_to_keep") if name in params), None)


class SampledLogProbs:
    """A logits processor that records log softmax(z_t / temperature)[y_t] of every sampled token during generate().

    First in generate()'s `logits_processor` list, before the temperature / top-k / top-p warpers and the sampler
    (`sampling_processors`), it sees the model's raw next-token logits z_t [B, V] (generate's float32 copy; the
    settings that would add processors of transformers' own are neutralised, `NEUTRAL_GENERATION`) and passes
    them on unchanged. The token y_t sampled from step t's logits is only known at the next call (the last column
    of its `input_ids`) or, for the last step, from the returned sequences (`finish`): so one step's logits are
    held back, never a [B, T, V] stack. The log-prob is the one the update's
    forward computes (`core.token_log_probs`: float32, row-chunked, over the whole vocabulary under the
    temperature); top-k / top-p truncation is left out on purpose, as the update's log-probs leave it out too and
    the importance ratio must compare like with like.
    """

    def __init__(self, temperature: float):
        self.temperature = float(temperature)
        self.held: Tensor | None = None  # [B, V]: the last step's logits, until its sampled token is known
        self.steps: list[Tensor] = []  # [B] float32 per generated token

    def _take(self, tokens: Tensor) -> None:
        """Log-prob of `tokens` [B] under the held logits [B, V]."""
        lp = core.token_log_probs(self.held[:, None, :], tokens[:, None], self.temperature)
        self.steps.append(lp[:, 0])
        self.held = None

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        if self.held is not None:
            self._take(input_ids[:, -1])
        self.held = scores
        return scores

    def finish(self, sequences: Tensor, n_new: int) -> Tensor:
        """The generated tokens' log-probs [B, n_new], `sequences` being generate()'s output (prompt + n_new)."""
        if self.held is not None:
            self._take(sequences[:, -1])
        if len(self.steps) != n_new:
            raise RuntimeError(
                f"recorded {len(self.steps)} sampling steps for {n_new} generated tokens: the "
                "logits processor was not called once per token; use text.old_log_probs=forward"
            )
        if not self.steps:
            return sequences.new_zeros((sequences.shape[0], 0), dtype=torch.float32)
        return torch.stack(self.steps, 1)


class InverseCdfSampler:
    """The last logits processor of a rollout's generate() call, which runs in greedy mode (do_sample=False): it
    draws each row's next token from softmax(scores) (`core.sample_categorical`, inverse CDF) and returns scores
    that are 0 at that token and -inf elsewhere, so that greedy decoding's argmax emits the draw.

    Why not generate's own sampling mode: it draws with torch.multinomial, which fills a [B, V] tensor with
    exponential random numbers at every step; on a CPU that is ~85 ms per step for 64 rows x 32k tokens, more
    than the model's own step (benchmarks/text_step.py). The distribution is the same: the scores arrive here
    through transformers' own temperature / top-k / top-p warpers, in generate's order (`sampling_processors`).
    """

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        tokens = core.sample_categorical(scores)
        return torch.full_like(scores, float("-inf")).scatter_(1, tokens[:, None], 0.0)


class StopOnStrings:
    """A stopping criterion of generate(): a row is done once the text of its generated tokens (after the first
    `prompt_len` of its ids) contains one of `stops`. Its own, rather than transformers' stop_strings, which needs a
    tokenizer that can spell its probe word (a character-level vocabulary cannot). Only the last tokens are
    decoded each step: as many as the longest stop string has characters, plus one."""

    def __init__(self, tokenizer, stops: list[str], prompt_len: int):
        self.tokenizer, self.stops, self.prompt_len = tokenizer, list(stops), prompt_len
        self.window = max(len(s) for s in self.stops) + 1

    def __call__(self, input_ids: Tensor, scores: Tensor, **kwargs) -> Tensor:
        tail = input_ids[:, self.prompt_len :][:, -self.window :].tolist()
        texts = self.tokenizer.batch_decode(tail, skip_special_tokens=True)
        return torch.tensor([any(s in t for s in self.stops) for t in texts], device=input_ids.device)


def sampling_processors(temperature: float, top_k: int, top_p: float) -> list:
    """transformers' warpers of generate's sampling mode, in its order (temperature, top-k, top-p; one token
    kept at least), for `temperature` / `top_k` (0 = off) / `top_p` (1 = off), followed by the sampler."""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    out = []
    if temperature != 1.0:
        out.append(TemperatureLogitsWarper(temperature))
    if top_k:
        out.append(TopKLogitsWarper(top_k=top_k, min_tokens_to_keep=1))
    if top_p < 1.0:
        out.append(TopPLogitsWarper(top_p=top_p, min_tokens_to_keep=1))
    return out + [InverseCdfSampler()]


#: generate() settings that would add logits processors (or, sampling, warpers) of their own, search for something
#: else than one token a step (beams, several sequences a prompt, a contrastive or assisted decoding), stop it early
#: (stop_strings, max_time, max_length) or return other than the ids: set to their neutral value so that a model's
#: generation_config.json (Qwen2.5-Instruct's sets repetition_penalty, top_k, top_p, temperature) cannot change the
#: distribution sampled from, or the eval's greedy decoding, behind the log-probs' back.
NEUTRAL_GENERATION = {
    "num_beams": 1,
    "num_return_sequences": 1,
    "num_beam_groups": 1,
    "diversity_penalty": None,
    "penalty_alpha": None,
    "dola_layers": None,
    "prompt_lookup_num_tokens": None,
    "constraints": None,
    "force_words_ids": None,
    "stop_strings": None,
    "max_time": None,
    "max_length": None,
    "return_dict_in_generate": False,
    "output_scores": False,
    "output_logits": False,
    "output_attentions": False,
    "output_hidden_states": False,
    "temperature": None,
    "top_k": None,
    "top_p": None,
    "min_p": None,
    "typical_p": None,
    "top_h": None,
    "epsilon_cutoff": None,
    "eta_cutoff": None,
    "repetition_penalty": None,
    "encoder_repetition_penalty": None,
    "no_repeat_ngram_size": None,
    "encoder_no_repeat_ngram_size": None,
    "bad_words_ids": None,
    "min_length": None,
    "min_new_tokens": None,
    "sequence_bias": None,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
    "exponential_decay_length_penalty": None,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "guidance_scale": None,
    "renormalize_logits": False,
    "watermarking_config": None,
}


def neutral_generation_kwargs() -> dict:
    """`NEUTRAL_GENERATION` restricted to the settings this transformers version's GenerationConfig knows."""
    from transformers import GenerationConfig

    known = GenerationConfig()
    return {k: v for k, v in NEUTRAL_GENERATION.items() if hasattr(known, k)}


class TextPolicy:
    reward_kind = "text"
    can_export = True
    sharded = False  # FSDP2 (see `shard`)

    def __init__(self, cfg, device):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.cfg = cfg
        self.text = cfg.text
        self.device = torch.device(device)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        except (OSError, ValueError, TypeError) as e:
            raise TextModelError(
                f"model.path={cfg.model.path}: its tokenizer does not load ({_first_line(e)}); a causal LM directory "
                "holds its tokenizer's files beside config.json (what tokenizer.save_pretrained(DIR) writes)"
            ) from None
        self.tokenizer.padding_side = "left"
        self.tokenizer.truncation_side = "left"  # keep the end of a long prompt: it is what is answered
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if self.tokenizer.eos_token_id is None:
            raise TextModelError(
                f"model.path={cfg.model.path}: its tokenizer has no EOS token, so completions could never end; set "
                "one and save it (tokenizer.eos_token = '<|endoftext|>'; tokenizer.save_pretrained(DIR)), or add "
                '"eos_token" to its tokenizer_config.json'
            )
        variant = {"variant": cfg.model.variant} if cfg.model.variant else {}
        from flowrl.hub import loading_bars

        try:
            with loading_bars(cfg.log.progress):  # transformers' "Loading weights" bar only with log.progress
                model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=DTYPES[cfg.model.dtype], **variant)
        except OSError as e:  # no weights file, or one that is truncated
            raise TextModelError(
                f"model.path={cfg.model.path}: its weights do not load ({_first_line(e)}); a causal LM directory holds "
                "them beside config.json (what model.save_pretrained(DIR) writes: model.safetensors, or its shards "
                "and their index)"
            ) from None
        except ValueError as e:  # a config transformers reads, but not as a causal LM (T5, CLIP, a vision model)
            raise TextModelError(
                f"model.path={cfg.model.path}: transformers does not load it as a causal LM ({_first_line(e)}); a "
                "text run trains a model AutoModelForCausalLM loads (GPT-2, Llama, Qwen, ...)"
            ) from None
        model.to(self.device).eval()  # eval: no dropout, so recomputed log-probs equal the recorded ones
        model.requires_grad_(False)
        self.stop_ids = stop_token_ids(self.tokenizer, model)
        self.prompt_limit = self._prompt_limit(cfg, model)
        self.ref_copy = None
        if cfg.lora.enabled:
            from peft import LoraConfig, get_peft_model
            from transformers.pytorch_utils import Conv1D

            torch.manual_seed(derive_seed(cfg.train.seed, 0x10BA))
            lcfg = LoraConfig(
                r=cfg.lora.rank,
                lora_alpha=cfg.lora.alpha,
                lora_dropout=cfg.lora.dropout,
                target_modules=cfg.lora.target_modules,
                task_type="CAUSAL_LM",
                # GPT-2's Conv1D stores its weight transposed (fan_in x fan_out); peft corrects it with a warning
                fan_in_fan_out=any(isinstance(m, Conv1D) for m in model.modules()),
            )
            with warnings.catch_warnings():  # peft reads transformers' deprecated name (a FutureWarning)
                warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
                model = get_peft_model(model, lcfg)
            if cfg.lora.init_path:
                load_adapter(model, cfg.lora, cfg.lora.init_path)
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.data = p.data.float()
                    p.requires_grad_(True)
        else:
            model.requires_grad_(True)  # a frozen reference copy, if the objective needs one: `ensure_reference`
        self.model = model
        self.train_model = model  # forward passes with grad run through it: a DDP wrapper after `wrap_trained`
        self.checkpointing = cfg.train.gradient_checkpointing
        if self.checkpointing:
            # transformers recomputes layers only in train mode: dropout is zeroed so that train mode changes
            # nothing else (the recomputed log-probs must equal the recorded ones)
            for module in model.modules():
                if isinstance(module, torch.nn.Dropout):
                    module.p = 0.0
            for key in ("attention_dropout", "attn_pdrop", "resid_pdrop", "embd_pdrop", "hidden_dropout"):
                if hasattr(model.config, key):
                    setattr(model.config, key, 0.0)
            if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x's name
                model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.aggregation = self.text.loss_agg
        self.entropy_coef = self.text.entropy_coef
        self.use_chat = self.text.chat_template and getattr(self.tokenizer, "chat_template", None) is not None
        self._drop_appended_eos = self._appends_eos()
        self._init_reward_io()

    def _prompt_limit(self, cfg, model) -> int:
        """The most prompt tokens: text.max_prompt_length, or fewer where the model's positions
        (max_position_embeddings) leave fewer after text.max_new_tokens (`encode_prompts` cuts a longer prompt from
        the left, with a warning, where a GPT-2 would index past its position table). A TextModelError when
        text.max_new_tokens alone fills them."""
        t = cfg.text
        positions = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        if not isinstance(positions, int) or t.max_prompt_length + t.max_new_tokens <= positions:
            return t.max_prompt_length
        if positions - t.max_new_tokens < 1:
            from flowrl.preflight import no_room_for_a_prompt

            raise TextModelError(no_room_for_a_prompt(t.max_new_tokens, positions, cfg.model.path))
        self._positions = positions
        return positions - t.max_new_tokens

    def _appends_eos(self) -> bool:
        """Whether the tokenizer's special tokens end a prompt with its EOS (a post-processor of "<s> $A </s>", a
        Llama tokenizer's add_eos_token): `encode_prompts` then drops it, else the model would be asked to go on
        after the end of a text."""
        if self.use_chat:
            return False
        ids = self.tokenizer("1", add_special_tokens=True)["input_ids"]
        bare = self.tokenizer("1", add_special_tokens=False)["input_ids"]
        return len(ids) > len(bare) and ids[-1] == self.tokenizer.eos_token_id

    # ---------------------------------------------------------------------------- parameters / reference

    def named_trainable_parameters(self):
        return [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]

    def trainable_parameters(self):
        return [p for _, p in self.named_trainable_parameters()]

    def wrap_trained(self, prepare) -> None:
        """Run the forward passes with grad through `prepare(model)` (accelerate's DDP wrapper), so that backward
        passes average the gradients over the processes; generation and the reference use the model itself."""
        self.train_model = prepare(self.model)

    @property
    def base_model(self) -> torch.nn.Module:
        """The transformers model itself: inside the peft wrapper with a LoRA, else `self.model`."""
        return self.model.get_base_model() if self.cfg.lora.enabled else self.model

    @property
    def trained_module(self) -> torch.nn.Module:
        """What the forward passes with grad run through (the DDP wrapper, for accelerate's no_sync), or when sharded
        the FSDP root, whose `set_requires_gradient_sync` the trainer switches."""
        return self.base_model if self.sharded else self.train_model

    def shard(self) -> None:
        """FSDP2 over the processes (`flowrl.policies.base.shard_blocks`): the transformers model, inside the peft
        wrapper with a LoRA (peft's forward and generate() both end in its forward, where the root's hooks gather what
        no layer holds), and the frozen reference copy of full fine-tuning, sharded the same way. The LoRA's weights,
        the gradients and the optimizer's states are sharded with the layers they belong to."""
        for model in (self.base_model, self.ref_copy):
            if model is not None:
                shard_blocks(model, offload=self.cfg.train.offload)
        self.sharded = True

    def lora_state(self) -> dict[str, Tensor]:
        """The LoRA's weights (peft's names, as in adapter_model.safetensors) as whole tensors on the CPU: gathered
        from every process when sharded (a collective: every process calls it)."""
        from peft.utils import get_peft_model_state_dict

        # save_embedding_layers=False: "auto" looks the base model's config up (on the hub, for a hub id) to see
        # whether its vocabulary grew, and it never does here
        state = get_peft_model_state_dict(self.model, save_embedding_layers=False)
        return {k: full_tensor(v).detach().cpu().contiguous() for k, v in state.items()}

    def model_state(self) -> dict[str, Tensor]:
        """The whole model's weights (transformers' names), gathered from the shards onto the CPU of the main
        process (the others get {}: only one writes them). A collective: every process calls it."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.base_model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    @contextlib.contextmanager
    def _checkpointing(self):
        """Train mode (where transformers' gradient checkpointing acts) for a forward with grad, when it is on."""
        if not (self.checkpointing and torch.is_grad_enabled()):
            yield
            return
        self.model.train()
        try:
            yield
        finally:
            self.model.eval()

    @contextlib.contextmanager
    def reference(self):
        """Yields the reference model: the same model with the adapter disabled, or the frozen copy."""
        if self.ref_copy is not None:
            yield self.ref_copy
        else:
            with self.model.disable_adapter():
                yield self.model

    def ensure_reference(self) -> None:
        """The reference policy for an objective that needs one: a LoRA's is the adapter off; full fine-tuning keeps a
        frozen copy of the starting model (made at the first call). Before wrapping or sharding."""
        if not self.cfg.lora.enabled and self.ref_copy is None:
            self.ref_copy = copy.deepcopy(self.model).requires_grad_(False).eval()

    # ---------------------------------------------------------------------------- rollout

    def format_prompt(self, prompt: str) -> str:
        if self.use_chat:
            return self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            )
        return prompt

    def encode_prompts(self, prompts: list[str]) -> tuple[Tensor, Tensor]:
        """Left-padded, left-truncated prompt ids and attention mask [B, Lp] on the model's device. Each distinct
        prompt is tokenized once (a rollout holds every prompt group_size times) and its rows repeated. An EOS the
        tokenizer appends (`_appends_eos`) is dropped: left-padded, it is every row's last column."""
        distinct = list(dict.fromkeys(prompts))
        self._check_read_back(distinct, "a prompt")
        drop = int(self._drop_appended_eos)
        texts = [self.format_prompt(p) for p in distinct]

        def tokenize(limit: int) -> dict:
            return self.tokenizer(
                texts,
                return_tensors="pt",
                padding=True,
                truncation=True,
                max_length=limit + drop,
                add_special_tokens=not self.use_chat,
            )

        enc = tokenize(self.text.max_prompt_length)
        if enc["input_ids"].shape[1] - drop > self.prompt_limit:  # longer than the model's positions leave
            limit, t = self.prompt_limit, self.text
            if not getattr(self, "_said_cut", False):  # once a run (rollouts and evals both call here)
                self._said_cut = True
                warnings.warn(
                    f"prompts of more than {limit} tokens are cut to their last {limit}: the {self._positions} "
                    f"positions of model.path={self.cfg.model.path} (max_position_embeddings) less text.max_new_tokens="
                    f"{t.max_new_tokens}; set text.max_prompt_length={limit} (or lower) to cut them there unwarned",
                    stacklevel=2,
                )
            enc = tokenize(limit)
        ids, attn = enc["input_ids"], enc["attention_mask"]
        if drop:
            ids, attn = ids[:, :-1], attn[:, :-1]
        where = {p: i for i, p in enumerate(distinct)}
        rows = torch.tensor([where[p] for p in prompts], dtype=torch.long)
        return ids[rows].to(self.device), attn[rows].to(self.device)

    def _check_read_back(self, texts: list[str], what: str) -> None:
        """Warn once a run (for `what`: "a prompt", "a tool reply") when one of `texts` does not read back whole
        through the tokenizer (`read_back`): the model is given fewer characters than the text holds."""
        said = self.__dict__.setdefault("_said_read_back", set())
        checked = self.__dict__.setdefault("_read_back_checked", set())
        new = [x for x in texts if x not in checked and x]
        if what in said or not new or len(checked) > 100_000:  # (a long run's distinct replies: enough checked)
            return
        checked.update(new)
        for text, ids in zip(new, self.tokenizer(new, add_special_tokens=False)["input_ids"]):
            back = read_back(self.tokenizer, text, ids)
            if back is not None:
                said.add(what)
                warnings.warn(
                    f"{what} does not read back whole through the tokenizer of model.path={self.cfg.model.path}: "
                    f"{text[:80]!r} is given to the model as {back[:80]!r} (characters outside its vocabulary are "
                    "dropped or unknown); keep to the characters it was trained on",
                    stacklevel=3,
                )
                return

    def decode_completions(self, completion: Tensor, mask: Tensor) -> tuple[list[str], list[list[int]]]:
        """[B, T] ids and their completion mask -> (texts, id lists through the EOS), in one batched decode."""
        lengths = mask.sum(1).long().tolist()
        ids = [row[:n] for row, n in zip(completion.tolist(), lengths)]
        return self.tokenizer.batch_decode(ids, skip_special_tokens=True), ids

    def _forward_log_probs(self, model, input_ids, attention_mask, prompt_len, temperature, with_entropy=False):
        """Token log-probs of the completion part [B, T] (and entropies [B, T]) from one forward.

        Only the last T + 1 positions go through the LM head (`logits_kept`): the prompt's logits are never used,
        and with a large vocabulary they would be a large share of the forward's and the backward's work."""
        n = input_ids.shape[1] - prompt_len  # T
        out = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids_from_mask(attention_mask),
            use_cache=False,
            **logits_kept(self.base_model, n + 1),
        )
        # [B, T + 1, V]: position prompt_len - 1 + t predicts completion token t; the last one predicts past the
        # sequence and gets a stand-in target, its log-prob dropped. Slicing it off the logits instead would make
        # them non-contiguous, and token_log_probs would copy all of them (a [B, T, V] copy, each way).
        logits = out.logits[:, -(n + 1) :]
        targets = torch.cat([input_ids[:, prompt_len:], input_ids[:, -1:]], 1)  # [B, T + 1]
        lp = core.token_log_probs(logits, targets, temperature)[:, :-1]
        ent = core.entropy_from_logits(logits, temperature)[:, :-1] if with_entropy else None
        return lp, ent

    def generate_samples(
        self,
        input_ids: Tensor,
        attn: Tensor,
        recorder: SampledLogProbs | None = None,
        *,
        max_new_tokens: int | None = None,
        stop: list[str] | None = None,
    ) -> Tensor:
        """generate() sampling under text.temperature / top_k / top_p: prompt + completion ids [B, Lp + n]. The draw
        is `InverseCdfSampler`'s (greedy mode over its one-hot scores); `recorder` first, when given. `stop`: strings
        that end a row as its EOS does (transformers' stop_strings)."""
        from transformers import LogitsProcessorList

        t = self.text
        processors = [recorder] if recorder is not None else []
        processors += sampling_processors(t.temperature, t.top_k, t.top_p)
        # greedy over InverseCdfSampler's one-hot scores: it samples (see there)
        return self._generate(
            input_ids, attn, max_new_tokens or t.max_new_tokens, stop, logits_processor=LogitsProcessorList(processors)
        )

    def _generate(self, input_ids: Tensor, attn: Tensor, max_new_tokens: int, stop: list[str] | None, **extra):
        """transformers' generate() as flowrl calls it, prompt + completion ids [B, Lp + n]: greedy over the scores
        (`extra`'s logits_processor makes them a draw), the KV cache, the stop ids and `stop`'s strings, the model's
        generation_config.json neutralised (`neutral_generation_kwargs`), transformers' false alarm of a dropped
        attention mask silenced (`_mask_passed`)."""
        from transformers import StoppingCriteriaList

        tok = self.tokenizer
        with _mask_passed():
            return self.model.generate(
                input_ids=input_ids,
                attention_mask=attn,
                do_sample=False,
                max_new_tokens=max_new_tokens,
                use_cache=True,
                pad_token_id=tok.pad_token_id,
                eos_token_id=self.stop_ids,
                synced_gpus=self.sharded,  # sharded: every step's forward is a collective, on every process
                **(
                    {"stopping_criteria": StoppingCriteriaList([StopOnStrings(tok, stop, input_ids.shape[1])])}
                    if stop
                    else {}
                ),
                **neutral_generation_kwargs(),
                **extra,
            )

    @property
    def engine(self):
        """The rollout engine of text.engine (flowrl.engines), built on first use."""
        if getattr(self, "_engine", None) is None:
            from flowrl.engines import build_engine

            self._engine = build_engine(self.text.engine, self)
        return self._engine

    @torch.no_grad()
    def rollout(self, prompts: list[str], metadata: list[dict], *, epoch: int, generator, stop=None) -> TextBatch:
        """One sampled completion per prompt, by the engine of text.engine holding the weights of
        `self.weights_version` (the trainer's optimizer steps); `stop()`: called before generating, raises to
        abandon the rollout."""
        if stop is not None:
            stop()
        t = self.text
        tok = self.tokenizer
        engine = self.engine
        pushed = engine.sync(getattr(self, "weights_version", 0))
        input_ids, attn = self.encode_prompts(prompts)
        prompt_len = input_ids.shape[1]
        seed = int(torch.randint(0, 2**62, (1,), generator=generator))  # this epoch/process's draw
        # the engine's log-probs: the old ones (text.old_log_probs=sampling), or beside the trainer's (a correction)
        own = t.old_log_probs == "sampling" and t.engine_correction == "none"
        # an engine's log-probs beside the trainer's measure its numerics; under top-k / top-p an engine that
        # renormalises (vLLM) would measure the truncation instead, so they are not asked for (config checks)
        truncating = bool(t.top_k) or t.top_p < 1
        record = own or not (engine.same_numerics or truncating)
        turns = None
        if t.tool_env:  # multi-turn with a tool: the environment's tokens are in `present` but not in `cmask`
            completion, model_mask, present, engine_lp, turns = self._tool_rollout(
                prompts, metadata, input_ids, attn, seed=seed, record=record
            )
            cmask = present * model_mask
            truncated = ~(torch.isin(completion, completion.new_tensor(self.stop_ids)) & (cmask > 0)).any(1)
        else:
            gen = engine.generate(input_ids, attn, seed=seed, record=record)
            completion = gen.completion_ids.to(self.device)
            n_new = completion.shape[1]
            if n_new < t.max_new_tokens:  # every row ended early: pad to a fixed T
                pad = completion.new_full((completion.shape[0], t.max_new_tokens - n_new), tok.pad_token_id)
                completion = torch.cat([completion, pad], 1)
            cmask, truncated = completion_mask_from_ids(completion, self.stop_ids)
            present = cmask
            engine_lp = None
            if gen.log_probs is not None:
                engine_lp = torch.nn.functional.pad(
                    gen.log_probs.float().to(self.device), (0, t.max_new_tokens - n_new)
                )
        completion = torch.where(present > 0, completion, torch.full_like(completion, tok.pad_token_id))
        full_ids = torch.cat([input_ids, completion], 1)
        full_attn = torch.cat([attn, present.long()], 1)
        if engine_lp is not None:
            engine_lp = engine_lp * cmask
        rollout_metrics = {"rollout/engine_version": float(engine.version), "rollout/engine_pushed": float(pushed)}
        loss_weights = None
        if own:
            old_lp = engine_lp
        else:
            old_lp, _ = self._forward_log_probs(self.model, full_ids, full_attn, prompt_len, t.temperature)
            if engine_lp is not None and not engine.same_numerics:
                level = None if t.engine_correction == "none" else t.engine_correction
                stats = core.mismatch_metrics(old_lp, engine_lp, cmask, level, t.engine_correction_cap)
                rollout_metrics.update({f"rollout/engine_{k}": v for k, v in stats.items()})
                if level is not None:
                    loss_weights = core.truncated_is_weights(old_lp, engine_lp, cmask, level, t.engine_correction_cap)
        texts, id_lists = self.decode_completions(completion, present)
        batch = TextBatch(
            prompts=list(prompts),
            metadata=list(metadata),
            input_ids=full_ids,
            attention_mask=full_attn,
            prompt_len=prompt_len,
            completion_ids=completion,
            completion_mask=cmask,
            truncated=truncated,
            old_log_probs=old_lp * cmask,
            completions=texts,
            completion_id_lists=id_lists,
            engine_log_probs=engine_lp,
            loss_weights=loss_weights,
            rollout_metrics=rollout_metrics,
            turns=turns,
        )
        if self.cfg.train.grpo.beta > 0 and t.kl_in_reward:
            with self.reference() as ref:
                ref_lp, _ = self._forward_log_probs(ref, full_ids, full_attn, prompt_len, t.temperature)
            kl = core.kl_estimate(old_lp, ref_lp, t.kl_estimator) * cmask
            batch.ref_log_probs = ref_lp
            batch.kl_penalty = (self.cfg.train.grpo.beta * kl.sum(1)).cpu()
        return batch

    @property
    def tool_env(self):
        """text.tool_env's environment (flowrl.tools), loaded on first use."""
        if getattr(self, "_tool_env", None) is None:
            from flowrl.tools import load_tool_env

            self._tool_env = load_tool_env(self.text.tool_env)
        return self._tool_env

    def _turn_end(self, row: list[int], stops: list[str]) -> tuple[int, str]:
        """How many of a turn's generated tokens `row` to keep and why the turn ended: through its first EOS
        ("eos", any of `stop_ids`), through the token that completes a stop string ("stop"), or all of them
        ("length")."""
        tok = self.tokenizer
        eos = next((k + 1 for k, i in enumerate(row) if i in self.stop_ids), None)
        upto = row[: eos or len(row)]
        if any(st in tok.decode(upto, skip_special_tokens=True) for st in stops):
            for k in range(1, len(upto) + 1):
                if any(st in tok.decode(upto[:k], skip_special_tokens=True) for st in stops):
                    return k, "stop"
        return (eos, "eos") if eos is not None else (len(row), "length")

    def _tool_rollout(self, prompts, metadata, input_ids, attn, *, seed: int, record: bool, greedy: bool = False):
        """Multi-turn sampling with text.tool_env (flowrl.tools): each row's completion is the model's turns and
        the environment's replies, text.max_new_tokens tokens in all, text.max_turns model turns at most. Returns
        completion [B, T], model_mask [B, T] (1 = the model's token), present [B, T] (1 = a token of the
        completion, either kind), the engine's log-probs [B, T] (0 on the environment's tokens; None unless
        `record`) and each row's turns [{"model": text, "tool": reply}, ...]. `greedy`: the eval's greedy decoding
        of the trained model instead of the engine's sampling."""
        from flowrl.engines import Generation

        t, tok, env = self.text, self.tokenizer, self.tool_env
        engine = None if greedy else self.engine
        stops = list(t.tool_stop) or env.stop
        B, T = len(prompts), t.max_new_tokens
        heads = [row[m.bool()].tolist() for row, m in zip(input_ids.cpu(), attn.cpu())]
        comp, kind, lps = [[] for _ in range(B)], [[] for _ in range(B)], [[] for _ in range(B)]
        turns = [[] for _ in range(B)]
        active = list(range(B))
        for turn in range(t.max_turns):
            if not active:
                break
            budget = [T - len(comp[i]) for i in active]
            seqs = [heads[i] + comp[i] for i in active]
            width = max(len(q) for q in seqs)
            ids = torch.full((len(seqs), width), tok.pad_token_id, dtype=torch.long)
            mask = torch.zeros((len(seqs), width), dtype=torch.long)
            for j, q in enumerate(seqs):  # left-padded, as encode_prompts
                ids[j, width - len(q) :] = torch.tensor(q)
                mask[j, width - len(q) :] = 1
            if greedy:
                out = self._greedy(ids.to(self.device), mask.to(self.device), max(budget), stops)
                gen = Generation(completion_ids=out, log_probs=None)
            else:
                gen = engine.generate(
                    ids.to(self.device),
                    mask.to(self.device),
                    seed=seed + turn,
                    record=record,
                    max_new_tokens=max(budget),
                    stop=stops,
                )
            still = []
            for j, i in enumerate(active):
                row = gen.completion_ids[j].tolist()[: budget[j]]
                keep, ended = self._turn_end(row, stops)
                comp[i] += row[:keep]
                kind[i] += [1] * keep
                lps[i] += gen.log_probs[j].tolist()[:keep] if record else [0.0] * keep
                said = tok.decode(row[:keep], skip_special_tokens=True)
                entry = {"model": said}
                if ended == "stop" and len(comp[i]) < T and turn + 1 < t.max_turns:  # no reply after the last turn
                    context = {
                        "prompt": prompts[i],
                        "transcript": tok.decode(comp[i], skip_special_tokens=True),
                        "metadata": metadata[i],
                    }
                    reply = env(said, context)
                    if reply is not None:
                        self._check_read_back([reply], "a tool reply")
                        rids = tok(reply, add_special_tokens=False)["input_ids"][: T - len(comp[i])]
                        comp[i] += rids
                        kind[i] += [0] * len(rids)
                        lps[i] += [0.0] * len(rids)
                        entry["tool"] = reply
                        if len(comp[i]) < T:
                            still.append(i)
                turns[i].append(entry)
            active = still
        completion = torch.full((B, T), tok.pad_token_id, dtype=torch.long)
        model_mask = torch.zeros((B, T))
        present = torch.zeros((B, T))
        engine_lp = torch.zeros((B, T))
        for i in range(B):
            n = len(comp[i])
            completion[i, :n] = torch.tensor(comp[i], dtype=torch.long)
            model_mask[i, :n] = torch.tensor(kind[i], dtype=torch.float32)
            present[i, :n] = 1.0
            engine_lp[i, :n] = torch.tensor(lps[i], dtype=torch.float32)
        dev = self.device
        return completion.to(dev), model_mask.to(dev), present.to(dev), engine_lp.to(dev) if record else None, turns

    def _init_reward_io(self) -> None:
        """What text rewards see and log besides the batch: ``reward_state`` (TRL's ``trainer_state``; the
        trainer sets its ``global_step`` and ``epoch``), and the values they pass to ``log_metric`` and
        ``log_extra`` since the last ``pop_reward_logs`` / ``pop_reward_extra``."""
        from rewards import RewardState

        self.reward_state = RewardState()
        self._reward_logs: dict[str, list[float]] = {}
        self._reward_extra: dict[str, list] = {}

    def call_reward(self, fn, batch: TextBatch, columns: dict) -> Tensor:
        """A text reward called as TRL's GRPOTrainer calls it (prompts, completions, completion_ids, the
        columns, trainer_state, log_metric, log_extra; async ones awaited) -> [B] float32, NaN where it
        returned None (it does not apply)."""
        from rewards import call_text_reward

        out = call_text_reward(
            fn,
            batch.prompts,
            batch.completions,
            batch.completion_id_lists,
            columns,
            state=self.reward_state,
            logs=self._reward_logs,
            extra=self._reward_extra,
        )
        return torch.tensor([float("nan") if v is None else v for v in out], dtype=torch.float32)

    def pop_reward_logs(self) -> dict[str, float]:
        """The mean of each metric the rewards logged with ``log_metric`` since the last call, as
        ``reward_log/<name>``; the logs are cleared."""
        means = {
            f"reward_log/{name}": sum(values) / len(values) for name, values in self._reward_logs.items() if values
        }
        self._reward_logs.clear()
        return means

    def pop_reward_extra(self) -> dict[str, list]:
        """The columns the rewards logged with ``log_extra(column, values)`` since the last call (values in
        call order, one per completion scored); cleared."""
        extra = dict(self._reward_extra)
        self._reward_extra.clear()
        return extra

    # ---------------------------------------------------------------------------- training

    def train_units(self, batch: TextBatch, steps_per_forward: int) -> list[list[int]]:
        return [list(range(batch.completion_ids.shape[1]))]  # one forward covers every token

    def step_mask(self, batch: TextBatch, idx: Tensor, unit: list[int]) -> Tensor:
        """The completion tokens through the EOS (none of a truncated completion with text.mask_truncated)."""
        idx = idx.to(batch.completion_mask.device)
        mask = batch.completion_mask[idx].clone()
        if self.text.mask_truncated:
            mask = mask * (~batch.truncated[idx]).float()[:, None]
        return mask

    def unit_log_probs(
        self,
        batch: TextBatch,
        idx: Tensor,
        unit: list[int],
        *,
        with_reference: bool,
        reference_cache: ReferenceCache | None = None,
    ) -> UnitOutput:
        t = self.text
        idx = idx.to(self.device)
        ids, attn = batch.input_ids[idx], batch.attention_mask[idx]
        with self._checkpointing():
            lp, ent = self._forward_log_probs(
                self.train_model, ids, attn, batch.prompt_len, t.temperature, with_entropy=self.entropy_coef > 0
            )
        mask = self.step_mask(batch, idx, unit)
        out = UnitOutput(log_prob=lp, old_log_prob=batch.old_log_probs[idx], mask=mask, entropy=ent)
        if batch.loss_weights is not None:  # text.engine_correction's importance weights
            out.weight = batch.loss_weights[idx.to(batch.loss_weights.device)].to(lp.device)
        if with_reference and not t.kl_in_reward:

            def reference_log_probs() -> Tensor:  # [b, T]
                with torch.no_grad(), self.reference() as ref:
                    return self._forward_log_probs(ref, ids, attn, batch.prompt_len, t.temperature)[0]

            if reference_cache is None:
                ref_lp = reference_log_probs()
            else:  # a sample's tokens: the same input in every pass
                ref_lp = reference_cache.rows(idx.tolist(), reference_log_probs)
            out.kl = core.kl_estimate(lp, ref_lp, t.kl_estimator)
        return out

    def reward_penalty(self, batch: TextBatch) -> Tensor | None:
        return batch.kl_penalty

    # ---------------------------------------------------------------------------- eval / export

    @torch.no_grad()
    def generate_greedy(
        self, prompts: list[str], max_new_tokens: int | None = None, metadata: list[dict] | None = None
    ) -> tuple[list[str], list[list[int]]]:
        """Greedy completions: (texts up to the EOS, their token ids through the EOS). With text.tool_env, greedy
        multi-turn ones (the environment answers each turn, as in the rollouts; `metadata` is what it sees)."""
        input_ids, attn = self.encode_prompts(prompts)
        if self.text.tool_env:
            meta = metadata if metadata is not None else [{} for _ in prompts]
            comp, _, present, _, _ = self._tool_rollout(
                prompts, meta, input_ids, attn, seed=0, record=False, greedy=True
            )
            return (*self.decode_completions(comp, present),)
        comp = self._greedy(input_ids, attn, max_new_tokens or self.text.max_new_tokens)
        mask, _ = completion_mask_from_ids(comp, self.stop_ids)
        return (*self.decode_completions(comp, mask),)

    def _greedy(self, input_ids: Tensor, attn: Tensor, max_new_tokens: int, stop: list[str] | None = None) -> Tensor:
        """generate()'s greedy decoding of the trained model: the completion ids [B, n] (a row ends at its EOS, or
        at one of `stop`'s strings). Plain greedy whatever the model's generation_config.json says
        (`NEUTRAL_GENERATION`: no repetition penalty, no beams)."""
        out = self._generate(input_ids, attn, max_new_tokens, stop)
        return out[:, input_ids.shape[1] :]

    @torch.no_grad()
    def sample_completions(
        self, prompts: list[str], seeds: list[int] | None, metadata: list[dict] | None = None
    ) -> list[list[str]]:
        """Completions of every prompt, prompt-major ([prompt][k]): with `seeds`, one drawn as the rollouts draw
        (text.engine, text.temperature / top_k / top_p, text.tool_env's turns) per seed, in a call per seed (the
        same prompts and seed draw the same); `seeds` None: the eval's greedy completion. `metadata`: each prompt's
        row (its prompt file's columns), what text.tool_env's environment sees, as in training."""
        meta = list(metadata) if metadata is not None else [{} for _ in prompts]
        if seeds is None:
            return [[c] for c in self.generate_greedy(prompts, metadata=meta)[0]]
        input_ids, attn = self.encode_prompts(prompts)
        self.engine.sync(getattr(self, "weights_version", 0))
        out: list[list[str]] = [[] for _ in prompts]
        for seed in seeds:
            if self.text.tool_env:
                comp, _, present, _, _ = self._tool_rollout(prompts, meta, input_ids, attn, seed=seed, record=False)
                texts = self.decode_completions(comp, present)[0]
            else:
                comp = self.engine.generate(input_ids, attn, seed=seed, record=False).completion_ids.to(self.device)
                texts = self.decode_completions(comp, completion_mask_from_ids(comp, self.stop_ids)[0])[0]
            for row, text in zip(out, texts):
                row.append(text)
        return out

    @torch.no_grad()
    def evaluate_prompts(
        self,
        prompts,
        metadata,
        reward_fns,
        eval_cfg,
        part: slice | None = None,
        stop=None,
        *,
        per_call=0,
        on_batch=None,
    ):
        """Greedy completions of the eval prompts `prompts[part]` and each reward's scores (None: NaN, "does not
        apply", which the eval leaves out of its means as training does):
        (completions, per-reward scores [n] each, {} components). The rewards are called as in training, with
        their log_metric / log_extra calls kept out of the training logs. `stop()`: called before each batch of
        64 prompts (`per_call` is the image policies' and is not used here) and each reward; it raises to abandon
        the eval. `on_batch(k)`: called after each batch with its k completions."""
        from rewards import call_text_reward

        part = part or slice(0, len(prompts))
        prompts, metadata = list(prompts[part]), list(metadata[part])
        completions, ids = [], []
        per = 64
        for i in range(0, len(prompts), per):
            if stop is not None:
                stop()
            texts, tids = self.generate_greedy(prompts[i : i + per], metadata=metadata[i : i + per])
            completions.extend(texts)
            ids.extend(tids)
            if on_batch is not None:
                on_batch(len(texts))
        columns = {k: [m.get(k) for m in metadata] for k in {k for m in metadata for k in m}}
        per_reward = []
        for fn in reward_fns:
            if stop is not None:
                stop()
            vals = call_text_reward(fn, prompts, completions, ids, columns, state=self.reward_state, logs={}, extra={})
            per_reward.append(torch.tensor([float("nan") if v is None else float(v) for v in vals]))
        return completions, per_reward, {}

    def save_eval_outputs(self, outputs, prompts, path: Path, scores=None) -> Path:
        """`path`.jsonl: one row per eval prompt with its completion (and score, when given)."""
        path = Path(str(path) + ".jsonl")
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        rows = [{"prompt": p, "completion": c} for p, c in zip(prompts, outputs)]
        if scores is not None:
            for row, score in zip(rows, scores):  # None: the reward does not apply (or not a finite number)
                row["score"] = float(score) if math.isfinite(float(score)) else None
        tmp.write_text("".join(json.dumps(row) + "\n" for row in rows))
        tmp.replace(path)
        return path

    def describe_outputs(self, batch: TextBatch) -> list[str]:
        return batch.completions

    def export_state(self) -> dict[str, Tensor]:
        """What `export` writes, gathered from every process when sharded (a collective: every process calls it):
        the LoRA's weights, or the whole model's (on the main process only)."""
        return self.lora_state() if self.cfg.lora.enabled else self.model_state()

    def export(self, directory: Path, state: dict[str, Tensor] | None = None) -> None:
        """The adapter (peft format) or the full model, with the tokenizer, loadable with from_pretrained. Sharded,
        the weights come already gathered (`state`: `export_state()`, which needs every process); this writes
        them (main process)."""
        directory = Path(directory)
        if state is None and self.sharded:
            raise ValueError(
                "export of a sharded policy needs its weights gathered by every process first: pass "
                "state=policy.export_state()"
            )
        from flowrl.hub import loading_bars

        lora = {"save_embedding_layers": False} if self.cfg.lora.enabled else {}  # (see lora_state)
        with loading_bars(self.cfg.log.progress):  # transformers' "Writing model shards" bar only with log.progress
            if state is None:
                self.model.save_pretrained(directory, safe_serialization=True, **lora)
            elif self.cfg.lora.enabled:
                self._save_adapter(directory, state)
            else:
                self.base_model.save_pretrained(directory, state_dict=state, safe_serialization=True)
        self.tokenizer.save_pretrained(directory)

    def _save_adapter(self, directory: Path, state: dict[str, Tensor]) -> None:
        """Gathered LoRA weights as peft's save_pretrained writes an adapter: adapter_config.json (inference mode)
        and adapter_model.safetensors, for PeftModel.from_pretrained."""
        from safetensors.torch import save_file

        config = copy.deepcopy(self.model.peft_config["default"])
        config.inference_mode = True
        directory.mkdir(parents=True, exist_ok=True)
        config.save_pretrained(str(directory))
        save_file(state, str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})


def load_adapter(model, lora_cfg, init_path: str) -> None:
    """Start the peft `model`'s adapter from the LoRA of `init_path` (lora.init_path: a text run's `lora/`, or any
    `PeftModel.save_pretrained` directory, or its adapter_model.safetensors). A LoRA of another rank, alpha or
    other modules is a ConfigError naming the file's setting against the config's (`flowrl.lora_files`)."""
    from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict

    from flowrl.lora_files import init_state
    from flowrl.preflight import lora_init_file

    path, _ = lora_init_file(init_path)
    own = {k: tuple(v.shape) for k, v in get_peft_model_state_dict(model).items()}
    state = init_state(path, lora_cfg, own)
    set_peft_model_state_dict(model, state)
