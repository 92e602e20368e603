"""Test helpers for the rewards: a network guard, and tiny random-weight reward backbones of the real
architecture classes, saved to a directory so that the rewards load them through their real code."""

from __future__ import annotations

import ipaddress
import json
import os
import socket
from pathlib import Path

import torch
from PIL import Image, ImageDraw, ImageFont

LOOPBACK_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost")


class NetworkBlockedError(RuntimeError):
    """A test tried to reach an address off this machine."""


def _is_loopback(host: object) -> bool:
    if not isinstance(host, str):
        return False
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False


def block_non_loopback(monkeypatch) -> None:
    """Make any socket connection (or name lookup) to a non-loopback address raise NetworkBlockedError.

    Unix sockets and 127.0.0.0/8 / ::1 / "localhost" stay allowed, so loopback servers still work.
    """
    real_connect, real_connect_ex = socket.socket.connect, socket.socket.connect_ex
    real_sendto, real_getaddrinfo = socket.socket.sendto, socket.getaddrinfo

    def check(sock: socket.socket | None, address: object) -> None:
        if sock is not None and sock.family == getattr(socket, "AF_UNIX", None):
            return
        host = address[0] if isinstance(address, tuple) else address
        if not _is_loopback(host):
            raise NetworkBlockedError(f"test tried to reach {address!r}; only loopback is allowed in tests")

    def connect(self, address):
        check(self, address)
        return real_connect(self, address)

    def connect_ex(self, address):
        check(self, address)
        return real_connect_ex(self, address)

    def sendto(self, data, *args):
        check(self, args[-1])
        return real_sendto(self, data, *args)

    def getaddrinfo(host, *args, **kwargs):
        if host is not None:
            check(None, host.decode() if isinstance(host, bytes) else host)
        return real_getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket.socket, "connect_ex", connect_ex)
    monkeypatch.setattr(socket.socket, "sendto", sendto)
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


# ---- tiny CLIP (transformers) ---------------------------------------------------------------


def byte_alphabet() -> list[str]:
    """The 256 printable stand-ins for bytes used by byte-level BPE (GPT-2 / CLIP): printable
    Latin-1 bytes map to themselves, the others to code points from 256 up, in byte order."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return [mapping[b] for b in range(256)]


def save_tiny_clip(
    directory: str | os.PathLike, *, projection_dim: int = 16, image_size: int = 32, seed: int = 0
) -> "torch.nn.Module":
    """Save a 1-layer random ``CLIPModel`` with a character-level CLIP tokenizer (no merges, 514 tokens)
    and a ``CLIPProcessor`` (OpenAI mean/std, resize + centre crop to ``image_size``) to ``directory``.
    Returns the model (eval mode)."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizer

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    alphabet = byte_alphabet()
    vocab = {tok: i for i, tok in enumerate(alphabet + [a + "</w>" for a in alphabet])}
    vocab["<|startoftext|>"], vocab["<|endoftext|>"] = len(vocab), len(vocab) + 1
    tok_dir = directory / "tokenizer_src"
    tok_dir.mkdir(exist_ok=True)
    (tok_dir / "vocab.json").write_text(json.dumps(vocab))
    (tok_dir / "merges.txt").write_text("#version: 0.2\n")
    tokenizer = CLIPTokenizer.from_pretrained(str(tok_dir))
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}
    )
    CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(str(directory))

    torch.manual_seed(seed)
    config = CLIPConfig(
        text_config=dict(
            vocab_size=len(vocab),
            hidden_size=32,
            intermediate_size=37,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=77,
            bos_token_id=vocab["<|startoftext|>"],
            eos_token_id=vocab["<|endoftext|>"],
            pad_token_id=vocab["<|endoftext|>"],
        ),
        vision_config=dict(
            image_size=image_size,
            patch_size=8,
            hidden_size=32,
            intermediate_size=37,
            num_hidden_layers=1,
            num_attention_heads=2,
        ),
        projection_dim=projection_dim,
        logit_scale_init_value=3.0,
    )
    model = CLIPModel(config).eval()
    model.save_pretrained(str(directory))
    return model


# ---- tiny DINOv2 (transformers) ------------------------------------------------------------------


def save_tiny_dinov2(directory: str | os.PathLike, *, image_size: int = 32, seed: int = 0) -> "torch.nn.Module":
    """Save a 1-layer random ``Dinov2Model`` (width 32, patch 8) and the ``BitImageProcessor`` DINOv2 checkpoints
    use (resize the short side, centre crop to ``image_size``, ImageNet mean/std) to ``directory``. Returns the model
    (eval mode)."""
    from transformers import BitImageProcessor, Dinov2Config, Dinov2Model

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    BitImageProcessor(
        size={"shortest_edge": image_size},
        crop_size={"height": image_size, "width": image_size},
        image_mean=[0.485, 0.456, 0.406],
        image_std=[0.229, 0.224, 0.225],
        do_convert_rgb=True,
    ).save_pretrained(str(directory))
    torch.manual_seed(seed)
    config = Dinov2Config(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, mlp_ratio=2, image_size=image_size, patch_size=8
    )
    model = Dinov2Model(config).eval()
    model.save_pretrained(str(directory))
    return model


# ---- tiny open_clip (HPSv2 architecture) ------------------------------------------------------

TINY_OPEN_CLIP = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "head_width": 16, "patch_size": 8},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
}


def save_tiny_hps(directory: str | os.PathLike, *, seed: int = 0) -> tuple["torch.nn.Module", str]:
    """An open_clip ``CLIP`` built from ``TINY_OPEN_CLIP`` with random weights: its config saved as
    ``directory/open_clip_config.json`` and its state dict as an HPS-style checkpoint
    (``{"state_dict": ...}``) in ``directory/HPS_v2.1_compressed.pt``. Returns (model, checkpoint path)."""
    import open_clip

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "open_clip_config.json").write_text(json.dumps({"model_cfg": TINY_OPEN_CLIP}))
    torch.manual_seed(seed)
    model = open_clip.CLIP(**json.loads(json.dumps(TINY_OPEN_CLIP))).eval()
    checkpoint = directory / "HPS_v2.1_compressed.pt"
    torch.save({"state_dict": model.state_dict()}, checkpoint)
    return model, str(checkpoint)


# ---- images --------------------------------------------------------------------------------------


def random_images(n: int, size: tuple[int, int] = (40, 40), seed: int = 0) -> list[Image.Image]:
    """``n`` RGB images of uniform noise (deterministic in ``seed``)."""
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (n, size[1], size[0], 3), generator=g, dtype=torch.uint8)
    return [Image.fromarray(p.numpy()) for p in pixels]


def render_text(text: str, size: tuple[int, int] = (360, 90), font_size: int = 40) -> Image.Image:
    """Black ``text`` on white, in DejaVu Sans when installed (else PIL's default font)."""
    image = Image.new("RGB", size, "white")
    try:
        font = ImageFont.truetype("DejaVuSans.ttf", font_size)
    except OSError:
        font = ImageFont.load_default(size=font_size)
    ImageDraw.Draw(image).text((15, (size[1] - font_size) // 2), text, fill="black", font=font)
    return image
