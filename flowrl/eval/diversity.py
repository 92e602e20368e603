"""Diversity of what a model draws where the prompt leaves it free, against the base model.

RL on a reward can narrow a model: asked for "a square" with no colour, a trained model may draw it red far
more often than the base model did, a drift the reward never sees and accuracy hides. A reward reports, per
image, how many of the things the prompt left free came out with each value, as components named

    "free_<attribute>=<value>"        e.g. shapes_geneval's "free_color=red": [n] counts per image

(for each object whose colour the prompt does not fix, +1 to the count of its detected colour). Summed over an
eval's images they make a distribution p over the values; `distribution_metrics` reports its entropy (bits) and,
given the base model's distribution q (the first eval, before training), the total variation distance
TV(p, q) = 1/2 sum_v |p_v - q_v|, the share of the mass that moved to other values (0: unchanged, 1: disjoint).
Entropy alone hides a drift that keeps the spread: from mostly green to mostly red is no entropy change.
The base model need not draw its free things as they should be drawn (the shapes model draws a free colour
yellow a third of the time where its world draws each of four colours a quarter), and a model that learns its
world moves away from the base's there too: with eval.free_reference (`uniform`, or a distribution per attribute)
the distance from the distribution they should follow is reported as well.

For models whose free attributes no reward counts, `feature_metrics` measures the same in a vision backbone's
feature space (eval.diversity_features): how far apart each prompt's images are (`feature_spread`), against the
base model's, and how far they moved from the base model's images of the prompt (`energy_distance`).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import warnings
from pathlib import Path

import torch

#: a reward component that counts, per image, the free attribute's values: "<reward>/free_<attribute>=<value>"
COUNT_RE = re.compile(r"^(?P<reward>.+)/free_(?P<attr>[A-Za-z0-9_]+)=(?P<value>[^/]+)$")


def is_count(name: str) -> bool:
    """Whether a score's name is a free-attribute count (summed into a distribution, not averaged)."""
    return COUNT_RE.match(name) is not None


def histograms(scores: dict[str, torch.Tensor]) -> dict[str, dict[str, float]]:
    """{"<reward>/<attribute>": {value: total count over the images}} from the count components of `scores`."""
    out: dict[str, dict[str, float]] = {}
    for name, values in scores.items():
        m = COUNT_RE.match(name)
        if m:
            counts = out.setdefault(f"{m['reward']}/{m['attr']}", {})
            counts[m["value"]] = counts.get(m["value"], 0.0) + float(torch.as_tensor(values, dtype=torch.float64).sum())
    return out


def normalised(counts: dict[str, float]) -> dict[str, float]:
    total = sum(counts.values())
    return {v: c / total for v, c in counts.items()} if total > 0 else {}


def entropy_bits(p: dict[str, float]) -> float:
    """H(p) = -sum_v p_v log2 p_v (0 log 0 = 0)."""
    return -sum(x * math.log2(x) for x in p.values() if x > 0)


def total_variation(p: dict[str, float], q: dict[str, float]) -> float:
    """TV(p, q) = 1/2 sum_v |p_v - q_v| over the values of either (a missing value has probability 0)."""
    return 0.5 * sum(abs(p.get(v, 0.0) - q.get(v, 0.0)) for v in set(p) | set(q))


def distribution_metrics(
    hists: dict[str, dict[str, float]],
    base: dict[str, dict[str, float]] | None = None,
    prefix: str = "eval/diversity/",
    reference: str | dict[str, dict[str, float]] | None = None,
) -> dict[str, float]:
    """For every "<reward>/<attribute>" histogram: its entropy in bits, the number of free things counted, with
    `base` (the same keys, counts or probabilities) the total variation distance from the base's distribution
    (`..._tv_from_base`), and with `reference` (eval.free_reference, see `reference_distributions`) the distance
    from the distribution the free things should follow (`..._tv_from_reference`). An attribute with nothing
    counted reports nothing."""
    out = {}
    refs = reference_distributions(reference, hists)
    for key, counts in sorted(hists.items()):
        p = normalised(counts)
        if not p:
            continue
        out[f"{prefix}{key}_entropy_bits"] = entropy_bits(p)
        out[f"{prefix}{key}_count"] = sum(counts.values())
        q = normalised((base or {}).get(key, {}))
        if q:
            out[f"{prefix}{key}_tv_from_base"] = total_variation(p, q)
        if key in refs:
            out[f"{prefix}{key}_tv_from_reference"] = total_variation(p, refs[key])
    return out


#: eval.free_reference's value for "every value a reward counts equally likely"
UNIFORM = "uniform"


def _read_free_reference(spec: str) -> tuple[dict | None, list[str]]:
    """eval.free_reference's JSON file -> (its mapping, []) or (None, what is wrong)."""
    what = (
        f"eval.free_reference={spec!r}: expected '' (off), '{UNIFORM}', or a JSON file of "
        '{"<reward>/<attribute>": {"<value>": weight, ...}} (e.g. {"shapes_geneval/color": {"red": 1, "blue": 1}})'
    )
    path = Path(spec)
    if not path.is_file():
        return None, [f"{what}; no such file"]
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return None, [f"{what}; it does not read as JSON ({e})"]
    if not isinstance(data, dict) or not data:
        return None, [f"{what}; it holds {type(data).__name__} {str(data)[:60]}"]
    problems = []
    for key, dist in data.items():
        if not isinstance(dist, dict) or not dist:
            problems.append(f"{what}; {key!r} maps to {str(dist)[:60]}, not a mapping of values to weights")
            continue
        bad = {
            v: w
            for v, w in dist.items()
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0
        }
        if bad:
            problems.append(f"{what}; {key!r} has weights that are not finite numbers >= 0: {bad}")
        elif sum(dist.values()) <= 0:
            problems.append(f"{what}; {key!r}'s weights sum to 0")
    return (None, problems) if problems else (data, [])


def free_reference_problems(spec: str) -> list[str]:
    """What is wrong with eval.free_reference (empty: nothing): "" (off), "uniform", or a JSON file of
    {"<reward>/<attribute>": {"<value>": weight >= 0, ...}, ...} with a positive total per attribute."""
    return [] if spec in ("", UNIFORM) else _read_free_reference(spec)[1]


def load_free_reference(spec: str) -> str | dict[str, dict[str, float]] | None:
    """eval.free_reference -> None (off), "uniform", or the JSON file's {"<reward>/<attribute>": {value: weight}}
    (checked: `free_reference_problems`; a ValueError names what is wrong)."""
    if spec in ("", UNIFORM):
        return spec or None
    data, problems = _read_free_reference(spec)
    if problems:
        raise ValueError("; ".join(problems))
    return {k: {v: float(w) for v, w in d.items()} for k, d in data.items()}


def reference_distributions(
    reference: str | dict[str, dict[str, float]] | None, hists: dict[str, dict[str, float]]
) -> dict[str, dict[str, float]]:
    """The distribution each counted attribute of `hists` should follow, by eval.free_reference: "uniform" gives
    every value the reward reports for it (counted or not: a reward lists every value it can report) probability
    1 / their number; a mapping gives its own weights, normalised, for the attributes it names. An attribute the
    mapping names and no reward counts is warned about, with the ones counted (a misspelt name would otherwise
    report nothing; Python's warning registry shows the same message once)."""
    if not reference:
        return {}
    if reference == UNIFORM:
        return {k: {v: 1.0 / len(c) for v in c} for k, c in hists.items() if c}
    missing = sorted(k for k in reference if k not in hists)
    if missing and hists:
        warnings.warn(
            f"eval.free_reference names {missing}, which no reward of this eval counts; the counted ones: "
            f"{sorted(hists)}",
            stacklevel=3,
        )
    return {k: normalised(d) for k, d in reference.items() if k in hists}


#: the text settings a text eval's greedy completions depend on (beside the prompts)
TEXT_EVAL_KEYS = ("max_new_tokens", "max_prompt_length", "chat_template", "tool_env", "tool_stop", "max_turns")


def eval_settings(prompts: list[str], metadata: list[dict], eval_cfg, sample_cfg, text_cfg=None) -> dict:
    """What an eval's images depend on besides the weights, for telling whether a stored base-model eval can be
    compared with this one: the prompts as listed (with their metadata, as `eval_plan` lays them out; a digest),
    the ODE steps, the CFG scale, the noise seed, the images per listed prompt and the size. Two evals with the same
    settings draw the same initial noise for the same prompts, so the base model's images pair with the trained
    model's. `text_cfg` (a text run's): the text settings its completions depend on (`TEXT_EVAL_KEYS`) too."""
    listed = json.dumps([prompts, metadata], sort_keys=True, default=str, ensure_ascii=False)
    text = {f"text.{k}": getattr(text_cfg, k) for k in TEXT_EVAL_KEYS} if text_cfg is not None else {}
    return {
        **text,
        "prompts": f"{len(prompts)} listed, sha256 {hashlib.sha256(listed.encode()).hexdigest()[:16]}",
        "eval.num_steps": eval_cfg.num_steps,
        "eval.guidance_scale": eval_cfg.guidance_scale,
        "eval.seed": eval_cfg.seed,
        "images per listed prompt": eval_cfg.images_per_prompt,
        "sample.height": getattr(sample_cfg, "height", None),
        "sample.width": getattr(sample_cfg, "width", None),
        "sample.num_frames": getattr(sample_cfg, "num_frames", None),
    }


def settings_differences(stored: dict | None, now: dict) -> list[str]:
    """The settings in which a stored base-model eval differs from this eval, as "<key>: <base's> (base) vs
    <this one's>" (empty: comparable). A base file from before flowrl recorded its settings (`stored` None) is
    taken as comparable."""
    if stored is None:
        return []
    return [
        f"{k}: {stored.get(k)!r} (base) vs {now.get(k)!r}"
        for k in sorted(set(stored) | set(now))
        if stored.get(k) != now.get(k)
    ]


class BaseDistribution:
    """The base model's free-attribute histograms, kept in the run directory (`eval-base-distribution.json`):
    written by the first evaluation that counts anything (the one before training, when eval.before is on) and
    read by the later ones, also after a resume. The file holds {"histograms": ..., "settings": `eval_settings`}
    (files written before the settings were recorded hold the histograms alone)."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / "eval-base-distribution.json"

    def _read(self) -> dict | None:
        if not self.path.exists():
            return None
        data = json.loads(self.path.read_text())
        if isinstance(data.get("histograms"), dict):
            return data
        return {"histograms": data, "settings": None}

    def load(self) -> dict[str, dict[str, float]] | None:
        data = self._read()
        return None if data is None else data["histograms"]

    def settings(self) -> dict | None:
        """The `eval_settings` of the eval that wrote the file (None: no file, or one that did not record them)."""
        data = self._read()
        return None if data is None else data.get("settings")

    def save(self, hists: dict[str, dict[str, float]], settings: dict | None = None) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"histograms": hists, "settings": settings}, indent=1, sort_keys=True))
        tmp.replace(self.path)


class BaseMetrics:
    """The base model's eval metrics, kept beside its other base-model files (`eval-base-metrics.json`): written by
    every eval of the base model that keeps its files (the one before training, `flowrl eval` of the base model
    with --out), whatever its rewards count, so that a later eval of a checkpoint (`flowrl eval --checkpoint`)
    prints its means beside the base's. The file holds {"metrics": {"eval/...": number}, "settings":
    `eval_settings`}."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / "eval-base-metrics.json"

    def _read(self) -> dict | None:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) and isinstance(data.get("metrics"), dict) else None

    def load(self) -> dict | None:
        data = self._read()
        return None if data is None else data["metrics"]

    def settings(self) -> dict | None:
        data = self._read()
        return None if data is None else data.get("settings")

    def save(self, metrics: dict, settings: dict | None = None) -> None:
        numbers = {k: v for k, v in metrics.items() if k.startswith("eval/") and isinstance(v, (int, float))}
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"metrics": numbers, "settings": settings}, indent=1, sort_keys=True))
        tmp.replace(self.path)


# ---------------------------------------------------------------------------------------------------------------
# Feature-space diversity (eval.diversity_features): for models whose free attributes no reward counts.
#
# A vision backbone (DINOv2, CLIP) embeds every eval image as an L2-normalised feature; the images of one prompt
# (its eval.images_per_prompt images, or its share of eval.images_per_group) form a set. Per prompt:
#   spread     the mean cosine distance 1 - <x, y> over the set's distinct pairs: how different a prompt's images
#              are from each other;
#   distance   the energy distance (Euclidean) between the set and the base model's set of the same prompt.
# Averaged over the prompts, they become `feature_metrics`. The base sets are those of the first eval, before
# training (`BaseFeatures`, in the run directory).


#: a base spread below this is identical images at float32 rounding (|<f, f> - 1| ~ 1e-7): no ratio to it
MIN_BASE_SPREAD = 1e-6


def feature_spread(f: torch.Tensor) -> float:
    """The mean pairwise cosine distance of one prompt's images.

    f: [n, D] L2-normalised features, n >= 2 -> mean over the n(n-1)/2 pairs i < j of 1 - <f_i, f_j>, in [0, 2]
    (0: n identical images). Computed in float64."""
    if f.ndim != 2 or f.shape[0] < 2:
        raise ValueError(f"feature_spread needs [n, D] features of n >= 2 images, got shape {tuple(f.shape)}")
    f = f.to(torch.float64)
    n = f.shape[0]
    gram = f @ f.T  # [n, n]
    off_diagonal = gram.sum() - gram.diagonal().sum()  # 2 x the pairs' <f_i, f_j>
    return float(1.0 - off_diagonal / (n * (n - 1)))


def energy_distance(f: torch.Tensor, g: torch.Tensor) -> float:
    """The energy distance between two sets of features of one prompt (e.g. the trained model's and the base
    model's images), with the Euclidean distance d(x, y) = |x - y| (on unit vectors sqrt(2 (1 - <x, y>))):

        2 E d(X, Y) - E d(X, X') - E d(Y, Y')

    f: [n, D], g: [m, D] L2-normalised (n, m >= 1) -> a float >= 0; 0 for two equal sets, and it grows as one set
    moves away from the other. With the Euclidean distance it is 0 only when the two distributions are the same
    (Szekely and Rizzo): it sees a narrowing or a split that keeps the mean feature, which the cosine distance
    1 - <x, y> (= |x - y|^2 / 2, whose energy distance is only |mean f - mean g|^2) would not.

    The form: every expectation is a mean over all pairs (the V-statistic: E d(X, X') over the n^2 pairs of f, its n
    zero self-pairs included), not the unbiased form (within-set means over the n(n-1) distinct pairs). flowrl's evals
    draw the trained and the base images from the same noise, so the sets are paired, not independent draws: at
    step 0 they are the same images, where this form gives exactly 0 and the unbiased one a negative value
    (-(E_f/n + E_g/m) with E the mean distance of distinct pairs). This form is never negative. The distances are
    taken from the differences (not from 1 - <x, y>, whose rounding the square root would blow up near 0), in
    float64."""
    if f.ndim != 2 or g.ndim != 2 or not len(f) or not len(g) or f.shape[1] != g.shape[1]:
        raise ValueError(
            f"energy_distance needs [n, D] and [m, D] features with n, m >= 1 and the same D, got "
            f"shapes {tuple(f.shape)} and {tuple(g.shape)}"
        )
    f, g = f.to(torch.float64), g.to(torch.float64)

    def mean_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # E |a_i - b_j|, [n, m]
        return torch.cdist(a, b, compute_mode="donot_use_mm_for_euclid_dist").mean()

    return max(0.0, float(2.0 * mean_distance(f, g) - mean_distance(f, f) - mean_distance(g, g)))


def prompt_keys(prompts: list[str], metadata: list[dict], images_per_prompt: int) -> list[str]:
    """The prompt each eval image belongs to [P * n], prompt-major as the evals lay their images out: the prompt
    with its metadata row (an edit's source image, GenEval's objects), so that one instruction on two source
    images is two prompts, and a prompt listed several times (eval.images_per_group) is one."""
    keys = [json.dumps([p, m], sort_keys=True, default=str, ensure_ascii=False) for p, m in zip(prompts, metadata)]
    return [k for k in keys for _ in range(images_per_prompt)]


def group_features(features: torch.Tensor, keys: list[str]) -> dict[str, torch.Tensor]:
    """features [N, D] and their prompts' keys [N] -> {key: [n_key, D]}, in order of first appearance."""
    if len(features) != len(keys):
        raise ValueError(f"{len(features)} features for {len(keys)} prompt keys")
    rows: dict[str, list[int]] = {}
    for i, k in enumerate(keys):
        rows.setdefault(k, []).append(i)
    return {k: features[idx] for k, idx in rows.items()}


def feature_metrics(
    groups: dict[str, torch.Tensor],
    base: dict[str, torch.Tensor] | None = None,
    prefix: str = "eval/diversity/features/",
) -> dict[str, float]:
    """The feature-space diversity of an eval's images, {prompt key: [n, D] L2-normalised features}:
      spread              the mean over prompts (of >= 2 images) of `feature_spread`;
    with `base` (the base model's {key: [m, D]}), over the prompts it holds (others are left out):
      spread_from_base    sum of their spreads / sum of the base's spreads of the same prompts: the ratio of mean
                          spreads, 1 = as diverse as the base model, below 1 = narrowed (left out when the base's
                          images of each of those prompts were identical: mean spread < MIN_BASE_SPREAD);
      distance_from_base  the mean over those prompts of `energy_distance`(trained, base)."""
    spreads = {k: feature_spread(f) for k, f in groups.items() if len(f) >= 2}
    out: dict[str, float] = {}
    if spreads:
        out[f"{prefix}spread"] = sum(spreads.values()) / len(spreads)
    shared = [k for k in groups if base is not None and k in base]
    if not shared:
        return out
    paired = [k for k in shared if k in spreads and len(base[k]) >= 2]
    base_total = sum(feature_spread(base[k]) for k in paired)
    if paired and base_total >= MIN_BASE_SPREAD * len(paired):
        out[f"{prefix}spread_from_base"] = sum(spreads[k] for k in paired) / base_total
    out[f"{prefix}distance_from_base"] = sum(energy_distance(groups[k], base[k]) for k in shared) / len(shared)
    return out


class BaseFeatures:
    """The base model's eval features per prompt, kept in the run directory (`eval-base-features.safetensors`):
    written by the first evaluation before training (optimizer_steps == 0) and read by the later ones, also after a
    resume. Tensor "<i>" holds the features [n_i, D] of prompt i of the metadata's "prompts" (a JSON list of
    `prompt_keys`); "backbone" names the encoder (eval.diversity_features) that embedded them, "settings" the
    `eval_settings` of the eval that sampled the images (absent from files written before they were recorded)."""

    NAME = "eval-base-features.safetensors"

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / self.NAME

    def exists(self) -> bool:
        return self.path.exists()

    def load(self) -> tuple[dict[str, torch.Tensor], str] | None:
        """({prompt key: [n, D] float32}, backbone), or None when there is no file."""
        if not self.path.exists():
            return None
        from safetensors import safe_open

        with safe_open(str(self.path), framework="pt") as f:
            meta = f.metadata() or {}
            keys = json.loads(meta.get("prompts", "[]"))
            groups = {k: f.get_tensor(str(i)) for i, k in enumerate(keys)}
        return groups, meta.get("backbone", "")

    def settings(self) -> dict | None:
        """The `eval_settings` of the eval that wrote the file (None: no file, or one that did not record them)."""
        if not self.path.exists():
            return None
        from safetensors import safe_open

        with safe_open(str(self.path), framework="pt") as f:
            stored = (f.metadata() or {}).get("settings")
        return None if stored is None else json.loads(stored)

    def save(self, groups: dict[str, torch.Tensor], backbone: str, settings: dict | None = None) -> None:
        """Atomically (a temporary file, then a rename)."""
        from safetensors.torch import save_file

        keys = list(groups)
        tensors = {str(i): groups[k].detach().to("cpu", torch.float32).contiguous() for i, k in enumerate(keys)}
        tmp = self.path.with_name(self.path.name.replace(".safetensors", ".tmp.safetensors"))
        metadata = {"prompts": json.dumps(keys, ensure_ascii=False), "backbone": backbone}
        if settings is not None:
            metadata["settings"] = json.dumps(settings)
        save_file(tensors, str(tmp), metadata=metadata)
        tmp.replace(self.path)
