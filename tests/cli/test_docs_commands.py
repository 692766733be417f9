"""What the docs tell a user to type works, and the README stays a landing page: every relative
link in README.md, docs/ and clusters/README.md resolves, and every ``raytrain-loops`` command
line in them parses (the verb and its flags, each override's key and value against the recipe,
``task.params.*`` against the named task's constructor). A synopsis (``RECIPE``,
``<checkpoint>``, ``[key=value ...]``) is checked for its verb and flags only."""

from __future__ import annotations

import inspect
import re
import shlex
from pathlib import Path

import pytest

from raytrain_loops.cli import _parser, parse
from raytrain_loops.config import load_config
from raytrain_loops.recipes import resolve
from raytrain_loops.tasks import BUILTIN_PATHS, builtin

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", ROOT / "clusters" / "README.md", *(ROOT / "docs").glob("*.md")])
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _snippets(text: str) -> list[str]:
    """The text of each command-like piece: every line of a fenced block (continuations joined)
    and every inline code span (a span may wrap over lines)."""
    out = []
    for block in FENCE.findall(text):
        out += re.sub(r"\\\n\s*", " ", block).splitlines()[1:-1]
    prose = FENCE.sub("", text)
    out += [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", prose)]
    return out


def _commands(page: Path) -> list[list[str]]:
    """Each ``raytrain-loops`` command line on ``page``, as the arguments after the program name."""
    found = []
    for snippet in _snippets(page.read_text()):
        for match in re.finditer(r"(?:^|[\s:(])raytrain-loops ([a-z].*)", snippet):
            line = re.split(r"\s+#|\s*(?:\||&&|;|>)\s*", match.group(1))[0]
            found.append(shlex.split(line))
    return found


def _synopsis(args: list[str]) -> bool:
    """A verb alone (a heading, a mention) or a line with placeholders."""
    return len(args) == 1 or any(re.search(r"[<\[\]]|^[A-Z][A-Z_]+$|^\.\.\.$|=[A-Z]+$", a) for a in args)


def _check(args: list[str]) -> None:
    parser = _parser()
    if _synopsis(args):
        verbs = parser._subparsers._group_actions[0].choices
        assert args[0] in verbs, f"no verb {args[0]!r}"
        flags = {s for a in verbs[args[0]]._actions for s in a.option_strings}
        unknown = [a for a in args if a.startswith("--") and a not in flags]
        assert not unknown, f"unknown flags {unknown}"
        return
    try:
        parsed = parse(args)
    except SystemExit:
        raise AssertionError(f"does not parse: raytrain-loops {shlex.join(args)}") from None
    if parsed.command not in ("train", "tune", "submit", "plan"):
        return
    recipe = parsed.recipe if parsed.recipe in _builtin_recipes() else "default"  # a user's file: ours
    overrides = parsed.overrides
    config = load_config(resolve(recipe), overrides)
    params = [o.split("=", 1)[0].split(".")[2] for o in overrides if o.startswith("task.params.")]
    if params and config.task.name in BUILTIN_PATHS:
        signature = inspect.signature(builtin(config.task.name))
        if not any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values()):
            unknown = sorted(set(params) - set(signature.parameters))
            assert not unknown, f"task {config.task.name!r} takes no {unknown}"


def _builtin_recipes() -> set[str]:
    return {p.stem for p in (ROOT / "raytrain_loops" / "recipes").glob("*.yaml")}


def test_every_relative_link_resolves():
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", FENCE.sub("", page.read_text())):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            if not (page.parent / target.split("#")[0]).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert broken == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_command_line_parses_with_its_keys(page):
    problems = []
    for args in _commands(page):
        try:
            _check(args)
        except Exception as error:  # noqa: BLE001 - every kind of refusal is a finding, named below
            problems.append(f"raytrain-loops {shlex.join(args)}: {error}")
    assert problems == []


def test_the_checks_find_a_bad_key_a_bad_flag_and_an_unknown_task_parameter(tmp_path):
    for bad in (["train", "default", "optim.lr=0.1"], ["train", "default", "--fast"], ["train", "hf_lm", "task.params.modle=x"]):
        with pytest.raises(Exception):  # noqa: B017 - a ConfigError, an AssertionError: each a refusal
            _check(bad)
    _check(["train", "hf_lm", "task.params.model=my_model", "loop.max_steps=10"])
    page = tmp_path / "page.md"
    page.write_text("Run `raytrain-loops train\ndefault loop.epochs=3`, then:\n\n```\nraytrain-loops export \\\n  ck out  # x\n```\n")
    assert _commands(page) == [["train", "default", "loop.epochs=3"], ["export", "ck", "out"]] or _commands(page) == [
        ["export", "ck", "out"],
        ["train", "default", "loop.epochs=3"],
    ]


def test_the_readme_is_a_landing_page_that_links_every_docs_page():
    """At most 250 lines; the set-up and test commands CI runs (``.ci/run`` runs the README's
    ``scripts/test.sh``); every page of docs/ reachable from it."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    assert re.search(r"^scripts/demo\.sh\s", text, re.M) and re.search(r"^scripts/test\.sh\s", text, re.M)
    assert "scripts/test.sh" in (ROOT / ".ci" / "run").read_text()
    linked = {Path(t.split("#")[0]).name for t in re.findall(r"\]\((docs/[^)\s]+)\)", text)}
    assert sorted(p.name for p in (ROOT / "docs").glob("*.md") if p.name not in linked) == []


def test_every_guide_starts_with_the_command_or_code_that_does_the_thing():
    """A page of docs/ opens, after its title, with a code block (the generated references open
    with what generated them)."""
    late = []
    for page in sorted((ROOT / "docs").glob("*.md")):
        blocks = page.read_text().split("\n\n")
        if "Generated from the code" not in blocks[1] and not blocks[1].startswith("```"):
            late.append(page.name)
    assert late == []


def _anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation but hyphens and
    underscores dropped, spaces made hyphens."""
    headings = re.findall(r"^#+ (.*)$", FENCE.sub("", page.read_text()), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_every_link_to_a_section_names_a_heading_of_its_page():
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+#[^)\s]+)\)", FENCE.sub("", page.read_text())):
            if re.match(r"[a-z]+:", target):
                continue
            path, anchor = target.split("#", 1)
            linked = (page.parent / path) if path else page
            if linked.suffix == ".md" and linked.exists() and anchor not in _anchors(linked):
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert broken == []
