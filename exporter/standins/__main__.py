"""python -m exporter.standins CACHE SPEC...: train the stand-ins SPEC names into CACHE, one after another.

SPEC: digits[:WEIGHT], quantized:WEIGHT, segmentation[:WEIGHT], detection, clips. The test suite starts this in
the background for the stand-ins its tests will need (tests/conftest.py); one already cached costs a file check."""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

from . import detection, digit_clips, digits, segmentation

PREPARE = {
    "digits": lambda cache, weight: digits.prepare(cache, weight=weight or digits.WEIGHT),
    "quantized": lambda cache, weight: digits.prepare_quantized(cache, weight),
    "segmentation": lambda cache, weight: segmentation.prepare(cache, weight or segmentation.WEIGHTS[0]),
    "detection": lambda cache, weight: detection.prepare(cache),
    "clips": lambda cache, weight: digit_clips.prepare(cache),
}


def main(argv: list[str]) -> int:
    if len(argv) < 2 or any(spec.partition(":")[0] not in PREPARE for spec in argv[1:]):
        print(__doc__.splitlines()[0], file=sys.stderr)
        return 2
    cache, failed = Path(argv[0]), 0
    for spec in argv[1:]:
        kind, _, weight = spec.partition(":")
        try:
            PREPARE[kind](cache, weight)
        except Exception:  # the next may still be made; whoever asks for this one trains it and sees the error
            traceback.print_exc()
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
