"""Built-in YAML recipes, shipped as package data."""

from __future__ import annotations

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
    """The first comment line of a recipe, as its one-line description."""
    for line in path.read_text().splitlines():
        if line.startswith("#") and line.strip("# "):
            return line.strip("# ").strip()
    return ""
