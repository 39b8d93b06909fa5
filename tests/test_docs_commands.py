"""docs/index.md lists every `vitrieval-index` command and option that the CLI's parser
has, and nothing the parser lacks: the docs follow each new option or command."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from vitrieval.index.cli import build_parser

DOCS = Path(__file__).resolve().parents[1] / "docs" / "index.md"
SECTION = "### Every command and option"


def parser_commands() -> dict[str, list[str]]:
    """{command: its option strings, long form first where it has one, -h left out}."""
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    commands = {}
    for name, command in sub.choices.items():
        commands[name] = [
            sorted(action.option_strings, key=lambda o: not o.startswith("--"))[0]
            for action in command._actions
            if action.option_strings and not isinstance(action, argparse._HelpAction)
        ]
    return commands


def docs_section() -> tuple[str, dict[str, str]]:
    """The section's text before its first bullet, and {command: its bullet}."""
    text = DOCS.read_text()
    assert SECTION in text, f"docs/index.md has no {SECTION!r} section"
    section = text.split(SECTION, 1)[1].split("\n#", 1)[0]
    intro, *bullets = section.split("\n- ")
    documented = {}
    for bullet in bullets:
        found = re.match(r"\*\*`([\w-]+)`\*\*", bullet)
        assert found, f"a bullet that names no command: {bullet[:60]!r}"
        documented[found.group(1)] = bullet
    return intro, documented


def mentions(text: str, option: str) -> bool:
    return re.search("`" + re.escape(option) + r"(?![\w-])", text) is not None


def test_every_command_and_option_is_documented() -> None:
    commands = parser_commands()
    intro, documented = docs_section()
    assert sorted(documented) == sorted(commands)
    common = set.intersection(*(set(options) for options in commands.values()))
    assert common, "no option is common to every command"
    missing = [option for option in sorted(common) if not mentions(intro, option)]
    for name, options in commands.items():
        missing += [
            f"{name} {o}" for o in options if o not in common and not mentions(documented[name], o)
        ]
    assert not missing, f"options the CLI has and docs/index.md does not list: {missing}"


def test_no_documented_option_is_missing_from_the_cli() -> None:
    commands = parser_commands()
    _, documented = docs_section()
    stale = [
        f"{name} {option}"
        for name, bullet in documented.items()
        for option in re.findall(r"`(--?[a-z][\w-]*)", bullet)
        if option not in commands[name]
    ]
    assert not stale, f"docs/index.md lists options the CLI does not have: {stale}"


def test_command_examples_cover_every_command_and_info_is_not_verify() -> None:
    text = DOCS.read_text()
    block = text.split("## Commands", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    for name in parser_commands():
        assert f"vitrieval-index {name} " in block, name
    (info,) = [line for line in block.splitlines() if line.startswith("vitrieval-index info ")]
    # info checks sizes and headers; reading every checksum is what verify does
    assert "checksum" not in info.split("#", 1)[1], info
