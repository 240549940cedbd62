"""What several coverage test files share: the two small weights the sweeps build, and a coverage table
written to disk for a merge to read."""

from __future__ import annotations

import json
from pathlib import Path

from exporter.coverage import sweep, table

SMALL = ["mobilenet_v3_small", "squeezenet1_1"]


def merge_doc(
    tmp_path,
    name: str,
    rows: list[dict],
    time_limit: float,
    torch_version: str = "2.14.1",
    classifier_size: int | None = None,
    formats: tuple[str, ...] = (),
) -> Path:
    settings = sweep.Settings(
        targets=("android",), time_limit=time_limit, classifier_size=classifier_size, formats=formats
    ).describe()
    doc = table.new_document("test", settings, {}, {"torch": torch_version})
    doc.update(rows=rows, planned_rows=len(rows), complete=True)
    (tmp_path / name).write_text(json.dumps(doc))
    return tmp_path / name
