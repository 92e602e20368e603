"""A vLLM server for `text.engine: vllm`, run in vLLM's own environment (vLLM pins its own torch and
transformers; `make vllm-env` builds one: docs/text.md):

    .venv-vllm/bin/python flowrl/engines/vllm_server.py --model MODEL_DIR --port 8100

It holds one vLLM engine (in this process) and answers, one request at a time:
  GET  /health                    {"kind": "flowrl-vllm", "model", "version", "vllm", "config": the model's
                                   architecture entries of its config.json (CONFIG_KEYS)}
  POST /generate                  {"prompt_token_ids": [[int]], "max_tokens", "temperature", "top_k", "top_p",
                                   "seed", "stop_token_ids", "stop": [str], "logprobs": bool}
                               -> {"token_ids": [[int]], "logprobs": [[float]] | null, "version", "seconds"}
                                  (the log-prob of each sampled token under the tempered distribution,
                                  renormalised after top_k / top_p: flowrl asks for none under them)
  POST /update_weights            {"path": a folder of safetensors in the model's checkpoint names, "version"}
                               -> {"version", "seconds"}: reloaded in place, the prefix cache reset
This file imports nothing of flowrl's besides itself, so that it runs where flowrl's own dependencies are not
installed (only vLLM, torch and safetensors)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

KIND = "flowrl-vllm"


class Engine:
    def __init__(self, model: str, *, dtype: str, kv_cache_mb: int, max_model_len: int | None, seed: int):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in this process: weights reload in place
        from vllm import LLM

        kwargs = dict(
            model=model,
            dtype=dtype,
            seed=seed,
            enforce_eager=True,
            logprobs_mode="processed_logprobs",  # after the temperature: the update's quantity
            kv_cache_memory_bytes=kv_cache_mb * 2**20,
        )
        if max_model_len:
            kwargs["max_model_len"] = max_model_len
        self.llm = LLM(**kwargs)
        self.model = model
        self.config = model_config(model)
        self.version = 0

    def generate(self, req: dict) -> dict:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        start = time.perf_counter()
        want_lp = bool(req.get("logprobs", True))
        base = int(req.get("seed", 0))
        params = [
            SamplingParams(
                n=1,
                max_tokens=int(req["max_tokens"]),
                temperature=float(req.get("temperature", 1.0)),
                top_k=int(req.get("top_k", 0)) or -1,
                top_p=float(req.get("top_p", 1.0)),
                seed=(base + i) % 2**31,
                stop_token_ids=list(req.get("stop_token_ids") or []),
                stop=list(req.get("stop") or []) or None,
                include_stop_str_in_output=True,  # the turn's tokens through the stop string
                logprobs=0 if want_lp else None,
                detokenize=bool(req.get("stop")),  # stop strings are matched on the text
            )
            for i in range(len(req["prompt_token_ids"]))
        ]
        prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in req["prompt_token_ids"]]
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        token_ids, logprobs = [], []
        for out in outs:
            c = out.outputs[0]
            ids = list(c.token_ids)
            token_ids.append(ids)
            if want_lp:
                logprobs.append([float(step[tok].logprob) for tok, step in zip(ids, c.logprobs)])
        return dict(
            token_ids=token_ids,
            logprobs=logprobs if want_lp else None,
            version=self.version,
            seconds=time.perf_counter() - start,
        )

    def update_weights(self, req: dict) -> dict:
        from safetensors.torch import load_file

        start = time.perf_counter()
        folder = Path(req["path"])
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise ValueError(f"no *.safetensors in {folder}")
        tensors = {}
        for f in files:
            tensors.update(load_file(str(f)))
        self.llm.collective_rpc(
            "reload_weights", kwargs=dict(weights_iterator=iter(tensors.items()), is_checkpoint_format=True)
        )
        self.llm.collective_rpc(_refresh_embeddings)  # a tied output layer reads the new embedding
        self.llm.reset_prefix_cache()
        self.version = int(req["version"])
        return dict(version=self.version, seconds=time.perf_counter() - start)


#: the config.json entries /health reports: the trainer compares them with its own model's (a server holding
#: another model would sample for another policy, and the weight pushes load into it only partly)
CONFIG_KEYS = (
    "model_type",
    "architectures",
    "vocab_size",
    "hidden_size",
    "n_embd",
    "num_hidden_layers",
    "n_layer",
    "num_attention_heads",
    "n_head",
    "num_key_value_heads",
    "intermediate_size",
    "n_inner",
    "tie_word_embeddings",
)


def model_config(model: str) -> dict | None:
    """The CONFIG_KEYS of `model`'s config.json as transformers reads it; None when it cannot be read."""
    try:
        from transformers import AutoConfig

        raw = AutoConfig.from_pretrained(model).to_dict()
    except Exception:  # noqa: BLE001 - vLLM loaded it; the check is only skipped
        return None
    return {k: raw[k] for k in CONFIG_KEYS if raw.get(k) is not None}


def _refresh_embeddings(worker) -> None:
    """vLLM repacks some weights after loading (process_weights_after_loading); a reload in place skips that for
    the embedding modules, whose tied output layer then kept the old matrix: run it for them."""
    import torch

    model = worker.model_runner.model
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None and isinstance(module, torch.nn.Embedding | getattr(_vocab(), "VocabParallelEmbedding")):
            method.process_weights_after_loading(module)


def _vocab():
    from vllm.model_executor.layers import vocab_parallel_embedding

    return vocab_parallel_embedding


def make_handler(engine: Engine):
    class Handler(BaseHTTPRequestHandler):
        def _send(self, code: int, payload: dict) -> None:
            body = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, fmt, *args):  # one line per request is too much at one request per rollout
            pass

        def do_GET(self):
            if self.path.rstrip("/") == "/health":
                import vllm

                info = dict(kind=KIND, model=engine.model, version=engine.version, vllm=vllm.__version__)
                self._send(200, dict(info, config=engine.config))
            else:
                self._send(404, dict(error=f"no GET {self.path}; GET /health"))

        def do_POST(self):
            route = {"/generate": engine.generate, "/update_weights": engine.update_weights}.get(self.path.rstrip("/"))
            if route is None:
                self._send(404, dict(error=f"no POST {self.path}; POST /generate or /update_weights"))
                return
            try:
                req = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                self._send(200, route(req))
            except Exception as e:  # the client prints it in one line
                self._send(500, dict(error=f"{type(e).__name__}: {e}"))

    return Handler


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a model directory (or hub id) the trainer starts from")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8100)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--kv-cache-mb", type=int, default=64, help="the KV cache's memory (MiB)")
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument(
        "--cpu-cores",
        default=None,
        help="CPU cores the engine's threads bind to, e.g. 1 or 0-3 (vLLM's VLLM_CPU_OMP_THREADS_BIND; default: "
        "vLLM's choice, every core); leave the trainer's cores free",
    )
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.cpu_cores:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = args.cpu_cores
    engine = Engine(
        args.model, dtype=args.dtype, kv_cache_mb=args.kv_cache_mb, max_model_len=args.max_model_len, seed=args.seed
    )
    server = HTTPServer((args.host, args.port), make_handler(engine))
    print(f"flowrl vLLM server: {args.model} on http://{args.host}:{args.port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        sys.stdout.flush()


if __name__ == "__main__":
    main()
