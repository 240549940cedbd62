"""What a build came to (exporter.coverage.outcome): a manifest's artifacts read into cells, failures
classified, and a failure the precision floor also shows marked as the reference's, not the export's."""

from __future__ import annotations

import signal

import pytest

from exporter import coverage
from exporter.coverage import outcome, rowcache, sweep, table

from exporter.results import Kind, Reason
from exporter.thresholds import THRESHOLD_KEYS, breaches

from .coverage_helpers import merge_doc


def _said(kind: str, text: str) -> dict:
    """A reason's JSON record, as a manifest holds it."""
    return Reason(Kind(kind), text).to_json()


def _broken(key: str, value: float, limit: float) -> dict:
    """A broken threshold's record, as a build writes it (thresholds.breaches)."""
    (section, name), _ = THRESHOLD_KEYS[key]
    (reason,) = breaches({section: {name: value}}, {key: limit})
    return reason.to_json()


def _on(cpu: str, record: dict) -> dict:
    """The record of a reason found on an emulated aarch64 CPU."""
    return Reason.from_json(record).on_cpu(cpu).to_json()


def test_a_build_killed_from_outside_the_sweep_is_not_kept_as_the_weights_verdict(tmp_path):
    """EfficientNet-B6's row was ended by a `kill` (its .ptl profile was filling memory): the row said
    "converter crash" and the row cache served it ever after. A build ended by SIGTERM, SIGINT or SIGHUP the
    sweep did not send is "killed" and built again next time; a crash (SIGSEGV) and the OOM killer's SIGKILL
    stay verdicts."""
    planned = [{"name": "executorch_fp32", "format": "executorch", "precision": "fp32"}]
    for code, kind, kept in (
        (-signal.SIGTERM, "killed", False),
        (-signal.SIGHUP, "killed", False),
        (-signal.SIGSEGV, "converter crash", True),
        (-signal.SIGKILL, "out of memory", True),
    ):
        (cell,) = outcome.stopped_cells(planned, [], code, False, None, None)
        row = outcome.reclassify({"outcome": "stopped", "returncode": code, "cells": [cell]})
        assert (cell["kind"], sweep._cacheable(row)) == (kind, kept), code
    rowcache.store(tmp_path, {"key": "b6", "outcome": "stopped", "returncode": -signal.SIGTERM, "cells": []})
    assert rowcache.fetch(tmp_path, "b6", None) is None  # one stored before this rule: built again too
    built = {"weight": "W", "target": "android", "outcome": "built", "returncode": 0}
    killed = dict(built, outcome="stopped", returncode=-signal.SIGTERM)
    assert not table._kept(built, killed) and table._kept(killed, built)  # a merge keeps the built row


def test_an_artifact_a_full_disk_stopped_is_not_kept_as_the_weights_verdict(tmp_path):
    """RegNetY-128GF's .ptl failed with "No space left on device" while another giant's build filled the disk:
    a converter crash by the old rules, cached and shown as the weight's ❌."""
    cell = outcome.cell_from_artifact(
        {
            "name": "torchscript_lite_fp32",
            "format": "torchscript_lite",
            "precision": "fp32",
            "status": "failed",
            "reasons": [_said("disk_full", "export failed: OSError: [Errno 28] No space left on device: '/b/r.ptl'")],
            "details": {},
        }
    )
    assert (cell["outcome"], cell["kind"]) == ("export", "disk full")
    built = {"weight": "W", "target": "android", "outcome": "built", "returncode": 0}
    full = dict(built, key="r", cells=[cell])
    assert outcome.not_a_verdict(full) and not sweep._cacheable(full)
    rowcache.store(tmp_path, full)
    assert rowcache.fetch(tmp_path, "r", None) is None
    # a merge keeps the built row, also over a row written before this rule ("converter crash")
    row = {"model": "w", "task": "classification", "params": 1e6, "seconds": 1.0, "time_limit_s": 900, "reason": None}
    earlier = merge_doc(tmp_path, "earlier.json", [dict(built, **row, cells=[])], 900)
    later = merge_doc(tmp_path, "later.json", [dict(full, **row, cells=[dict(cell, kind="converter crash")])], 900)
    (merged,) = coverage.merge([earlier, later], tmp_path / "m", command="test")["rows"]
    assert merged["cells"] == []


@pytest.mark.parametrize(
    "error,kind",
    [
        ("export failed: Unsupported: torch.* op returned non-Tensor", "unsupported op"),
        ("export failed: NotImplementedError: aten::_upsample_bicubic2d_aa has no lowering", "unsupported op"),
        ("export failed: RuntimeError: XNNPACK partitioner left the graph unlowered", "delegate fallback"),
        (
            "export failed: RuntimeError: DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes",
            "out of memory",
        ),
        ("export failed: AssertionError: ", "converter crash"),
        ("export failed: OSError: [Errno 28] No space left on device: '/b/r.ptl' -> '/b/cache/r'", "disk full"),
        ("the eager reference is degenerate: every input gives the same output", "degenerate reference"),
    ],
)
def test_export_failures_are_classified_from_their_first_line(error, kind):
    assert outcome.classify(error.removeprefix("export failed: ")) == kind


def test_cells_read_from_a_manifest():
    def artifact(**kw):
        return {
            "name": "a",
            "format": "coreml",
            "precision": "fp16",
            "path": None,
            "size_bytes": None,
            "status": "failed",
            "reasons": [],
            "details": {},
            **kw,
        }

    core_ml = outcome.cell_from_artifact(
        artifact(
            status="unavailable",
            path="m.mlpackage",
            size_bytes=5_000_000,
            reasons=[_said("unavailable_here", "not validated: Core ML predict needs macOS")],
        )
    )
    assert (core_ml["outcome"], table.cell_text(core_ml)) == ("unavailable", "⚪ 5.0 MB")
    refused = outcome.cell_from_artifact(
        artifact(status="unavailable", reasons=[_said("not_made", "cannot take an eager-quantized model: …")])
    )
    assert refused["outcome"] == "refused"
    broke = outcome.cell_from_artifact(
        artifact(path="m.pte", size_bytes=1, reasons=[_broken("top1_agreement", 0.375, 0.97)])
    )
    assert (broke["outcome"], table.cell_text(broke)) == ("failed", "❎ top1_agreement 0.375")
    degenerate = outcome.cell_from_artifact(
        artifact(path="m.pte", reasons=[_said("degenerate_reference", "degenerate eager reference: constant outputs")])
    )
    assert (degenerate["outcome"], degenerate["kind"]) == ("failed", "degenerate reference")
    stops = outcome.cell_from_artifact(
        artifact(
            path="m.onnx",
            reasons=[
                _said(
                    "does_not_run",
                    "does not run on every validation input: RuntimeError: [ONNXRuntimeError] : 1 : FAIL : Reshape",
                )
            ],
        )
    )
    assert (stops["outcome"], stops["kind"], table.cell_text(stops)) == (
        "failed",
        "runtime error",
        "❎ runtime error (RuntimeError)",
    )
    assert not outcome.floor_wanted({"cells": [stops]})  # no rounding of eager explains a crash
    crashed = outcome.cell_from_artifact(
        artifact(reasons=[_said("export_failed", "export failed: TypeError: bad thing")])
    )
    assert (crashed["outcome"], crashed["kind"], table.cell_text(crashed)) == (
        "export",
        "converter crash",
        "❌ converter crash",
    )
    pte = outcome.cell_from_artifact(
        artifact(
            format="executorch",
            status="passed",
            path="m.pte",
            details={
                "delegation": {
                    "delegated_nodes": 9,
                    "non_delegated_nodes": 1,
                    "delegated_subgraphs": 1,
                    "ops_outside_delegate": {"mean": 1},
                    "ops_outside_on_tensors": {"mean": 1},
                }
            },
        )
    )
    assert table._outside_xnnpack([pte]) == "fp16: mean×1"

    def rows(*statuses):
        return [{"cpu": cpu, "status": st} for cpu, st in zip(("cortex-a53", "cortex-a76"), statuses)]

    on_arm = outcome.cell_from_artifact(
        artifact(status="passed", path="m.pte", size_bytes=2_000_000, aarch64=rows("passed", "passed"))
    )
    assert table.cell_text(on_arm) == "✅ 2.0 MB · ✅ on cortex-a53, cortex-a76"
    broke_there = outcome.cell_from_artifact(
        artifact(
            path="m.pte",
            aarch64=rows("passed", "failed"),
            reasons=[_on("cortex-a76", _broken("psnr_db", 25.1, 30))],
        )
    )
    assert (broke_there["outcome"], table.cell_text(broke_there)) == ("failed", "❎ cortex-a76: psnr_db 25.1")
    # qemu out of time (a starved host) is no verdict on the artifact
    slow = outcome.cell_from_artifact(
        artifact(
            path="m.ptl",
            aarch64=rows("passed", "failed"),
            reasons=[
                _on(
                    "cortex-a76",
                    _said(
                        "emulator_timeout", "could not run on aarch64: timed out after 1800 s under qemu (cortex-a76)"
                    ),
                )
            ],
        )
    )
    assert (slow["outcome"], slow["kind"], table.cell_text(slow)) == ("time", "time limit", "⏱ qemu on cortex-a76")


def test_a_killed_build_marks_where_it_stopped():
    planned = [
        {"name": n, "format": "executorch", "precision": p}
        for n, p in (("x_fp32", "fp32"), ("x_int8", "int8"), ("y", "fp32"))
    ]
    done = [{"name": "x_fp32", "outcome": "passed"}]
    cells = outcome.stopped_cells(planned, done, -9, False, None, None)
    # a build makes its float artifacts first: it was at y, and had not reached x_int8; cells in the target's order
    assert [(c["name"], c["outcome"], c.get("kind")) for c in cells] == [
        ("x_fp32", "passed", None),
        ("x_int8", "not_run", "not reached"),
        ("y", "export", "out of memory"),
    ]
    done.append({"name": "y", "outcome": "passed"})
    cells = outcome.stopped_cells(planned, done, -9, False, None, None)
    assert [(c["name"], c["outcome"], c.get("kind")) for c in cells] == [
        ("x_fp32", "passed", None),
        ("x_int8", "export", "out of memory"),
        ("y", "passed", None),
    ]
    refused = outcome.stopped_cells(planned, [], 2, False, "the eager reference is degenerate", None)
    assert {(c["outcome"], c["kind"]) for c in refused} == {("export", "degenerate reference")}


def test_an_oom_kill_is_the_weights_verdict_only_when_the_build_had_the_host():
    """RegNetY-128GF's android build was killed by the kernel at 12.3 GB while another sweep's build held
    14.8 GB of the 24 GB host: kept, that row would have said the weight needs more than this host has."""
    planned = [{"name": "executorch_fp32", "format": "executorch", "precision": "fp32"}]
    gb = 10**9
    alone = {"build_peak_bytes": 22 * gb, "host_bytes": 24 * gb, "others_bytes": 1 * gb}
    crowded = {"build_peak_bytes": 12.3 * gb, "host_bytes": 24 * gb, "others_bytes": 11 * gb}
    for sample, kept in ((alone, True), (crowded, False), (None, True)):
        (cell,) = outcome.stopped_cells(planned, [], -signal.SIGKILL, False, None, None, sample)
        row = {
            "outcome": "stopped",
            "returncode": -signal.SIGKILL,
            "timed_out": False,
            "memory": sample,
            "cells": [cell],
        }
        assert cell["kind"] == "out of memory" and sweep._cacheable(row) is kept
        assert ("built again next time" in cell["reason"]) is not kept
    assert (
        "held at least 12.3 GB of this host's 24.0 GB, other processes 11.0 GB when last sampled: built again"
        in outcome.death_reason(-9, crowded)
    )
    later = {"weight": "W", "target": "android", "outcome": "stopped", "returncode": -9, "memory": crowded}
    built = {"weight": "W", "target": "android", "outcome": "built", "returncode": 0}
    assert not table._kept(built, later) and table._kept(built, dict(later, memory=alone))  # a merge keeps the build


def test_an_int8_failure_the_static_floor_shows_is_ill_conditioned():
    """EfficientNetV2-S's random int8 .pte: 22.7 dB from eager, the dynamic floor 29.9 (7.2 dB better: not
    explained), eager with static ranges from the calibration images 24.5 dB."""
    int8 = {"int8": {"fidelity": {"psnr_db": 29.9}, "reasons": [_broken("psnr_db", 29.9, 30)]}}
    static = {"int8_static": {"fidelity": {"psnr_db": 24.5}, "reasons": [_broken("psnr_db", 24.5, 30)]}}
    cell = {"precision": "int8", "outcome": "failed", "kind": "validation", "reasons": [_broken("psnr_db", 22.7, 30)]}
    assert outcome.reclassify({"floor": int8, "cells": [dict(cell)]})["cells"][0]["kind"] == "validation"
    row = outcome.reclassify({"floor": dict(int8, **static), "cells": [dict(cell)]})
    assert row["cells"][0]["kind"] == "ill-conditioned reference"
    assert table.floor_text(row, row["cells"][0]) == (
        "eager rounded to int8: psnr_db 29.9; with static int8 ranges: psnr_db 24.5"
    )
    # far below even the static floor: ours to explain
    far = dict(cell, reasons=[_broken("psnr_db", 12, 30)])
    assert outcome.reclassify({"floor": dict(int8, **static), "cells": [far]})["cells"][0]["kind"] == "validation"
    # a cached row measured before the static floor existed asks for it; one that has it, or is explained, does not
    assert outcome.floor_wanted({"floor": int8, "cells": [dict(cell)]})
    assert not outcome.floor_wanted(row)
    assert not outcome.floor_wanted({"floor": int8, "cells": [dict(cell, kind="ill-conditioned reference")]})
    assert not outcome.floor_wanted({"floor": {"error": "x"}, "cells": [dict(cell)]})
    assert outcome.floor_wanted({"cells": [dict(cell, precision="fp32")]})


def test_a_labeled_int8_failure_needs_a_floor_judged_on_the_labels():
    """The trained EfficientNet-B1's int8 .pte: 26.8 dB and 1.2 points of acc@1 lost; eager rounded to int8 27.4 dB.
    A floor without labels cannot have broken accuracy_drop, so it explains nothing and is measured again; one
    judged on the labels that loses as much explains the cell, and the table says what it lost."""
    cell = {
        "precision": "int8",
        "outcome": "failed",
        "kind": "validation",
        "reasons": [_broken("psnr_db", 26.83, 30), _broken("accuracy_drop", 1.163, 1)],
    }
    unlabeled = {
        "int8": {"fidelity": {"psnr_db": 27.4}, "reasons": [_broken("psnr_db", 27.4, 30)]},
        "int8_static": {"fidelity": {"psnr_db": 26.0}, "reasons": [_broken("psnr_db", 26, 30)]},
    }
    assert outcome.reclassify({"floor": unlabeled, "cells": [dict(cell)]})["cells"][0]["kind"] == "validation"
    assert outcome.floor_wanted({"floor": unlabeled, "cells": [dict(cell)]})
    lost = {
        "fidelity": {"psnr_db": 27.4},
        "accuracy": {"drop_points": 2.326},
        "reasons": [_broken("psnr_db", 27.4, 30), _broken("accuracy_drop", 2.326, 1)],
    }
    row = outcome.reclassify({"floor": dict(unlabeled, labeled=True, int8=lost), "cells": [dict(cell)]})
    assert row["cells"][0]["kind"] == "ill-conditioned reference"
    assert not outcome.floor_wanted(row)
    assert table.floor_text(row, row["cells"][0]).startswith("eager rounded to int8: accuracy_drop 2.326, psnr_db 27.4")
    # the int8 search's own measure of how much the model amplifies a small error is shown beside it
    moved = dict(row["cells"][0], quantization={"perturbation": {"input_snr_db": 40.0, "output_psnr_db": 31.46}})
    assert table.floor_text(row, moved).endswith("; eager, its input perturbed at 40 dB SNR: psnr_db 31.46")
    # judged on the labels and losing less than the artifact's budget allows: the failure is ours to explain
    kept = dict(lost, accuracy={"drop_points": 0.0}, reasons=lost["reasons"][:1])
    row = outcome.reclassify({"floor": dict(unlabeled, labeled=True, int8=kept), "cells": [dict(cell)]})
    assert row["cells"][0]["kind"] == "validation" and not outcome.floor_wanted(row)


def test_a_failure_the_floor_also_shows_is_marked_ill_conditioned():
    floor = {
        "int8": {
            "fidelity": {"top1_agreement": 0.5, "psnr_db": 29.6},
            "reasons": [_broken("top1_agreement", 0.5, 0.97), _broken("psnr_db", 29.6, 30)],
        },
        "fp32": {"fidelity": {"top1_agreement": 1.0, "psnr_db": 130.0}, "reasons": []},
    }

    def cell(precision, reasons):
        return {
            "name": f"x_{precision}",
            "precision": precision,
            "outcome": "failed",
            "kind": "validation",
            "reason": reasons[0]["text"],
            "reasons": reasons,
        }

    row = {
        "floor": floor,
        "cells": [
            cell("int8", [_broken("top1_agreement", 0.375, 0.97)]),
            cell("int8", [_broken("top1_agreement", 0.375, 0.97), _broken("accuracy_drop", 5, 1)]),
            cell("fp32", [_broken("top1_agreement", 0.875, 1)]),
            cell("int8", [_broken("top1_agreement", 0.5, 0.97), _broken("psnr_db", 25.1, 30)]),
            cell("int8", [_broken("top1_agreement", 0, 0.97), _broken("psnr_db", 11.86, 30)]),
        ],
    }
    kinds = [c["kind"] for c in outcome.reclassify(row)["cells"]]
    # explained only when every broken threshold is one eager's own rounding breaks too, and the artifact's PSNR
    # is within the margin of eager's own (MaxViT-T's int8 .pte: 11.86 dB against a floor of 28.9)
    assert kinds == ["ill-conditioned reference", "validation", "validation", "ill-conditioned reference", "validation"]
    assert table.cell_text(row["cells"][0]) == "❎ top1_agreement 0.375 · ill-conditioned"
    assert table.floor_text(row, row["cells"][0]) == "eager rounded to int8: top1_agreement 0.5"
    assert (
        outcome.reclassify({"cells": [cell("int8", [_broken("top1_agreement", 0.375, 0.97)])]})["cells"][0]["kind"]
        == "validation"
    )


def test_a_quantized_weights_own_loss_is_told_from_its_exports():
    """torchvision's int8 weights are judged against their float model: the digits-trained quantized MobileNetV2's
    .ptl lost 1.16 points of acc@1 because the int8 weight itself does (eager, run as it is); a .ptl losing what
    the weight does not is ours to explain, and a quantized row measured before the weight's row asks for it."""
    weight = {"fidelity": {"psnr_db": 31.8}, "reasons": [_broken("accuracy_drop", 1.163, 1)]}
    floor = {
        "int8": {"fidelity": {"psnr_db": 40.0}, "reasons": []},
        "int8_static": {"fidelity": {"psnr_db": 38.0}, "reasons": []},
    }
    cell = {
        "precision": "int8",
        "outcome": "failed",
        "kind": "validation",
        "psnr_db": 31.76,
        "reason": "accuracy_drop 1.163 (needs <= 1)",
        "reasons": [_broken("accuracy_drop", 1.163, 1)],
    }
    row = outcome.reclassify({"quantized": True, "floor": dict(floor, quantized_weight=weight), "cells": [dict(cell)]})
    assert row["cells"][0]["kind"] == "quantized weight"
    assert table.cell_text(row["cells"][0]) == "❎ accuracy_drop 1.163 · the int8 weight's own"
    assert table.floor_text(row, row["cells"][0]) == "the int8 weight in eager PyTorch: accuracy_drop 1.163"
    worse = dict(cell, reasons=[_broken("accuracy_drop", 1.163, 1), _broken("psnr_db", 20.1, 30)], psnr_db=20.1)
    assert (
        outcome.reclassify({"quantized": True, "floor": dict(floor, quantized_weight=weight), "cells": [worse]})[
            "cells"
        ][0]["kind"]
        == "validation"
    )
    assert outcome.floor_wanted({"quantized": True, "floor": floor, "cells": [dict(cell)]})
    # a float weight's row has no weight floor to ask for once its own floor was judged on the labels
    assert not outcome.floor_wanted({"quantized": False, "floor": dict(floor, labeled=True), "cells": [dict(cell)]})


def test_decisions_flipped_by_an_artifact_closer_to_eager_than_the_floor_are_ill_conditioned():
    """Wide-ResNet50-2's ONNX fp16 flipped 2 of 8 top-1s (margins 0.005 and 0.013) at 47.4 dB from eager; eager
    rounded to fp16 sat at 44.2 dB and happened to flip none. Eager in half precision flipped the same two."""
    floor = {"fp16": {"fidelity": {"top1_agreement": 1.0, "psnr_db": 44.22}, "reasons": []}}
    closer = {
        "precision": "fp16",
        "outcome": "failed",
        "kind": "validation",
        "reasons": [_broken("top1_agreement", 0.75, 0.99)],
    }
    row = {
        "floor": floor,
        "cells": [
            dict(closer, psnr_db=47.36),
            dict(closer, psnr_db=40.0),
            dict(closer),
            dict(
                closer, psnr_db=47.36, reasons=[_broken("top1_agreement", 0.75, 0.99), _broken("accuracy_drop", 5, 1)]
            ),
        ],
    }
    kinds = [c["kind"] for c in outcome.reclassify(row)["cells"]]
    # farther than the floor, no PSNR recorded, or a broken threshold that is no decision: ours to explain
    assert kinds == ["ill-conditioned reference", "validation", "validation", "validation"]
    # ShuffleNetV2-0.5's random Q/DQ ONNX: one top-1 of 8 flipped at 27.3 dB; eager rounded to int8 (25.1 dB) broke
    # the PSNR threshold too but flipped none. Every threshold the artifact broke is either broken by the floor
    # or a decision flipped closer to eager than the floor; 6 dB farther than the floor, not.
    int8 = {"int8": {"fidelity": {"top1_agreement": 1.0, "psnr_db": 25.08}, "reasons": [_broken("psnr_db", 25.08, 30)]}}
    reasons = [_broken("top1_agreement", 0.875, 0.97), _broken("psnr_db", 27.28, 30)]
    flipped = {"precision": "int8", "outcome": "failed", "kind": "validation", "reasons": reasons, "psnr_db": 27.28}
    farther = dict(flipped, reasons=[reasons[0], _broken("psnr_db", 19, 30)], psnr_db=19.0)
    kinds = [c["kind"] for c in outcome.reclassify({"floor": int8, "cells": [flipped, farther]})["cells"]]
    assert kinds == ["ill-conditioned reference", "validation"]
    artifact = {
        "name": "onnx_fp16",
        "format": "onnx",
        "precision": "fp16",
        "status": "failed",
        "path": "m.onnx",
        "reasons": closer["reasons"],
        "fidelity": {"psnr_db": 47.3641, "top1_agreement": 0.75},
    }
    assert outcome.cell_from_artifact(artifact)["psnr_db"] == 47.36


def test_a_top1_flipped_on_a_near_tie_is_the_references_not_the_exports():
    """Swin-V2-S's random int8 .pte flipped one top-1 of 8 at 39.51 dB, 0.12 dB farther from eager than its
    floor (39.63 dB), which flipped none: eager's margin on that image was 0.004, a fifth of the RMS error."""
    margins = [0.004, 0.020, 0.029, 0.038, 0.081, 0.104, 0.113, 0.294]
    floor = {
        "margins": margins,
        "int8": {"fidelity": {"top1_agreement": 1.0, "psnr_db": 39.63}, "reasons": [], "rms": [0.022] * 8},
    }
    cell = {
        "precision": "int8",
        "outcome": "failed",
        "kind": "validation",
        "psnr_db": 39.51,
        "reasons": [_broken("top1_agreement", 0.875, 0.97)],
    }
    tie = dict(cell, flipped_rows=[{"row": 0, "top1_flipped": 1.0}])
    cells = [
        tie,
        dict(cell, flipped_rows=[{"row": 7, "top1_flipped": 1.0}]),  # a margin 13x the error: the export's
        dict(cell),  # the flipped images unknown
        dict(tie, reasons=[_broken("top1_agreement", 0.75, 0.97)]),  # two flipped, one listed
        dict(tie, psnr_db=33.0),
    ]  # 6.6 dB farther than eager's own rounding
    row = outcome.reclassify({"floor": floor, "cells": cells})
    assert [c["kind"] for c in row["cells"]] == ["ill-conditioned reference"] + ["validation"] * 4
    assert table.floor_text(row, row["cells"][0]) == (
        "eager rounded to int8: top1_agreement 1; "
        "top-1 flipped where eager's margin was 0.004 "
        "(rounding's RMS error there 0.022)"
    )
    # the flipped images come from the manifest's preview rows (the images where the artifact departs most)
    artifact = {
        "name": "executorch_int8",
        "format": "executorch",
        "precision": "int8",
        "status": "failed",
        "path": "m.pte",
        "reasons": cell["reasons"],
        "preview_rows": [
            {"row": 3, "departure": {"top1_flipped": 1.0, "logit_rmse": 0.03}},
            {"row": 5, "departure": {"top1_flipped": 0.0, "logit_rmse": 0.02}},
        ],
    }
    assert outcome.cell_from_artifact(artifact)["flipped_rows"] == [{"row": 3, "top1_flipped": 1.0, "logit_rmse": 0.03}]
