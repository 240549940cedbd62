"""The docs cannot fall behind the CLI, their relative links resolve, and the README stays short.

Fast: reads Markdown and walks the click group; importing exporter.cli imports no torch."""

from __future__ import annotations

import re
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
