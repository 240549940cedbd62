"""`make demo`: a real android build of a really trained model, offline.

Trains (once, cached in .cache/digits) MobileNetV3-Small on scikit-learn's digits, then runs
`exporter build` on it exactly as a user would, with the checkpoint and labeled held-out images.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from . import digits


def main() -> None:
    model = digits.prepare(Path(".cache/digits"))
    print(f"digits model: {model.checkpoint} (held-out acc@1 {model.held_out_accuracy:.1%})")
    command = [
        sys.executable,
        "-m",
        "exporter.cli",
        "build",
        model.weight,
        "--target",
        "android",
        "--checkpoint",
        str(model.checkpoint),
        "--labels",
        str(model.labels_file),
        "--data",
        str(model.data_dir),
        "--calib-size",
        "100",
        "--val-size",
        "200",
        "--out",
        "exports/demo/android",
        "--force",
    ]
    print("$ " + " ".join(command[2:]).replace("exporter.cli", "exporter"))
    sys.exit(subprocess.call(command))


if __name__ == "__main__":
    main()
