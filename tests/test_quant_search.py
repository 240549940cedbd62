"""The budget search (exporter.quant.search): plain PTQ, then other range methods, ops and the most sensitive
layers back in float until the budget holds on held-out calibration images; checked on fake backends that export
nothing, so every path of the search is quick to reach."""

from __future__ import annotations

import pytest
import torch

from exporter.quant import SETTINGS, Calibration
from exporter.results import Kind, kinds, texts
from exporter.quant.search import _steps

from .quant_models import DynamicBackend, FakeBackend, FakeCandidate, KindsBackend


@pytest.fixture
def budget_search(monkeypatch):
    """quantize_with_budget on a fake backend, without exporting anything: `search(make_backend, ranking, **settings)`
    runs it on make_backend(model) for a seeded 4-in, 10-out linear model, its layers' sensitivity ranked in
    `ranking`'s order (FakeBackend.LAYERS by default), a 30 dB budget and SETTINGS updated with `settings`; it
    returns the (candidate, report) the search does. Candidates alive are counted from the start of each search."""
    from exporter.quant import search
    from exporter.quant.sensitivity import Sensitivity

    def run(make_backend, ranking=None, **settings):
        ranking = list(FakeBackend.LAYERS if ranking is None else ranking)
        monkeypatch.setattr(
            search,
            "layer_sensitivity",
            lambda *a, **k: Sensitivity(
                {n: 10.0 + i for i, n in enumerate(ranking)}, {n: 5.0 + i for i, n in enumerate(ranking)}
            ),
        )
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 10)
        calibration = Calibration(
            [torch.randn(1, 4) for _ in range(20)], None, {"psnr_db": 30.0}, {**SETTINGS, **settings}
        )
        FakeCandidate.most_alive = FakeCandidate.alive
        return search.quantize_with_budget(model, make_backend(model), calibration)

    return run


def test_fallback_steps_grow_and_stop_at_the_cap():
    assert list(_steps(0)) == []
    steps = list(_steps(13))
    assert steps[:3] == [1, 2, 3] and steps[-1] == 13 and steps == sorted(set(steps))


def test_search_keeps_the_best_ranges_and_floats_layers_in_sensitivity_order(budget_search):
    ranking = [f"layer{i}" for i in (5, 1, 3, 0, 2, 4, 6, 7)]
    report = budget_search(FakeBackend.given("layer3"), ranking, max_float_fraction=1.0)[1]
    assert report["calibration_method"] == "fine" and [s["ranges"] for s in report["steps"][:2]] == ["coarse", "fine"]
    assert [f["name"] for f in report["float_layers"]] == ["layer5", "layer1", "layer3"]  # steps of 1, 2, 3 layers
    assert report["meets_budget"] and not report["before"]["meets_budget"] and report["int8_layers"] == 5


def test_search_stops_when_float_layers_stop_helping(budget_search):
    report = budget_search(FakeBackend.given(None), list(FakeBackend.LAYERS), max_float_fraction=1.0)[1]
    fallback_steps = [s["float_layers"] for s in report["steps"][2:]]
    assert fallback_steps == [1, 2, 3, 4] and not report["meets_budget"]  # the cap (8) is not reached
    assert "4 steps in a row" in report["note"]
    assert report["float_layers"] == [] and report["after"] == report["before"]  # no gain: plain PTQ kept


def test_search_holds_one_candidate_at_a_time_and_returns_the_one_it_reports(budget_search):
    """Every candidate holds a runtime session or a quantized copy of the model: the search keeps one (two while
    the next is made), and when an earlier step is chosen it is made again, the same as the report says."""
    candidate, report = budget_search(FakeBackend.given(None), list(FakeBackend.LAYERS), max_float_fraction=1.0)
    assert len(report["steps"]) == 6 and FakeCandidate.most_alive <= 2
    assert (candidate.float_layers, candidate.method) == ([], "fine") and report["float_layers"] == []
    del candidate
    candidate, report = budget_search(FakeBackend.given("layer2"), list(FakeBackend.LAYERS), max_float_fraction=1.0)
    assert report["meets_budget"] and FakeCandidate.most_alive <= 2
    assert candidate.float_layers == [f["name"] for f in report["float_layers"]] == ["layer0", "layer1", "layer2"]


def test_a_candidate_that_cannot_run_a_check_image_is_the_worst_and_the_search_goes_on(monkeypatch, budget_search):
    """Faster R-CNN's int8 RPN left one check image without a proposal, and ONNX Runtime failed on the zero rows
    its box head got: the search crashed and the int8 artifact was "export failed". Such a candidate is now the
    worst there is: the layers go back to float until one runs and meets the budget."""
    from exporter.quant import search

    def failing_until_fixed(self, x):
        if self.error:  # every candidate but the one with the culprit in float
            raise search.CandidateFailed("Fail: Reshape of 0 rows")
        return self.model(x)

    monkeypatch.setattr(FakeCandidate, "__call__", failing_until_fixed)
    report = budget_search(FakeBackend.given("layer1"), list(FakeBackend.LAYERS), max_float_fraction=1.0)[1]
    assert (
        report["before"]["psnr_db"] is None
        and "does not run on every check image" in texts(report["before"]["reasons"])[0]
        and kinds(report["before"]["reasons"]) == {Kind.DOES_NOT_RUN}
        and "Reshape of 0 rows" in texts(report["before"]["reasons"])[0]
    )
    assert report["meets_budget"] and [f["name"] for f in report["float_layers"]] == ["layer0", "layer1"]
    never = budget_search(FakeBackend.given("no-such-layer"), list(FakeBackend.LAYERS), max_float_fraction=1.0)[1]
    assert not never["meets_budget"] and "does not run on every check image" in never["note"]


def test_search_respects_the_cap_and_no_fallback(budget_search):
    capped = budget_search(FakeBackend.given("layer7"), list(FakeBackend.LAYERS), max_float_fraction=0.25)[1]
    assert [s["float_layers"] for s in capped["steps"][2:]] == [1, 2] and "cap of 2" in capped["note"]
    plain = budget_search(FakeBackend.given("layer0"), list(FakeBackend.LAYERS), fallback=False)[1]
    assert plain["float_layers"] == [] and len(plain["steps"]) == 2 and "--no-fallback" in plain["note"]


def test_the_cap_and_the_steps_count_the_layers_floated_beside_a_layer(monkeypatch, budget_search):
    """On ExecuTorch a layer's producer goes float with it (XNNPACK runs a quantized op only with a quantized
    output): a step of one layer can be two in float. The cap holds for all of them, and a layer already float
    beside another is not a step of its own."""
    producer = {"layer7": "layer6", "layer5": "layer4"}
    monkeypatch.setattr(
        FakeBackend,
        "float_closure",
        lambda self, layers: list(dict.fromkeys([*layers, *(producer[n] for n in layers if n in producer)])),
    )
    # ranking: layer7 (floats layer6 with it), layer6 (already float: no step), layer5 (+ layer4), ...
    ranking = ["layer7", "layer6", "layer5", "layer0", "layer1", "layer2", "layer3", "layer4"]
    report = budget_search(FakeBackend.given("layer3"), ranking, max_float_fraction=0.5)[1]  # cap: 4 layers
    fallback = report["steps"][2:]
    assert [s["float_layers"] for s in fallback] == [2, 4, 5] and fallback[-1]["over_cap"], fallback
    assert len(report["float_layers"]) <= 4 and "over the cap of 4" in report["note"], report


def test_a_missed_budget_says_when_the_model_itself_amplifies_small_errors(monkeypatch, budget_search):
    """A digits-trained EfficientNet-B1 missed its int8 budget on both runtimes: eager itself, its
    input perturbed at 40 dB SNR, moved to 30.5 dB. Here a model reads an input channel that never varies with a
    1000x weight: noise there, as int8 rounding adds anywhere, is amplified; the same model with a unit weight is not."""
    from exporter.quant import SETTINGS, search
    from exporter.quant.sensitivity import Sensitivity

    monkeypatch.setattr(
        search,
        "layer_sensitivity",
        lambda *a, **k: Sensitivity({n: 10.0 for n in FakeBackend.LAYERS}, {n: 5.0 for n in FakeBackend.LAYERS}),
    )
    torch.manual_seed(0)
    images = [torch.cat([torch.randn(1, 3), torch.zeros(1, 1)], 1) for _ in range(20)]
    reports = {}
    for gain in (1.0, 1000.0):
        model = torch.nn.Linear(4, 10)
        with torch.no_grad():
            model.weight[:, 3] = gain
        calibration = Calibration(images, None, {"psnr_db": 30.0}, {**SETTINGS, "max_float_fraction": 1.0})
        reports[gain] = search.quantize_with_budget(model, FakeBackend(model, None), calibration)[1]
    quiet, loud = reports[1.0], reports[1000.0]
    assert not quiet["meets_budget"] and not loud["meets_budget"]
    assert quiet["perturbation"] == {"input_snr_db": 40.0, "output_psnr_db": quiet["perturbation"]["output_psnr_db"]}
    assert quiet["perturbation"]["output_psnr_db"] >= 32 and "amplifies" not in quiet["note"]
    assert loud["perturbation"]["output_psnr_db"] < 30 and "the model amplifies small errors" in loud["note"]
    assert (
        "perturbation"
        not in budget_search(FakeBackend.given("layer0"), list(FakeBackend.LAYERS), max_float_fraction=1.0)[1]
    )


def test_an_error_spread_over_every_add_is_kept_float_by_kind_before_layers_are(budget_search):
    """EfficientNetV2-S trained on digits: its 35 residual adds, each requantizing a stream that grows to ±300,
    cost 6.6 dB together and no more than 1.9 dB each, so no layer in float recovered them. When plain PTQ misses
    the budget, every add in float is tried first; the layer search goes on from it, and it is kept only if it
    gains."""
    candidate, report = budget_search(
        KindsBackend.given("layer1", add_error=0.2, layer_error=0.2), max_float_fraction=1.0
    )
    kinds_step = report["steps"][1]
    assert kinds_step["float_kinds"] == ["add"] and kinds_step["float_layers"] == 0
    assert kinds_step["psnr_db"] > report["before"]["psnr_db"] + 0.5 and not kinds_step["meets_budget"]
    assert report["meets_budget"] and report["float_kinds"] == ["add"] and report["float_ops"]["add"] == 3
    *layer_steps, without_adds = report["steps"][2:]
    assert all(s["float_kinds"] == ["add"] for s in layer_steps)  # every layer step keeps the adds float
    assert "float_kinds" not in without_adds and not without_adds["meets_budget"]  # the layers alone: tried, missed
    assert [f["name"] for f in report["float_layers"]] == ["layer0", "layer1"]
    assert candidate.kinds == ("add",) and candidate.float_layers == ["layer0", "layer1"] and candidate.error == 0
    assert FakeCandidate.most_alive <= 2
    del candidate

    # the layers meet the budget without the adds too: the adds go back to int8 (float adds only cost speed)
    candidate, report = budget_search(
        KindsBackend.given("layer1", add_error=0.02, layer_error=0.3), max_float_fraction=1.0
    )
    assert report["steps"][1]["float_kinds"] == ["add"] and report["meets_budget"], report["steps"]
    assert "float_kinds" not in report and "float_kinds" not in report["after"]
    assert candidate.kinds == () and candidate.float_layers == ["layer0", "layer1"]
    del candidate

    # the budget is missed whatever the search floats: the adds-only step is kept, and made again
    candidate, report = budget_search(KindsBackend.given(None, add_error=0.05, layer_error=0.3), max_float_fraction=1.0)
    assert not report["meets_budget"] and report["float_kinds"] == ["add"] and report["float_layers"] == []
    assert candidate.kinds == ("add",) and candidate.float_layers == [] and FakeCandidate.most_alive <= 2
    del candidate

    # adds float alone meet the budget: no layer goes float
    candidate, report = budget_search(
        KindsBackend.given("layer1", add_error=0.2, layer_error=0.0), max_float_fraction=1.0
    )
    assert report["meets_budget"] and report["float_kinds"] == ["add"] and report["float_layers"] == []
    assert len(report["steps"]) == 2 and candidate.kinds == ("add",)
    del candidate

    # adds float gain less than 0.5 dB: they stay int8, the layers alone fix it
    candidate, report = budget_search(
        KindsBackend.given("layer1", add_error=0.01, layer_error=0.2), max_float_fraction=1.0
    )
    gain = report["steps"][1]["psnr_db"] - report["before"]["psnr_db"]
    assert report["steps"][1]["float_kinds"] == ["add"] and 0 < gain < 0.5 and "float_kinds" not in report
    assert all("float_kinds" not in s for s in report["steps"][2:]) and report["meets_budget"]
    assert candidate.kinds == () and "add" not in report["float_ops"]
    del candidate

    # plain PTQ meets the budget: nothing else is tried
    candidate, report = budget_search(
        KindsBackend.given("layer1", add_error=0.0, layer_error=0.0), max_float_fraction=1.0
    )
    assert len(report["steps"]) == 1 and "float_kinds" not in report and candidate.kinds == ()
    assert not {"dynamic_ranges", "onnx_calibration"} & set(report)  # settings no backend of this kind reads


def test_ranges_chosen_per_inference_are_tried_only_when_static_ranges_miss_and_kept_when_they_gain(budget_search):
    """EfficientNet-B2 trained on the digits: static ranges 25.1 dB from eager, ranges chosen per inference 37.2 dB
    with every layer still int8. The fallback range method is tried before any op or layer goes float; a build
    whose static ranges meet the budget never tries it (they are faster where the two differ)."""
    candidate, report = budget_search(
        DynamicBackend.given("layer1", static_error=0.001, dynamic_error=0.0), max_float_fraction=1.0
    )
    assert [s["ranges"] for s in report["steps"]] == ["histogram"] and candidate.method == "histogram"
    assert report["dynamic_ranges"] is True and "onnx_calibration" not in report  # only the settings it reads
    del candidate

    candidate, report = budget_search(
        DynamicBackend.given("layer1", static_error=0.2, dynamic_error=0.001), max_float_fraction=1.0
    )
    assert [s["ranges"] for s in report["steps"]] == ["histogram", "dynamic"], report["steps"]
    assert report["meets_budget"] and report["after"]["ranges"] == "dynamic" and report["float_layers"] == []
    assert report["calibration_method"] == "dynamic" and report["float_ops"] == {"linear": 0, "add": 3}
    assert not report["before"]["meets_budget"] and candidate.method == "dynamic" and candidate.error == 0.001
    del candidate

    # it gains but misses: the layer search goes on from it, with the same ranges
    candidate, report = budget_search(
        DynamicBackend.given("layer1", static_error=0.2, dynamic_error=0.0, layer_error=0.2), max_float_fraction=1.0
    )
    assert report["meets_budget"] and all(s["ranges"] == "dynamic" for s in report["steps"][1:])
    assert candidate.method == "dynamic" and candidate.float_layers == ["layer0", "layer1"]
    del candidate

    # it does not gain: the static candidate goes on and is the one kept
    candidate, report = budget_search(
        DynamicBackend.given("layer1", static_error=0.2, dynamic_error=0.25, layer_error=0.0), max_float_fraction=1.0
    )
    assert report["steps"][1]["ranges"] == "dynamic" and report["after"]["ranges"] == "histogram"
    assert candidate.method == "histogram" and report["calibration_method"] == "histogram"
    del candidate

    # layers it cannot quantize (a depthwise conv) are float layers: reported, and counted against the cap
    candidate, report = budget_search(
        DynamicBackend.given("layer1", static_error=0.2, dynamic_error=0.0, unquantized=["layer5"]),
        max_float_fraction=1.0,
    )
    assert (
        report["after"]["ranges"] == "dynamic"
        and report["int8_layers"] == 7
        and report["steps"][1]["float_layers"] == 1
    )
    assert [(f["name"], "why" in f) for f in report["float_layers"]] == [("layer5", True)]
    del candidate
    candidate, report = budget_search(
        DynamicBackend.given(
            "layer1", static_error=0.2, dynamic_error=0.0, layer_error=0.0, unquantized=["layer3", "layer4", "layer5"]
        ),
        max_float_fraction=0.25,
    )
    assert report["steps"][1]["ranges"] == "dynamic" and report["steps"][1]["over_cap"]
    assert report["after"]["ranges"] == "histogram" and candidate.method == "histogram"
    del candidate

    # it cannot quantize the graph at all: left out and said, the static search goes on
    candidate, report = budget_search(
        DynamicBackend.given("layer1", static_error=0.2, dynamic_error=None), max_float_fraction=1.0
    )
    assert report["range_methods_unusable"] == {"dynamic": "RuntimeError: no dynamic kernel for this graph"}
    assert candidate.method == "histogram" and all(s["ranges"] == "histogram" for s in report["steps"])
    del candidate


def test_a_build_whose_calibrated_ranges_failed_validation_starts_from_ranges_chosen_per_inference(budget_search):
    """static_ranges=False (set by a build, exporter.engine.pipeline._remake_with_per_inference_ranges): the search starts from the fallback
    range method even where static ranges would meet the budget, and never tries those; without a fallback method,
    or with dynamic ranges turned off, it is the static search as before."""
    candidate, report = budget_search(
        DynamicBackend.given("layer1", static_error=0.0, dynamic_error=0.001),
        max_float_fraction=1.0,
        static_ranges=False,
    )
    assert [s["ranges"] for s in report["steps"]] == ["dynamic"] and candidate.method == "dynamic"
    assert report["after"]["ranges"] == "dynamic" and report["meets_budget"] and report["static_ranges"] is False
    del candidate
    # missing the budget with them goes on to layers in float, with the same ranges
    candidate, report = budget_search(
        DynamicBackend.given("layer1", static_error=0.0, dynamic_error=0.0, layer_error=0.2),
        max_float_fraction=1.0,
        static_ranges=False,
    )
    assert {s["ranges"] for s in report["steps"]} == {"dynamic"} and candidate.float_layers == ["layer0", "layer1"]
    del candidate
    candidate, report = budget_search(
        DynamicBackend.given("layer1", static_error=0.0, dynamic_error=0.001),
        max_float_fraction=1.0,
        static_ranges=False,
        dynamic_ranges=False,
    )
    assert [s["ranges"] for s in report["steps"]] == ["histogram"] and candidate.method == "histogram"
    del candidate
    # a per-inference candidate over the cap on float layers is not made (the build keeps its first artifact)
    with pytest.raises(ValueError, match="over the cap of 2"):
        budget_search(
            DynamicBackend.given(
                "layer1", static_error=0.0, dynamic_error=0.0, unquantized=["layer3", "layer4", "layer5"]
            ),
            max_float_fraction=0.25,
            static_ranges=False,
        )
    candidate, report = budget_search(FakeBackend.given("layer1"), max_float_fraction=1.0, static_ranges=False)
    assert report["steps"][0]["ranges"] == "coarse" and "static_ranges" not in report  # a backend without them
    del candidate


def test_a_range_method_that_cannot_measure_the_model_is_left_out_and_said(monkeypatch, budget_search):
    """ONNX Runtime's percentile calibrator raised on a random RetinaNet (a histogram of a tensor with no range)
    and the whole ONNX int8 export failed, though its other two range methods work."""

    def quantize(self, float_layers, range_images, method):
        if method == "coarse":
            raise ValueError("Too many bins for data range. Cannot create 2048 finite-sized bins.")
        return real(self, float_layers, range_images, method)

    real = FakeBackend.quantize
    monkeypatch.setattr(FakeBackend, "quantize", quantize)
    report = budget_search(FakeBackend.given("layer3"), [f"layer{i}" for i in range(8)], max_float_fraction=1.0)[1]
    assert report["calibration_method"] == "fine" and {s["ranges"] for s in report["steps"]} == {"fine"}
    assert "Too many bins" in report["range_methods_unusable"]["coarse"]

    monkeypatch.setattr(FakeBackend, "range_methods", ("coarse",))  # nothing else to try: the error stands
    with pytest.raises(ValueError, match="Too many bins"):
        budget_search(FakeBackend.given("layer3"), [f"layer{i}" for i in range(8)])[1]


def test_a_program_that_does_not_load_or_run_scores_as_the_worst_candidate():
    """ShuffleNetV2's dynamic .pte failed to run (`Propagating input shapes failed`): a program that raises is
    scored as failing the budget, not an export that fails, so a program without the fault can be made instead."""
    from exporter.quant import Calibration
    from exporter.quant.search import lowered_quality, lowering_broke

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 10)).eval()
    calibration = Calibration([torch.randn(1, 3, 2, 2) for _ in range(8)], budget={"psnr_db": 30.0})

    def fails(_x):
        raise RuntimeError("method->execute() failed with error 0x1")

    def no_load():
        raise RuntimeError("XNNPACK: invalid parameter")

    graph = {"meets_budget": True, "psnr_db": 40.0}
    for load in (lambda: fails, no_load):
        score = lowered_quality(model, load, calibration)
        assert not score["meets_budget"] and score["psnr_db"] is None and "does not run" in texts(score["reasons"])[0]
        assert lowering_broke(graph, score)
    itself = lowered_quality(model, lambda: model, calibration)
    assert itself["meets_budget"] and not lowering_broke(graph, itself)
    # under the budget by a rounding of its graph: not a lowering fault
    assert not lowering_broke({"meets_budget": True, "psnr_db": 32.3}, {"meets_budget": False, "psnr_db": 31.9})


def test_the_report_says_when_the_check_images_are_too_few_to_resolve_the_accuracy_budget():
    """A trained SqueezeNet 1.1 met its 1-point budget on 64 check images (no image lost) and lost 3.5 points on
    172 validation images: one of 64 images is 1.6 points, so the check could not see a 1-point drop."""
    from exporter.release.report import quantization_summary

    step = {
        "float_layers": 0,
        "ranges": "histogram",
        "agreement": 0.984,
        "psnr_db": 46.7,
        "drop": 0.0,
        "meets_budget": True,
        "reasons": [],
    }
    q = {
        "check_images": 64,
        "check_labeled": True,
        "budget": {"accuracy_drop": 1.0, "psnr_db": 32.0},
        "int8_layers": 26,
        "layers": 26,
        "before": step,
        "after": step,
        "steps": [step],
        "meets_budget": True,
        "float_layers": [],
        "calibration_method": "histogram",
        "seconds": 1.0,
    }
    assert "one of 64 check images is 1.6 points of acc@1, coarser than the 1-point budget" in quantization_summary(q)
    assert "coarser" not in quantization_summary({**q, "check_images": 200})
    assert "coarser" not in quantization_summary({**q, "check_labeled": False})
