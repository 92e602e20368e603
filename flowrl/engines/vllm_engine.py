"""`text.engine: vllm`: the client of a vLLM server (`flowrl.engines.vllm_server`, run in vLLM's own environment).

Each rollout sends the prompts' token ids and the sampling settings (text.temperature / top_k / top_p /
max_new_tokens, the EOS, a seed) and gets back the sampled token ids with the engine's log-prob of each token under
the tempered distribution. Before a rollout that follows an update, the trainer's weights (a LoRA merged into the
base: W + scale * B A) go to the server as a folder of safetensors with their version; the server reloads them in
place and resets its prefix cache. The server and the trainer share a filesystem (one machine, or a shared disk)."""

from __future__ import annotations

import json
import shutil
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from pathlib import Path

import torch
from torch import Tensor

from flowrl.errors import EngineError

from .base import Generation, TextEngine, register

SERVER_KIND = "flowrl-vllm"


def start_command(model: str = "MODEL_DIR", url: str = "http://127.0.0.1:8100") -> str:
    """The command that starts the server for `model` at `url`, with absolute paths (it runs from any folder): the
    Python of vLLM's environment (`vllm_python`; `make vllm-env` builds it) and this package's server script."""
    from urllib.parse import urlsplit

    try:
        port = urlsplit(url).port or 8100
    except ValueError:  # a port that is not a number: the config's check names it
        port = 8100
    python = vllm_python()
    shown = str(python) if python.exists() else "VLLM_ENV/bin/python"
    return f"{shown} {SERVER_SCRIPT} --model {model} --port {port}"


def request(url: str, payload: dict | None = None, timeout: float = 600.0, model: str = "MODEL_DIR") -> dict:
    """GET (payload None) or POST JSON to the server; one-line EngineError naming the URL on any failure."""
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            body = r.read()
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace").strip().splitlines()
        raise EngineError(f"the vLLM server at {url} answered {e.code}: {detail[-1] if detail else e.reason}") from None
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise EngineError(
            f"cannot reach the vLLM server at {url} ({reason}); start it with `{start_command(model, url)}` "
            "(docs/text.md), then run again (a training run: with checkpoint.resume=auto)"
        ) from None
    try:
        return json.loads(body)
    except json.JSONDecodeError:
        raise EngineError(
            f"{url} did not answer JSON: is it a flowrl vLLM server ({start_command(model, url)})?"
        ) from None


SERVER_SCRIPT = Path(__file__).with_name("vllm_server.py")


def vllm_python() -> Path:
    """The Python of vLLM's environment: $FLOWRL_VLLM_PYTHON, else .venv-vllm/bin/python of the checkout."""
    import os

    return Path(os.environ.get("FLOWRL_VLLM_PYTHON") or SERVER_SCRIPT.parents[2] / ".venv-vllm" / "bin" / "python")


class LocalServer:
    """A flowrl vLLM server started here in vLLM's environment (tests, benchmarks): `start()` waits for /health,
    `stop()` kills it. Its output goes to `log`."""

    def __init__(self, model: str | Path, log: str | Path, *, port: int | None = None, extra: list[str] = ()):
        import socket

        if port is None:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        self.model, self.log, self.port, self.extra, self.proc = str(model), Path(log), port, list(extra), None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 300.0) -> "LocalServer":
        import os
        import subprocess

        python = vllm_python()
        if not python.exists():
            raise EngineError(f"no vLLM environment at {python}: build it with `make vllm-env`")
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        command = [str(python), str(SERVER_SCRIPT), "--model", self.model, "--port", str(self.port), *self.extra]
        self.proc = subprocess.Popen(command, stdout=self.log.open("a"), stderr=subprocess.STDOUT, env=env)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                tail = self.log.read_text()[-3000:]
                raise EngineError(f"the vLLM server exited ({self.proc.returncode}); its log ends: {tail!r}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2):
                    return self
            except OSError:
                time.sleep(1)
        self.stop()
        raise EngineError(f"the vLLM server did not answer in {timeout:.0f} s; see {self.log}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def merged_state(policy) -> dict[str, Tensor]:
    """The policy's weights as the base model's checkpoint names, a LoRA merged in (W + its delta, computed beside
    the trained weights, which stay as they are), tied embeddings once (under the input embedding's name)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    model = policy.base_model
    state = {}
    for name, tensor in model.state_dict().items():
        if "lora_" in name:
            continue
        state[name.replace(".base_layer.", ".")] = tensor.detach()
    for name, module in model.named_modules():
        if isinstance(module, BaseTunerLayer) and "default" in getattr(module, "lora_A", {}):
            key = f"{name}.weight"
            state[key] = state[key] + module.get_delta_weight("default").to(state[key].dtype)
    if getattr(model.config, "tie_word_embeddings", False):
        out = model.get_output_embeddings()
        for name, tensor in list(state.items()):
            if out is not None and tensor.data_ptr() == out.weight.data_ptr() and name != _input_embedding_name(model):
                del state[name]
    return {k: v.contiguous().cpu() for k, v in state.items()}


def _input_embedding_name(model) -> str:
    emb = model.get_input_embeddings()
    for name, module in model.named_modules():
        if module is emb:
            return f"{name}.weight"
    return ""


@register
class VLLMEngine(TextEngine):
    name = "vllm"
    same_numerics = False

    def __init__(self, policy):
        super().__init__(policy)
        self.url = policy.text.vllm_url.rstrip("/")
        self.model = policy.cfg.model.path
        self.timeout = policy.text.engine_timeout
        self.push_seconds = 0.0
        self._dir = Path(tempfile.mkdtemp(prefix="flowrl-vllm-weights-"))
        weakref.finalize(self, shutil.rmtree, self._dir, True)  # the last pushed weights go with the engine

    def generate(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        *,
        seed: int,
        record: bool,
        max_new_tokens: int | None = None,
        stop: list[str] | None = None,
    ) -> Generation:
        t, tok = self.policy.text, self.policy.tokenizer
        prompts = [row[m.bool()].tolist() for row, m in zip(input_ids.cpu(), attention_mask.cpu())]
        out = request(
            f"{self.url}/generate",
            dict(
                prompt_token_ids=prompts,
                max_tokens=max_new_tokens or t.max_new_tokens,
                stop=list(stop or []),
                temperature=t.temperature,
                top_k=t.top_k,
                top_p=t.top_p,
                seed=seed % 2**31,
                stop_token_ids=list(self.policy.stop_ids),  # the tokenizer's EOS and the model's others
                logprobs=record,
                version=self.version,
            ),
            timeout=self.timeout,
            model=self.model,
        )
        if out.get("version") != self.version:
            raise EngineError(
                f"the vLLM server at {self.url} holds weights version {out.get('version')}, the trainer pushed "
                f"{self.version}: was it restarted? Resume the run with checkpoint.resume=auto"
            )
        ids, lps = out["token_ids"], out.get("logprobs")
        n = max((len(r) for r in ids), default=0)
        pad = tok.pad_token_id
        completion = torch.full((len(ids), n), pad, dtype=torch.long)
        log_probs = torch.zeros((len(ids), n), dtype=torch.float32) if record else None
        for i, row in enumerate(ids):
            completion[i, : len(row)] = torch.tensor(row, dtype=torch.long)
            if record:
                log_probs[i, : len(row)] = torch.tensor(lps[i], dtype=torch.float32)
        return Generation(completion_ids=completion, log_probs=log_probs)

    def push_weights(self, version: int) -> None:
        from safetensors.torch import save_file

        start = time.perf_counter()
        folder = self._dir / f"v{version}"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        save_file(merged_state(self.policy), str(folder / "model.safetensors"), metadata={"format": "pt"})
        payload = dict(path=str(folder), version=version)
        request(f"{self.url}/update_weights", payload, timeout=self.timeout, model=self.model)
        for old in self._dir.iterdir():  # the server has read them
            if old != folder:
                shutil.rmtree(old, ignore_errors=True)
        self.push_seconds = time.perf_counter() - start

    def close(self) -> None:
        shutil.rmtree(self._dir, ignore_errors=True)
