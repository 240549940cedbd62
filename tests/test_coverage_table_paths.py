"""The coverage pages show the folders of the machine that ran the sweep as paths relative to the folder that holds
them all: a reader elsewhere learns nothing from /work/sweepout/… (issue 61). The JSON keeps the commands as given."""

from __future__ import annotations

import re
from pathlib import Path

from exporter.coverage import sweep, table

DOCS = Path(__file__).parents[1] / "docs"


def _merged_doc(command: str, *commands: str) -> dict:
    doc = table.new_document(command, sweep.Settings(targets=("android",)).describe(), {}, {})
    doc.update(
        exporter_commit=None,
        complete=True,
        merged_from=[{"command": c, "created": "2026-12-03T10:00:00"} for c in commands],
    )
    return doc


def test_the_page_shows_the_sweeps_paths_relative_to_the_folder_holding_them():
    doc = _merged_doc(
        "exporter coverage --merge /srv/sweeps/before.json /srv/sweeps/R_vit/coverage.json",
        "exporter coverage --models vit_b_16 --out /srv/sweeps/R_vit --builds /srv/builds",
        "exporter coverage --out '/srv/sweeps/with space'",
        "exporter coverage --out docs",
    )
    text = table.markdown(doc)
    assert "| command | `exporter coverage --merge sweeps/before.json sweeps/R_vit/coverage.json` |" in text
    assert "- `exporter coverage --models vit_b_16 --out sweeps/R_vit --builds builds` (2026-12-03)" in text
    assert "- `exporter coverage --out 'sweeps/with space'` (2026-12-03)" in text
    assert "- `exporter coverage --out docs` (2026-12-03)" in text  # a relative path is shown as given
    assert "/srv" not in text
    assert table.render(doc)[0].count("/srv/") == 5  # the JSON records the commands as they were given


def test_a_page_of_one_sweep_names_its_output_folder():
    settings = sweep.Settings(targets=("ios",)).describe()
    doc = dict(table.new_document("exporter coverage --out /srv/sweeps/R_vit", settings, {}, {}), exporter_commit=None)
    assert "| command | `exporter coverage --out R_vit` |" in table.markdown(doc)
    assert "| command | `exporter coverage --out docs` |" in table.markdown(
        dict(doc, command="exporter coverage --out docs")
    )


def test_the_coverage_pages_carry_no_absolute_paths():
    for page in sorted(DOCS.glob("coverage*.md")):
        commands = [
            line for line in page.read_text(encoding="utf-8").splitlines() if line.startswith(("| command", "- `"))
        ]
        assert commands, page.name
        for line in commands:
            assert not re.search(r"[\s`']/\w", line), f"{page.name}: {line[:200]}"
