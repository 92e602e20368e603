"""Samples with a time axis. A video sample is a uint8 numpy array of frames [F, H, W, C] (C = 3, RGB); an image
sample stays a PIL image. This module holds what the rest of flowrl needs to treat both: telling them apart,
choosing frames evenly, the contact sheet an eval grid shows for a video (its first, middle and last frames), and
writing a video as an animation (animated WebP or GIF through Pillow; MP4 only where `imageio[ffmpeg]` is
installed, which flowrl does not require).

    is_video(sample)                          # True for a [F, H, W, C] uint8 array
    frame_indices(17, 4)                      # [0, 5, 11, 16]: first, last and evenly between
    contact_sheet(video)                      # PIL image: frames 0, F // 2, F - 1 side by side
    save_animation(video, "clip.webp", fps=8)
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

ANIMATION_FORMATS = (".webp", ".gif", ".mp4")
AGGREGATES = ("mean", "min", "max")


def is_video(sample) -> bool:
    """True for a video sample: a numpy array [F, H, W, C] (F frames); False for a PIL image or anything else."""
    return isinstance(sample, np.ndarray) and sample.ndim == 4


def as_video(frames) -> np.ndarray:
    """A video sample from frames: an array [F, H, W, C] (uint8, or float in [0, 1], which is scaled and rounded),
    or a list of F PIL images of one size. An error says what the input was instead."""
    if isinstance(frames, (list, tuple)):
        if not frames or not all(isinstance(f, Image.Image) for f in frames):
            raise ValueError("a video from a list needs one or more PIL images (its frames)")
        sizes = {f.size for f in frames}
        if len(sizes) != 1:
            raise ValueError(f"a video's frames must have one size, got {sorted(sizes)}")
        frames = np.stack([np.asarray(f.convert("RGB")) for f in frames])
    array = np.asarray(frames)
    if array.ndim != 4 or array.shape[-1] not in (1, 3, 4) or array.shape[0] < 1:
        raise ValueError(f"a video is frames [F, H, W, C] with C in (1, 3, 4), got shape {tuple(array.shape)}")
    if array.dtype != np.uint8:
        if not np.issubdtype(array.dtype, np.floating):
            raise ValueError(f"a video's frames are uint8, or floats in [0, 1]; got dtype {array.dtype}")
        array = np.round(np.clip(array, 0.0, 1.0) * 255).astype(np.uint8)
    return array


def frame_indices(num_frames: int, k: int) -> list[int]:
    """k frame indices of a video of `num_frames`, evenly spaced from the first to the last (rounded to the nearest
    frame); every frame when k >= num_frames; the first when k == 1."""
    if num_frames < 1 or k < 1:
        raise ValueError(f"frame_indices needs num_frames >= 1 and k >= 1, got {num_frames} and {k}")
    if k >= num_frames:
        return list(range(num_frames))
    if k == 1:
        return [0]
    return [int(round(i * (num_frames - 1) / (k - 1))) for i in range(k)]


def frame_image(video: np.ndarray, index: int) -> Image.Image:
    """Frame `index` of a video as an RGB PIL image."""
    frame = video[index]
    return Image.fromarray(frame[..., 0] if frame.shape[-1] == 1 else frame).convert("RGB")


def sampled_frames(videos: list, k: int) -> tuple[list[Image.Image], list[int]]:
    """The frames an image reward scores of each video: `frame_indices(F, k)` of each, as PIL images, video-major
    (all of video 0's, then video 1's, ...), and how many each video gave (k, or F when it has fewer frames)."""
    frames, counts = [], []
    for video in videos:
        picked = frame_indices(len(video), k)
        frames.extend(frame_image(video, i) for i in picked)
        counts.append(len(picked))
    return frames, counts


def aggregate(values, counts: list[int], how: str = "mean") -> np.ndarray:
    """Per-video values [B] from per-frame values [sum(counts)] (video-major): their mean, min or max over each
    video's frames; NaN frames are left out (all NaN: NaN)."""
    if how not in AGGREGATES:
        raise ValueError(f"unknown frame aggregate {how!r}; valid: {', '.join(AGGREGATES)}")
    values = np.asarray(values, dtype=np.float64).reshape(-1)
    if len(values) != sum(counts):
        raise ValueError(f"{len(values)} per-frame values for {sum(counts)} frames")
    fn = {"mean": np.nanmean, "min": np.nanmin, "max": np.nanmax}[how]
    out, start = [], 0
    for n in counts:
        chunk = values[start : start + n]
        start += n
        out.append(np.nan if np.isnan(chunk).all() else fn(chunk))
    return np.asarray(out, dtype=np.float32)


def contact_sheet(video: np.ndarray, pad: int = 1, background=(255, 255, 255)) -> Image.Image:
    """A video's first, middle and last frames side by side, `pad` pixels apart (one frame: that frame alone; two:
    both): what an eval grid shows in place of a video."""
    video = as_video(video)
    picked = list(dict.fromkeys([0, len(video) // 2, len(video) - 1]))
    frames = [frame_image(video, i) for i in picked]
    w, h = frames[0].size
    sheet = Image.new("RGB", (len(frames) * w + (len(frames) - 1) * pad, h), background)
    for k, frame in enumerate(frames):
        sheet.paste(frame, (k * (w + pad), 0))
    return sheet


def mp4_available() -> bool:
    """Whether MP4 can be written here: imageio with its ffmpeg plugin (imageio-ffmpeg) is installed."""
    try:
        import imageio.v3  # noqa: F401
        import imageio_ffmpeg  # noqa: F401
    except ImportError:
        return False
    return True


def save_animation(video, path, fps: float = 8.0) -> Path:
    """Write a video (see `as_video`) to `path` as an animation looping forever: .webp (animated WebP, lossless)
    or .gif through Pillow, .mp4 through imageio[ffmpeg] (an error saying how to install it when missing).
    Written to a temporary name and renamed, so a reader never sees half a file. Returns the path."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in ANIMATION_FORMATS:
        raise ValueError(
            f"cannot write a video as {suffix or '(no extension)'!r}; valid: {', '.join(ANIMATION_FORMATS)}"
        )
    if fps <= 0:
        raise ValueError(f"fps must be > 0, got {fps}")
    video = as_video(video)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.stem + ".tmp" + suffix)
    if suffix == ".mp4":
        if not mp4_available():
            raise ImportError(
                "writing MP4 needs imageio with ffmpeg: pip install 'imageio[ffmpeg]'; or write .webp "
                "or .gif, which need nothing more"
            )
        import imageio.v3 as iio

        iio.imwrite(tmp, video if video.shape[-1] == 3 else video[..., :3], fps=fps, codec="libx264")
    else:
        frames = [frame_image(video, i) for i in range(len(video))]
        options = {"lossless": True} if suffix == ".webp" else {}
        frames[0].save(
            tmp, save_all=True, append_images=frames[1:], duration=max(1, round(1000 / fps)), loop=0, **options
        )
    tmp.replace(path)
    return path


def animation_suffix(prefer: str = ".webp") -> str:
    """The animation format to write: `prefer` (".webp", ".gif" or ".mp4"), but ".webp" when MP4 is preferred and
    imageio[ffmpeg] is not installed."""
    if prefer not in ANIMATION_FORMATS:
        raise ValueError(f"unknown animation format {prefer!r}; valid: {', '.join(ANIMATION_FORMATS)}")
    return ".webp" if prefer == ".mp4" and not mp4_available() else prefer
