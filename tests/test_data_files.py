"""Prompt data: one-line errors naming the file and line, `hf:` datasets (local copies, offline), and every preset's
prompt data shipped or named by a dataset id."""

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest

from flowrl.data import PromptFileError, load_config_prompts, load_prompts

ROOT = Path(__file__).resolve().parents[1]
PRESETS = sorted((ROOT / "configs").glob("*.yaml"))


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def _jsonl(path: Path, rows: list) -> Path:
    return _write(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


# ------------------------------------------------------------------------------------------ files


def test_positional_call_reads_txt_and_jsonl_as_before(tmp_path):
    txt = load_prompts(_write(tmp_path / "p.txt", "a cat\n\n  a dog  \n"))
    assert txt.prompts == ["a cat", "a dog"] and txt.metadata == [{}, {}]
    rows = _jsonl(tmp_path / "p.jsonl", [{"prompt": "a cow", "family": "x"}])
    assert load_prompts(str(rows)).metadata == [{"family": "x"}]


def test_column_and_template_make_the_prompt_and_the_other_columns_are_metadata(tmp_path):
    path = _jsonl(
        tmp_path / "q.jsonl",
        [
            {"question": "What is 2 + 3?", "answer": "#### 5", "level": 1},
            {"question": "What is 4 + 4?", "answer": "#### 8", "level": 2},
        ],
    )
    ps = load_prompts(path, column="question", template="Level {level}: {prompt} Answer with a number.")
    assert ps.prompts == [
        "Level 1: What is 2 + 3? Answer with a number.",
        "Level 2: What is 4 + 4? Answer with a number.",
    ]
    assert ps.metadata == [{"answer": "#### 5", "level": 1}, {"answer": "#### 8", "level": 2}]


def test_a_txt_line_is_the_prompt_column(tmp_path):
    ps = load_prompts(_write(tmp_path / "p.txt", "a red apple\n"), column="question", template="{question}, photo")
    assert ps.prompts == ["a red apple, photo"]


def test_the_built_in_prompts_take_the_template_and_old_mac_line_endings_split_lines(tmp_path):
    from flowrl.data import BUILTIN_PROMPTS

    assert load_prompts(None, template="a photo of {prompt}").prompts == [f"a photo of {p}" for p in BUILTIN_PROMPTS]
    assert load_prompts(None).prompts == list(BUILTIN_PROMPTS)
    with pytest.raises(PromptFileError, match=r"built-in prompt #1 .*names column 'style', which this row lacks"):
        load_prompts(None, template="a {style} photo of {prompt}")
    assert load_prompts(_write(tmp_path / "mac.txt", "a cat\ra dog\r")).prompts == ["a cat", "a dog"]


def test_a_json_string_holding_a_line_separator_stays_one_row(tmp_path):
    # U+2028 is legal unescaped inside a JSON string; str.splitlines would cut the row in two
    path = _jsonl(tmp_path / "p.jsonl", [{"prompt": "first\u2028second"}, {"prompt": "third"}])
    assert load_prompts(path).prompts == ["first\u2028second", "third"]


def test_a_utf8_byte_order_mark_is_not_part_of_the_first_prompt(tmp_path):
    path = tmp_path / "p.txt"
    path.write_bytes(b"\xef\xbb\xbfa cat\r\na dog\r\n")
    assert load_prompts(path).prompts == ["a cat", "a dog"]


@pytest.mark.parametrize("text, state", [("", "is empty"), ("\n  \n\t\n", "holds only blank lines")])
@pytest.mark.parametrize("suffix", [".txt", ".jsonl"])
def test_a_file_without_prompts_is_an_error_naming_it(tmp_path, text, state, suffix):
    path = _write(tmp_path / f"p{suffix}", text)
    with pytest.raises(PromptFileError, match=rf"^{re.escape(str(path))}: no prompts: the file {state}; write one"):
        load_prompts(path)


def test_a_file_that_is_not_utf8_names_the_line_and_byte_offset(tmp_path):
    path = tmp_path / "p.txt"
    path.write_bytes(b"a cat\nan \xe9clair\n")  # Latin-1 e-acute: byte 9 of the file, byte 4 of line 2
    with pytest.raises(
        PromptFileError,
        match=rf"^{re.escape(str(path))}:2: not UTF-8 text: byte 0xe9 at byte "
        r"offset 9 \(byte 4 of the line\); save the file as UTF-8$",
    ):
        load_prompts(path)


def test_a_malformed_jsonl_row_names_file_line_and_the_parser_message(tmp_path):
    path = _write(tmp_path / "p.jsonl", '{"prompt": "a cat"}\n{"prompt": "a dog",}\n')
    with pytest.raises(PromptFileError) as info:
        load_prompts(path)
    try:
        json.loads('{"prompt": "a dog",}')
    except json.JSONDecodeError as e:
        expected = f"{path}:2: not valid JSON: {e.msg} at column {e.colno}; each line must be one JSON object"
    assert str(info.value).startswith(expected) and "\n" not in str(info.value)


@pytest.mark.parametrize("row, kind", [(["a cat"], "an array"), ("a cat", "a string"), (3, "a number")])
def test_a_row_that_is_not_an_object_is_an_error(tmp_path, row, kind):
    path = _jsonl(tmp_path / "p.jsonl", [{"prompt": "ok"}, row])
    with pytest.raises(
        PromptFileError,
        match=rf"p.jsonl:2: a row must be a JSON object with a 'prompt' key, "
        rf"got {kind}",
    ):
        load_prompts(path)


@pytest.mark.parametrize(
    "value, shown", [(12, "12 (int)"), ("  ", "'  ' (str)"), (None, "None (NoneType)"), (["a"], "['a'] (list)")]
)
def test_a_prompt_that_is_not_a_non_empty_string_is_an_error(tmp_path, value, shown):
    path = _jsonl(tmp_path / "p.jsonl", [{"prompt": value}])
    expected = r"p.jsonl:1: the prompt \('prompt'\) must be a non-empty string, got " + re.escape(shown) + "$"
    with pytest.raises(PromptFileError, match=expected):
        load_prompts(path)


def test_a_conversational_row_is_named_as_one(tmp_path):
    """TRL's conversational rows (a `messages` or `prompt` list of role/content dicts): one line saying that a
    prompt is text and the chat template is applied by flowrl (it pointed at data.prompt_column=answer)."""
    chat = [{"role": "user", "content": "What is 2+2?"}]
    for row, key in (({"messages": chat, "answer": "4"}, "messages"), ({"prompt": chat, "answer": "4"}, "prompt")):
        path = _jsonl(tmp_path / f"{key}.jsonl", [row])
        with pytest.raises(PromptFileError, match=rf"{key}.jsonl:1: '{key}' is a conversation \(a list of role"):
            load_prompts(path)


def test_a_missing_prompt_column_lists_the_row_keys_and_the_config_key(tmp_path):
    path = _jsonl(tmp_path / "p.jsonl", [{"text": "a cat", "id": 1}])
    with pytest.raises(
        PromptFileError,
        match=r"p.jsonl:1: no prompt column 'prompt' \(data.prompt_column\); "
        r"the row's keys are \['id', 'text'\]; data.prompt_column=text if that column holds the prompt$",
    ):
        load_prompts(path)
    # the hint names only the columns of text, and all of them when there are several
    path = _jsonl(tmp_path / "q.jsonl", [{"caption": "a cat", "title": "cats", "id": 1}])
    with pytest.raises(PromptFileError, match=r"the column of text that holds the prompt \(caption, title\)$"):
        load_prompts(path)
    path = _jsonl(tmp_path / "r.jsonl", [{"id": 1}])
    with pytest.raises(PromptFileError, match=r"the row's keys are \['id'\]$"):
        load_prompts(path)


def test_a_template_naming_a_column_the_row_lacks_is_an_error(tmp_path):
    path = _jsonl(tmp_path / "p.jsonl", [{"prompt": "a cat", "style": "oil"}, {"prompt": "a dog"}])
    with pytest.raises(
        PromptFileError,
        match=r"p.jsonl:2: data.prompt_template '\{prompt\}, \{style\} painting' "
        r"names column 'style', which this row lacks; "
        r"its columns are \['prompt'\]",
    ):
        load_prompts(path, template="{prompt}, {style} painting")


@pytest.mark.parametrize(
    "template, problem",
    [
        ("{prompt", "is not a valid format string"),
        ("{} please", "every {} field needs a column name"),
        ("a fixed prompt", "names no column"),
    ],
)
def test_a_bad_template_is_an_error_before_reading(tmp_path, template, problem):
    path = _write(tmp_path / "p.txt", "a cat\n")
    expected = re.escape(f"data.prompt_template {template!r}") + ".*" + re.escape(problem)
    with pytest.raises(PromptFileError, match=expected):
        load_prompts(path, template=template)


def test_a_missing_file_names_it_the_working_directory_and_the_files_beside_it(tmp_path):
    _write(tmp_path / "train.txt", "a cat\n")
    (tmp_path / "train_run.txt").mkdir()  # a folder is not a prompt file, whatever its name
    missing = tmp_path / "trian.txt"
    with pytest.raises(
        PromptFileError,
        match=rf"prompt file '{re.escape(str(missing))}' does not exist .*"
        rf"{re.escape(os.getcwd())}.*prompt files in [^:]*: train.txt$",
    ) as info:
        load_prompts(missing)
    assert isinstance(info.value, FileNotFoundError)  # what load_prompts raised before


@pytest.mark.parametrize("name", ["prompts.xlsx", "prompts"])
def test_an_unknown_extension_lists_the_formats(tmp_path, name):
    path = _write(tmp_path / name, "a cat\n")
    with pytest.raises(
        PromptFileError, match=r"unknown format .*; valid: \.txt .*\.jsonl .*\.json .*\.csv or \.tsv .*hf:ORG/NAME"
    ):
        load_prompts(path)


def test_a_parquet_file_is_sent_to_an_hf_folder_or_jsonl(tmp_path):
    path = _write(tmp_path / "prompts.parquet", "PAR1")
    with pytest.raises(PromptFileError, match=r"a \.parquet file is read as a dataset: .*hf:FOLDER .*\.jsonl"):
        load_prompts(path)
    with pytest.raises(PromptFileError) as info:
        load_prompts(_write(tmp_path / "prompts.yaml", "a cat\n"))
    assert "hf:FOLDER" not in str(info.value)


@pytest.mark.parametrize("name", ["prompts", "prompts.txt"])
def test_a_directory_is_named_as_one_with_the_file_or_hf_folder_to_give(tmp_path, name):
    folder = tmp_path / name
    folder.mkdir()
    with pytest.raises(PromptFileError, match=r"is a directory; give a \.txt or \.jsonl file in it, or hf:") as info:
        load_prompts(folder)
    assert "unknown format" not in str(info.value)


def test_an_upper_case_extension_and_a_home_relative_path_are_read(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    _write(tmp_path / "PROMPTS.TXT", "a cat\n")
    _jsonl(tmp_path / "rows.JSONL", [{"prompt": "a dog", "style": "flat"}])
    assert load_prompts(tmp_path / "PROMPTS.TXT").prompts == ["a cat"]
    assert load_prompts("~/PROMPTS.TXT").prompts == ["a cat"]
    rows = load_prompts("~/rows.JSONL")
    assert rows.prompts == ["a dog"] and rows.metadata == [{"style": "flat"}]


# ------------------------------------------------------------------------------------------ hf: datasets


@pytest.fixture
def datasets(tmp_path, monkeypatch):
    """The `datasets` module, with its cache in tmp_path (a local folder is converted into that cache)."""
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    return datasets


def _saved_gsm8k(datasets, path: Path) -> Path:
    """A two-split dataset shaped like GSM8K (question, answer ending in '#### N'), written with save_to_disk."""
    train = {
        "question": [
            "Ana has 3 boxes of 4 pens. How many pens does she have?",
            "A bus holds 30 people and 12 get off. How many are left?",
        ],
        "answer": ["3 boxes x 4 pens = <<3*4=12>>12 pens\n#### 12", "30 - 12 = <<30-12=18>>18\n#### 18"],
    }
    test = {
        "question": ["Tim reads 5 pages a day for 6 days. How many pages?"],
        "answer": ["5 * 6 = <<5*6=30>>30\n#### 30"],
    }
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_dict(train), "test": datasets.Dataset.from_dict(test)}
    ).save_to_disk(str(path))
    return path


def test_hf_loads_a_saved_dataset_split_column_template_and_metadata(datasets, tmp_path):
    local = _saved_gsm8k(datasets, tmp_path / "gsm")
    ps = load_prompts(f"hf:{local}", column="question", template="{prompt} Reply with a number.", split="test")
    assert ps.prompts == ["Tim reads 5 pages a day for 6 days. How many pages? Reply with a number."]
    assert ps.metadata == [{"answer": "5 * 6 = <<5*6=30>>30\n#### 30"}]
    assert len(load_prompts(f"hf:{local}", column="question", split="train")) == 2


def test_hf_loads_a_folder_of_jsonl_files(datasets, tmp_path):
    folder = tmp_path / "folder"
    folder.mkdir()
    _jsonl(folder / "train.jsonl", [{"prompt": "a cat", "k": 1}, {"prompt": "a dog", "k": 2}])
    _jsonl(folder / "test.jsonl", [{"prompt": "a cow", "k": 3}])
    ps = load_prompts(f"hf:{folder}", split="test")
    assert ps.prompts == ["a cow"] and ps.metadata == [{"k": 3}]


def test_hf_bad_split_names_the_splits_and_bad_column_names_the_columns(datasets, tmp_path):
    local = _saved_gsm8k(datasets, tmp_path / "gsm")
    with pytest.raises(PromptFileError, match=r"no split 'validation'; the dataset's splits are \['train', 'test'\]"):
        load_prompts(f"hf:{local}", column="question", split="validation")
    with pytest.raises(
        PromptFileError,
        match=r"no prompt column 'prompt' \(data.prompt_column\); the dataset's "
        r"columns are \['question', 'answer'\]; set data.prompt_column to the column of text that holds the prompt "
        r"\(question, answer\)$",
    ):
        load_prompts(f"hf:{local}")
    with pytest.raises(PromptFileError, match=r"names column 'level', which the dataset lacks"):
        load_prompts(f"hf:{local}", column="question", template="{level}: {prompt}")


def test_hf_rows_with_a_bad_prompt_name_the_row(datasets, tmp_path):
    local = tmp_path / "bad"
    datasets.Dataset.from_dict({"prompt": ["a cat", ""]}).save_to_disk(str(local))
    with pytest.raises(PromptFileError, match=r"\(split 'train'\) row 1: the prompt \('prompt'\) must be a non-empty"):
        load_prompts(f"hf:{local}")


def test_hf_columns_that_are_not_json_are_left_out_with_a_warning(datasets, tmp_path):
    local = tmp_path / "blobs"
    datasets.Dataset.from_dict({"prompt": ["a cat"], "blob": [b"\x00\x01"], "tags": [["pet"]]}).save_to_disk(str(local))
    with pytest.warns(UserWarning, match=r"columns \['blob'\] hold values that are not JSON"):
        ps = load_prompts(f"hf:{local}")
    assert ps.metadata == [{"tags": ["pet"]}]
    json.dumps(ps.metadata)


def test_hf_image_columns_become_cached_files_the_family_can_load(datasets, tmp_path):
    """data.image_column of a `hf:` dataset: decoded images (an Image feature), lists of them and paths relative to
    the dataset's folder all become absolute paths of files holding the same pixels; one image is written once,
    named by its content (a second load writes nothing new); a row without an image has no column."""
    from PIL import Image

    red, blue = Image.new("RGB", (8, 6), (255, 0, 0)), Image.new("RGB", (4, 4), (0, 0, 255))
    local = tmp_path / "edits"
    features = datasets.Features({"prompt": datasets.Value("string"), "image": datasets.Image()})
    datasets.Dataset.from_dict(
        {"prompt": ["make it blue", "make it red", "add a cat"], "image": [red, blue, None]}, features=features
    ).save_to_disk(str(local))
    ps = load_prompts(f"hf:{local}")
    cache = Path(datasets.config.HF_DATASETS_CACHE) / "flowrl_images"
    assert [sorted(m) for m in ps.metadata] == [["image"], ["image"], []]
    for meta, want in zip(ps.metadata, (red, blue)):
        (path,) = meta["image"]
        assert Path(path).parent == cache
        with Image.open(path) as im:
            assert im.size == want.size and np.array_equal(np.asarray(im.convert("RGB")), np.asarray(want))
    files = sorted(cache.iterdir())
    assert len(files) == 2
    assert load_prompts(f"hf:{local}").metadata == ps.metadata and sorted(cache.iterdir()) == files
    json.dumps(ps.metadata)

    many = tmp_path / "multi"
    datasets.Dataset.from_dict(
        {"prompt": ["merge them"], "image": [[red, blue]]},
        features=datasets.Features({"prompt": datasets.Value("string"), "image": datasets.Sequence(datasets.Image())}),
    ).save_to_disk(str(many))
    (meta,) = load_prompts(f"hf:{many}").metadata
    assert len(meta["image"]) == 2 and {Path(p).name for p in meta["image"]} == {f.name for f in files}

    folder = tmp_path / "paths"
    folder.mkdir()
    red.save(folder / "src.png")
    _jsonl(folder / "train.jsonl", [{"prompt": "make it blue", "image": "src.png"}])
    (meta,) = load_prompts(f"hf:{folder}").metadata
    assert meta["image"] == [str((folder / "src.png").resolve())]
    _jsonl(folder / "train.jsonl", [{"prompt": "make it blue", "image": "gone.png"}])
    with pytest.raises(
        PromptFileError,
        match=r"row 0: image 'gone.png' does not exist .*relative to the dataset's "
        r"folder",
    ):
        load_prompts(f"hf:{folder}")
    assert "image" not in load_prompts(f"hf:{local}", image_column="").metadata[0]  # off: dropped as before


def test_hf_without_the_datasets_package_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "datasets", None)  # `import datasets` now raises ImportError
    with pytest.raises(
        PromptFileError,
        match=r"need the `datasets` package, which is not installed: "
        r"pip install 'flowrl\[hf\]'",
    ):
        load_prompts("hf:openai/gsm8k")


def _offline_without_cache(datasets, tmp_path, monkeypatch, variable):
    """Offline through `variable` only, with empty caches; `datasets.load_dataset` would hit the network."""
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(variable, "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "home" / "datasets"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "home" / "hub"))
    # as if `datasets` had been imported while online: only an answer from the environment, now, avoids the network
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)


@pytest.mark.parametrize("variable", ["HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"])
def test_hf_offline_and_not_cached_fails_at_once_with_the_fix(datasets, tmp_path, monkeypatch, variable):
    _offline_without_cache(datasets, tmp_path, monkeypatch, variable)

    def no_network(*args, **kwargs):
        raise AssertionError("load_dataset was called: it would try the network (and retry) before failing")

    monkeypatch.setattr(datasets, "load_dataset", no_network)
    with pytest.raises(PromptFileError) as info:
        load_prompts("hf:openai/gsm8k", column="question", hf_config="main")
    message = str(info.value)
    assert message.startswith(
        "hf:openai/gsm8k: dataset 'openai/gsm8k' is neither a local directory nor in the Hugging Face cache"
    )
    assert f"offline ({variable}=1)" in message and f"run once with network access and {variable} unset" in message
    assert "hf:/path/to/dir" in message and "\n" not in message


def test_hf_offline_but_cached_is_loaded_from_the_cache(datasets, tmp_path, monkeypatch):
    _offline_without_cache(datasets, tmp_path, monkeypatch, "HF_HUB_OFFLINE")
    (tmp_path / "home" / "datasets" / "openai___gsm8k").mkdir(parents=True)  # what `datasets` caches it as
    calls = []

    def from_cache(name, config=None, **kwargs):
        calls.append((name, config))
        return datasets.DatasetDict({"train": datasets.Dataset.from_dict({"question": ["q?"], "answer": ["#### 1"]})})

    monkeypatch.setattr(datasets, "load_dataset", from_cache)
    ps = load_prompts("hf:openai/gsm8k", column="question", hf_config="main")
    assert ps.prompts == ["q?"] and calls == [("openai/gsm8k", "main")]


def test_hf_a_name_that_is_neither_a_directory_nor_an_id_is_an_error(datasets):
    with pytest.raises(PromptFileError, match=r"'not an id!' is neither a local directory nor a dataset id"):
        load_prompts("hf:not an id!")


# ------------------------------------------------------------------------------------------ config


def test_load_config_prompts_takes_each_part_split_and_prefixes_errors(datasets, tmp_path):
    from flowrl.config import load_config

    local = _saved_gsm8k(datasets, tmp_path / "gsm")
    common = [f"data.train_prompts=hf:{local}", "data.prompt_column=question", "data.prompt_template='{prompt}?'"]
    cfg = load_config(None, common + [f"data.eval_prompts=hf:{local}"])
    assert len(load_config_prompts(cfg.data, "train")) == 2
    assert load_config_prompts(cfg.data, "eval").prompts == ["Tim reads 5 pages a day for 6 days. How many pages??"]
    cfg = load_config(None, common)  # no eval prompts: the training prompts, their split
    assert load_config_prompts(cfg.data, "eval").prompts == load_config_prompts(cfg.data, "train").prompts
    cfg = load_config(None, common + [f"data.eval_prompts={tmp_path / 'none.txt'}"])
    with pytest.raises(PromptFileError, match=r"^data.eval_prompts: prompt file .*none.txt' does not exist"):
        load_config_prompts(cfg.data, "eval")


def test_eval_prompts_under_another_column_take_data_eval_prompt_column(tmp_path):
    """A held-out file whose prompts are under `question` while the training file's are under `prompt`:
    data.eval_prompt_column reads it (the template and the metadata as for the training prompts), a missing column
    names that key, the planner counts each file in its own column, and the key alone (no eval file) is refused."""
    from flowrl.config import ConfigError, load_config
    from flowrl.plan.image import plan_image

    train = _jsonl(tmp_path / "train.jsonl", [{"prompt": "a cat"}, {"prompt": "a dog"}])
    held = _jsonl(tmp_path / "held.jsonl", [{"question": "a red cube", "family": "colour"}])
    common = [f"data.train_prompts={train}", f"data.eval_prompts={held}", "data.prompt_template='{prompt}, photo'"]
    cfg = load_config(None, [*common, "data.eval_prompt_column=question"])
    assert load_config_prompts(cfg.data, "train").prompts == ["a cat, photo", "a dog, photo"]
    evals = load_config_prompts(cfg.data, "eval")
    assert evals.prompts == ["a red cube, photo"] and evals.metadata == [{"family": "colour"}]
    with pytest.raises(
        PromptFileError,
        match=r"^data\.eval_prompts: .*held\.jsonl:1: no prompt column 'prompt' \(data\.prompt_column\); "
        r"the row's keys are \['family', 'question'\]; set data\.eval_prompt_column to the column of text",
    ):
        load_config_prompts(load_config(None, common).data, "eval")
    with pytest.raises(PromptFileError, match=r"no prompt column 'title' \(data\.eval_prompt_column\)"):
        load_config_prompts(load_config(None, [*common, "data.eval_prompt_column=title"]).data, "eval")
    plan_image(load_config(None, [*common, "data.eval_prompt_column=question", "model.path=tiny-sd3"]), 1, 80.0)
    # an eval alone (flowrl eval) reads the eval file only: a training file that does not read is no matter
    from flowrl.preflight import PreflightError, load_prompt_sets

    gone = [f"data.train_prompts={tmp_path / 'gone.jsonl'}", f"data.eval_prompts={held}"]
    cfg = load_config(None, [*gone, "data.eval_prompt_column=question"])
    assert load_prompt_sets(cfg, train=False)[0] is None
    assert load_prompt_sets(cfg, train=False)[1].prompts == ["a red cube"]
    with pytest.raises(PreflightError, match=r"data\.train_prompts: prompt file .*gone\.jsonl' does not exist"):
        load_prompt_sets(cfg)
    with pytest.raises(
        ConfigError,
        match=r"data\.eval_prompt_column=question names the prompt column of "
        r"data\.eval_prompts, which is not set",
    ):
        load_config(None, [f"data.train_prompts={train}", "data.eval_prompt_column=question"])


# ------------------------------------------------------------------------------------------ presets


def _sources(preset: Path):
    from flowrl.config import load_config

    data = load_config(preset).data
    return data, [s for s in (data.train_prompts, data.eval_prompts) if s]


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_every_preset_prompt_source_exists(preset):
    data, sources = _sources(preset)
    for source in sources:
        if source.startswith("hf:"):
            assert re.fullmatch(r"[\w.-]+/[\w.-]+", source[3:]), f"{preset.name}: {source!r} is not an ORG/NAME id"
            continue
        path = ROOT / source
        assert path.is_file(), f"{preset.name}: {source} does not exist"
        assert len(load_prompts(path, column=data.prompt_column, template=data.prompt_template)) > 0


def test_shipped_prompt_files_hold_out_their_test_prompts():
    trains = sorted((ROOT / "samples" / "prompts").glob("*_train.txt"))
    assert [t.name for t in trains] == ["hpd_train.txt", "ocr_train.txt", "pickscore_train.txt"]
    for train in trains:
        test = train.with_name(train.name.replace("_train", "_test"))
        assert not set(load_prompts(train).prompts) & set(load_prompts(test).prompts), train.name


def test_ocr_prompts_quote_the_text_the_ocr_reward_reads():
    from rewards.ocr import quoted_target

    _, sources = _sources(ROOT / "configs" / "sd35m_ocr.yaml")
    for source in sources:
        for prompt in load_prompts(ROOT / source).prompts:
            assert quoted_target(prompt).strip(), prompt


@pytest.mark.parametrize(
    "preset, completion, format_reward",
    [
        ("text_qwen_gsm8k", "<think>3 boxes of 4 pens is 12.</think>\n<answer>12</answer>", "think_format"),
        ("text_dapo", "Three boxes of four pens: 3 * 4 = 12. So \\boxed{12}", None),
    ],
)
def test_gsm8k_presets_send_the_answer_column_to_the_accuracy_reward(
    datasets, tmp_path, preset, completion, format_reward
):
    import rewards
    from flowrl.config import load_config

    local = _saved_gsm8k(datasets, tmp_path / "gsm")
    cfg = load_config(
        ROOT / "configs" / f"{preset}.yaml", [f"data.train_prompts=hf:{local}", f"data.eval_prompts=hf:{local}"]
    )
    assert cfg.data.train_prompts and cfg.data.hf_config == "main"  # the hub id's configuration, unused by a saved copy
    train = load_config_prompts(cfg.data, "train")
    assert train.prompts[0].startswith("Ana has 3 boxes of 4 pens. How many pens does she have?\n")
    assert ("<answer>" in train.prompts[0]) == (format_reward is not None)
    assert len(load_config_prompts(cfg.data, "eval")) == 1  # the test split
    columns = {"answer": [train.metadata[0]["answer"]] * 2}
    scores = rewards.get("accuracy")([train.prompts[0]] * 2, [completion, "It is 13."], **columns)
    assert scores == [1.0, 0.0]
    if format_reward:
        assert rewards.get(format_reward)([train.prompts[0]], [completion]) == [1.0]


def test_gsm8k_presets_name_the_hub_dataset():
    from flowrl.config import load_config

    for preset in ("text_qwen_gsm8k", "text_dapo"):
        data = load_config(ROOT / "configs" / f"{preset}.yaml").data
        assert (
            data.train_prompts,
            data.eval_prompts,
            data.hf_config,
            data.prompt_column,
            data.train_split,
            data.eval_split,
        ) == ("hf:openai/gsm8k",) * 2 + ("main", "question", "train", "test")


def test_csv_and_tsv_files_are_read_by_their_header(tmp_path):
    # a quoted cell may hold the delimiter and a line break; a row of empty cells is skipped
    path = _write(
        tmp_path / "p.csv", 'prompt,category\na red apple,colors\n"two cats, one dog",counting\n,\n"a\nsign",text\n'
    )
    got = load_prompts(path)
    assert got.prompts == ["a red apple", "two cats, one dog", "a\nsign"]
    assert got.metadata == [{"category": "colors"}, {"category": "counting"}, {"category": "text"}]
    assert [o.rsplit(":", 1)[1] for o in got.origins] == ["2", "3", "6"]  # the line where each row ends
    # DrawBench's own header, by data.prompt_column
    tsv = _write(tmp_path / "drawbench.tsv", "Prompts\tCategory\nA red colored car.\tColors\n")
    assert load_prompts(tsv, column="Prompts").prompts == ["A red colored car."]
    with pytest.raises(PromptFileError, match=r"drawbench.tsv:2: no prompt column 'prompt' .*\(Prompts, Category\)$"):
        load_prompts(tsv)


@pytest.mark.parametrize(
    "text, message",
    [
        ("", r"p.csv: no prompts: the file is empty; write a header row"),
        ("prompt\n", r"p.csv: no prompts: the file has a header row and no rows under it"),
        ("prompt,\na cat,1\n", r"p.csv:1: the header's column 2 has no name"),
        ("prompt,style\na cat,flat,extra\n", r"p.csv:2: 3 cells under a header of 2 columns; quote a prompt"),
        ("prompt,style\n,flat\n", r"p.csv:2: the prompt \('prompt'\) must be a non-empty string"),
        # a quote opened and never closed: not the rest of the file as one prompt
        (
            'prompt\n"a dog, unterminated\nsecond row\nthird\n',
            r"p.csv:2: not valid \.csv text: unexpected end of "
            r"data; a cell's opening quote has no closing one$",
        ),
        ('prompt,style\n"a cat, a dog"x,flat\n', r"p.csv:2: not valid \.csv text: .*; a quoted cell ends at its "),
    ],
)
def test_a_csv_file_that_cannot_give_prompts_says_where_and_why(tmp_path, text, message):
    with pytest.raises(PromptFileError, match=message):
        load_prompts(_write(tmp_path / "p.csv", text))


def test_a_json_file_is_an_array_of_objects_or_strings(tmp_path):
    path = _write(tmp_path / "p.json", json.dumps([{"prompt": "a cat", "style": "flat"}, "a dog"]))
    got = load_prompts(path)
    assert got.prompts == ["a cat", "a dog"]
    assert got.metadata == [{"style": "flat"}, {}]
    assert got.origins == [f"{path}[0]", f"{path}[1]"]
    cases = [
        ('{"prompts": ["a cat"]}', r"p.json: a .json prompt file holds one array .*got an object \(its key 'prompts'"),
        ("[]", r"p.json: no prompts: the array is empty"),
        ('["a cat", 3]', r"p.json\[1\]: an item must be a JSON object with a 'prompt' key or a string, got int: 3"),
        ('[\n{"prompt": "a cat",}\n]', r"p.json:2: not valid JSON: .* at column"),
    ]
    for text, message in cases:
        with pytest.raises(PromptFileError, match=message):
            load_prompts(_write(tmp_path / "p.json", text))
