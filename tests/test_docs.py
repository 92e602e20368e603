"""The README and the docs site say what the code does: the README's own example trains as printed, its links
resolve, every page is in the site's navigation, every pointer to a docs or samples page names a file that exists,
the pages use the config's current key spellings, and the configuration reference is generated from whatever
config tree `flowrl.config.describe()` returns. (`make test` also builds the site with `mkdocs build --strict`.)"""

import json
import re
from pathlib import Path

import yaml
from repo_files import load_module

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"


def _hooks():
    return load_module("docs/hooks.py", "docs_hooks")


def fenced_blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def section(text: str, heading: str) -> str:
    """The Markdown from `heading` to the next heading of its level."""
    level = heading.split(" ")[0]
    start = text.index(heading + "\n")
    end = text.find(f"\n{level} ", start + len(heading))
    return text[start : end if end >= 0 else len(text)]


def relative_links(text: str) -> list[str]:
    """The targets of the Markdown links and images in `text` that point into the repository."""
    targets = re.findall(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", text)
    return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:|#", t)]


# ------------------------------------------------------------------------------------------- the README


OWN = "## Your model, your reward, your prompts"


def test_the_readmes_own_model_reward_and_prompts_train_as_printed(tmp_path, monkeypatch, capsys):
    """The README's config and reward file, written out as printed, train one epoch on a model directory and a
    prompt file where the config says they are (tiny settings as overrides), and the reward reaches the metrics."""
    from flowrl.cli import main
    from flowrl.families import tiny_pipeline

    own = section(README.read_text(), OWN)
    (config_text,), (reward_text,) = fenced_blocks(own, "yaml"), fenced_blocks(own, "python")
    config_name = re.match(r"# (\S+\.yaml)\n", config_text).group(1)
    reward_name = re.match(r"# (\S+\.py)\n", reward_text).group(1)
    config = yaml.safe_load(config_text)
    (reward,) = config["rewards"]
    assert reward["name"].startswith(reward_name + ":")  # the config names the file the README prints

    monkeypatch.chdir(tmp_path)
    (tmp_path / config_name).write_text(config_text)
    (tmp_path / reward_name).write_text(reward_text)
    tiny_pipeline("tiny-sd3").save_pretrained(tmp_path / config["model"]["path"])  # "your model"
    for prompts in {config["data"]["train_prompts"], config["data"]["eval_prompts"]}:
        (tmp_path / prompts).write_text("a red circle\na blue square\na green triangle\na yellow circle\n")

    tiny = [
        "train.epochs=1",
        "sample.height=32",
        "sample.width=32",
        "sample.num_steps=3",
        "sample.max_sequence_length=16",
        "eval.num_steps=2",
        "eval.num_prompts=2",
        "eval.grid=false",
        "log.progress=false",
        "model.device=cpu",
    ]
    assert main(["train", config_name, *tiny]) == 0
    run = tmp_path / config["log"]["run_dir"]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    key = f"reward/{reward['name'].rpartition(':')[2]}_mean"  # a plug-in is named by its function
    means = [row[key] for row in rows if key in row]
    gain = reward["kwargs"]["gain"]
    assert means and 0 < means[0] < gain  # gain x a mean brightness in (0, 1)
    assert list(run.glob("ckpt-*/lora"))  # a checkpoint with the LoRA in the diffusers format
    # the eval before and after training, one line each on stderr (stdout keeps the final metrics' JSON)
    out, err = capsys.readouterr()
    final = json.loads(out[out.index("{") :])
    evals = [row for row in rows if any(k.startswith("eval/") for k in row)]
    eval_key = key.replace("reward/", "eval/")
    assert len(evals) == 2 and final[eval_key] == evals[-1][eval_key]
    b, a = evals[0][eval_key], evals[1][eval_key]
    assert f"flowrl: {eval_key}: before {b:#.4g} -> after {a:#.4g} ({a - b:+#.3g})\n" in err
    # the eval of its checkpoint, beside the base's (the run's eval before training; a plain reward counts nothing,
    # so its base is eval-base-metrics.json alone), and beside a base eval of its own (--out, then --base)
    assert main(["eval", config_name, *tiny, "--checkpoint", str(run)]) == 0
    out, err = capsys.readouterr()
    after = json.loads(out[out.index("{") :])[eval_key]
    assert f"flowrl eval: {eval_key}: base {b:#.4g} -> checkpoint {after:#.4g} ({after - b:+#.3g})\n" in err
    assert main(["eval", config_name, *tiny, "--out", "base"]) == 0
    base = json.loads((tmp_path / "base" / "eval.json").read_text())[eval_key]
    assert base == b  # the same images as the run's eval before training
    capsys.readouterr()
    assert main(["eval", config_name, *tiny, "--checkpoint", str(run), "--base", "base"]) == 0
    assert f"flowrl eval: {eval_key}: base {b:#.4g} -> checkpoint {after:#.4g}" in capsys.readouterr().err

    # the README's second command: the planner reads the same config and model directory
    assert main(["plan", config_name, "--gpus", "1"]) == 0


def test_the_quickstart_prints_the_readmes_example_unchanged():
    ours = section((DOCS / "quickstart.md").read_text(), OWN)
    theirs = section(README.read_text(), OWN)
    for lang in ("yaml", "python", "bash"):
        assert fenced_blocks(ours, lang) == fenced_blocks(theirs, lang), lang


def test_every_relative_link_in_the_readme_points_at_a_file():
    links = relative_links(README.read_text())
    assert any(link.startswith("docs/") for link in links)
    missing = [link for link in links if not (ROOT / link.split("#")[0]).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


def test_the_readme_stays_short():
    assert len(README.read_text().splitlines()) <= 150


# ------------------------------------------------------------------------------------------- the site


def _nav_pages(nav) -> list[str]:
    pages = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages.extend(_nav_pages(value) if isinstance(value, list) else [value])
    return pages


def test_every_page_is_in_the_nav_and_every_nav_entry_exists():
    site = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    nav = _nav_pages(site["nav"])
    on_disk = sorted(p.name for p in DOCS.glob("*.md"))
    generated = [_hooks().CONFIG_PAGE]
    assert sorted(set(nav) - set(generated)) == on_disk
    assert len(nav) == len(set(nav))


MENTION = re.compile(r"(?<![\w/.-])((?:docs|samples)/[\w./-]*?\.md)\b")


def test_every_mention_of_a_docs_or_samples_page_names_a_file_that_exists():
    """Pointers in the README, the pages, the samples, the configs, the scripts, the tests and the package to a
    page under docs/ or samples/ (after a page moved from samples/ to docs/, for example)."""
    sources = [
        README,
        *DOCS.glob("*.md"),
        *ROOT.glob("samples/**/*.md"),
        *ROOT.glob("configs/**/*.yaml"),
        *ROOT.glob("scripts/*.py"),
        *ROOT.glob("benchmarks/*.py"),
        *ROOT.glob("tests/*.py"),
        *ROOT.glob("flowrl/**/*.py"),
        *ROOT.glob("rewards/*.py"),
        ROOT / "Makefile",
    ]
    stale = [
        f"{src.relative_to(ROOT)}: {name}"
        for src in sources
        if src.is_file()
        for name in MENTION.findall(src.read_text())
        if not (ROOT / name).exists()
    ]
    assert not stale, stale


def test_every_page_links_inside_the_site():
    """Relative links in the pages stay in docs/ (MkDocs cannot serve a file outside it: the pictures under
    samples/ are served by docs/hooks.py as repo/<path>) and name a page or a served file."""
    served = {f"repo/{path}" for path in _hooks().REPO_FILES} | {_hooks().CONFIG_PAGE}
    bad = []
    for page in DOCS.glob("*.md"):
        for link in relative_links(page.read_text()):
            target = link.split("#")[0]
            inside = (DOCS / target).resolve().is_relative_to(DOCS)
            if target and not (inside and (DOCS / target).is_file() or target in served):
                bad.append(f"{page.name}: {link}")
    assert not bad, bad


#: GRPO's keys before each objective got its own section; the pages use train.grpo.* (the old spellings are
#: still read, and a paragraph saying so may name them).
OLD_SPELLINGS = re.compile(
    r"(?<![\w.])(?:train\.(?:policy_loss|clip_low|clip_high|dual_clip|beta|kl_std|step_weighting)"
    r"|sample\.(?:sde_type|noise_level|window|same_noise_per_group))\b"
)


def test_the_pages_use_the_objective_sections_key_spellings():
    found = []
    for page in [README, *DOCS.glob("*.md")]:
        for paragraph in page.read_text().split("\n\n"):
            if "still read" in paragraph:
                continue
            found.extend(f"{page.name}: {m}" for m in OLD_SPELLINGS.findall(paragraph))
    assert not found, found


def test_every_reward_of_the_package_is_in_the_rewards_pages_table():
    """The rewards page's table is generated from the registrations: every reward of the package has a row with its
    summary, so adding a reward adds its row (and a reward without a summary fails here)."""
    from rewards.registry import REWARDS, load_all

    hooks = _hooks()
    assert hooks.REWARDS_MARKER in (DOCS / "rewards.md").read_text()
    load_all()
    table = hooks.rewards_table().splitlines()
    for name in REWARDS.names():
        row = next((line for line in table if line.startswith(f"| `{name}` |")), None)
        summary = REWARDS.get(name).reward_summary
        assert row is not None and summary and row.endswith(f"| {hooks._cell(summary)} |"), name
    assert "| `shapes_motion` | videos |" in "\n".join(table) and "| `accuracy` | texts |" in "\n".join(table)


# ------------------------------------------------------------------------------------------- config reference


def _sections(page: str) -> dict[str, list[str]]:
    """`## `section`` heading -> the keys of its table, in order."""
    out: dict[str, list[str]] = {}
    current = None
    for line in page.splitlines():
        heading = re.match(r"## `([^`]+)`", line)
        if heading:
            current = out.setdefault(heading.group(1), [])
        elif current is not None and re.match(r"\| `[^`]+` \|", line):
            current.append(re.match(r"\| `([^`]+)` \|", line).group(1))
    return out


def test_the_config_reference_has_every_key_of_the_tree_under_its_section_with_its_doc():
    from flowrl.config import describe

    hooks = _hooks()
    page = hooks.generated_config_reference()
    rows = hooks.expand(describe(), describe)
    expected: dict[str, list[str]] = {}
    for key, *_ in rows:
        expected.setdefault(hooks.section_of(key), []).append(key)
    assert _sections(page) == expected
    assert "rewards[].name" in expected["rewards"]  # the items of a list of sections are described too
    for key, type_text, default, doc in rows:
        line = next(line for line in page.splitlines() if line.startswith(f"| `{key}` |"))
        assert hooks.value_text(default) in line and " ".join(doc.split())[:40].replace("|", "\\|") in line, key


def test_the_config_reference_walks_whatever_tree_it_is_given():
    """No list of sections of its own: a new objective section, a nested one and a list of sections all appear,
    in the order the tree names them; pipes stay inside their cell."""
    from dataclasses import dataclass

    hooks = _hooks()

    @dataclass
    class Item:
        name: str = "a"

    def describe(cls, prefix=""):
        assert cls is Item
        return [(prefix + "name", "str", "a", "The item's name.")]

    rows = [
        ("backend", "{image,text}", "image", "What is trained."),
        ("train.objective", "{grpo,nft}", "grpo", "The objective."),
        ("train.grpo.clip_low", "float", 0.2, "Lower clip, ratio >= 1 - clip_low."),
        ("train.grpo.window.kind", "{all,fixed}", "all", "Which steps are trained."),
        ("train.grpo.dual_clip", "float|null", None, "Dual clip `c|none`; c > 1."),
        ("items", "list[Item]", [Item()], "Items."),
        ("train.zeta.gamma", "bool", True, "A section no one has heard of."),
    ]
    page = hooks.config_reference(hooks.expand(rows, describe))
    assert list(_sections(page)) == ["backend", "train", "train.grpo", "train.grpo.window", "items", "train.zeta"]
    assert _sections(page)["items"] == ["items", "items[].name"]
    dual = next(line for line in page.splitlines() if "train.grpo.dual_clip" in line)
    assert dual.count(" | ") == 3  # four cells: no pipe splits one
    assert "<code>float&#124;null</code>" in dual and "<code>c&#124;none</code>" in dual and "`null`" in dual
    assert "`true`" in next(line for line in page.splitlines() if "train.zeta.gamma" in line)
