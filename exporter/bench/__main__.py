"""`python -m exporter.bench` (`make bench`): the options, every model in turn, and the report written."""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
import warnings
from pathlib import Path

import torch

from .. import bench, hostload
from ..release import manifest
from . import counts
from .measure import bench_model
from .report import against_baseline, table
from .rows import BASELINE, MODELS


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m exporter.bench", description=bench.__doc__)
    parser.add_argument("--models", default=",".join(MODELS), help=f"any of {', '.join(MODELS)}")
    parser.add_argument("--threads", type=int, default=hostload.usable_cores())
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--iterations", type=int, default=100)
    parser.add_argument("--out", type=Path, default=Path("exports/bench"))
    parser.add_argument("--baseline", type=Path, default=BASELINE, help="a previous bench.json to compare ratios with")
    parser.add_argument(
        "--arm-cpus",
        default=",".join(counts.profile_cpus()),
        help="emulated cores to count instructions on (the android and jetson profiles' by default); none: skip",
    )
    parser.add_argument("--save-baseline", action="store_true", help="make this run the baseline (then commit it)")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.models.split(",")) - set(MODELS))
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    warnings.filterwarnings("ignore")
    logging.getLogger().setLevel(logging.ERROR)
    torch.set_num_threads(args.threads)
    host = manifest.host(args.threads)
    print(f"host: {host['cpu']}, {host['cores']} cores, {args.threads} threads for every runtime; batch 1")
    cpus = [] if args.arm_cpus in ("", "none") else args.arm_cpus.split(",")
    arm = counts.ArmCounter(cpus, print) if cpus else None
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            results[name] = bench_model(name, args.threads, args.warmup, args.iterations, Path(tmp), print, arm)
    baseline = json.loads(args.baseline.read_text()) if args.baseline.is_file() else None
    text = table(results) + against_baseline(results, baseline)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    run = {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "host": host,
        "threads": args.threads,
        "tools": manifest.tool_versions(),
        "results": results,
    }
    (args.out / "bench.json").write_text(json.dumps(run, indent=2))
    if args.save_baseline:
        args.baseline.write_text(json.dumps(run, indent=2) + "\n")
        print(f"baseline written: {args.baseline}")
    (args.out / "bench.md").write_text(text + "\n")
    print(f"written: {args.out / 'bench.md'}")


if __name__ == "__main__":
    main()
