"""The configuration and CLI references, generated from the code: ``docs/configuration.md`` from
the config dataclasses (every dotted key with its type, default, allowed values and help string)
and ``docs/cli.md`` from the argument parser (every verb with its arguments and flags).

``python scripts/reference.py`` rewrites both files; ``--check`` exits 1 naming the
files that are out of date (the suite runs the same comparison).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

DOCS = Path(__file__).resolve().parents[1] / "docs"
CONFIG_DOC, CLI_DOC = DOCS / "configuration.md", DOCS / "cli.md"
SECTION = "(a section: its keys below)"
GENERATED = "Generated from the code by `python scripts/reference.py`: edit the help strings, not this file."


def _type(tp: Any) -> str:
    """A field's type as a reader writes its value."""
    origin, args = get_origin(tp), get_args(tp)
    if origin is Literal:
        return "one of " + ", ".join(f"`{a}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type(a) for a in args if a is not type(None)) + (
            " or null" if type(None) in args else ""
        )
    if origin in (list, tuple):
        return f"list of {_type(args[0])}" if args else "list"
    if origin is dict:
        return f"mapping of {_type(args[0])} to {_type(args[1])}" if args else "mapping"
    if dataclasses.is_dataclass(tp):
        return f"mapping ({tp.__name__})"
    return {bool: "bool", int: "int", float: "float", str: "string"}.get(tp, getattr(tp, "__name__", str(tp)))


def _default(value: Any) -> str:
    if dataclasses.is_dataclass(value):
        value = dataclasses.asdict(value)
    if isinstance(value, dict) and value and all(dataclasses.is_dataclass(v) for v in value.values()):
        return ", ".join(f"`{k}`" for k in value) + " (each below)"  # named sections: their names
    text = json.dumps(value, default=str)
    return "`" + text.replace("|", "\\|") + "`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _field_default(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        return _default(field.default)
    if field.default_factory is not dataclasses.MISSING:
        return _default(field.default_factory())
    return "(required)"


def _rows(cls: type, prefix: str) -> list[tuple[str, str, str, str]]:
    """(dotted key, type, default, help) of every field of ``cls``, nested sections expanded."""
    hints = typing.get_type_hints(cls)
    rows = []
    for field in dataclasses.fields(cls):
        key, tp = f"{prefix}{field.name}", hints[field.name]
        help_text = field.metadata.get("help", "")
        if dataclasses.is_dataclass(tp):
            rows.append((key, "section", SECTION, help_text))
            rows += _rows(tp, f"{key}.")
            continue
        rows.append((key, _type(tp), _field_default(field), help_text))
        origin, args = get_origin(tp), get_args(tp)
        item = args[-1] if args else None
        if origin in (dict, list) and item is not None and dataclasses.is_dataclass(item):
            rows += _rows(item, f"{key}.<name>." if origin is dict else f"{key}[i].")
            if origin is dict and field.default_factory is not dataclasses.MISSING:
                rows += _named_defaults(key, item, field.default_factory())
    return rows


def _named_defaults(key: str, cls: type, named: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """The rows of a mapping's named entries present by default (``schedules.lr``): each one's
    ``value`` and every key where it differs from the ``<name>`` rows' defaults."""
    hints, plain = typing.get_type_hints(cls), cls()
    rows = []
    for name, entry in named.items():
        for f in dataclasses.fields(cls):
            value = getattr(entry, f.name)
            if f.name == "value" or value != getattr(plain, f.name):
                what = f"`{key}.{name}`, there by default: its {f.name} (its other keys at the `{key}.<name>` defaults)."
                rows.append((f"{key}.{name}.{f.name}", _type(hints[f.name]), _default(value), what))
    return rows


def _table(rows: list[tuple[str, str, str, str]]) -> list[str]:
    out = ["| key | type | default | what it does |", "|---|---|---|---|"]
    out += [f"| `{key}` | {_cell(tp)} | {default} | {_cell(help_text)} |" for key, tp, default, help_text in rows]
    return out


def configuration_reference() -> str:
    """``docs/configuration.md``: the run config's sections, then the sweep file's."""
    from raytrain_loops.config import Config
    from raytrain_loops.config.sweep import SweepConfig

    lines = [
        "# Configuration reference",
        "",
        GENERATED,
        "",
        "A recipe is a YAML file of these sections; `key=value` overrides on the command line use the",
        "same dotted keys (`precision.dtype=bf16`). Unknown keys and invalid values are refused before",
        "anything starts, with an error naming the key. `<name>` stands for a name you choose",
        "(`schedules.lr`, `schedules.my_weight`), `[i]` for an entry of a list.",
        "",
    ]
    every = _rows(Config, "")
    for field in dataclasses.fields(Config):
        lines += [f"## `{field.name}`", "", _cell(field.metadata.get("help", "")), ""]
        section = [r for r in every if r[0] == field.name or r[0].startswith(f"{field.name}.")]
        # A section's own row says nothing its heading does not.
        lines += [*_table([r for r in section if r[1] != "section" or r[0] != field.name]), ""]
    lines += [
        "## The sweep file (`raytrain-loops tune --sweep FILE`)",
        "",
        _cell(SweepConfig.__doc__ or ""),
        "",
        *_table(_rows(SweepConfig, "")),
        "",
    ]
    return "\n".join(lines)


def _action_row(action: argparse.Action) -> str:
    name = ", ".join(f"`{s}`" for s in action.option_strings) or f"`{action.metavar or action.dest}`"
    if action.nargs in ("*", "+"):
        name += " ..."
    details = []
    if action.choices:
        details.append("one of " + ", ".join(f"`{c}`" for c in action.choices))
    if action.option_strings and action.default not in (None, False, argparse.SUPPRESS):
        details.append(f"default `{action.default}`")
    if action.required and action.option_strings:
        details.append("required")
    return f"| {name} | {_cell(action.help or '')} | {'; '.join(details)} |"


def cli_reference() -> str:
    """``docs/cli.md``: each verb of ``raytrain-loops`` with its arguments and flags."""
    from raytrain_loops.cli import _parser

    parser = _parser()
    (verbs,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    helps = {a.dest: a.help for a in verbs._choices_actions}
    lines = ["# Command-line reference", "", GENERATED, "", _cell(parser.description or ""), ""]
    for verb, sub in verbs.choices.items():
        usage = " ".join(sub.format_usage().split()).removeprefix("usage: ")
        lines += [f"## `raytrain-loops {verb}`", "", _cell(helps.get(verb) or ""), "", f"    {usage}", ""]
        actions = [a for a in sub._actions if not isinstance(a, argparse._HelpAction)]
        if actions:
            lines += ["| argument | what it does | values |", "|---|---|---|", *map(_action_row, actions), ""]
    return "\n".join(lines)


def stale() -> list[Path]:
    """The generated files whose contents differ from what the code generates now."""
    wanted = {CONFIG_DOC: configuration_reference(), CLI_DOC: cli_reference()}
    return [p for p, text in wanted.items() if not p.exists() or p.read_text() != text]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python scripts/reference.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 naming the files that are out of date")
    args = ap.parse_args(argv)
    if args.check:
        out_of_date = stale()
        for path in out_of_date:
            print(f"{path} is out of date: run python scripts/reference.py", file=sys.stderr)
        return 1 if out_of_date else 0
    CONFIG_DOC.write_text(configuration_reference())
    CLI_DOC.write_text(cli_reference())
    print(f"wrote {CONFIG_DOC} and {CLI_DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
