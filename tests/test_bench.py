"""make bench's report: ratios, top operators, and the comparison with the previous committed run (no timing)."""

from exporter import bench


def _run(pte_ms: float) -> dict:
    latency = {
        label: {"p50": ms}
        for label, ms in {
            "eager": 10.0,
            "pte fp32": pte_ms,
            "onnx fp32 (ORT)": 2.0,
            bench.ORT_AS_ON_ARM: 6.0,
            "pte int8 plain": 1.0,
        }.items()
    }
    profile = {
        "available": True,
        "ops": [{"op": "Fully Connected (NC, F32) GEMM", "ms": 1.5, "count": 50, "share": 0.6}],
    }
    return {
        "input": [224, 224],
        "latency_ms": latency,
        "profiles": {"pte fp32": profile},
        "rewrites": {
            "pte fp32": {
                "padding_taps_dropped": [
                    {
                        "module": "classifier.0.convs.3.0",
                        "input": [33, 33],
                        "kernel": [3, 3],
                        "dilation": [36, 36],
                        "parts": [[1, 1]],
                    }
                ],
                "large_depthwise_split": 2 * [{"module": "b", "kernel": [7, 7], "parts": [[5, 5], [2, 7], [5, 2]]}],
                "padded_avg_pools_as_pad": 9,
                "single_tensor_cats_dropped": 4,
            }
        },
    }


def test_ratios_are_how_many_times_faster_a_is_than_b():
    r = bench.ratios(_run(pte_ms=2.5))
    assert r["pte fp32 / eager"] == 4.0 and r["pte fp32 vs ORT fp32"] == 0.8 and r["pte fp32 vs ORT no NCHWc"] == 2.4
    assert r["pte int8 plain vs pte fp32"] == 2.5 and "ptl / eager" not in r  # a runtime not timed has no ratio


def test_the_bytes_rows_are_compared_with_their_float_files_and_the_graph_decode_with_the_host_one():
    run = _run(pte_ms=2.5)
    run["latency_ms"]["pte fp32 uint8"] = {"p50": 2.0}
    run["postprocess_ms"] = {"trained stand-in": {"p50": 3.0}, "random heads (worst case)": {"p50": 40.0}}
    run["decode_in_graph_ms"] = {"onnx heads + numpy decode": {"p50": 9.5}, "onnx decode in graph": {"p50": 7.25}}
    assert bench.ratios(run)["pte fp32 uint8 vs float"] == 1.25
    assert "onnx fp32 uint8 (ORT) vs float" not in bench.ratios(run)  # not timed: no ratio
    text = bench.table({"ssd": run})
    assert (
        "ssd trained stand-in in ONNX Runtime, per canvas, p50 ms: onnx heads + numpy decode 9.50, onnx decode in graph 7.25"
        in text
    )


def test_the_table_shows_top_operators_and_rewrites():
    text = bench.table({"m": _run(2.5)})
    assert "Fully Connected (NC, F32) GEMM 60% (1.50 ms ×50)" in text
    assert "classifier.0.convs.3.0 (3x3 dilation 36 on 33x33) -> 1 part(s) 1x1" in text
    assert (
        "2 7x7 depthwise -> 5x5 + 2x7 + 5x2; 9 padded average pool(s) as a zero pad and a pool; "
        "4 one-tensor cat(s) dropped"
    ) in text


def test_a_ratio_that_fell_against_the_baseline_is_flagged():
    baseline = {"date": "2026-11-23", "host": {"cpu": "x"}, "threads": 2, "results": {"m": _run(2.5)}}
    same = bench.against_baseline({"m": _run(2.5)}, baseline)
    slower = bench.against_baseline({"m": _run(5.0)}, baseline)
    assert "⚠ fell" not in same and "pte fp32 / eager 4.00× → 4.00×" in same
    assert "pte fp32 / eager 4.00× → 2.00× ⚠ fell" in slower
    faster = bench.against_baseline({"m": _run(2.5)}, {**baseline, "results": {"m": _run(5.0)}})
    assert "pte fp32 / eager 2.00× → 4.00×;" in faster  # a ratio that rose is not flagged
    assert "pte int8 plain vs pte fp32 5.00× → 2.50× ⚠ fell" in faster  # int8's lead over a faster fp32 shrank
    assert bench.against_baseline({"m": _run(2.5)}, None) == ""
    assert "new: not in the baseline" in bench.against_baseline({"new": _run(2.5)}, baseline)


def test_the_arm_columns_give_millions_per_core_count_ratios_and_what_was_not_counted():
    from exporter.bench import counts as bench_counts

    run = _run(2.5)
    run["instructions"] = {
        "unit": bench_counts.UNIT,
        "cpus": {
            "cortex-a76": {"eager": 900e6, "pte fp32": 100e6, "onnx fp32 (ORT)": 150e6, "pte int8 plain": 40e6},
            "cortex-a53": {"eager": 800e6, "pte fp32": 90e6},
        },
        "spread": 0.0,
        "failed": {"tflite fp32 on cortex-a53": "RuntimeError: boom"},
    }
    text = bench.table({"m": run, "n": {**_run(2.5), "instructions": {"unavailable": "no counting qemu"}}})
    a76 = text[text.index("on cortex-a76, millions") :]
    assert (
        "| m | 900.0 | 100.0 | 40.0 |" in a76 and "| 1.50× | — | — | — | — | 2.50× | — | — | — | — | — | 9.00× |" in a76
    )
    assert "on cortex-a53, millions" in text and "| m | 800.0 | 90.0 |" in text
    assert "- m: not counted: tflite fp32 on cortex-a53: RuntimeError: boom" in text
    assert "- n: unavailable (no counting qemu)" in text and "not time" in text
    assert bench_counts.ratios(run["instructions"]["cpus"]["cortex-a76"])["pte fp32 vs ORT fp32"] == 1.5


def test_the_bench_counts_on_the_profiles_cores_and_says_why_it_cannot(monkeypatch):
    from exporter.bench import counts as bench_counts
    from exporter.errors import UsageError

    assert bench_counts.profile_cpus()[0] == "cortex-a76" and {"cortex-a53", "cortex-a57"} <= set(
        bench_counts.profile_cpus()
    )

    def refuse(**kwargs):
        raise UsageError("no aarch64 runner here")

    monkeypatch.setattr("exporter.aarch64.runner.prepare", refuse)
    said = []
    arm = bench_counts.ArmCounter(["cortex-a76"], said.append, offline=True)
    assert arm.count("m", None, {}, None) == {"unavailable": "no aarch64 runner here"}
    assert said == ["ARM instruction counts: unavailable (no aarch64 runner here)"]


def test_the_size_and_psnr_lines_name_each_file_and_say_what_the_psnr_is():
    run = {**_run(2.5), "size_bytes": {"pte fp32": 6_100_000, "tflite fp16": 3_200_000}}
    run["psnr_db"] = {"pte fp32": 131.2, "tflite fp16": 75.4}
    text = bench.table({"m": run})
    assert "- m: pte fp32 6.1 / 131.2, tflite fp16 3.2 / 75.4" in text and "random weights" in text


def test_onnx_runtime_is_raced_with_its_own_int8_recipe(tmp_path):
    """The bench's ORT int8 peer row: quantize_static's QDQ with uint8 activations (not our int8-activation Q/DQ),
    run by ONNX Runtime, close to eager."""
    import onnx
    import torch
    from torch import nn

    from exporter.bench.measure import _ort_own_int8, _psnr_vs_eager
    from exporter.formats.onnx import FORMAT

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 1), nn.Flatten()).eval()
    images = [torch.randn(1, 3, 16, 16) for _ in range(8)]
    fp32 = tmp_path / "m.onnx"
    FORMAT.export(model, images[0], "fp32", None, fp32, {})
    own = _ort_own_int8(fp32, images, tmp_path / "own.onnx")
    graph = onnx.load(str(own)).graph
    activations = [n for n in graph.node if n.op_type == "QuantizeLinear"]
    assert activations and all(
        next(i for i in graph.initializer if i.name == n.input[2]).data_type == onnx.TensorProto.UINT8
        for n in activations
    )
    psnr = _psnr_vs_eager(model, {"own": FORMAT.load(own, 1), "fp32": FORMAT.load(fp32, 1)}, images[:3])
    assert 25 < psnr["own"] < psnr["fp32"], psnr
