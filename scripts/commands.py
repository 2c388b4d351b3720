"""The `selfspec` command: one subcommand per entry point, `selfspec train eagle [overrides]`, `selfspec generate ...`.

A subcommand runs the `main` of its module (an `@selfspec.core.cli.entry` function) on the rest of the command
line, so `selfspec generate head=... prompt=...` is `python -m selfspec.decode.generate head=... prompt=...`, and
`selfspec <command> --help` lists that command's config fields. Only the chosen module is imported (listing the
commands reads the modules' docstrings without importing them). Several processes:
`accelerate launch -m selfspec.methods.eagle.train [overrides]`.

The table sits in the top room, scripts/, the one room that may import every other (README's import map): the
ground floor, core/, names no module above it. A method's `train <name>` is its registry entry's recipe.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
from pathlib import Path

from selfspec.registry import method, names

COMMANDS = {  # subcommand -> the module whose `main(argv)` runs it: each method's recipe (registry.py), then the rest
    **{f"train {name}": method(name).recipe for name in names()},
    "generate": "selfspec.decode.generate",
    "bench": "selfspec.scripts.bench",
    "eval": "selfspec.scripts.eval_heads",
    "export": "selfspec.scripts.export",
    "import-head": "selfspec.scripts.import_head",
    "publish": "selfspec.scripts.publish",
    "regenerate": "selfspec.scripts.regenerate",
    "cache-features": "selfspec.scripts.cache_features",
    "data-stats": "selfspec.scripts.data_stats",
    "sweep-exit": "selfspec.scripts.sweep_exit",
    "serve-bench": "selfspec.scripts.serve_bench",
    "check-vllm": "selfspec.scripts.check_vllm",
    "check-vllm-features": "selfspec.scripts.check_vllm_features",
    "check-engine-families": "selfspec.scripts.check_engine_families",
    "check-gpu": "selfspec.scripts.check_gpu",
    "profile-step": "selfspec.scripts.profile_step",
    "peer-eagle": "selfspec.scripts.peer_eagle",
    "plot-curve": "selfspec.scripts.plot_curve",
    "replay-lookup": "selfspec.scripts.replay_lookup",
    "contention": "selfspec.scripts.contention",
}


LINE = 100  # longest command summary in `selfspec --help`


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help") or args[:2] in (["train", "-h"], ["train", "--help"]):
        print(usage())
        return 0
    words = 2 if args[0] == "train" else 1
    name = " ".join(args[:words])
    if name not in COMMANDS:
        known = ", ".join(c.split()[1] for c in COMMANDS if c.startswith("train ")) if args[0] == "train" else None
        print(f"error: selfspec train needs one of: {known}" if known and len(args) < 2 else
              f"error: unknown command '{name}'; `selfspec --help` lists the commands", file=sys.stderr)
        return 2
    # argv None: the `selfspec` command itself, so the entry point ends the process once its work is done
    importlib.import_module(COMMANDS[name]).main(args[words:], prog=f"selfspec {name}", program=argv is None)
    return 0


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: selfspec <command> [key=value ...] [group=option ...] [--cfg] [-h]", "",
             "Train speculative-decoding drafters from a frozen LM and decode with them, losslessly.", "",
             "commands:"]
    lines += [f"  {name:<{width}}  {summary(module)}" for name, module in COMMANDS.items()]
    lines += ["", "`selfspec <command> --help` lists a command's config fields. Several processes:",
              "`accelerate launch -m selfspec.methods.eagle.train [overrides]` (any module above runs with -m)."]
    return "\n".join(lines)


def summary(module: str) -> str:
    """The first sentence of a module's docstring, read from its source (importing would load torch)."""
    spec = importlib.util.find_spec(module)
    doc = ast.get_docstring(ast.parse(Path(spec.origin).read_text())) if spec and spec.origin else None
    text = " ".join((doc or "").split("\n\n")[0].split()).split(": `")[0]  # drop a trailing usage example
    sentence = text.split(". ")[0].rstrip(".")
    if len(sentence) > LINE:  # too long: keep what comes before its colon, else cut at a clause break
        colon = sentence.find(": ", 0, LINE)
        sentence = sentence[: colon if colon > 0 else max(sentence.rfind(sep, 0, LINE) for sep in (", ", " ("))]
    return sentence


if __name__ == "__main__":
    sys.exit(main())
