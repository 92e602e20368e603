"""Causal LM directories as other people save them: a generation_config.json that would reshape decoding, a second
EOS id in it, fewer positions than the prompt budget, a tokenizer that appends its EOS or has none. Each runs as
the plain one does, or fails in one line naming what to fix."""

import json
import shutil
import warnings

import pytest
import torch
from conftest import save_tiny_gpt2, tiny_gpt2_overrides

from flowrl.config import load_config
from flowrl.errors import FlowrlError
from flowrl.policies.text import TextPolicy, completion_mask_from_ids


def policy(model_dir, *extra, lora=False):
    cfg = load_config(
        None,
        [
            *tiny_gpt2_overrides(model_dir),
            "text.max_new_tokens=4",
            "log.progress=false",
            f"lora.enabled={str(lora).lower()}",
            *extra,
        ],
    )
    return TextPolicy(cfg, "cpu")


def copy_with_generation_config(src, dst, **settings):
    shutil.copytree(src, dst)
    gen = json.loads((dst / "generation_config.json").read_text())
    (dst / "generation_config.json").write_text(json.dumps({**gen, **settings}))
    return dst


PROMPTS = ["10+20=", "11+21=", "12+22="]


def test_a_generation_config_of_beams_penalties_and_stop_strings_changes_no_decoding(tiny_lm, tmp_path):
    hostile = copy_with_generation_config(
        tiny_lm,
        tmp_path / "lm",
        num_beams=2,
        num_return_sequences=2,
        repetition_penalty=5.0,
        no_repeat_ngram_size=1,
        stop_strings=["1"],
        return_dict_in_generate=True,
        output_scores=True,
        max_length=5,
    )
    plain, odd = policy(tiny_lm), policy(hostile)
    assert odd.generate_greedy(PROMPTS) == plain.generate_greedy(PROMPTS)  # plain greedy, one row a prompt
    a = plain.rollout(PROMPTS, [{}] * 3, epoch=0, generator=torch.Generator().manual_seed(0))
    b = odd.rollout(PROMPTS, [{}] * 3, epoch=0, generator=torch.Generator().manual_seed(0))
    assert b.completion_ids.shape == (3, 4)
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.old_log_probs, b.old_log_probs)


def test_a_second_eos_of_the_generation_config_ends_completions_and_their_mask(tiny_lm, tmp_path):
    base = policy(tiny_lm)
    first = base._greedy(*base.encode_prompts(PROMPTS[:1]), 4)[0, 0].item()
    eos = base.tokenizer.eos_token_id
    assert first != eos  # the random model's first greedy token: made an EOS below
    two = copy_with_generation_config(tiny_lm, tmp_path / "lm", eos_token_id=[eos, first, 10**6])
    p = policy(two)
    assert p.stop_ids == [eos, first]  # the tokenizer's first; an id past the vocabulary is left out
    texts, ids = p.generate_greedy(PROMPTS[:1])
    assert ids == [[first]] and texts == [p.tokenizer.decode([first], skip_special_tokens=True)]
    mask, truncated = completion_mask_from_ids(torch.tensor([[5, first, 7, 7], [5, 6, 7, 8]]), p.stop_ids)
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]] and truncated.tolist() == [False, True]


def test_prompts_are_cut_to_the_positions_the_completion_leaves(tmp_path):
    d = save_tiny_gpt2(tmp_path / "lm", n_positions=16)
    p = policy(d)  # text.max_prompt_length 256 + 4 new tokens > 16 positions
    assert p.prompt_limit == 12
    long = "1+" * 20 + "1="
    with pytest.warns(UserWarning, match=r"cut to their last 12: the 16 positions .* text.max_new_tokens=4"):
        ids, _ = p.encode_prompts([long])
    assert ids.shape[1] == 12
    import warnings

    with warnings.catch_warnings(record=True) as again:  # said once a run, not at every call
        warnings.simplefilter("always")
        assert len(p.generate_greedy([long])[0]) == 1  # no index past GPT-2's position table
    assert not [w for w in again if "cut to their last" in str(w.message)]
    with pytest.raises(FlowrlError, match=r"text.max_new_tokens=16 leaves no room for a prompt in the 16 positions"):
        policy(d, "text.max_new_tokens=16")


def test_a_completion_that_fills_the_models_positions_fails_before_it_loads(tmp_path, no_model_load):
    from flowrl.preflight import PreflightError, check_model

    d = save_tiny_gpt2(tmp_path / "lm", n_positions=16)  # GPT-2's n_positions is its max_position_embeddings
    run = [*tiny_gpt2_overrides(d), f"log.run_dir={tmp_path / 'run'}"]
    with pytest.raises(PreflightError, match=rf"^text.max_new_tokens=16 leaves no room .* model.path={d} .*below 16$"):
        check_model(load_config(None, [*run, "text.max_new_tokens=16"]))
    check_model(load_config(None, [*run, "text.max_new_tokens=15"]))  # one position left for the prompt


def test_a_directory_without_its_tokenizer_or_weights_is_one_line(tiny_lm, tmp_path, no_model_load):
    """The preflight names what a local directory lacks; a model that gets past it (a hub snapshot whose download
    stopped, a weights file that is not one) fails in one line of the policy's, not in transformers' traceback."""
    from flowrl.preflight import PreflightError, check_text_model

    files = {p.name for p in tiny_lm.iterdir()}
    assert "model.safetensors" in files and "tokenizer.json" in files
    no_tok, no_weights = tmp_path / "no_tok", tmp_path / "no_weights"
    for d, left_out in ((no_tok, ("tokenizer.json", "tokenizer_config.json")), (no_weights, ("model.safetensors",))):
        shutil.copytree(tiny_lm, d, ignore=shutil.ignore_patterns(*left_out))
    with pytest.raises(PreflightError, match=rf"^model.path={no_tok}: no tokenizer there \(none of tokenizer.json"):
        check_text_model(str(no_tok))
    with pytest.raises(PreflightError, match=rf"^model.path={no_weights}: no weights there"):
        check_text_model(str(no_weights))
    check_text_model(str(tiny_lm))
    with pytest.raises(FlowrlError, match=rf"^model.path={no_weights}: its weights do not load \(.*model.safetensors"):
        policy(no_weights)
    bad = shutil.copytree(tiny_lm, tmp_path / "bad_tok")
    (bad / "tokenizer.json").write_text("{not json")
    with pytest.raises(FlowrlError, match=rf"^model.path={bad}: its tokenizer does not load \("):
        policy(bad)


def test_an_eos_the_tokenizer_appends_is_not_part_of_the_prompt(tiny_lm, tmp_path):
    from tokenizers import processors
    from transformers import AutoTokenizer

    d = shutil.copytree(tiny_lm, tmp_path / "lm")
    tok = AutoTokenizer.from_pretrained(d)
    tok._tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{tok.bos_token} $A {tok.eos_token}",
        special_tokens=[(tok.bos_token, tok.bos_token_id), (tok.eos_token, tok.eos_token_id)],
    )
    tok.save_pretrained(d)
    assert AutoTokenizer.from_pretrained(d)("1=")["input_ids"][-1] == tok.eos_token_id
    ids, attn = policy(d).encode_prompts(PROMPTS[:2])
    plain_ids, plain_attn = policy(tiny_lm).encode_prompts(PROMPTS[:2])
    assert torch.equal(ids, plain_ids) and torch.equal(attn, plain_attn)


def test_a_tokenizer_without_an_eos_is_one_line(tiny_lm, tmp_path):
    d = shutil.copytree(tiny_lm, tmp_path / "lm")
    config = json.loads((d / "tokenizer_config.json").read_text())
    config["eos_token"] = None
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(FlowrlError, match=r"its tokenizer has no EOS token, so completions could never end; set one"):
        policy(d)


def test_a_lora_policy_builds_and_saves_without_library_warnings(tiny_lm, tmp_path, capsys):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        p = policy(tiny_lm, lora=True)
        # a hub id as the base model: peft's "auto" embedding check would look it up on the hub at every save
        p.model.peft_config["default"].base_model_name_or_path = "org/not-cached"
        p.lora_state()
        p.export(tmp_path / "lora")
        policy(tiny_lm).export(tmp_path / "full")
    messages = [str(w.message) for w in caught]
    assert not [m for m in messages if "is_gradient_checkpointing" in m or "Could not find a config" in m], messages
    assert "Writing model shards" not in capsys.readouterr().err  # log.progress=false


def test_a_model_that_is_not_a_causal_lm_or_a_pipeline_is_one_line(tiny_lm, tmp_path, no_model_load):
    """A T5 or a CLIP text encoder saved with its tokenizer (what AutoModelForCausalLM does not load) and a diffusers
    pipeline directory given to a text run are each one line before the model loads, naming what they are; a causal
    LM whose config names its own classes (auto_map) is left to its load."""
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5ForConditionalGeneration

    from flowrl.preflight import PreflightError, check_text_model
    from flowrl.worlds.arith import arith_tokenizer

    tok = arith_tokenizer()
    t5 = T5Config(vocab_size=len(tok), d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8)
    clip = CLIPTextConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1)
    clip.num_attention_heads = 2
    for name, model, what in (
        ("t5", T5ForConditionalGeneration(t5), r"T5ForConditionalGeneration \(model_type t5\)"),
        ("clip", CLIPTextModel(clip), r"CLIPTextModel \(model_type clip_text_model\)"),
    ):
        model.save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
        with pytest.raises(PreflightError, match=rf"^model.path={tmp_path / name} is a {what}, not a causal LM: "):
            check_text_model(str(tmp_path / name))
        # past the check (a policy built in a script): the load's own error is one line too
        with pytest.raises(FlowrlError, match=r"transformers does not load it as a causal LM \(.*\); a text run"):
            policy(tmp_path / name)
    pipeline = tmp_path / "pipeline"
    pipeline.mkdir()
    (pipeline / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusion3Pipeline"}))
    with pytest.raises(PreflightError, match=r"no config.json there: it is a diffusers pipeline .*drop backend: text$"):
        check_text_model(str(pipeline))
    custom = shutil.copytree(tmp_path / "t5", tmp_path / "custom")
    config = json.loads((custom / "config.json").read_text())
    (custom / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoModelForCausalLM": "m.Lm"}}))
    check_text_model(str(custom))
    check_text_model(str(tiny_lm))


def test_a_causal_lm_given_to_an_image_run_names_backend_text(tiny_lm):
    """A causal LM directory as an image run's model.path (a config without `backend: text`) says so, with the key
    to set, instead of "not a diffusers pipeline directory"."""
    from flowrl.families import ImageModelError, preflight_image_model

    with pytest.raises(
        ImageModelError,
        match=r"has no model_index.json: it is a causal LM \(GPT2LMHeadModel, .*"
        r"set backend: text$",
    ):
        preflight_image_model(str(tiny_lm), height=32, width=32)


def test_a_prompt_the_tokenizer_cannot_read_back_is_warned_once(tiny_lm):
    """The arithmetic tokenizer knows digits and `+-*=`: a prompt with letters is given to the model with unknown
    tokens in their place, said once a run (naming the prompt and how it reads); prompts of its characters (spaces
    aside) are not warned about."""
    from flowrl.policies.text import read_back

    p = policy(tiny_lm)
    assert read_back(p.tokenizer, "12 + 3 =", p.tokenizer("12 + 3 =", add_special_tokens=False)["input_ids"]) is None
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        p.encode_prompts(["12+30=", "10+20="])
    assert not seen
    with pytest.warns(
        UserWarning,
        match=r"a prompt does not read back whole .*'what is 2\+2\?' is given to the model "
        r"as ' *2\+2' \(characters outside its vocabulary",
    ):
        p.encode_prompts(["12+30=", "what is 2+2?"])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        p.encode_prompts(["and 3+4?"])
    assert not seen  # once a run
