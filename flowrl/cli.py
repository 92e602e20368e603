"""The `flowrl` command line."""

from __future__ import annotations

import argparse
import sys


def _demo(args: argparse.Namespace) -> int:
    from .toy import run_toy_grpo

    print("flowrl demo: the embedded image default is not built yet, so this runs the smallest real thing:\n"
          "GRPO from flowrl.core teaching a tabular token policy to spell 'flowrl' (reward = matching letters).")
    history = run_toy_grpo(steps=args.steps, seed=args.seed)
    first, last = sum(history[:5]) / 5, sum(history[-5:]) / 5
    print(f"mean reward, first 5 steps {first:.3f} -> last 5 steps {last:.3f}")
    return 0 if last > first else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flowrl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the embedded default (offline, CPU)")
    demo.add_argument("--steps", type=int, default=60)
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=_demo)
    serve = sub.add_parser("serve-reward", add_help=False,
                           help="serve a registered reward over HTTP (see `flowrl serve-reward --help`)")
    serve.set_defaults(func=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "serve-reward":
        from rewards.server import serve_main

        return serve_main(argv[1:])
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
