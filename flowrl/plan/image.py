"""The plan of an image run: the family's pipeline built on meta, its LoRA, what the objective and the rewards add,
the trajectory and prompt cache the rollout leaves, one update sample's activations and the rollout's peak."""

from __future__ import annotations

import copy

from .activations import activation_bytes, activation_terms, block_params, denoiser_layers
from .budget import Training, batch_shape, finish, training_rows
from .columns import columns, spread
from .declarations import GENERIC_LAYOUT, NOT_CALIBRATED, Calibration, Layout
from .models import (
    DTYPE_BYTES,
    PlanError,
    check_local_model,
    family_of,
    feature_components,
    inject_lora,
    lora_parameters,
    pipeline_components,
    reward_components,
)
from .report import Plan, RolloutEstimate, Row, UpdateEstimate
from .shapes import config_dict, image_shape, prompt_file, vae_decode_bytes


def denoiser_declarations(fam, class_name: str) -> tuple[Layout, Calibration, str | None]:
    """(layout, calibration, note) of the denoiser class `class_name` that family `fam` trains: what the family
    declares (`plan_layout`, `plan_calibration`) when it is the family's `denoiser_class`; for another class (a model
    of the user's own under the family's pipeline) the generic layout and uncalibrated factors, and a note saying so.
    A family that declares none is a PlanError naming what is missing."""
    missing = [name for name in ("plan_layout", "plan_calibration") if not hasattr(fam, name)]
    if missing:
        raise PlanError(
            f"family {fam.family!r} declares no {' and no '.join(missing)} for flowrl plan: add them to "
            f"its backend class (docs/new_model.md)"
        )
    if class_name == fam.denoiser_class:
        return fam.plan_layout, fam.plan_calibration, None
    return (
        GENERIC_LAYOUT,
        NOT_CALIBRATED,
        (
            f"the denoiser is a {class_name}, not the {fam.denoiser_class} the {fam.family} family declares a layout "
            f"for: its layers are read by the names diffusers' transformers share (flowrl.plan.declarations."
            f"GENERIC_LAYOUT), its activations with uncalibrated factors"
        ),
    )


def plan_image(cfg, gpus: int, gpu_memory_gib: float) -> Plan:
    """The plan of an image run (`cfg.backend` "image") on `gpus` GPUs of `gpu_memory_gib` GiB."""
    m, s, t = cfg.model, cfg.sample, cfg.train
    fam = family_of(m.path, m.family)
    check_local_model(cfg)  # what train refuses of a local directory (model.variant's files, ...), plan refuses
    local, minibatch, micro = batch_shape(cfg, gpus)
    dtype, b = m.dtype, DTYPE_BYTES[m.dtype]
    skip = fam.t5_components if m.drop_t5 else ()
    pipeline_class, parts, source = pipeline_components(m.path, dtype, skip=skip)
    components = {c.name: c for c in parts}
    if fam.denoiser_attr not in components:
        raise PlanError(f"{m.path}: its pipeline has no {fam.denoiser_attr} ({fam.denoiser_class}) to train")
    den = components[fam.denoiser_attr]
    rewards, notes = reward_components(cfg.rewards)
    features, feature_notes = feature_components(cfg.eval.diversity_features)
    rewards, notes = rewards + features, notes + feature_notes  # placed as rewards are: off the GPU with offload
    layout, cal, generic = denoiser_declarations(fam, den.class_name)
    if generic:
        notes.append(generic)

    targets = list(cfg.lora.target_modules or fam.lora_targets)
    if cfg.lora.enabled:  # the adapters go into a copy: the built modules are shared
        den_module, adapted = inject_lora(copy.deepcopy(den.module), cfg.lora.rank, cfg.lora.alpha, targets)
        n_trained = lora_parameters(den_module)
    else:
        den_module, adapted, n_trained = den.module, {}, den.params
    from flowrl.objectives import get_objective

    cfg_rows = 2 if (fam.uses_cfg_encodings and s.guidance_scale > 1) else 1  # the rollout's rows per image
    obj = get_objective(t.objective).memory_terms(cfg, cfg_rows, fam.uses_cfg_encodings)
    if obj.unit == "pairs":  # a micro-batch counts pairs, the winners: at most the groups of a GPU's batch
        minibatch = min(minibatch, local // s.group_size)
        micro = min(micro, minibatch)
    tr = Training(
        n_trained,
        f"LoRA r{cfg.lora.rank} on {len(adapted)} layers" if cfg.lora.enabled else None,
        "float32" if cfg.lora.enabled else dtype,
        t.ema_decay > 0,
        (0.0 if cfg.lora.enabled else den.weight_bytes) if obj.reference else None,
        block_params(den.module, layout.blocks) * b,
        t.optimizer,
    )
    cols = columns(cfg, n_trained, gpus)

    # what the rollout leaves on the GPU for the update: the trajectory and the prompt encodings
    try:
        frames = fam.check_num_frames(s.num_frames)
    except ValueError as e:
        raise PlanError(str(e)) from None
    d = cfg.data
    sources = {d.train_prompts: d.prompt_column}
    if d.eval_prompts:
        sources.setdefault(d.eval_prompts, d.eval_prompt_column or d.prompt_column)
    files = [prompt_file(f, d.image_column, column) for f, column in sources.items()]
    counted, most = [n for n, _ in files], [k for _, k in files] if fam.condition_images[1] else []
    shape = image_shape(
        components,
        fam.denoiser_attr,
        s.height,
        s.width,
        s.max_sequence_length,
        frames,
        fam,
        max(most) if most and None not in most else None,
    )
    kept = obj.latents_kept  # GRPO keeps every step's latents, the forward-process objectives the final ones
    trajectory = local * (kept * shape.latent_elements + shape.condition_elements) * b
    trajectory += local * obj.means_kept * shape.latent_elements * 4  # the transition means (float32), if kept
    n_prompts = min(1024, sum(counted)) if None not in counted else 1024  # ImageBackend's prompt_cache_size
    prompt_cache = n_prompts * shape.text_tokens * shape.text_width * b

    # one micro-batch sample: K trained steps stacked along the batch, doubled by CFG
    layers = denoiser_layers(
        den_module,
        layout,
        image_tokens=shape.image_tokens,
        text_tokens=shape.text_tokens,
        levels=shape.levels,
        lora_targets=adapted,
    )
    terms = activation_terms(layers, dtype)
    update = UpdateEstimate(
        den.class_name,
        cal,
        dtype,
        obj.rows,
        terms,
        activation_bytes(terms, cal, dtype),
        n_trained * DTYPE_BYTES[tr.dtype],
        0.0,
    )

    # the rollout, without gradients: `chunk` images through the denoiser (their CFG rows), then the VAE decoder
    chunk = s.rollout_batch_size or local
    if obj.whole_groups:  # whole groups per call, as ImagePolicy.rollout makes them
        chunk = max(s.group_size, chunk - chunk % s.group_size)
    phases = {"denoiser": (cfg_rows * cal.gamma * b * terms.units_checkpointed, False)}
    if "vae" in components:
        decode = vae_decode_bytes(config_dict(components["vae"].module), s.height, s.width, b)
        if decode is None:
            notes.append(f"the VAE decode ({components['vae'].class_name}) of the rollout is not estimated")
        else:
            phases["VAE decode"] = (decode, True)
    rollout = RolloutEstimate(min(chunk, local), phases)

    rows = [
        Row(
            f"{fam.denoiser_attr} ({den.class_name})", den.params / 1e9, spread(cols, den.weight_bytes, gpus, "weights")
        )
    ]
    off_gpu = [c for c in parts if c.name != fam.denoiser_attr] + rewards  # no strategy shards them; offload moves them
    rows += [
        Row(
            f"{c.name} ({c.class_name})",
            c.params / 1e9,
            spread(cols, c.weight_bytes, gpus, offloaded=True),
            "" if c.dtype == dtype else c.dtype,
        )
        for c in off_gpu
    ]
    rows += training_rows(tr, cols, gpus)
    for name in obj.shadows:  # NFT's old policy, AWM's EMA policy: a second adapter, or a frozen copy
        if cfg.lora.enabled:
            rows.append(
                Row(
                    f"{t.objective}: shadow adapter '{name}' (float32)",
                    None,
                    spread(cols, 4 * n_trained, gpus, "weights"),
                )
            )
        else:
            rows.append(
                Row(
                    f"{t.objective}: shadow policy '{name}', a frozen copy",
                    None,
                    spread(cols, den.weight_bytes, gpus, "weights"),
                )
            )
    rows.append(
        Row(
            f"trajectory latents ({local} samples x {kept}"
            + (", with their conditions" if shape.condition_elements else "")
            + ")",
            None,
            spread(cols, trajectory, gpus),
        )
    )
    if obj.reference_cached:
        cached = local * obj.reference_cached * shape.latent_elements * 4
        what, per = obj.reference_cached_what
        rows.append(
            Row(
                f"reference {what} kept for the epoch ({local} samples x {obj.reference_cached} {per}, float32)",
                None,
                spread(cols, cached, gpus),
            )
        )
    rows.append(Row(f"prompt-encoding cache ({n_prompts} prompts)", None, spread(cols, prompt_cache, gpus)))

    rows_note = obj.rows_note
    lora = (
        f"LoRA r{cfg.lora.rank} alpha {cfg.lora.alpha:g} on {', '.join(targets)}"
        if cfg.lora.enabled
        else f"full fine-tuning of the {fam.denoiser_attr} (weights, gradients, AdamW in {dtype})"
    )
    size = f"{s.height}x{s.width} px" if not fam.video else f"{frames} frames of {s.height}x{s.width} px"
    if shape.sources:
        size += f" and {shape.sources} conditioning image{'s' if shape.sources > 1 else ''}" + (
            ""
            if fam.condition_images[0] == fam.condition_images[1]
            else " (the most the family takes)"
            if not most or None in most
            else " (the most a prompt has)"
        )
    facts = [
        ("model", f"{m.path} ({fam.family}, {pipeline_class}; configuration: {source})"),
        (
            "update",
            f"{lora}; {dtype}; {size} = {shape.image_tokens} image + {shape.text_tokens} "
            f"text tokens; {rows_note}; {obj.reference_note}",
        ),
        (
            "batch",
            f"{local} samples per GPU per epoch, minibatch {minibatch}"
            + (" pairs (a winner with its loser)" if obj.unit == "pairs" else "")
            + f", micro-batch {micro}, "
            f"gradient checkpointing {'on' if t.gradient_checkpointing else 'off'}",
        ),
        ("GPUs", f"{gpus} x {gpu_memory_gib:g} GiB"),
    ]
    notes.append(f"activations of {den.class_name}: {cal.measured}")
    host = sum(c.weight_bytes for c in off_gpu) + tr.host_bytes()
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
        obj.unit,
    )
