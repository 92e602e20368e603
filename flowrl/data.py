"""Prompt sets: a .txt file (one prompt per line), a .jsonl file (one JSON object per line: a prompt column, the other
keys are metadata that reaches the reward functions, e.g. GenEval-style object lists), a .json file (an array of such
objects, or of prompts), a .csv/.tsv file (a header row names the columns; every cell is text), or `hf:ORG/NAME`, a
Hugging Face dataset (`hf:DIR` for a local copy). Every error names the source and line (or dataset row), what was
wrong and what would be right, in one line: `PromptFileError`.

A row of a .jsonl, .json or .csv file may carry conditioning images in its `image` column (`data.image_column`): a
path or a list of paths (one path in a .csv cell), relative to the file (a source image to edit, several for
multi-image editing). Each is checked when the file is read (it exists and Pillow can read it) and kept in the row's
metadata as an absolute path, always a list; `flowrl.conditioning` loads them for the rollout.

Once the model is loaded, `check_prompt_lengths` warns (once per prompt set) about prompts longer than its text
encoders take, naming the first one's file:line, and silences the libraries' own truncation logs (which print the cut
text at every encode)."""

from __future__ import annotations

import json
import logging
import os
import random
import re
import string
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

if TYPE_CHECKING:
    import torch

    from .config import DataConfig

BUILTIN_PROMPTS = [
    "a red circle",
    "a blue square",
    "a green triangle",
    "a yellow circle",
    "two red squares",
    "a cat on a mat",
    "a photo of a mountain lake",
    "an apple on a table",
]


@dataclass
class PromptSet:
    prompts: list[str]
    metadata: list[dict] = field(default_factory=list)
    origins: list[str] = field(default_factory=list)  # where each prompt came from ("file:line"), for errors

    def __post_init__(self):
        if not self.metadata:
            self.metadata = [{} for _ in self.prompts]
        if not self.origins:
            self.origins = [f"prompt {i}" for i in range(len(self.prompts))]
        if len(self.metadata) != len(self.prompts) or len(self.origins) != len(self.prompts):
            raise ValueError("prompts, metadata and origins differ in length")
        if not self.prompts:
            raise ValueError("a prompt set needs at least one prompt")

    def __len__(self) -> int:
        return len(self.prompts)

    def draw(self, n: int, epoch: int, seed: int, balance_by: str = "") -> tuple[list[str], list[dict]]:
        """n prompts for `epoch`: a seeded shuffle of the whole set, walked in order across epochs, so every
        prompt is seen once before any repeats; the same (seed, epoch) always gives the same prompts.

        balance_by: a metadata column (e.g. GenEval's `family`). Each value of it is then drawn equally often,
        however many prompts it has: draws go round the G values (in a seeded order, reshuffled every round),
        and each value walks its own seeded shuffle of its prompts. Every G consecutive draws, counted across
        epochs, hold each value once."""
        if balance_by:
            return self._draw_balanced(n, epoch, seed, balance_by)
        order: list[int] = []
        start = epoch * n
        cycle = start // len(self)
        while len(order) < start % len(self) + n:
            order.extend(self._permutation(seed, cycle))
            cycle += 1
        idx = order[start % len(self) : start % len(self) + n]
        return self.pick(idx)

    def strata(self, column: str) -> list[list[int]]:
        """The prompts' indices grouped by their value of `column`, values in first-seen order (cached); an
        error names the columns the prompts do have when some prompt lacks this one."""
        cache = self.__dict__.setdefault("_strata", {})
        if column not in cache:
            require_column(
                self.metadata,
                column,
                f"cannot balance prompts by {column!r}",
                "; set data.balance_by= (or data.balance_by=null) to draw every prompt equally often",
                self.origins,
            )
            groups: dict = {}
            for i, meta in enumerate(self.metadata):
                groups.setdefault(json.dumps(meta[column], sort_keys=True), []).append(i)
            cache[column] = list(groups.values())
        return cache[column]

    def _draw_balanced(self, n: int, epoch: int, seed: int, column: str) -> tuple[list[str], list[dict]]:
        groups = self.strata(column)
        idx = []
        for k in range(epoch * n, epoch * n + n):  # the k-th draw of the run
            rnd, pos = divmod(k, len(groups))
            value = round_order(seed, rnd, len(groups))[pos]
            idx.append(value_member(seed, value, groups[value], rnd))  # each value is drawn once a round
        return self.pick(idx)

    def pick(self, idx: list[int]) -> tuple[list[str], list[dict]]:
        """The prompts at `idx` and copies of their metadata (a draw's result)."""
        return [self.prompts[i] for i in idx], [dict(self.metadata[i]) for i in idx]

    def walk(self, seed: int, position: int) -> int:
        """The prompt at `position` of the unbalanced draw order: seeded passes over the whole set, one after
        another."""
        cycle, at = divmod(position, len(self))
        return self._permutation(seed, cycle)[at]

    def _permutation(self, seed: int, cycle: int) -> list[int]:
        """The seeded order of one pass over the set (cached: a pass spans many epochs)."""
        cache = self.__dict__.setdefault("_perm_cache", {})
        if (seed, cycle) not in cache:
            perm = list(range(len(self)))
            random.Random(seed * 1_000_003 + cycle).shuffle(perm)
            cache.clear()
            cache[(seed, cycle)] = perm
        return cache[(seed, cycle)]

    def head(self, n: int) -> tuple[list[str], list[dict]]:
        n = len(self) if n <= 0 else min(n, len(self))
        return self.prompts[:n], [dict(m) for m in self.metadata[:n]]


def round_order(seed: int, rnd: int, values: int) -> list[int]:
    """The order in which balanced draws visit the `values` values of the balancing column in round `rnd`."""
    order = list(range(values))
    random.Random(f"{seed}/round/{rnd}").shuffle(order)
    return order


def value_member(seed: int, value: int, members: list[int], count: int) -> int:
    """The prompt of a value's `count`-th draw: the value walks its own seeded shuffle of its `members`, a new
    shuffle each time round."""
    cycle, at = divmod(count, len(members))
    perm = list(members)
    random.Random(f"{seed}/{value}/{cycle}").shuffle(perm)
    return perm[at]


def require_column(
    metadata: list[dict], column: str, what: str, how_off: str = "", origins: list[str] | None = None
) -> None:
    """Raise ValueError, starting with `what` and ending with `how_off` (how to turn the option off), when a
    prompt's metadata lacks `column`; the message names the first such prompt (its `origins` entry, file:line,
    when given) and the columns the prompts do have."""
    missing = next((i for i, m in enumerate(metadata) if column not in (m or {})), None)
    if missing is not None:
        where = origins[missing] if origins and missing < len(origins) else f"prompt {missing}"
        raise ValueError(
            f"{what}: {where} has no column {column!r}; the prompts' metadata columns are "
            f"{metadata_columns(metadata)}{how_off}"
        )


def metadata_columns(metadata: list[dict]) -> str:
    """The metadata columns the prompts hold, for an error: a sorted list, or that plain-text prompts hold none."""
    keys = sorted({k for m in metadata for k in (m or {})})
    return str(keys) if keys else "none (plain-text prompts, e.g. a .txt prompt file)"


def warn_repeated_prompts(prompts: PromptSet, per_epoch: int) -> None:
    """A ConfigWarning when an epoch draws more prompts (sample.prompts_per_epoch) than the training set holds
    distinct ones: every epoch then draws some prompt more than once, each time as a separate group."""
    distinct = len(set(prompts.prompts))
    if per_epoch > distinct:
        from .errors import ConfigWarning

        warnings.warn(
            f"sample.prompts_per_epoch={per_epoch} but data.train_prompts has {distinct} distinct prompts: every "
            f"epoch draws some prompts more than once, each time as a separate group of sample.group_size samples "
            f"with its own advantages; set sample.prompts_per_epoch={distinct} or less for distinct prompts in "
            f"each epoch",
            ConfigWarning,
            stacklevel=2,
        )


def warn_eval_not_held_out(train: PromptSet, eval_set: PromptSet | None, image_column: str = "") -> None:
    """A ConfigWarning when the eval is not held out: no data.eval_prompts (`eval_set` None: the eval samples the
    training prompts), or eval prompts that are training prompts too (the same text and, for a model that takes
    conditioning images, the same `image_column` images), with how many and the first."""
    from .errors import ConfigWarning

    if eval_set is None:
        warnings.warn(
            "data.eval_prompts is not set: the eval before and after training samples the training prompts, so it "
            "shows how the run fit them, not how it does on prompts it never trained on; give held-out prompts in "
            "data.eval_prompts",
            ConfigWarning,
            stacklevel=2,
        )
        return

    def keys(prompts: PromptSet) -> list:
        if not image_column:
            return list(prompts.prompts)
        return [(p, json.dumps(m.get(image_column), sort_keys=True)) for p, m in zip(prompts.prompts, prompts.metadata)]

    trained, evaluated = set(keys(train)), keys(eval_set)
    shared = [(k, origin) for k, origin in zip(evaluated, eval_set.origins) if k in trained]
    if shared:
        first, origin = shared[0]
        text = first[0] if isinstance(first, tuple) else first
        distinct = len({k for k, _ in shared})
        warnings.warn(
            f"data.eval_prompts: {distinct} of its {len(set(evaluated))} distinct prompts are training prompts "
            f"too (the first: {text!r}, {origin}); the eval is not held out for them: take them out of one of the "
            "two sets",
            ConfigWarning,
            stacklevel=2,
        )


# ------------------------------------------------------------------------------------------ loading

FORMATS = (
    ".txt (one prompt per line), .jsonl (one JSON object per line), .json (an array of objects or strings), .csv or "
    ".tsv (a header row naming the columns) or hf:ORG/NAME (a Hugging Face dataset; hf:DIR for a local copy)"
)
_FILE_SUFFIXES = (".txt", ".jsonl", ".json", ".csv", ".tsv")
HF_PREFIX = "hf:"
OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
_TRUE = {"1", "ON", "YES", "TRUE"}
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
_LOCAL_COPY = (
    "point to a local copy: hf:/path/to/dir (a folder written by Dataset.save_to_disk, or holding "
    "json/jsonl/csv/parquet files)"
)


class PromptFileError(ValueError):
    """A prompt source that cannot be read. The one-line message names the file and line (or the dataset and
    row), what was wrong and what would be right."""


class _MissingPromptFile(PromptFileError, FileNotFoundError):
    """A prompt file that does not exist (also a FileNotFoundError, as load_prompts raised before)."""


def load_prompts(
    path: str | Path | None,
    *,
    column: str = "prompt",
    template: str = "{prompt}",
    split: str = "train",
    hf_config: str = "",
    image_column: str = "image",
) -> PromptSet:
    """The prompts of a .txt file (one per line), a .jsonl file (one JSON object per line), a .json file (an array),
    a .csv/.tsv file (a header row) or `hf:ORG/NAME` (a Hugging Face dataset; `hf:DIR` a local one); an empty path
    gives the built-in prompts.

    column: the key of a row that holds the prompt (every format but .txt); the row's other keys become its metadata,
        which reaches the rewards. A .txt line is that column, with no metadata.
    template: a format string over the row's columns that makes the prompt; `{prompt}` is the prompt column.
    split, hf_config: the split and the configuration of a `hf:` dataset ("" = its default configuration).
    image_column: the column of conditioning images, stored as a list of absolute paths, each checked to exist and
        to be readable as an image; "" = none. In a .jsonl/.json/.csv file: a path or a list of paths relative to
        the file. In
        a `hf:` dataset: images (an Image feature, decoded or not) or a list of them, each written once as a file
        to `datasets`' cache (named by its content), or paths (relative to a local dataset's folder).
    Raises PromptFileError, whose one-line message names the file and line (or dataset row) and the fix."""
    fields = _template_columns(template)
    if not path:  # the built-in prompts: rows of a prompt alone, the template applied as to a file's
        rows = [
            (f"built-in prompt #{i + 1} (no data.train_prompts)", {column: p}) for i, p in enumerate(BUILTIN_PROMPTS)
        ]
        return PromptSet([_row_prompt(row, where, column, template, fields)[0] for where, row in rows])
    source = str(path)
    if source.startswith(HF_PREFIX):
        return _load_hf(source, column, template, fields, split, hf_config, image_column)
    path = Path(source).expanduser()
    if path.is_dir():
        raise PromptFileError(
            f"prompt source {source!r} is a directory; give a .txt or .jsonl file in it, or hf:{source} for a "
            f"dataset folder (one written by Dataset.save_to_disk, or of json/jsonl/csv/parquet files)"
        )
    if path.suffix.lower() not in _FILE_SUFFIXES:
        hint = ""
        if path.suffix.lower() == ".parquet":  # what `datasets` reads from a folder
            hint = (
                f"; a {path.suffix} file is read as a dataset: put it in a folder of its own and give hf:FOLDER "
                "(its one split is train: data.eval_split=train for eval prompts), or write it as .jsonl, one JSON "
                "object per line"
            )
        raise PromptFileError(
            f"prompt source {source!r}: unknown format {path.suffix or '(no extension)'!r}; valid: {FORMATS}{hint}"
        )
    rows = _file_rows(path, column)
    if image_column and path.suffix.lower() != ".txt":
        hint = f"; column {image_column!r} is data.image_column: data.image_column='' keeps it as plain metadata"
        rows = ((where, _with_images(row, where, image_column, path.parent, hint=hint)) for where, row in rows)
    return _prompt_set(rows, column, template, fields)


def load_config_prompts(data: DataConfig, part: str = "train") -> PromptSet:
    """The training (`part="train"`) or eval (`"eval"`) prompts of a config's `data` section (a DataConfig): its
    source, split, prompt column, template and hf_config. The eval prompts default to the training prompts
    (same source and split) when `data.eval_prompts` is empty. Errors start with the config key."""
    if part not in ("train", "eval"):
        raise ValueError(f"part must be 'train' or 'eval', got {part!r}")
    key, source, split = "train_prompts", data.train_prompts, data.train_split
    column, own_file = data.prompt_column, False
    if part == "eval" and data.eval_prompts:
        key, source, split, own_file = "eval_prompts", data.eval_prompts, data.eval_split, True
        column = data.eval_prompt_column or column
    try:
        return load_prompts(
            source,
            column=column,
            template=data.prompt_template,
            split=split,
            hf_config=data.hf_config,
            image_column=data.image_column,
        )
    except PromptFileError as e:
        message = str(e)
        if own_file:  # the eval file's column is its own key (the training file's stays as it is)
            for old in ("; data.prompt_column=", "; set data.prompt_column to"):
                message = message.replace(old, old.replace("prompt_column", "eval_prompt_column"))
            if data.eval_prompt_column:
                message = message.replace("(data.prompt_column)", "(data.eval_prompt_column)")
        raise type(e)(f"data.{key}: {message}") from e


# ------------------------------------------------------------------------------------------ rows


def _template_columns(template: str) -> list[str]:
    """The columns that `template` names; an error when it is not a format string naming at least one column."""
    what = f"data.prompt_template {template!r}"
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as e:
        raise PromptFileError(
            f"{what} is not a valid format string ({e}); write a column as {{prompt}} and a "
            f"literal brace as {{{{ or }}}}"
        ) from None
    columns = []
    for _, name, _, _ in parsed:
        if name is None:
            continue
        column = re.split(r"[.\[]", name, maxsplit=1)[0]
        if not column or column.isdigit():
            raise PromptFileError(f"{what}: every {{}} field needs a column name, as in {{prompt}} or {{question}}")
        columns.append(column)
    if not columns:
        raise PromptFileError(f"{what} names no column, so every prompt would be the same; include {{prompt}}")
    return columns


def _prompt_set(rows: Iterable[tuple[str, dict]], column: str, template: str, fields: list[str]) -> PromptSet:
    """The PromptSet of (where, row) pairs; `where` (file:line or dataset row) starts any error message."""
    prompts, metadata, origins = [], [], []
    for where, row in rows:
        prompt, meta = _row_prompt(row, where, column, template, fields)
        prompts.append(prompt)
        metadata.append(meta)
        origins.append(where)
    return PromptSet(prompts, metadata, origins)


def _row_prompt(row: dict, where: str, column: str, template: str, fields: list[str]) -> tuple[str, dict]:
    """One row's prompt (its `column` through `template`) and metadata (its other columns)."""
    chat = next((k for k in (column, "messages", "prompt") if _is_conversation(row.get(k))), None)
    if chat is not None:
        raise PromptFileError(
            f"{where}: {chat!r} is a conversation (a list of role/content messages, TRL's conversational format), "
            "and flowrl reads a prompt as text: give the user's message as the row's prompt string (text.chat_template "
            "wraps it in the tokenizer's chat template)"
        )
    if column not in row:
        raise PromptFileError(
            f"{where}: no prompt column {column!r} (data.prompt_column); the row's keys are {sorted(row)}"
            f"{_column_hint([k for k, v in row.items() if isinstance(v, str) and v.strip()])}"
        )
    value = row[column]
    if not isinstance(value, str) or not value.strip():
        raise PromptFileError(
            f"{where}: the prompt ({column!r}) must be a non-empty string, got "
            f"{_clip(repr(value))} ({type(value).__name__})"
        )
    missing = next((f for f in fields if f != "prompt" and f not in row), None)
    if missing is not None:
        raise PromptFileError(
            f"{where}: data.prompt_template {template!r} names column {missing!r}, which this row "
            f"lacks; its columns are {sorted(row)} ({{prompt}} is the prompt column, {column!r})"
        )
    try:
        prompt = template.format_map({**row, "prompt": value})
    except (AttributeError, IndexError, KeyError, TypeError, ValueError) as e:
        raise PromptFileError(
            f"{where}: data.prompt_template {template!r} does not apply to this row: {type(e).__name__}: {e}"
        ) from None
    return prompt, {k: v for k, v in row.items() if k != column}


def _is_conversation(value) -> bool:
    """A list of chat messages ({"role", "content"} dicts), as TRL's conversational datasets hold them."""
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) and "role" in m for m in value)


def _clip(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ------------------------------------------------------------------------------------------ files


def _column_hint(candidates: list) -> str:
    """'; set data.prompt_column=KEY ...' for the text-valued columns a row or dataset has instead."""
    if not candidates:
        return ""
    if len(candidates) == 1:
        return f"; data.prompt_column={candidates[0]} if that column holds the prompt"
    names = ", ".join(str(c) for c in candidates[:6])
    return f"; set data.prompt_column to the column of text that holds the prompt ({names})"


def _is_text_feature(feature) -> bool:
    """A `datasets` feature of plain strings (Value('string'))."""
    return getattr(feature, "dtype", None) in ("string", "large_string")


def _read_lines(path: Path) -> list[tuple[int, str]]:
    """The non-blank lines of a prompt file with their 1-based numbers (a UTF-8 byte-order mark is skipped);
    errors for a missing file, a directory, text that is not UTF-8, and a file without prompts."""
    text = _read_text(path)
    if "\r" in text and "\n" not in text:  # old Mac line endings: each CR ends a line
        text = text.replace("\r", "\n")
    lines = [(i + 1, line.rstrip("\r")) for i, line in enumerate(text.split("\n")) if line.strip()]
    if not lines:
        state = "is empty" if not text else "holds only blank lines"
        want = (
            "one prompt per line"
            if path.suffix.lower() == ".txt"
            else 'one JSON object per line, e.g. {"prompt": "a red apple"}'
        )
        raise PromptFileError(f"{path}: no prompts: the file {state}; write {want}")
    return lines


def _read_text(path: Path) -> str:
    """A prompt file's text (a UTF-8 byte-order mark skipped); errors for a missing file, a directory and text
    that is not UTF-8."""
    if not path.exists():
        raise _MissingPromptFile(
            f"prompt file {str(path)!r} does not exist (relative paths are read from the "
            f"working directory, {os.getcwd()}){_nearby_files(path)}"
        )
    if path.is_dir():
        raise PromptFileError(f"prompt file {str(path)!r} is a directory; for a dataset folder write hf:{path}")
    data = path.read_bytes()
    bom = 3 if data.startswith(b"\xef\xbb\xbf") else 0
    try:
        text = data[bom:].decode("utf-8")
    except UnicodeDecodeError as e:
        offset = bom + e.start
        line = data.count(b"\n", 0, offset) + 1
        in_line = offset - data.rfind(b"\n", 0, offset)  # 1-based
        raise PromptFileError(
            f"{path}:{line}: not UTF-8 text: byte 0x{data[offset]:02x} at byte offset {offset} "
            f"(byte {in_line} of the line); save the file as UTF-8"
        ) from None
    return text


def _nearby_files(path: Path) -> str:
    """'; prompt files in DIR: a, b' for the prompt files beside a missing `path` (closest names first)."""
    parent = path.parent
    if not parent.is_dir():
        return ""
    names = sorted(p.name for p in parent.iterdir() if p.suffix.lower() in _FILE_SUFFIXES and p.is_file())
    if not names:
        return ""
    import difflib

    close = difflib.get_close_matches(path.name, names, n=5, cutoff=0.0)
    return f"; prompt files in {parent}: {', '.join(close)}"


def _file_rows(path: Path, column: str) -> Iterator[tuple[str, dict]]:
    """(file:line, row) for every non-blank line: a .txt line is the prompt column, a .jsonl line a JSON object;
    (file:line, row) of a .csv/.tsv file's rows, (file[i], row) of a .json file's array."""
    suffix = path.suffix.lower()
    if suffix in (".csv", ".tsv"):
        yield from _table_rows(path, "\t" if suffix == ".tsv" else ",")
        return
    if suffix == ".json":
        yield from _json_array_rows(path, column)
        return
    for number, line in _read_lines(path):
        where = f"{path}:{number}"
        yield where, ({column: line.strip()} if path.suffix.lower() == ".txt" else _jsonl_row(line, where, column))


def _table_rows(path: Path, delimiter: str) -> Iterator[tuple[str, dict]]:
    """The rows of a .csv/.tsv file with a header, as {column: text}; a row of only empty cells is skipped."""
    import csv
    import io

    text = _read_text(path)
    # strict: a quote opened and never closed is an error (not the rest of the file read as one cell)
    reader = csv.DictReader(io.StringIO(text, newline=""), delimiter=delimiter, restkey=_EXTRA_CELLS, strict=True)
    if not reader.fieldnames:
        raise PromptFileError(
            f"{path}: no prompts: the file is empty; write a header row naming the columns (e.g. prompt), then one "
            "row per prompt"
        )
    blank = [i + 1 for i, name in enumerate(reader.fieldnames) if not name.strip()]
    if blank:
        raise PromptFileError(
            f"{path}:1: the header's column {blank[0]} has no name; the first row names the columns "
            f"({delimiter!r}-separated), e.g. prompt"
        )
    count = 0
    try:
        for row in reader:
            where = f"{path}:{reader.line_num}"
            if _EXTRA_CELLS in row:
                raise PromptFileError(
                    f"{where}: {len(reader.fieldnames) + len(row[_EXTRA_CELLS])} cells under a header of "
                    f"{len(reader.fieldnames)} columns; quote a prompt that holds {delimiter!r}"
                )
            cells = {k: ("" if v is None else v) for k, v in row.items()}
            if not any(v.strip() for v in cells.values()):
                continue
            count += 1
            yield where, cells
    except csv.Error as e:
        hint = "; a cell's opening quote has no closing one" if "end of data" in str(e) else ""
        hint += f"; a quoted cell ends at its closing quote, then {delimiter!r}" if "expected after" in str(e) else ""
        # (line_num is the last whole row's last line: the bad row starts on the next)
        raise PromptFileError(f"{path}:{reader.line_num + 1}: not valid {path.suffix} text: {e}{hint}") from None
    if not count:
        raise PromptFileError(f"{path}: no prompts: the file has a header row and no rows under it")


_EXTRA_CELLS = "\0extra"


def _json_array_rows(path: Path, column: str) -> Iterator[tuple[str, dict]]:
    """The items of a .json file's array: objects are rows, strings are the prompt column."""
    text = _read_text(path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise PromptFileError(
            f"{path}:{e.lineno}: not valid JSON: {e.msg.removesuffix(' at')} at column {e.colno}; a .json prompt "
            f'file holds one array, e.g. [{{"{column}": "a red apple"}}] or ["a red apple"]'
        ) from None
    if not isinstance(data, list):
        kind = "an object" if isinstance(data, dict) else type(data).__name__
        lists = [k for k, v in data.items() if isinstance(v, list)] if isinstance(data, dict) else []
        inside = f" (its key {lists[0]!r} holds one: write that array alone, or as .jsonl)" if lists else ""
        raise PromptFileError(f"{path}: a .json prompt file holds one array of objects or strings, got {kind}{inside}")
    if not data:
        raise PromptFileError(f'{path}: no prompts: the array is empty; e.g. [{{"{column}": "a red apple"}}]')
    for i, item in enumerate(data):
        where = f"{path}[{i}]"
        if isinstance(item, str):
            yield where, {column: item}
        elif isinstance(item, dict):
            yield where, item
        else:
            raise PromptFileError(
                f"{where}: an item must be a JSON object with a {column!r} key or a string, got "
                f"{type(item).__name__}: {_clip(json.dumps(item))}"
            )


def _jsonl_row(line: str, where: str, column: str) -> dict:
    """One JSONL line as a dict; errors name the JSON parser's complaint, or what the line holds instead."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise PromptFileError(
            f"{where}: not valid JSON: {e.msg.removesuffix(' at')} at column {e.colno}; each line must be one JSON "
            f'object, e.g. {{"{column}": "a red apple"}}'
        ) from None
    if not isinstance(row, dict):
        kind = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(row), "a number")
        raise PromptFileError(
            f"{where}: a row must be a JSON object with a {column!r} key, got {kind}: {_clip(line.strip())}"
        )
    return row


def _with_images(
    row: dict, where: str, column: str, base: Path, base_is: str = "the prompt file's folder", hint: str = ""
) -> dict:
    """`row` with its `column` (a path or a list of paths, relative to `base`, which errors call `base_is`) as a
    list of absolute paths, each an existing file Pillow reads; a row without the column is returned as it is.
    `hint` ends the message of an image that does not exist or does not read."""
    if column not in row:
        return row
    value = row[column]
    paths = [value] if isinstance(value, str) else value
    if not isinstance(paths, list) or not paths or not all(isinstance(p, str) and p.strip() for p in paths):
        raise PromptFileError(
            f"{where}: {column!r} must be an image path or a non-empty list of image paths "
            f"(relative to {base_is}), got {_clip(repr(value))} (data.image_column)"
        )
    resolved = []
    for given in paths:
        file = (base / Path(given).expanduser()).resolve()
        if not file.is_file():
            state = "is a directory" if file.is_dir() else "does not exist"
            raise PromptFileError(
                f"{where}: image {given!r} {state} (looked for {file}; paths are relative to {base_is} {base}){hint}"
            )
        problem = _unreadable_image(file)
        if problem:
            raise PromptFileError(
                f"{where}: image {given!r} ({file}) is not an image Pillow can read: {problem}; "
                f"give a PNG, JPEG or WebP file{hint}"
            )
        resolved.append(str(file))
    return {**row, column: resolved}


def _unreadable_image(file: Path) -> str:
    """Why Pillow cannot read image `file` ("" when it can): its header is identified and its data decoded."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(file) as im:
            im.load()
    except UnidentifiedImageError:
        return "not a known image format"
    except (OSError, SyntaxError, ValueError) as e:  # truncated or corrupt data
        return " ".join(str(e).split()) or type(e).__name__
    return ""


# ------------------------------------------------------------------------------------------ hf: datasets


def _load_hf(
    source: str, column: str, template: str, fields: list[str], split: str, hf_config: str, image_column: str = ""
) -> PromptSet:
    """The prompts of `hf:ORG/NAME` (the hub, or its local cache) or `hf:DIR` (a local dataset): split `split`,
    prompt from `column` through `template`, the other JSON-valued columns as metadata, and the images of
    `image_column` (when the dataset has it) as paths of files (see `_hf_images`)."""
    datasets, table, where, base = _hf_table(source, split, hf_config)
    if column not in table.column_names:
        raise PromptFileError(
            f"{where}: no prompt column {column!r} (data.prompt_column); the dataset's columns are {table.column_names}"
            f"{_column_hint([c for c in table.column_names if _is_text_feature(table.features.get(c))])}"
        )
    missing = next((f for f in fields if f != "prompt" and f not in table.column_names), None)
    if missing is not None:
        raise PromptFileError(
            f"{where}: data.prompt_template {template!r} names column {missing!r}, which the "
            f"dataset lacks; its columns are {table.column_names}"
        )
    if len(table) == 0:
        raise PromptFileError(
            f"{where}: the split has no rows; choose another split (data.train_split / data.eval_split)"
        )
    rows = table.to_list()
    if image_column and image_column in table.column_names and image_column != column:
        cache = _image_cache(datasets)
        rows = [_hf_images(row, f"{where} row {i}", image_column, base, cache) for i, row in enumerate(rows)]
    rows = _json_columns(rows, column, source)
    return _prompt_set(((f"{where} row {i}", row) for i, row in enumerate(rows)), column, template, fields)


def _hf_table(source: str, split: str, hf_config: str):
    """(the `datasets` module, split `split` of dataset `source`, how errors name it, the local dataset's folder
    or None for a hub dataset)."""
    name = source[len(HF_PREFIX) :].strip()
    datasets = _import_datasets(source)
    local = Path(name).expanduser()
    is_local = bool(name) and local.is_dir()
    loaded = (
        _load_local_dataset(datasets, source, local, hf_config)
        if is_local
        else _load_hub_dataset(datasets, source, name, hf_config)
    )
    return datasets, _choose_split(loaded, source, split), f"{source} (split {split!r})", local if is_local else None


def _image_cache(datasets) -> Path:
    """Where the images of `hf:` datasets are written as files (`_cached_image`)."""
    return Path(datasets.config.HF_DATASETS_CACHE).expanduser() / "flowrl_images"


def _hf_images(row: dict, where: str, column: str, base: Path | None, cache: Path) -> dict:
    """`row` with its image `column` as a list of absolute paths (None: the row has no image). An image is a PIL
    image (a decoded Image feature), a {"bytes", "path"} dict (an undecoded one) or a path: images and bytes are
    written once to `cache`, named by a hash of their content (several processes may write the same file: each
    writes a temporary file and renames it); a path is relative to the local dataset's folder `base`."""
    value = row[column]
    if value is None:
        return {k: v for k, v in row.items() if k != column}
    items = value if isinstance(value, (list, tuple)) else [value]
    paths = []
    for item in items:
        if isinstance(item, dict) and item.get("bytes") is None and item.get("path"):
            item = item["path"]  # an undecoded Image feature that points to a file
        if isinstance(item, str):
            if base is None and not Path(item).expanduser().is_absolute():
                raise PromptFileError(
                    f"{where}: image {item!r} ({column!r}, data.image_column) is a relative path "
                    f"in a hub dataset, with no folder to resolve it against; use a dataset whose "
                    f"column holds images (an Image feature), or a local copy (hf:DIR)"
                )
            paths.append(item)
        else:
            paths.append(_cached_image(item, where, column, cache))
    return _with_images({**row, column: paths}, where, column, base or Path.cwd(), "the dataset's folder")


def _cached_image(item, where: str, column: str, cache: Path) -> str:
    """The path of a file in `cache` holding image `item` (a PIL image or a {"bytes": ...} dict), written when
    missing: PNG for a PIL image, the bytes as they are otherwise; the name is the SHA-256 of the content."""
    import hashlib

    from PIL import Image

    if isinstance(item, Image.Image):
        import io

        buffer = io.BytesIO()
        (item if item.mode in ("1", "L", "LA", "P", "RGB", "RGBA", "I") else item.convert("RGB")).save(buffer, "PNG")
        data, suffix = buffer.getvalue(), ".png"
    elif isinstance(item, dict) and isinstance(item.get("bytes"), (bytes, bytearray)):
        data, suffix = bytes(item["bytes"]), Path(str(item.get("path") or "")).suffix.lower() or ".img"
    else:
        raise PromptFileError(
            f"{where}: {column!r} (data.image_column) must hold images, image paths or lists of "
            f"them, got {type(item).__name__}: {_clip(repr(item))}"
        )
    file = cache / f"{hashlib.sha256(data).hexdigest()}{suffix}"
    if not file.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        tmp = file.with_name(f"{file.name}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, file)
    return str(file)


def _import_datasets(source: str):
    """The `datasets` module, imported on first use; an error with the install command when it is missing."""
    try:
        import datasets
    except ImportError as e:
        raise PromptFileError(
            f"{source}: Hugging Face prompt datasets need the `datasets` package, which is not "
            f"installed: pip install 'flowrl[hf]'"
        ) from e
    return datasets


def _load_local_dataset(datasets, source: str, local: Path, hf_config: str):
    """A local dataset folder: one written by `save_to_disk` (which holds one configuration, so hf_config is
    not used), or data files that `load_dataset` reads (json, jsonl, csv, parquet, ...)."""
    saved = (local / "dataset_dict.json").is_file() or (local / "state.json").is_file()
    try:
        if saved:
            return datasets.load_from_disk(str(local))
        return datasets.load_dataset(str(local), hf_config or None)
    except Exception as e:  # datasets raises many kinds; the message is what matters
        config = f" (data.hf_config={hf_config!r})" if hf_config and not saved else ""
        raise PromptFileError(
            f"{source}: cannot load the local dataset{config}: {_one_line(e)}; expected a folder "
            f"written by Dataset.save_to_disk or holding json/jsonl/csv/parquet files"
        ) from e


def _load_hub_dataset(datasets, source: str, name: str, hf_config: str):
    """A dataset of the Hugging Face Hub (or its local cache). Offline and not cached: an error at once, without
    calling `datasets` (which could spend a minute on retries)."""
    if not _HUB_ID.fullmatch(name):
        raise PromptFileError(
            f"{source}: {name!r} is neither a local directory nor a dataset id such as hf:openai/gsm8k"
        )
    from . import hub

    hub.settle()  # (offline at once, HF_HUB_OFFLINE=1, when the hub cannot be reached)
    offline = _offline_variables()
    if offline and not any(d.exists() for d in _cache_dirs(datasets, name)):
        raise PromptFileError(_offline_message(datasets, source, name, offline))
    config = f" (data.hf_config={hf_config!r})" if hf_config else ""
    try:
        return datasets.load_dataset(name, hf_config or None)
    except ConnectionError as e:
        if offline:
            raise PromptFileError(_offline_message(datasets, source, name, offline)) from e
        raise PromptFileError(
            f"{source}: cannot reach the Hugging Face Hub ({_one_line(e)}); check the network, or {_LOCAL_COPY}"
        ) from e
    except Exception as e:  # datasets raises many kinds; the message is what matters
        raise PromptFileError(f"{source}: cannot load dataset {name!r}{config}: {_one_line(e)}") from e


def _offline_variables() -> list[str]:
    """The environment variables, of `HF_HUB_OFFLINE` and `HF_DATASETS_OFFLINE`, set to put Hugging Face offline
    (1/true/yes/on), read now (not when `datasets` was imported)."""
    return [v for v in OFFLINE_VARIABLES if os.environ.get(v, "").strip().upper() in _TRUE]


def _cache_dirs(datasets, name: str) -> list[Path]:
    """Where a hub dataset `name` would be cached: the datasets cache (`ORG___NAME`, as `datasets` names it)
    and the hub cache (`datasets--ORG--NAME`), read from the environment now and from `datasets`' settings."""
    home = Path(os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache") / "huggingface")
    roots = {
        Path(os.environ.get("HF_DATASETS_CACHE") or home / "datasets").expanduser(),
        Path(getattr(datasets.config, "HF_DATASETS_CACHE", home / "datasets")).expanduser(),
    }
    hub = Path(os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE") or home / "hub").expanduser()
    org, _, short = name.rpartition("/")
    try:
        from datasets.naming import camelcase_to_snakecase

        short = camelcase_to_snakecase(short)
    except ImportError:
        pass
    cached = "___".join(filter(None, [org, short]))
    return sorted(root / cached for root in roots) + [hub / ("datasets--" + name.replace("/", "--"))]


def _offline_message(datasets, source: str, name: str, variables: list[str]) -> str:
    """Why an offline machine cannot load hub dataset `name`, and the two ways out."""
    dirs = " or ".join(str(d) for d in _cache_dirs(datasets, name))
    settings = ", ".join(f"{v}={os.environ.get(v)}" for v in variables)
    return (
        f"{source}: dataset {name!r} is neither a local directory nor in the Hugging Face cache ({dirs}), and "
        f"this machine is offline ({settings}), so it cannot be downloaded; run once with network access and "
        f"{' and '.join(variables)} unset to cache it, or {_LOCAL_COPY}"
    )


def _choose_split(loaded, source: str, split: str):
    """Split `split` of a DatasetDict (an error lists the splits it has); a lone Dataset (saved without splits)
    is every split."""
    if not isinstance(loaded, dict):
        return loaded
    if split not in loaded:
        raise PromptFileError(
            f"{source}: no split {split!r}; the dataset's splits are {list(loaded)} "
            f"(data.train_split / data.eval_split)"
        )
    return loaded[split]


def _json_columns(rows: list[dict], column: str, source: str) -> list[dict]:
    """`rows` without the metadata columns whose values are not JSON (images, bytes, dates), with a warning
    naming them: metadata is logged and sent to remote rewards as JSON."""
    dropped = sorted({k for row in rows for k, v in row.items() if k != column and not _is_json(v)})
    if dropped:
        warnings.warn(
            f"{source}: columns {dropped} hold values that are not JSON (images, bytes, dates, ...) and "
            f"are left out of the prompts' metadata",
            stacklevel=3,
        )
        rows = [{k: v for k, v in row.items() if k not in dropped} for row in rows]
    return rows


def _is_json(value) -> bool:
    """True for None, str, bool, int, float, and lists and str-keyed dicts of them."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_is_json(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_json(v) for k, v in value.items())
    return False


def _one_line(error: BaseException) -> str:
    """An exception as one line: its type and its message with line breaks folded."""
    return f"{type(error).__name__}: {' '.join(str(error).split())}"


# ------------------------------------------------------------------------------------------ preference pairs

PAIR_KEYS = ("prompt", "chosen", "rejected")
LATENTS_SUFFIX = ".safetensors"
LATENTS_KEY = "latents"
PAIR_EXAMPLE = '{"prompt": "a red circle", "chosen": "good.png", "rejected": "bad.png"}'


def load_pairs(
    source: str | Path, *, size: tuple[int, int] | None = None, image_column: str = "image", split: str = "train"
) -> PromptSet:
    """Preference pairs (offline Diffusion-DPO) of a .jsonl file (one JSON object per line) or `hf:ORG/NAME` /
    `hf:DIR` (split `split`): each row a `prompt`, the `chosen` and the `rejected` sample, and any other keys as
    metadata. A sample is an image (a path relative to the .jsonl file's folder or the local dataset's folder, or
    a dataset's Image feature; its size (height, width) must be `size` when given: images are not resized) or a
    `.safetensors` file holding its clean latents under the key `latents` (their shape is the model's to check).
    Returns a PromptSet whose metadata hold `chosen` and `rejected` as absolute paths (images of a dataset written
    once to `datasets`' cache), with the conditioning images of `image_column` resolved as `load_prompts` does.
    Raises PromptFileError, one line naming the file and line (or dataset row) and the fix."""
    source = str(source)
    if source.startswith(HF_PREFIX):
        datasets, table, where, base = _hf_table(source, split, "")
        if len(table) == 0:
            raise PromptFileError(f"{where}: no pairs: the split has no rows")
        cache = _image_cache(datasets)
        rows = [(f"{where} row {i}", row, base, cache) for i, row in enumerate(table.to_list())]
    else:
        path = Path(source)
        if path.suffix != ".jsonl":
            raise PromptFileError(
                f"pairs {source!r}: unknown format {path.suffix or '(no extension)'!r}; valid: a .jsonl file (one "
                f"JSON object per line, e.g. {PAIR_EXAMPLE}) or hf:ORG/NAME (hf:DIR for a local copy)"
            )
        if path.is_file() and not path.read_bytes().strip():
            raise PromptFileError(
                f"{path}: no pairs: the file is empty; write one JSON object per line, e.g. {PAIR_EXAMPLE}"
            )
        rows = [(where, row, path.parent, None) for where, row in _file_rows(path, "prompt")]
    pairs = []
    for where, row, base, cache in rows:
        missing = [k for k in PAIR_KEYS if k not in row]
        if missing:
            raise PromptFileError(
                f"{where}: no {' or '.join(map(repr, missing))}: a pair row has the keys 'prompt', 'chosen' and "
                f"'rejected' (an image, or a .safetensors file of latents), other keys are metadata; this row has "
                f"{sorted(row)}"
            )
        row = {**row, **{key: _pair_sample(row, key, where, base, cache, size) for key in ("chosen", "rejected")}}
        if image_column and cache is not None and row.get(image_column) is not None:
            row = _hf_images(row, where, image_column, base, cache)
        elif image_column:
            row = _with_images(row, where, image_column, base or Path.cwd())
        pairs.append((where, row))
    rows = _json_columns([row for _, row in pairs], "prompt", source)
    return _prompt_set(zip([where for where, _ in pairs], rows), "prompt", "{prompt}", ["prompt"])


def _pair_sample(row: dict, key: str, where: str, base: Path | None, cache: Path | None, size) -> str:
    """The absolute path of a pair's `key` sample: a latents file (checked to hold `latents`) or an image (checked
    to be readable, and of `size` (height, width) when given)."""
    value = row[key]
    if isinstance(value, str) and value.strip().endswith(LATENTS_SUFFIX):
        file = (base or Path.cwd()) / Path(value).expanduser()
        if not file.is_file():
            raise PromptFileError(f"{where}: {key} latents {value!r} do not exist (looked for {file.resolve()})")
        return _latents_file(file.resolve(), where, key)
    if value is None or (cache is None and not (isinstance(value, str) and value.strip())):
        raise PromptFileError(
            f"{where}: {key!r} must be an image (a path relative to the pairs file's folder) or a .safetensors file "
            f"of latents, got {_clip(repr(value))}"
        )
    if cache is not None:  # a dataset's image (a PIL image, bytes or a path)
        path = _hf_images({key: value}, where, key, base, cache)[key][0]
    else:
        path = _with_images({key: value}, where, key, base)[key][0]
    if size is not None:
        from .images import upright_size

        w, h = upright_size(path)  # as the pair's image is encoded (upright, as its EXIF orientation says)
        if (h, w) != tuple(size):
            raise PromptFileError(
                f"{where}: {key} image {path} is {w}x{h} pixels and the run trains at {size[1]}x{size[0]} "
                f"(sample.width x sample.height); write the pairs' images at that size (they are not resized)"
            )
    return path


def _latents_file(file: Path, where: str, key: str) -> str:
    """`file` as a string when it is a safetensors file holding `latents` (its header read, no tensor loaded)."""
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            keys = list(f.keys())
    except Exception as e:  # safetensors raises its own error types for truncated or foreign files
        raise PromptFileError(f"{where}: {key} latents {file} is not a readable safetensors file: {_one_line(e)}")
    if LATENTS_KEY not in keys:
        raise PromptFileError(
            f"{where}: {key} latents {file} hold no tensor {LATENTS_KEY!r} (its keys: {keys}); save one sample's clean "
            f"latents as save_file({{'{LATENTS_KEY}': x0}}, path)"
        )
    return str(file)


def read_latents(path: str) -> torch.Tensor:
    """The clean latents of a pair's `.safetensors` file, float32."""
    from safetensors.torch import load_file

    return load_file(path)[LATENTS_KEY].float()


def latents_shape(path: str) -> tuple[int, ...]:
    """The shape of a pair's `.safetensors` latents, from the file's header alone."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        return tuple(f.get_slice(LATENTS_KEY).get_shape())


# ------------------------------------------------------------------------------------------ prompt lengths

#: the log lines of diffusers' pipelines and transformers' tokenizers about a prompt cut to the text encoder's
#: length: the first holds the cut text (hundreds of KB for a long prompt), both repeat at every encode
TRUNCATION_LOGS = ("The following part of your input was truncated", "Token indices sequence length is longer than")


class _TruncationLogFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(TRUNCATION_LOGS)


_TRUNCATION_FILTER = _TruncationLogFilter()


@dataclass
class TokenLimit:
    """A text encoder's prompt length in tokens: what the truncation warning calls its tokens ("CLIP", "T5"; "" for
    a text model's own), the length, a note on it (the setting that sets it), and a function giving the token
    count of each prompt as the policy tokenizes it."""

    name: str
    limit: int
    note: str
    count: Callable[[list[str]], list[int]]

    def tokens(self, n: int) -> str:
        """`n` of these tokens, in words: "77 CLIP tokens"."""
        return f"{n} {self.name} tokens" if self.name else f"{n} tokens"


def check_prompt_lengths(policy, sets: dict[str, PromptSet], *, warn: bool = True) -> None:
    """Silence the libraries' own truncation logs (`TRUNCATION_LOGS`) for `policy`'s model and, with `warn`, give
    one warning per prompt set (`sets`: config key -> PromptSet; a set given under two keys is checked once) whose
    prompts are longer than a text encoder of the policy takes: how many are cut, to how many tokens, and the first
    one's file:line. Image families that wrap the prompt in a chat template (Qwen-Image, Z-Image, FLUX.2) count the
    prompt alone, so a prompt a few tokens short of the limit may be cut unwarned."""
    limits = _token_limits(policy)
    if not warn:
        return
    seen: set[int] = set()
    for key, prompts in sets.items():
        if id(prompts) in seen:
            continue
        seen.add(id(prompts))
        message = truncation_message(key, prompts, limits)
        if message:
            warnings.warn(message, stacklevel=2)


def truncation_message(key: str, prompts: PromptSet, limits: list[TokenLimit]) -> str:
    """The warning about the prompts of `prompts` (config key `key`) longer than a limit of `limits`; "" when
    none is."""
    texts = list(prompts.prompts)
    over: list[tuple[TokenLimit, list[int]]] = []  # each limit with the token counts of every prompt
    for limit in limits:
        counts = limit.count(texts)
        if any(n > limit.limit for n in counts):
            over.append((limit, counts))
    if not over:
        return ""
    cut = [i for i in range(len(texts)) if any(counts[i] > limit.limit for limit, counts in over)]
    parts = ", ".join(
        f"{sum(n > limit.limit for n in counts)} to {limit.tokens(limit.limit)}"
        + (f" ({limit.note})" if limit.note else "")
        for limit, counts in over
    )
    first = cut[0]
    lengths = ", ".join(limit.tokens(counts[first]) for limit, counts in over)
    if not any(limit.name for limit in limits):  # a text model's own prompt
        encoders = "prompt length"
    else:
        encoders = "text encoders" if len(limits) > 1 else "text encoder"
    return (
        f"{key}: {len(cut)} of {len(texts)} prompts are too long for the model's {encoders} and are cut: "
        f"{parts}; the first is {prompts.origins[first]} ({len(texts[first])} characters, {lengths}); the model "
        f"never sees the cut part"
    )


def _token_limits(policy) -> list[TokenLimit]:
    """The prompt lengths of `policy`'s text encoders (an image policy's pipeline tokenizers, a text policy's
    prompt), with the libraries' truncation logs silenced for them."""
    logging.getLogger("transformers.tokenization_utils_base").addFilter(_TRUNCATION_FILTER)
    backend = getattr(policy, "backend", None)
    if backend is not None:
        return _pipeline_limits(backend)
    tokenizer, text = getattr(policy, "tokenizer", None), getattr(policy, "text", None)
    if tokenizer is None or text is None:
        return []

    def count(texts: list[str]) -> list[int]:
        formatted = [policy.format_prompt(t) for t in texts]
        ids = tokenizer(formatted, add_special_tokens=not policy.use_chat, verbose=False)["input_ids"]
        return [len(i) for i in ids]

    limit = getattr(policy, "prompt_limit", None) or text.max_prompt_length
    why = (
        "text.max_prompt_length"
        if limit == text.max_prompt_length
        else "the model's positions less text.max_new_tokens, below text.max_prompt_length"
    )
    return [TokenLimit("", limit, f"{why}; a prompt's last tokens are kept", count)]


def _pipeline_limits(backend) -> list[TokenLimit]:
    """The prompt lengths of an image backend's pipeline: each CLIP tokenizer's model_max_length, and the
    family's max_sequence_length for its other text encoder (T5, Gemma, Qwen, ...); the pipeline's modules' truncation
    logs silenced."""
    pipe = backend.pipe
    for cls in type(pipe).__mro__:
        if cls.__module__.startswith("diffusers."):
            logging.getLogger(cls.__module__).addFilter(_TRUNCATION_FILTER)
    limits: dict[tuple[str, int], TokenLimit] = {}
    for suffix in ("", "_2", "_3"):
        tokenizer, encoder = getattr(pipe, f"tokenizer{suffix}", None), getattr(pipe, f"text_encoder{suffix}", None)
        tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a processor (FLUX.2 [dev]'s) holds its tokenizer
        if tokenizer is None or encoder is None:  # none, or left out (model.drop_t5)
            continue
        name = str(getattr(encoder.config, "model_type", ""))
        if name.startswith("clip"):
            name, limit, note = "CLIP", tokenizer.model_max_length, ""
        elif backend.default_max_sequence_length is not None and backend.max_sequence_length:
            limit, note = backend.max_sequence_length, "sample.max_sequence_length"
        else:
            continue
        name = name.upper() if name in ("t5", "umt5") else name

        def count(texts: list[str], tokenizer=tokenizer) -> list[int]:
            return [len(ids) for ids in tokenizer(texts, verbose=False)["input_ids"]]

        limits.setdefault((name, limit), TokenLimit(name, limit, note, count))
    return list(limits.values())
