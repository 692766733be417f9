"""The generated references (docs/configuration.md, docs/cli.md) are those the code generates now,
and they name every key a config holds and every verb the CLI has."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

from raytrain_loops.config import Config, to_dict
from raytrain_loops.driver.run_checks import flatten

# The generator is a developer's script (it reads the CLI, the package's top floor), not a module of the package.
_spec = importlib.util.spec_from_file_location("reference", Path(__file__).resolve().parents[2] / "scripts" / "reference.py")
reference = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(reference)


def test_the_generated_references_are_up_to_date():
    assert reference.stale() == [], "run: python scripts/reference.py"


def test_the_configuration_reference_names_every_key_with_its_default():
    text = reference.configuration_reference()
    rows = re.findall(r"^\| `([^`]+)` \| ([^|]+) \| ([^|]*) \|", text, re.M)
    documented = {key: default for key, _, default in rows}
    for key, value in flatten(to_dict(Config())).items():
        # A named schedule's key (schedules.lr.value) has its own row where its default is not the
        # schedules.<name> rows' (those of a Schedule), and always its value.
        generic = re.sub(r"^schedules\.[^.]+\.", "schedules.<name>.", key)
        shown = documented.get(key, documented.get(generic))
        assert shown is not None, key
        assert shown.strip() == "`" + json.dumps(value).replace("|", "\\|") + "`", key
    for name, value in (("lr", "0.001"), ("weight_decay", "0.0"), ("ema_momentum", "0.999")):
        assert documented[f"schedules.{name}.value"].strip() == f"`{value}`"
    # A section's row and a required key's say so instead of a default.
    for key, tp, default in rows:
        if tp.strip() == "section":
            assert default.strip() == reference.SECTION, key
    assert documented["fault.plan[i].step"].strip() == "(required)"


def test_the_cli_reference_names_every_verb_and_flag():
    from raytrain_loops.cli import _parser

    text = reference.cli_reference()
    help_text = _parser().format_help()
    verbs = re.search(r"\{([a-z,]+)\}", help_text).group(1).split(",")
    assert verbs and all(f"## `raytrain-loops {verb}`" in text for verb in verbs)
    for flag in ("--local", "--sweep", "--format", "--working-dir", "--no-wait", "--verbose"):
        assert f"`{flag}`" in text, flag
