"""Built-in YAML recipes, shipped as package data."""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path

from raytrain_loops.config import ConfigError


def builtin() -> dict[str, Path]:
    """Built-in recipe names and their files."""
    root = resources.files(__name__)
    return {Path(p.name).stem: Path(str(p)) for p in root.iterdir() if p.name.endswith(".yaml")}


def resolve(recipe: str) -> Path:
    """A built-in recipe name or a YAML path -> the file; anything else is a ConfigError."""
    known = builtin()
    if recipe in known:
        return known[recipe]
    path = Path(recipe).expanduser()
    if path.is_file():
        return path
    raise ConfigError(recipe, f"not a built-in recipe ({', '.join(sorted(known))}) nor a YAML file")


def describe(path: Path) -> str:
    """The first sentence of a recipe's opening comment (which may run over several lines), as its
    description."""
    lines: list[str] = []
    for line in path.read_text().splitlines():
        text = line.lstrip("#").strip()
        if not line.startswith("#") or (not text and lines):
            break
        if text:
            lines.append(text)
    paragraph = " ".join(lines)
    first = re.match(r".+?[.!?](?=\s|$)", paragraph)
    return first.group(0) if first else paragraph
