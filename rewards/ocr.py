"""OCR reward (Flow-GRPO's text-rendering task): the target is the text between the first pair of double
quotes in the prompt; the image is OCR'd; with whitespace removed and both lower-cased,

    d = 0 if target in recognised else Levenshtein(recognised, target)
    reward = 1 - min(d, n) / n,        n = len(target)

Engines: Tesseract (``pytesseract`` + Debian's ``tesseract-ocr``, CPU; the default) or PaddleOCR (the
optional package ``paddleocr``, as in Flow-GRPO)."""

from __future__ import annotations

import re
from typing import Callable

import numpy as np
import torch

from rewards._common import check_images, require
from rewards.memory import NOTHING, Held, NotEstimated
from rewards.registry import IMAGE, register

_QUOTED = re.compile(r'["\u201c](.*?)["\u201d]', re.DOTALL)


def levenshtein(a: str, b: str) -> int:
    """Edit distance: the fewest single-character insertions, deletions and substitutions turning
    ``a`` into ``b`` (Wagner–Fischer, two rows, O(len(a)·len(b)))."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))  # distances from a[:0] to every prefix of b
    for i, ca in enumerate(a, start=1):
        current = [i]
        for j, cb in enumerate(b, start=1):
            current.append(
                min(
                    previous[j] + 1,  # delete ca
                    current[j - 1] + 1,  # insert cb
                    previous[j - 1] + (ca != cb),
                )
            )  # substitute (free if equal)
        previous = current
    return previous[-1]


def quoted_target(prompt: str) -> str:
    """The text between the first pair of double quotes (straight or curly) of ``prompt``."""
    match = _QUOTED.search(prompt)
    if match is None:
        raise ValueError(
            f"the ocr reward needs the target text in double quotes in the prompt, as in "
            f"'a sign that says \"OPEN\"'; got prompt {prompt!r}"
        )
    return match.group(1)


def _normalise(text: str) -> str:
    return "".join(text.split()).lower()


def ocr_distance(recognised: str, target: str) -> int:
    """``d``: 0 if the normalised target is a substring of the normalised OCR text, else their
    Levenshtein distance."""
    recognised, target = _normalise(recognised), _normalise(target)
    return 0 if target in recognised else levenshtein(recognised, target)


def ocr_score(recognised: str, target: str) -> float:
    """``1 - min(d, n) / n`` with ``n`` the normalised target length (in [0, 1])."""
    n = len(_normalise(target))
    if n == 0:
        raise ValueError(f"the quoted target text is empty after removing whitespace: {target!r}")
    return 1.0 - min(ocr_distance(recognised, target), n) / n


class TesseractEngine:
    """``image -> text`` with Tesseract. ``config`` defaults to page segmentation mode 11 (sparse text:
    as much text as possible, in no particular order), which suits text anywhere in a picture."""

    def __init__(self, lang: str = "eng", config: str = "--psm 11"):
        self.pytesseract = require("pytesseract", extra="ocr", package="pytesseract", purpose="the ocr reward")
        try:
            self.pytesseract.get_tesseract_version()
        except self.pytesseract.TesseractNotFoundError as e:
            raise RuntimeError(
                "the ocr reward's tesseract engine needs the tesseract binary: "
                "apt-get install tesseract-ocr (or brew install tesseract)"
            ) from e
        self.lang, self.config = lang, config

    def __call__(self, image) -> str:
        return self.pytesseract.image_to_string(image, lang=self.lang, config=self.config)


class PaddleEngine:
    """``image -> text`` with PaddleOCR, keeping lines recognised with confidence > 0 (Flow-GRPO's rule)."""

    def __init__(self, lang: str = "en"):
        paddleocr = require(
            "paddleocr", extra="paddleocr", package="paddleocr", purpose="the ocr reward's paddle engine"
        )
        try:  # PaddleOCR 3.x
            self.ocr = paddleocr.PaddleOCR(
                lang=lang, use_doc_orientation_classify=False, use_doc_unwarping=False, use_textline_orientation=False
            )
        except (TypeError, ValueError):  # PaddleOCR 2.x
            self.ocr = paddleocr.PaddleOCR(use_angle_cls=False, lang=lang, show_log=False)

    def __call__(self, image) -> str:
        array = np.asarray(image)
        if hasattr(self.ocr, "predict"):  # 3.x: one result per image, with rec_texts / rec_scores
            texts = []
            for result in self.ocr.predict(array):
                texts += [t for t, s in zip(result["rec_texts"], result["rec_scores"]) if s > 0]
            return "".join(texts)
        lines = self.ocr.ocr(array, cls=False)[0] or []  # 2.x: [[box, (text, confidence)], ...]
        return "".join(text for _, (text, confidence) in lines if confidence > 0)


ENGINES: dict[str, Callable[..., Callable]] = {"tesseract": TesseractEngine, "paddle": PaddleEngine}


def engine_memory(options: dict) -> list[Held]:
    """Tesseract runs on the CPU (a separate program): nothing on the accelerator; PaddleOCR's models live in
    PaddlePaddle's memory, which the planner does not size."""
    if options.get("engine") == "tesseract":
        return list(NOTHING)
    return [NotEstimated(f"the {options.get('engine')} engine runs in PaddlePaddle's memory")]


@register(
    "ocr",
    kind=IMAGE,
    memory=engine_memory,
    summary="Flow-GRPO's text rendering: the prompt's quoted text against the OCR'd image, `1 - min(d, n)/n`; "
    'Tesseract (`".[ocr]"` and `apt-get install tesseract-ocr`) or PaddleOCR (`".[paddleocr]"`)',
)
class OCRReward:
    """``1 - min(d, n)/n`` per image (see the module docstring).

    Args:
        engine: "tesseract" (default) or "paddle".
        lang: the engine's language code (default "eng" for tesseract, "en" for paddle).
        tesseract_config: extra tesseract command-line options.
    """

    kind = IMAGE

    def __init__(self, engine: str = "tesseract", lang: str | None = None, tesseract_config: str = "--psm 11"):
        if engine not in ENGINES:
            raise ValueError(f"unknown OCR engine {engine!r}; valid: {', '.join(ENGINES)}")
        if engine == "tesseract":
            self.engine = TesseractEngine(lang or "eng", tesseract_config)
        else:
            self.engine = PaddleEngine(lang or "en")
        self.last_components: dict[str, torch.Tensor] = {}
        self.last_texts: list[str] = []

    def __call__(self, images, prompts, **metadata) -> torch.Tensor:
        images = check_images(images, prompts, "ocr")
        targets = [quoted_target(p) for p in prompts]
        self.last_texts = [self.engine(x) for x in images]
        distance = [ocr_distance(r, t) for r, t in zip(self.last_texts, targets)]
        self.last_components = {"edit_distance": torch.tensor(distance, dtype=torch.float32)}
        return torch.tensor([ocr_score(r, t) for r, t in zip(self.last_texts, targets)], dtype=torch.float32)
