"""Tool environments of multi-turn text rollouts (`text.tool_env`): the model's turn ends at one of
`text.tool_stop`'s strings (or its EOS); the environment reads that turn and answers with text that is appended to
the completion as the environment's tokens (left out of the policy loss, the KL and the entropy: Search-R1's state
masking), and the model goes on, up to `text.max_turns` turns and `text.max_new_tokens` tokens in all. The reward
scores the whole completion (the final outcome's advantage).

An environment is a registered name (`calculator`) or a function given as `path/to/file.py:function` or
`module:function`:

    def my_env(turn: str, *, prompt: str, transcript: str, metadata: dict) -> str | None:
        ...  # the text to append, or None to end the episode

`turn` is the model's last turn (through the stop string), `transcript` the completion so far (every turn and
reply), `metadata` the prompt row's other columns; a function may name only the keywords it wants."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import operator
import re
import sys
import traceback
from pathlib import Path
from typing import Callable

from flowrl.core.registry import Registry
from flowrl.errors import ConfigError, FlowrlError


class ToolEnvError(FlowrlError):
    """A tool environment that raised or answered something other than text during a rollout."""


ToolEnv = Callable[..., "str | None"]
TOOL_ENVS: Registry[ToolEnv] = Registry("tool environment")
CONTEXT = ("prompt", "transcript", "metadata")


def load_tool_env(target: str) -> Callable[[str, dict], str | None]:
    """The environment `target` names, as `call(turn, context) -> reply or None` (context: CONTEXT's keys). A
    ConfigError of one line for a name, file, module or function that is not there."""
    if ":" not in target:
        fn = TOOL_ENVS.get(target) if target in TOOL_ENVS else None
        if fn is None:
            raise ConfigError(
                f"text.tool_env={target!r} is not a registered tool environment ({', '.join(TOOL_ENVS.names())}) "
                "nor a `file.py:function` / `module:function`"
            )
    else:
        where, name = target.rsplit(":", 1)
        module = _module(where, target)
        fn = getattr(module, name, None)
        if not callable(fn):
            found = sorted(k for k, v in vars(module).items() if inspect.isfunction(v) and not k.startswith("_"))
            raise ConfigError(f"text.tool_env={target!r}: {where} has no function {name!r}; its functions: {found}")
    signature = inspect.signature(fn)
    params = signature.parameters
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    wanted = [k for k in CONTEXT if takes_all or k in params]
    try:  # how every turn calls it, checked before the model loads
        signature.bind("turn", **dict.fromkeys(wanted))
    except TypeError as e:
        raise ConfigError(
            f"text.tool_env={target!r} is called as f(turn, *, {', '.join(CONTEXT)}) (the turn's text, and any of "
            f"those by name), but its signature is {getattr(fn, '__name__', target)}{signature} ({e})"
        ) from None
    own_file = getattr(getattr(fn, "__code__", None), "co_filename", None)

    def call(turn: str, context: dict) -> str | None:
        try:
            reply = fn(turn, **{k: context[k] for k in wanted})
        except Exception as e:  # the user's environment failed on this turn: one line naming it and the turn
            frames = traceback.extract_tb(e.__traceback__)
            mine = [f for f in frames if f.filename == own_file]  # the user's line, not the library's it called
            where = (mine or frames)[-1]
            raise ToolEnvError(
                f"text.tool_env={target!r} raised {type(e).__name__}: {e} ({where.filename} line {where.lineno}) "
                f"on the turn {turn[-80:]!r}"
            ) from e
        if reply is not None and not isinstance(reply, str):
            raise ToolEnvError(
                f"text.tool_env={target!r} returned {type(reply).__name__} {reply!r}; it must return the text to "
                "append (a str) or None to end the episode"
            )
        return reply

    call.__name__ = getattr(fn, "__name__", target)
    call.stop = list(getattr(fn, "stop", None) or [])  # the environment's own stop strings, if it declares them
    return call


def _module(where: str, target: str):
    if where.endswith(".py") or "/" in where:
        path = Path(where).expanduser().resolve()
        if not path.is_file():
            raise ConfigError(f"text.tool_env={target!r}: file {where!r} not found (looked for {path})")
        name = "flowrl_tool_env_" + re.sub(r"\W", "_", path.stem)
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as e:
            raise ConfigError(f"text.tool_env={target!r}: running {where} raised {type(e).__name__}: {e}") from e
        return module
    try:
        return importlib.import_module(where)
    except ImportError as e:
        raise ConfigError(f"text.tool_env={target!r}: cannot import module {where!r} ({e})") from None


# ------------------------------------------------------------------------------------------- calculator

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv}
CALC = re.compile(r"<calc>(.*?)</calc>", re.S)


def evaluate(expression: str) -> int:
    """An integer expression of + - * // and parentheses (nothing else: no names, no calls), evaluated exactly."""

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        raise ValueError(f"not an integer expression: {expression!r}")

    return ev(ast.parse(expression.strip(), mode="eval"))


def calculator(turn: str) -> str | None:
    """`<calc>12*34</calc>` -> `<out>408</out>`; a malformed expression -> `<out>?</out>`; a turn with no call
    ends the episode (None)."""
    calls = CALC.findall(turn)
    if not calls:
        return None
    try:
        value = evaluate(calls[-1])
    except (ValueError, SyntaxError, ZeroDivisionError, RecursionError):
        return "<out>?</out>"
    return f"<out>{value}</out>"


calculator.stop = ["</calc>"]  # the turn ends where the call does (text.tool_stop, when not set)
TOOL_ENVS.register("calculator")(calculator)
