"""Typed configuration: dataclasses built from plain dicts, YAML and dotted ``key=value`` overrides.

Every config section is a ``@dataclass(kw_only=True, slots=True)`` whose fields carry a ``help``
string in their metadata. Values are checked against the field's type annotation (``Literal``
choices included) and every error names the full dotted key, so ``precision.dtype=fp8`` fails with
``precision.dtype: must be one of 'fp32', 'bf16', 'fp16', 'auto'; got 'fp8'``.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin

import yaml

from raytrain_loops.errors import ConfigError

T = TypeVar("T")

__all__ = [
    "ConfigError",
    "opt",
    "at_least",
    "from_dict",
    "to_dict",
    "apply_overrides",
    "set_dotted",
    "parse_override",
    "read_yaml",
]


def at_least(obj: Any, minimum: float, *keys: str) -> None:
    """Raise ConfigError naming the first of ``keys`` (fields of ``obj``) below ``minimum``."""
    for key in keys:
        value = getattr(obj, key)
        if value < minimum:
            raise ConfigError(key, f"must be >= {minimum:g}; got {value}")


def opt(default: Any, help: str) -> Any:
    """A dataclass field with a default and a help string (mutable defaults are copied)."""
    if isinstance(default, (list, dict, set)) or dataclasses.is_dataclass(default):
        import copy

        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata={"help": help})
    return dataclasses.field(default=default, metadata={"help": help})


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _describe(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if dataclasses.is_dataclass(tp):
        return f"a mapping ({tp.__name__})"
    if origin in (list, tuple):
        return "a list"
    if origin is dict:
        return "a mapping"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in get_args(tp))
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``tp`` and convert what is unambiguous."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin is Literal:
        choices = get_args(tp)
        if value not in choices:
            raise ConfigError(key, f"must be one of {', '.join(repr(c) for c in choices)}; got {value!r}")
        return value
    if origin in (typing.Union, types.UnionType):
        return _union(value, tp, key)
    if dataclasses.is_dataclass(tp):
        return _section(value, tp, key)
    if origin in (list, tuple):
        if isinstance(value, str):
            value = yaml.safe_load(value)
        if isinstance(value, tuple):
            value = list(value)
        if not isinstance(value, list):
            raise ConfigError(key, f"must be a list; got {value!r}")
        (item,) = get_args(tp)[:1] or (Any,)
        return [_convert(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(key, f"must be a mapping; got {value!r}")
        _, item = get_args(tp) or (str, Any)
        return {str(k): _convert(v, item, f"{key}.{k}") for k, v in value.items()}
    if tp in _SCALARS:
        return _SCALARS[tp](value, key)
    raise TypeError(f"unsupported config annotation {tp!r} at {key}")  # a bug in a config class


def _union(value: Any, tp: Any, key: str) -> Any:
    """The first member of a union that accepts ``value``."""
    args = get_args(tp)
    if value is None and type(None) in args:
        return None
    for arg in args:
        if arg is type(None):
            continue
        try:
            return _convert(value, arg, key)
        except ConfigError:
            continue
    raise ConfigError(key, f"must be {_describe(tp)}; got {value!r}")


def _section(value: Any, tp: type, key: str) -> Any:
    """A config section from a mapping (or, where the section allows it, a bare number)."""
    if isinstance(value, tp):
        return value
    if not isinstance(value, dict):
        scalar = getattr(tp, "from_scalar", None)
        if scalar is not None and isinstance(value, (int, float, str)) and not isinstance(value, bool):
            try:
                return scalar(_convert(value, float, key))
            except ConfigError:
                pass
        raise ConfigError(key, f"must be {_describe(tp)}; got {value!r}")
    return from_dict(tp, value, prefix=key)


def _to_bool(value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
        return value.lower() in ("true", "yes", "1")
    raise ConfigError(key, f"must be true or false; got {value!r}")


def _to_int(value: Any, key: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            pass
    raise ConfigError(key, f"must be an integer; got {value!r}")


def _to_float(value: Any, key: str) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    raise ConfigError(key, f"must be a number; got {value!r}")


def _to_str(value: Any, key: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise ConfigError(key, f"must be a string; got {value!r}")


_SCALARS = {bool: _to_bool, int: _to_int, float: _to_float, str: _to_str}


# The keys users bring from other trainers (Lightning's Trainer, Hugging Face's TrainingArguments,
# torch.optim's arguments), as they type them against a recipe: where each lives here.
FAMILIAR_KEYS = {
    "optim.lr": "schedules.lr.value (the learning rate is a schedule: schedules.lr.kind, .warmup_steps, .end)",
    "optim.learning_rate": "schedules.lr.value",
    "lr": "schedules.lr.value",
    "learning_rate": "schedules.lr.value",
    "optim.weight_decay": "schedules.weight_decay.value (a schedule, as the learning rate)",
    "weight_decay": "schedules.weight_decay.value",
    "trainer.max_epochs": "loop.epochs",
    "max_epochs": "loop.epochs",
    "epochs": "loop.epochs",
    "num_train_epochs": "loop.epochs",
    "trainer.max_steps": "loop.max_steps",
    "max_steps": "loop.max_steps",
    "seed": "loop.seed",
    "batch_size": "data.batch_size (per worker)",
    "per_device_train_batch_size": "data.batch_size (per worker)",
    "trainer.accumulate_grad_batches": "accum.steps",
    "gradient_accumulation_steps": "accum.steps",
    "trainer.gradient_clip_val": "clip.max_norm (with clip.mode=global)",
    "max_grad_norm": "clip.max_norm (with clip.mode=global)",
    "trainer.precision": "precision.dtype",
    "trainer.devices": "scaling.num_workers",
    "warmup_steps": "schedules.lr.warmup_steps",
}


def _unknown(key: str, full: str, value: Any, fields: dict[str, Any]) -> str:
    """Why ``full`` is refused: where a familiar key lives here, or the closest key; then the
    section's keys."""
    tried = [full, *(f"{full}.{k}" for k in value)] if isinstance(value, dict) else [full]
    familiar = next(((t, FAMILIAR_KEYS[t]) for t in tried if t in FAMILIAR_KEYS), None)
    close = difflib.get_close_matches(key, list(fields), n=1)
    if familiar:
        hint = f"; for {familiar[0]} use {familiar[1]}."
    elif close:
        hint = f"; did you mean '{close[0]}'?"
    else:
        hint = "."
    return f"unknown key{hint} Known keys here: {', '.join(sorted(fields))}."


def from_dict(cls: type[T], data: dict[str, Any] | None, prefix: str = "") -> T:
    """Build config class ``cls`` from a plain dict; unknown keys and bad values raise ConfigError.

    Fields of type ``dict[str, Section]`` merge the given entries over the default entries, so a
    recipe that sets ``schedules.lr`` keeps the default ``schedules.weight_decay``. A key of the
    class's ``RETIRED`` mapping (a key that was replaced) raises ConfigError with its message.
    """
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigError(prefix, f"must be a mapping; got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = _hints(cls)
    kwargs: dict[str, Any] = {}
    for raw_key, value in data.items():
        key = str(raw_key)
        full = f"{prefix}.{key}" if prefix else key
        if key in getattr(cls, "RETIRED", {}):  # a replaced key: say what replaces it
            raise ConfigError(full, cls.RETIRED[key])
        if key not in fields:
            raise ConfigError(full, _unknown(key, full, value, fields))
        tp = hints[key]
        if get_origin(tp) is dict and isinstance(value, dict):
            f = fields[key]
            if f.default_factory is not dataclasses.MISSING:
                merged = to_dict(f.default_factory())
                for k, v in value.items():
                    if isinstance(v, dict) and isinstance(merged.get(k), dict):
                        merged[k] = {**merged[k], **v}
                    else:
                        merged[k] = v
                value = merged
        kwargs[key] = _convert(value, tp, full)
    missing = [
        n
        for n, f in fields.items()
        if n not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        full = f"{prefix}.{missing[0]}" if prefix else missing[0]
        raise ConfigError(full, "is required")
    try:
        return cls(**kwargs)
    except ConfigError as err:
        raise err.under(prefix) from None


def to_dict(obj: Any) -> Any:
    """A plain-dict (YAML/JSON-safe) copy of a config object."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    return obj


def parse_override(text: str) -> tuple[str, Any]:
    """Split ``a.b.c=value`` into its key and its YAML-parsed value."""
    if "=" not in text:
        raise ConfigError(text, "an override must look like key=value (for example optim.name=sgd)")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(text, "an override must look like key=value (for example optim.name=sgd)")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as err:
        raise ConfigError(key, f"cannot parse value {raw!r}: {err}") from None
    return key, value


def set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    """Set ``a.b.c`` in a nested plain dict, creating sections; a section is never replaced by a value."""
    parts = key.split(".")
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            raise ConfigError(".".join(parts[: i + 1]), f"is a value ({child!r}), not a section; cannot set {key}")
        node = child
    leaf = parts[-1]
    # A task's keyword arguments are the task's to type: hf_lm's ``model`` is a directory or an
    # inline config, so a recipe's mapping there may give way to a path.
    task_argument = parts[:2] == ["task", "params"] and len(parts) == 3
    if isinstance(node.get(leaf), dict) and not isinstance(value, dict) and not task_argument:
        example = "value" if "value" in node[leaf] else next(iter(node[leaf]), "name")
        raise ConfigError(key, f"is a section; set one of its keys, for example {key}.{example}=...")
    node[leaf] = value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply dotted ``key=value`` overrides to a nested plain dict (a copy is returned).

    Key names are checked when the dict is turned into a config, so an unknown key is reported
    with its full dotted name there.
    """
    import copy

    out = copy.deepcopy(data)
    for text in overrides:
        set_dotted(out, *parse_override(text))
    return out


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping from ``path``; a missing file or a non-mapping is a ConfigError."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(str(path), "no such recipe file")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(str(path), f"is not valid YAML: {err}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(str(path), "must hold a mapping of config sections")
    return data
