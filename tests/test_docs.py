"""The docs cannot fall behind the CLI, their relative links resolve, and the README stays short.

Fast: reads Markdown and walks the click group; importing exporter.cli imports no torch."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import click
import pytest

from exporter.cli import main

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 160

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
# [text](target) or [text](target "title"); images too. Text may hold `code`, not nested brackets.
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
INLINE_CODE = re.compile(r"`[^`]*`")


def _prose_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    lines, fenced = [], False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, line))
    return lines


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: link targets and formatting dropped, lower case, punctuation other
    than '-' and '_' removed, spaces to '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for _, line in _prose_lines(path):
        match = HEADING.match(line)
        if not match:
            continue
        slug = _slug(match.group(2))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def _links(path: Path) -> list[tuple[int, str]]:
    found = []
    for number, line in _prose_lines(path):
        for match in LINK.finditer(INLINE_CODE.sub("``", line)):
            found.append((number, match.group(1)))
    return found


def _all_text() -> str:
    return "\n".join(path.read_text(encoding="utf-8") for path in PAGES)


def _mentioned(option: str, text: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", text) is not None


def _sections(text: str) -> dict[str, str]:
    """Heading text -> the text under it, up to the next heading of the same or a higher level."""
    lines = text.splitlines()
    sections = {}
    for i, line in enumerate(lines):
        match = HEADING.match(line)
        if not match:
            continue
        level, end = len(match.group(1)), len(lines)
        for j in range(i + 1, len(lines)):
            other = HEADING.match(lines[j])
            if other and len(other.group(1)) <= level:
                end = j
                break
        sections[match.group(2).strip("` ")] = "\n".join(lines[i + 1 : end])
    return sections


def _options(command: click.Command) -> list[str]:
    return [
        opt
        for param in command.params
        if isinstance(param, click.Option)
        for opt in (*param.opts, *param.secondary_opts)
    ]


COMMANDS = sorted(main.commands.items())


def test_pages_exist():
    assert README.is_file()
    assert len(PAGES) > 1, "docs/*.md is empty"


@pytest.mark.parametrize("name", [name for name, _ in COMMANDS])
def test_every_command_is_documented(name):
    text = _all_text()
    assert _mentioned(f"exporter {name}", text), f"`exporter {name}` appears in neither README.md nor docs/*.md"
    assert f"exporter {name}" in _sections("\n".join(p.read_text(encoding="utf-8") for p in PAGES[1:])), (
        f"docs/ has no heading `exporter {name}` (docs/cli.md has one per command)"
    )


@pytest.mark.parametrize(
    "name,option",
    [(name, opt) for name, command in COMMANDS for opt in _options(command)] + [("", opt) for opt in _options(main)],
)
def test_every_option_is_documented(name, option):
    text = _all_text()
    where = f"`exporter {name} {option}`" if name else f"`exporter {option}`"
    assert _mentioned(option, text), f"{where} appears in neither README.md nor docs/*.md"
    if name:  # and under its own command's heading, so an option shared by name cannot hide a missing one
        section = _sections("\n".join(p.read_text(encoding="utf-8") for p in PAGES[1:])).get(f"exporter {name}", "")
        assert _mentioned(option, section), f"{where} is not described under the heading `exporter {name}` in docs/"


def _relative_links():
    for path in PAGES:
        for number, target in _links(path):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:, …
                continue
            yield pytest.param(path, number, target, id=f"{path.relative_to(ROOT)}:{number}:{target}")


@pytest.mark.parametrize("path,number,target", list(_relative_links()))
def test_relative_links_resolve(path, number, target):
    file_part, _, anchor = target.partition("#")
    where = f"{path.relative_to(ROOT)}:{number}: link {target!r}"
    resolved = (path.parent / file_part).resolve() if file_part else path
    assert resolved.exists(), f"{where}: {resolved} does not exist"
    if anchor and resolved.suffix == ".md" and resolved.is_file():
        anchors = _anchors(resolved)
        assert anchor in anchors, (
            f"{where}: no heading with anchor #{anchor} in {resolved.name} (has: {', '.join(sorted(anchors))})"
        )


def test_there_are_links_to_check():
    assert len(list(_relative_links())) > 20


def test_readme_is_short():
    lines = len(README.read_text(encoding="utf-8").splitlines())
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines (at most {README_MAX_LINES}); move detail into docs/"
    )


@pytest.mark.parametrize(
    "heading,slug",
    [
        ("What `device_validate.py` holds a device to", "what-device_validatepy-holds-a-device-to"),
        ("Checkpoints: downloaded once, verified, or offline", "checkpoints-downloaded-once-verified-or-offline"),
        ("Measured 2026-11-22", "measured-2026-11-22"),
        ("Stand-in models (demo and tests)", "stand-in-models-demo-and-tests"),
    ],
)
def test_slug_is_githubs(heading, slug):
    assert _slug(heading) == slug


# --- the README's commands and schema version, held to the code ---
def _readme_commands() -> list[str]:
    """Every `exporter …` command the README shows: each line of its code blocks that starts with it (comments
    dropped), and each inline code span that does."""
    commands, fenced = [], False
    for line in README.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif fenced and line.strip().startswith("exporter "):
            commands.append(line.strip())
        elif not fenced:
            commands += [span for span in re.findall(r"`([^`]*)`", line) if span.startswith("exporter ")]
    return commands


def _command_problems(line: str) -> list[str]:
    """What click would refuse in a command line, read without running it: an unknown command or option, an option
    without its value, a required argument or option left out, a value outside an option's choices (a value
    written as alternatives, `a|b`, is read as each of them), arguments left over."""
    words = shlex.split(line, comments=True)
    name = words[1] if len(words) > 1 else ""
    if name not in main.commands:
        return [f"no command {name!r}"]
    command = main.commands[name]
    try:
        values, extra, _ = command.make_parser(click.Context(command, info_name=name)).parse_args(words[2:])
    except click.UsageError as error:
        return [error.format_message()]
    problems = [f"unexpected {' '.join(extra)!r}"] if extra else []
    for param in command.params:
        given = values.get(param.name)
        present = isinstance(given, (str, tuple, list)) and len(given) > 0
        if param.required and not present:
            problems.append(f"{param.opts[0] if isinstance(param, click.Option) else param.name.upper()} is required")
        if present and isinstance(param.type, click.Choice):
            for value in given if isinstance(given, (tuple, list)) else (given,):
                problems += [f"{part!r} is not one of {param.type.choices}" for part in str(value).split("|")
                             if part not in param.type.choices]  # fmt: skip
    return problems


def test_the_readme_shows_commands():
    commands = _readme_commands()
    assert len(commands) >= 15 and any(c.startswith("exporter matrix") for c in commands), commands


@pytest.mark.parametrize("line", _readme_commands())
def test_every_command_the_readme_shows_is_one_the_cli_takes(line):
    assert not _command_problems(line), f"README.md shows `{line}`: {'; '.join(_command_problems(line))}"


@pytest.mark.parametrize(
    "line,problem",
    [
        ("exporter matrix", "--weight is required"),
        ("exporter bundle", "OUT_DIR is required"),
        ("exporter build W --tagret android", "No such option"),
        ("exporter build W --input-size 160", "requires 2 arguments"),
        ("exporter build W --arch arm64", "'arm64' is not one of"),
        ("exporter inspect W X", "unexpected 'X'"),
        ("exporter publish W", "no command 'publish'"),
    ],
)
def test_the_command_check_finds_what_click_would_refuse(line, problem):
    assert any(problem in p for p in _command_problems(line)), _command_problems(line)


def test_the_readme_states_the_manifests_schema_version():
    from exporter.release import manifest

    stated = {int(v) for v in re.findall(r"schema_version:? *`?(\d+)", README.read_text(encoding="utf-8"))}
    assert stated == {manifest.SCHEMA_VERSION}, f"README.md states schema_version {stated}"
    assert manifest.schema()["properties"]["schema_version"] == {"const": manifest.SCHEMA_VERSION}
