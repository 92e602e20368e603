"""Z-Image (ZImagePipeline: Z-Image, Z-Image-Turbo): flow matching with the pipeline's own CFG form, a Qwen3 text
encoder behind a chat template, a single-stream DiT that takes lists of per-sample tensors; sampled with
flow_sde_step.

What differs from SD3 / FLUX, all mirrored from `ZImagePipeline.__call__`:
- the prompt embedding is Qwen3's second-to-last hidden state of the chat-templated prompt, and only its real
  tokens (the tokenizer's attention mask): one [L_i, D] tensor per prompt, L_i varying. Kept here as
  `prompt_embeds` [P, max_sequence_length, D] (zero past L_i) and `prompt_lengths` [P], and cut back to
  [L_i, D] for the transformer (its RoPE positions and padding depend on L_i);
- the transformer takes a list of [C, 1, H, W] latents, a timestep (1000 - t) / 1000 and a list of caption
  embeddings, and returns the negated velocity: the step uses -output;
- CFG is `pos + g (pos - neg)`, on when g > 0 (g = 0: one forward, Z-Image-Turbo's setting), so a guidance
  scale here is the pipeline's (the usual form's scale minus 1);
- the sigmas are linspace(1, 1/S, S) shifted by the scheduler (with `mu` from the image's token count when it
  shifts dynamically);
- the latents stay in float32 whatever the weights' dtype, as the pipeline keeps them (those a rollout draws;
  the base class casts latents passed to `rollout` to the weights' dtype).
"""

from __future__ import annotations

import torch

from flowrl.plan.declarations import Layout

from . import _tiny as tiny
from ._base import SizeRule, register_family
from ._flow import FlowMatchingBackend
from .flux import FluxBackend

# the pipeline calls its transformer with the default patch sizes (spatial 2, frame 1)
PATCH_SIZE = 2
# the transformer pads a caption to a multiple of 32 tokens (SEQ_MULTI_OF) and puts the image's frame position
# right after it, on RoPE's first axis
_CAPTION_MULTIPLE = 32

# the tiny test model's transformer (`tiny-zimage`)
TINY_TRANSFORMER = dict(
    all_patch_size=(PATCH_SIZE,),
    all_f_patch_size=(1,),
    in_channels=4,
    dim=32,
    n_layers=1,
    n_refiner_layers=1,
    n_heads=2,
    n_kv_heads=2,
    norm_eps=1e-5,
    qk_norm=True,
    cap_feat_dim=32,  # = the tiny Qwen3's hidden size
    rope_theta=256.0,
    t_scale=1000.0,
    axes_dims=(8, 4, 4),  # sums to the head dim, 32 / 2
    axes_lens=(128, 64, 64),  # captions up to 96 tokens; images up to 64 x patch 2 x VAE 2 = 256 px a side
)
TINY_TOKENIZER_MAX_LENGTH = 64  # the tiny tokenizer's model_max_length: the default max_sequence_length

# Qwen3's chat template, reduced to what ZImagePipeline renders: one user turn and the generation prompt
# (`enable_thinking=True`, the pipeline's, adds nothing; False would add an empty think block).
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{% endif %}"
)


def tiny_qwen_tokenizer():
    """A Qwen2Tokenizer (Qwen3's class) over the 256 byte-level symbols and no merges (one token per byte), with
    <|endoftext|> (pad), <|im_start|> and <|im_end|> as special tokens and a chat template."""
    from tokenizers import AddedToken, pre_tokenizers
    from transformers import Qwen2Tokenizer

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {token: i for i, token in enumerate(specials)}
    for symbol in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[symbol] = len(vocab)
    tokenizer = Qwen2Tokenizer(
        vocab=vocab, merges=[], model_max_length=TINY_TOKENIZER_MAX_LENGTH, chat_template=TINY_CHAT_TEMPLATE
    )
    tokenizer.add_tokens([AddedToken(token, special=True) for token in specials[1:]])
    return tokenizer


def _tiny_qwen3(tokenizer, hidden: int):
    from transformers import Qwen3Config, Qwen3Model

    config = Qwen3Config(
        vocab_size=tiny.vocab_size(tokenizer),
        hidden_size=hidden,
        intermediate_size=37,
        num_hidden_layers=2,  # ZImagePipeline reads hidden_states[-2]
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=2 * TINY_TOKENIZER_MAX_LENGTH,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    return Qwen3Model(config)


def _tiny_transformer():
    from diffusers import ZImageTransformer2DModel

    transformer = ZImageTransformer2DModel(**TINY_TRANSFORMER)
    with torch.no_grad():  # some diffusers versions leave the pad tokens uninitialised (torch.empty)
        transformer.x_pad_token.normal_()
        transformer.cap_pad_token.normal_()  # the tiny captions are padded: this token is really used
    return transformer


@register_family
class ZImageBackend(FlowMatchingBackend):
    """ZImagePipeline (Tongyi-MAI/Z-Image: CFG, guidance 4; Z-Image-Turbo: distilled, guidance 0). CFG when
    guidance_scale > 0, in the pipeline's form pos + g (pos - neg). Latents [B, C, H/f, W/f] (f: the VAE factor,
    8), drawn and stepped in float32 as the pipeline does (latents passed to `rollout` take the weights' dtype)."""

    family = "zimage"
    pipeline_classes = ("ZImagePipeline",)
    denoiser_attr = "transformer"
    denoiser_class = "ZImageTransformer2DModel"
    # Flow-Factory's Z-Image GRPO recipe (examples/grpo/lora/z_image/default.yaml) samples the base model with 4.0;
    # the pipeline's own default is 5.0, Z-Image-Turbo's is 0.0 (no CFG)
    default_guidance_scale = 4.0
    # the attention projections of every block (main, noise and context refiners): diffusers'
    # train_dreambooth_lora_z_image.py default, and the attention part of Flow-Factory's (which adds the FFN's
    # feed_forward.w1/w2/w3: the preset lists them)
    lora_targets = ("attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0")
    tiny_denoiser = TINY_TRANSFORMER
    plan_layout = Layout(
        blocks=r"(layers|noise_refiner|context_refiner)\.\d+",
        one=r"t_embedder|adaLN_modulation",
        txt=r"cap_embedder|context_refiner",
        joint=r"^layers\.",
    )
    # not measured yet: FLUX.1's factors (single-stream blocks over image and text tokens, as FLUX.1's last ones)
    plan_calibration = FluxBackend.plan_calibration.borrowed(FluxBackend.denoiser_class, denoiser_class)
    parity_guidance = (0.0, 4.0)  # without CFG (Turbo) and with it (Z-Image)
    default_max_sequence_length = 512  # ZImagePipeline's default
    uses_cfg_encodings = True
    _t5_tokenizer_attr = "tokenizer"  # caps max_sequence_length at the tokenizer's model_max_length

    def __init__(self, pipe, **kwargs):
        super().__init__(pipe, **kwargs)
        # the caption, padded to a multiple of 32, sits on RoPE's first axis before the image's frame position
        axes_lens = self.denoiser_config.get("axes_lens")
        if axes_lens:
            padded = -(-self.max_sequence_length // _CAPTION_MULTIPLE) * _CAPTION_MULTIPLE
            if padded + 2 > axes_lens[0]:
                longest = (axes_lens[0] - 2) // _CAPTION_MULTIPLE * _CAPTION_MULTIPLE
                raise ValueError(
                    f"max_sequence_length {self.max_sequence_length} is too long for this Z-Image transformer "
                    f"(RoPE axis 0 has {axes_lens[0]} positions): at most {longest}"
                )

    # ---- prompts ---------------------------------------------------------------------------------

    def _encode_text(self, prompts):
        # encode_prompt writes the chat-templated prompts into the list it is given: pass a copy
        embeds, _ = self.pipe.encode_prompt(
            list(prompts),
            device=self.device,
            do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length,
        )
        length = max([self.max_sequence_length, *(len(e) for e in embeds)])
        padded = embeds[0].new_zeros((len(embeds), length, embeds[0].shape[-1]))
        for i, e in enumerate(embeds):
            padded[i, : len(e)] = e
        lengths = torch.tensor([len(e) for e in embeds], dtype=torch.long, device=padded.device)
        return {"prompt_embeds": padded, "prompt_lengths": lengths}, {}

    @staticmethod
    def _captions(cond: dict) -> list:
        """The per-sample caption embeddings [L_i, D] the transformer takes."""
        embeds, lengths = cond["prompt_embeds"], cond["prompt_lengths"].tolist()
        return [e[:n] for e, n in zip(embeds, lengths)]

    # ---- sizes and noise -------------------------------------------------------------------------

    def _default_image_size(self) -> int:
        # ZImagePipeline: height or 1024 (here at most what the transformer makes); the tiny pipeline records
        # its own default (32 px)
        sample_size = getattr(self.pipe, "default_sample_size", None)
        if sample_size:
            return sample_size * self.pipe.vae_scale_factor
        max_side = self.size_rule(self.denoiser_config, self.pipe.vae_scale_factor).max_side
        return min(1024, max_side or 1024)

    @classmethod
    def size_rule(cls, denoiser_config, vae_scale_factor):
        """Sides divisible by VAE factor x patch size 2 (the pipeline's check), and at most the RoPE table's
        length on the height / width axes (`axes_lens`) in patches."""
        multiple = vae_scale_factor * PATCH_SIZE
        axes_lens = denoiser_config.get("axes_lens")
        if not axes_lens or len(axes_lens) < 3:
            return SizeRule(cls.family, multiple)
        grid = min(axes_lens[1], axes_lens[2])
        bound = f"axes_lens {grid} RoPE positions x patch size {PATCH_SIZE} x VAE factor {vae_scale_factor}"
        return SizeRule(cls.family, multiple, grid * multiple, bound)

    def _latent_shape(self, settings):
        f = self.pipe.vae_scale_factor
        return (self.denoiser_config.in_channels, settings.height // f, settings.width // f)

    def _initial_noise(self, n, settings, generator):
        # prepare_latents: randn_tensor(..., dtype=torch.float32) on the generator's device; kept in float32
        shape = (n, *self._latent_shape(settings))
        device = generator.device if generator is not None else self.device
        noise = torch.randn(shape, generator=generator, device=device, dtype=torch.float32)
        return noise.to(self.device)

    # ---- steps -----------------------------------------------------------------------------------

    def _schedule(self, num_steps, settings):
        from diffusers.pipelines.z_image.pipeline_z_image import calculate_shift

        config = self.pipe.scheduler.config
        f = self.pipe.vae_scale_factor
        image_seq_len = (settings.height // f // 2) * (settings.width // f // 2)
        mu = calculate_shift(
            image_seq_len,
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", 1.15),
        )
        sigmas = torch.linspace(1.0, 1 / num_steps, num_steps).tolist()  # get_default_z_image_sigmas
        return self._set_scheduler(num_steps, sigmas=sigmas, mu=mu)

    def training_guidance_scale(self, guidance_scale):
        """Z-Image's CFG is on for any guidance > 0: 0 is its CFG-free pass."""
        return 0.0

    def _predict(self, x, t, cond, encodings, settings):
        n = x.shape[0]
        guidance = settings.guidance_scale
        cfg = guidance > 0
        latents = x.to(self.dtype)
        timestep = (1000 - t) / 1000
        captions = self._captions(cond)
        if cfg:  # [cond, uncond], as the pipeline batches them
            latents, timestep = latents.repeat(2, 1, 1, 1), timestep.repeat(2)
            captions = captions + self._captions(self._negative_like(encodings, n))
        out = self.denoiser(list(latents.unsqueeze(2).unbind(dim=0)), timestep, captions, return_dict=False)[0]
        out = torch.stack([o.float() for o in out]).squeeze(2)
        if cfg:
            pos, neg = out[:n], out[n:]
            out = pos + guidance * (pos - neg)
        return -out  # the transformer predicts the negated velocity

    def _to_vae_latents(self, latents, height, width):
        return self._scale_shift(latents)

    def _from_vae_latents(self, latents, height, width):
        return self._unscale_shift(latents)

    def pipeline_call_kwargs(self, guidance_scale: float) -> dict:
        # no CFG renormalisation and no truncation (the pipeline's defaults, made explicit)
        return {
            "guidance_scale": guidance_scale,
            "max_sequence_length": self.max_sequence_length,
            "cfg_normalization": False,
            "cfg_truncation": 1.0,
        }

    # ---- the tiny model --------------------------------------------------------------------------

    @classmethod
    def tiny_pipeline(cls, seed: int = 0):
        """A ZImagePipeline: a 2-layer Qwen3 text encoder behind a byte-level Qwen2Tokenizer with a chat
        template, a transformer with one main and one refiner block of each kind, a 4-channel VAE, and a
        dynamically shifted scheduler (so the rollout's `mu` is checked against the pipeline's)."""
        from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline

        tokenizer = tiny_qwen_tokenizer()
        with tiny.Seeded(seed) as build:
            text_encoder = build(_tiny_qwen3, tokenizer, hidden=TINY_TRANSFORMER["cap_feat_dim"])
            transformer = build(_tiny_transformer)
            vae = build(tiny.vae)
        scheduler = FlowMatchEulerDiscreteScheduler(**tiny.DYNAMIC_SHIFT_SCHEDULER)
        pipe = ZImagePipeline(
            scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer
        )
        pipe.default_sample_size = tiny.TINY_IMAGE_SIZE // pipe.vae_scale_factor  # ZImagePipeline: 1024 px
        return tiny.finish(pipe)


def tiny_zimage_pipeline(seed: int = 0):
    """The `tiny-zimage` pipeline (see ZImageBackend.tiny_pipeline)."""
    return ZImageBackend.tiny_pipeline(seed)
