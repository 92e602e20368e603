"""flowrl.hub: a hub that cannot be reached puts the process offline at once, in one line, instead of half a minute of
retries per file; a reachable one, HF_HUB_OFFLINE already set, or a proxy leave everything as it was."""

import socket
import warnings

import pytest
from huggingface_hub import constants

from flowrl import hub


@pytest.fixture
def online(monkeypatch):
    """A process as on a machine without HF_HUB_OFFLINE or a proxy, not probed yet; every setting restored after."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    for variable in hub.PROXY_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hub, "_probed", None)
    return monkeypatch


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens there once it is closed


def test_an_unreachable_hub_goes_offline_once_with_one_line(online):
    import os

    port = closed_port()
    online.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    with pytest.warns(
        UserWarning, match=rf"^the Hugging Face hub \(127.0.0.1:{port}\) cannot be reached: models are read"
    ):
        assert hub.settle() is True
    assert constants.HF_HUB_OFFLINE is True and os.environ["HF_HUB_OFFLINE"] == "1"
    assert hub.why_offline() == f"the hub (127.0.0.1:{port}) cannot be reached"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert hub.settle() is True  # probed once: no second line


def test_a_model_not_cached_fails_at_once_naming_the_unreachable_hub(online, tmp_path):
    from flowrl.families import ImageModelError, read_hub_json

    online.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    online.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.warns(UserWarning, match="cannot be reached"):
        with pytest.raises(ImageModelError, match=r"someorg/some-sd3: model_index.json is not in .* cannot be reached"):
            read_hub_json("someorg/some-sd3", "model_index.json", cache_dir=str(tmp_path))


def test_a_reachable_hub_stays_online(online):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        online.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{server.getsockname()[1]}")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert hub.settle() is False
    assert constants.HF_HUB_OFFLINE is False


def test_hf_hub_offline_or_a_proxy_is_not_probed(online):
    def probe(*args, **kwargs):
        raise AssertionError("probed")

    online.setattr(hub, "reachable", probe)
    online.setenv("HTTPS_PROXY", "http://proxy.example:3128")
    assert hub.settle() is False  # the proxy's connection is its own
    online.setenv("HF_HUB_OFFLINE", "1")
    assert hub.settle() is True


def test_a_local_path_is_never_probed_a_hub_id_is(online, tmp_path):
    probes = []
    online.setattr(hub, "reachable", lambda *a, **k: probes.append(1) or True)
    assert hub.settle_for(str(tmp_path)) is False and probes == []
    assert hub.settle_for("openai/clip-vit-large-patch14") is False and probes == [1]


def test_loading_bars_are_off_with_log_progress_false_and_come_back(capfd):
    """log.progress=false: loading the shipped shapes model (diffusers' "Loading pipeline components", transformers'
    "Loading weights") prints no bar; with it, the bars are there; each library's own setting is put back after."""
    import diffusers.utils.logging as diffusers_logging
    import transformers.utils.logging as transformers_logging
    from diffusers import DiffusionPipeline

    def load(enabled: bool) -> str:
        capfd.readouterr()
        with hub.loading_bars(enabled):
            DiffusionPipeline.from_pretrained("samples/shapes/model")
        return capfd.readouterr().err

    assert diffusers_logging.is_progress_bar_enabled() and transformers_logging.is_progress_bar_enabled()
    assert "Loading pipeline components" not in load(False)
    assert diffusers_logging.is_progress_bar_enabled() and transformers_logging.is_progress_bar_enabled()
    assert "Loading pipeline components" in load(True)
    transformers_logging.disable_progress_bar()  # a user's own choice stays as it was
    try:
        load(False)
        assert not transformers_logging.is_progress_bar_enabled() and diffusers_logging.is_progress_bar_enabled()
    finally:
        transformers_logging.enable_progress_bar()
