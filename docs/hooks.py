"""MkDocs hooks (registered in mkdocs.yml): pages and files made at build time, so that nothing committed can go
stale.

- `config.md`, the configuration reference, is written from the config tree's own docstrings
  (`flowrl.config.describe()`), one table per section, in the order the tree declares them.
- The table of rewards on `rewards.md` is written from the rewards' registrations (their kind and `summary`),
  where the page holds REWARDS_MARKER: adding a reward adds its row.
- The few pictures the pages show live beside the files they describe (`samples/...`); they are served from
  there under `repo/samples/...` instead of being copied into docs/.
"""

from __future__ import annotations

import dataclasses
import html
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: Files outside docs/ that pages show, as repository paths; a page links to `repo/<path>`.
REPO_FILES = (
    "samples/shapes/demo_before_after.png",
    "samples/shapes/demo_curves.png",
    "samples/shapes/test_samples.png",
    "samples/shapes/race/race.png",
    "samples/shapes/race/race-val.png",
    "samples/arith/grpo_curve.png",
)

CONFIG_PAGE = "config.md"
REWARDS_PAGE = "rewards.md"
REWARDS_MARKER = "<!-- the table of the package's rewards, generated from their registrations by docs/hooks.py -->"

INTRO = """# Configuration reference

Every key of the config tree, with its type, its default and its documentation, generated from the docstrings
in the config's dataclasses when this site is built (`flowrl train --help` prints the same text). A key is set
in a YAML preset under its section, or on the command line as `key=value` after the command:

```bash
flowrl train configs/tiny_cpu.yaml train.lr=1e-4 sample.group_size=8 rewards.0.weight=2
```

An unknown key is an error that names the close valid keys (including the names TRL, diffusers and Flow-GRPO
use for them), and every numeric key has a valid range, checked before any model loads.
"""


def value_text(value) -> str:
    """A default as a YAML preset or a `key=value` override writes it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value if value else '""'
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return value_text(dataclasses.asdict(value))
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {value_text(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(value_text(v) for v in value) + "]"
    return repr(value)


def _cell(text: str) -> str:
    """Markdown that stays in one table cell: one line, and no `|` that would split it (an escaped one outside code;
    inside a code span, which would keep the backslash, an HTML `<code>` with the pipe as an entity)."""
    parts = " ".join(str(text).split()).split("`")
    if len(parts) % 2 == 0:  # an unpaired backtick: no code spans to keep
        return "`".join(parts).replace("|", "\\|")
    out = []
    for i, part in enumerate(parts):
        if i % 2 == 0:
            out.append(part.replace("|", "\\|"))
        elif "|" in part:
            out.append("<code>" + html.escape(part).replace("|", "&#124;") + "</code>")
        else:
            out.append(f"`{part}`")
    return "".join(out)


def _code(text: str) -> str:
    """`text` as inline code in a table cell."""
    return _cell("`" + " ".join(str(text).split()).replace("`", "'") + "`")


def expand(rows, describe) -> list[tuple[str, str, object, str]]:
    """`rows` with every list of sections (a default that is a list of dataclasses, like `rewards`) followed by
    the keys of one item, as `rewards[].name`, ...: found from the values, not from a list of names."""
    out = []
    for key, type_text, default, doc in rows:
        out.append((key, type_text, default, doc))
        items = default if isinstance(default, list) else []
        if items and all(dataclasses.is_dataclass(item) for item in items):
            out.extend(describe(type(items[0]), f"{key}[]."))
    return out


def section_of(key: str) -> str:
    """`train.nft.beta` -> `train.nft`; a top-level key (`backend`) and the items of a top-level list
    (`rewards[].name`) -> their own first part."""
    head, _, _ = key.rpartition(".")
    return (head[:-2] if head.endswith("[]") else head) or key


def config_reference(rows) -> str:
    """The reference page: one `##` section per dotted prefix, in the order `rows` first names it, each a table
    of key, type, default and documentation."""
    sections: dict[str, list] = {}
    for row in rows:
        sections.setdefault(section_of(row[0]), []).append(row)
    lines = [INTRO]
    lines.append("Sections: " + ", ".join(f"[`{name}`](#{_anchor(name)})" for name in sections) + ".\n")
    for name, members in sections.items():
        lines.append(f"## `{name}` {{#{_anchor(name)}}}\n")
        lines.append("| key | type | default | what it does |")
        lines.append("| --- | --- | --- | --- |")
        for key, type_text, default, doc in members:
            lines.append(f"| {_code(key)} | {_code(type_text)} | {_code(value_text(default))} | {_cell(doc) or '-'} |")
        lines.append("")
    return "\n".join(lines)


def _anchor(section: str) -> str:
    return "section-" + section.replace(".", "-").replace("[]", "")


def generated_config_reference() -> str:
    """The page for the config tree of this checkout."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))  # the checkout being documented, before any installed flowrl
    from flowrl.config import describe

    return config_reference(expand(describe(), describe))


def rewards_table() -> str:
    """A Markdown table of the rewards of the `rewards` package: name, what it scores (image, video or text) and
    its registration's summary."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from rewards.registry import REWARDS, load_all

    load_all()
    lines = ["| name | scores | what it scores |", "| --- | --- | --- |"]
    for name in REWARDS.names():
        factory = REWARDS.get(name)
        kind = "videos" if getattr(factory, "reward_accepts", None) == ("video",) else f"{factory.reward_kind}s"
        lines.append(f"| {_code(name)} | {kind} | {_cell(getattr(factory, 'reward_summary', '')) or '-'} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------- MkDocs events


def on_files(files, config):
    from mkdocs.structure.files import File

    files.append(File.generated(config, CONFIG_PAGE, content=generated_config_reference()))
    for path in REPO_FILES:
        source = ROOT / path
        if not source.is_file():
            raise FileNotFoundError(f"docs/hooks.py: REPO_FILES names {path}, which does not exist")
        files.append(File.generated(config, f"repo/{path}", abs_src_path=str(source)))
    return files


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri == REWARDS_PAGE:
        if REWARDS_MARKER not in markdown:
            raise ValueError(
                f"docs/hooks.py: {REWARDS_PAGE} lost the line where the rewards' table goes: {REWARDS_MARKER}"
            )
        return markdown.replace(REWARDS_MARKER, rewards_table())
    return markdown
