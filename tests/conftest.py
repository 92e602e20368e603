"""Suite-wide settings: offline, one thread for tiny models, and no network beyond loopback."""

import ipaddress
import os
import socket

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

# Tiny models: 1 thread (a second OpenMP thread makes tiny ops up to 100x slower under load).
torch.set_num_threads(1)


def _is_loopback(address) -> bool:
    if isinstance(address, (str, bytes)):  # AF_UNIX path
        return True
    host = address[0]
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name other than localhost
        return False


_real_connect = socket.socket.connect
_real_connect_ex = socket.socket.connect_ex


def _guarded(real):
    def connect(self, address):
        if self.family in (socket.AF_INET, socket.AF_INET6) and not _is_loopback(address):
            raise ConnectionRefusedError(f"tests may not open non-loopback sockets (tried {address!r})")
        return real(self, address)

    return connect


@pytest.fixture(autouse=True)
def _no_network(monkeypatch):
    """Fail any test that connects to a non-loopback address."""
    monkeypatch.setattr(socket.socket, "connect", _guarded(_real_connect))
    monkeypatch.setattr(socket.socket, "connect_ex", _guarded(_real_connect_ex))


def pytest_report_header(config):
    return (
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, HF_HUB_OFFLINE={os.environ['HF_HUB_OFFLINE']}"
    )


def perturb_lora_b(trainer, scale: float = 0.05, seed: int = 3) -> None:
    """Move every lora_B of `trainer` off zero (where the trained model is its reference, and a KL to it is 0)."""
    with torch.no_grad():
        for n, p in trainer.named_params.items():
            if "lora_B" in n:
                p.add_(scale * torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)))


def count_reference_entries(policy) -> list:
    """Wrap `policy.reference` so that each entry into the reference appends to the returned list."""
    calls, enter = [], policy.reference

    def counted():
        calls.append(1)
        return enter()

    policy.reference = counted
    return calls


def save_tiny_gpt2(d, **config):
    """A tiny random GPT-2 (seed 0) with the arithmetic tokenizer saved to `d`, and 12 addition prompts in its
    prompts.jsonl; `config`: GPT2Config fields over 2 blocks of 32 dims, 2 heads, 32 positions."""
    import json

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from flowrl.worlds.arith import arith_tokenizer

    tok = arith_tokenizer()
    torch.manual_seed(0)
    fields = {**dict(n_positions=32, n_embd=32, n_layer=2, n_head=2), **config}
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), **ids, **fields)).save_pretrained(d)
    tok.save_pretrained(d)
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10, 14) for b in range(20, 23)]
    (d / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


def tiny_gpt2_overrides(d) -> list[str]:
    """The overrides that point a text config at `save_tiny_gpt2(d)`'s model and prompts, on the CPU, rewarded by
    `accuracy` (a test adds its own batch, budget and run settings after them)."""
    return [
        "backend=text",
        f"model.path={d}",
        "model.device=cpu",
        f"data.train_prompts={d / 'prompts.jsonl'}",
        "rewards=[{name: accuracy}]",
    ]


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory):
    """A tiny random GPT-2 (2 blocks; GPT2Block is its _no_split_modules, which FSDP shards by) with the
    arithmetic tokenizer, saved to a directory, and 12 addition prompts in its prompts.jsonl."""
    return save_tiny_gpt2(tmp_path_factory.mktemp("tiny_gpt2"))


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if a model is loaded: the checks under test must come first."""
    import flowrl.policies

    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the mistake was reported")

    monkeypatch.setattr(flowrl.policies, "build_policy", refuse)


@pytest.fixture(scope="module")
def backends():
    """`backends(name)`: family `name`'s tiny backend (max_sequence_length 16), built once per test module."""
    from flowrl.families import load_image_backend

    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = load_image_backend(f"tiny-{name}", max_sequence_length=16)
        return cache[name]

    return get
