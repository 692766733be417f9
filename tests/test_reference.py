"""The generated references (docs/configuration.md, docs/cli.md) are those the code generates now,
and they name every key a config holds and every verb the CLI has."""

from __future__ import annotations

import json
import re

from raytrain_loops.config import Config, to_dict
from raytrain_loops.driver.run_dir import flatten
from raytrain_loops.tools import reference


def test_the_generated_references_are_up_to_date():
    assert reference.stale() == [], "run: python -m raytrain_loops.tools.reference"


def test_the_configuration_reference_names_every_key_with_its_default():
    text = reference.configuration_reference()
    documented = dict(re.findall(r"^\| `([^`]+)` \| [^|]+ \| ([^|]*) \|", text, re.M))
    for key, value in flatten(to_dict(Config())).items():
        generic = re.sub(r"^schedules\.[^.]+\.", "schedules.<name>.", key)
        assert generic in documented, key
        if generic == key:  # a named schedule's rows give the Schedule's defaults, not the recipe's
            assert documented[key].strip() == "`" + json.dumps(value).replace("|", "\\|") + "`", key


def test_the_cli_reference_names_every_verb_and_flag():
    from raytrain_loops.cli import _parser

    text = reference.cli_reference()
    help_text = _parser().format_help()
    verbs = re.search(r"\{([a-z,]+)\}", help_text).group(1).split(",")
    assert verbs and all(f"## `raytrain-loops {verb}`" in text for verb in verbs)
    for flag in ("--local", "--sweep", "--format", "--working-dir", "--no-wait", "--verbose"):
        assert f"`{flag}`" in text, flag
