"""int8 that holds its budget: plain PTQ, then the most sensitive layers back in float until the budget
holds on held-out calibration images. Proven on the trained digits model and on a copy of it with one
deliberately fragile layer (same function in eager, hostile to a per-tensor int8 range)."""

from __future__ import annotations

import json

import pytest
import torch

from exporter import files
from exporter.engine import profiles
from exporter.engine.plan import make as make_plan
from exporter.standins import digits
from exporter.errors import UsageError
from exporter.quant import SETTINGS, Calibration
from exporter.quant.search import _steps

from .conftest import FAST, assert_clean_refusal, build_args, run_cli

INT8 = ["--target", "android", "--target", "jetson", "--format", "executorch:int8", "--format", "onnx:int8"]
STRICT = [
    "--threshold",
    "int8.top1_agreement=0.99",
    "--threshold",
    "int8.psnr_db=30",
    "--threshold",
    "int8.accuracy_drop=0.5",
]


def _int8_artifacts(out):
    docs = [json.loads((out / target / "manifest.json").read_text()) for target in ("android", "jetson")]
    return {a["name"]: a for doc in docs for a in doc["artifacts"]}


@pytest.fixture(scope="module")
def fragile_checkpoint(tmp_path_factory, digits_model):
    return digits.fragile_checkpoint(digits_model, tmp_path_factory.mktemp("fragile"))


def _fragile_args(model, checkpoint, out, *extra):
    args = build_args(model, out, *INT8, *extra)
    args[args.index("--checkpoint") + 1] = checkpoint
    return args


# --- the pieces --------------------------------------------------------------------------------------


def test_calibration_split_holds_out_disjoint_interleaved_images():
    images = [torch.full((1, 3, 2, 2), float(i)) for i in range(10)]
    labels = torch.arange(10) % 3
    ranges, check, check_labels = Calibration(images, labels).split()
    seen = sorted(int(x[0, 0, 0, 0]) for x in ranges + check)
    assert seen == list(range(10)) and len(check) == 5  # every image once, half held out
    assert [int(x[0, 0, 0, 0]) for x in check] == [1, 3, 5, 7, 9]
    assert check_labels.tolist() == [labels[i].item() for i in (1, 3, 5, 7, 9)]
    # another fraction holds out that share, not the nearest 1/k of it; a small one still holds one image out
    for fraction, held in ((0.75, 96), (0.05, 6), (0.004, 1)):
        images = [torch.full((1,), float(i)) for i in range(128)]
        ranges, check, _ = Calibration(images, None, settings={**SETTINGS, "check_fraction": fraction}).split()
        assert len(check) == held and len(ranges) == 128 - held, (fraction, len(check))
        assert len({float(x) for x in check} | {float(x) for x in ranges}) == 128


def test_fallback_steps_grow_and_stop_at_the_cap():
    assert list(_steps(0)) == []
    steps = list(_steps(13))
    assert steps[:3] == [1, 2, 3] and steps[-1] == 13 and steps == sorted(set(steps))


def test_budget_follows_int8_thresholds_unless_overridden():
    profile = profiles.with_overrides(
        profiles.load("jetson"),
        thresholds=["int8.psnr_db=33"],
        quant_budget=["top1_agreement=0.995", "max_float_fraction=0.1", "dynamic_ranges=False"],
        fallback=False,
    )
    plan = make_plan(profile, "classification")
    budget, settings = plan.quant_budget, plan.quant_settings
    assert budget["psnr_db"] == 33 and budget["top1_agreement"] == 0.995
    assert settings["max_float_fraction"] == 0.1 and settings["fallback"] is False
    assert (
        settings["dynamic_ranges"] is False
        and make_plan(profiles.load("android"), "classification").quant_settings["dynamic_ranges"] is True
    )
    with pytest.raises(UsageError, match="unknown key"):
        profiles.check({**profile, "quantization": {"bogus": 1}}, "test")
    with pytest.raises(UsageError, match="onnx_calibration"):
        profiles.check({**profile, "quantization": {"onnx_calibration": "entropy"}}, "test")


@pytest.mark.parametrize(
    "budget, message",
    [
        ("psnr=30", "unknown key 'psnr'"),
        ("psnr_db=high", "not a number"),
        ("max_float_fraction=2", "fraction"),
        ("fallback=1", "unknown key"),
        ("dynamic_ranges=maybe", "true or false"),
    ],
)
def test_bad_quant_budget_exits_2_and_writes_nothing(digits_model, tmp_path, budget, message):
    out = tmp_path / "out"
    assert_clean_refusal(run_cli(*build_args(digits_model, out, "--quant-budget", budget)), out, message)


def test_sensitivity_ranks_the_fragile_layer_first(digits_model, fragile_checkpoint):
    from exporter import data, weights
    from exporter.quant.sensitivity import layer_sensitivity, quantizable_layers

    loaded = weights.load(digits_model.weight, fragile_checkpoint, verify=False)
    inputs = data.from_imagefolder(digits_model.data_dir, loaded.weights.transforms(), 24, 8, 0, 10)
    images = torch.cat(inputs.calibration)
    with torch.no_grad():
        reference = loaded.model(images[16:])
    sensitivity = layer_sensitivity(loaded.model, quantizable_layers(loaded.model), images[:16], images[16:], reference)
    # by construction: a 1000x channel in a per-tensor int8 range zeroes every other channel of that input
    assert sensitivity.ranking()[0] == digits.FRAGILE_LAYER
    assert sensitivity.output_psnr_db[digits.FRAGILE_LAYER] < 20


class _FakeBackend:
    """Quantizes nothing: its candidate is the model plus an error that only keeping `culprit` in float
    removes, so the search can be checked without exporting anything."""

    range_methods = ("coarse", "fine")
    LAYERS = [f"layer{i}" for i in range(8)]

    def __init__(self, model, culprit: str | None):
        self.model, self.culprit = model, culprit

    def layers(self):
        return list(self.LAYERS)

    def describe(self, method):
        return method

    def float_closure(self, float_layers):
        return list(float_layers)

    def float_ops(self, float_layers):
        return {"linear": len(float_layers)} if float_layers else {}

    def quantize(self, float_layers, range_images, method):
        return _FakeCandidate(
            self.model,
            0.0 if self.culprit in float_layers else (0.5 if method == "coarse" else 0.2),
            list(float_layers),
            method,
        )


class _FakeCandidate:
    alive = most_alive = 0  # candidates in memory now / at most during a search

    def __init__(self, model, error, float_layers, method):
        self.model, self.error, self.float_layers, self.method = model, error, float_layers, method
        _FakeCandidate.alive += 1
        _FakeCandidate.most_alive = max(_FakeCandidate.most_alive, _FakeCandidate.alive)

    def __del__(self):
        _FakeCandidate.alive -= 1

    def __call__(self, x):
        out = self.model(x)
        return out + self.error * torch.linspace(-1, 1, out.numel()).reshape(out.shape)


def _search(monkeypatch, culprit, ranking, **settings):
    return _search_candidate(monkeypatch, culprit, ranking, **settings)[1]


def _search_candidate(monkeypatch, culprit, ranking, **settings):
    from exporter.quant import SETTINGS, search
    from exporter.quant.sensitivity import Sensitivity

    monkeypatch.setattr(
        search,
        "layer_sensitivity",
        lambda *a, **k: Sensitivity(
            {n: 10.0 + i for i, n in enumerate(ranking)}, {n: 5.0 + i for i, n in enumerate(ranking)}
        ),
    )
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 10)
    calibration = Calibration([torch.randn(1, 4) for _ in range(20)], None, {"psnr_db": 30.0}, {**SETTINGS, **settings})
    _FakeCandidate.most_alive = _FakeCandidate.alive
    return search.quantize_with_budget(model, _FakeBackend(model, culprit), calibration)


def test_search_keeps_the_best_ranges_and_floats_layers_in_sensitivity_order(monkeypatch):
    ranking = [f"layer{i}" for i in (5, 1, 3, 0, 2, 4, 6, 7)]
    report = _search(monkeypatch, "layer3", ranking, max_float_fraction=1.0)
    assert report["calibration_method"] == "fine" and [s["ranges"] for s in report["steps"][:2]] == ["coarse", "fine"]
    assert [f["name"] for f in report["float_layers"]] == ["layer5", "layer1", "layer3"]  # steps of 1, 2, 3 layers
    assert report["meets_budget"] and not report["before"]["meets_budget"] and report["int8_layers"] == 5


def test_search_stops_when_float_layers_stop_helping(monkeypatch):
    report = _search(monkeypatch, None, list(_FakeBackend.LAYERS), max_float_fraction=1.0)
    fallback_steps = [s["float_layers"] for s in report["steps"][2:]]
    assert fallback_steps == [1, 2, 3, 4] and not report["meets_budget"]  # the cap (8) is not reached
    assert "4 steps in a row" in report["note"]
    assert report["float_layers"] == [] and report["after"] == report["before"]  # no gain: plain PTQ kept


def test_search_holds_one_candidate_at_a_time_and_returns_the_one_it_reports(monkeypatch):
    """Every candidate holds a runtime session or a quantized copy of the model: the search keeps one (two while
    the next is made), and when an earlier step is chosen it is made again, the same as the report says."""
    candidate, report = _search_candidate(monkeypatch, None, list(_FakeBackend.LAYERS), max_float_fraction=1.0)
    assert len(report["steps"]) == 6 and _FakeCandidate.most_alive <= 2
    assert (candidate.float_layers, candidate.method) == ([], "fine") and report["float_layers"] == []
    del candidate
    candidate, report = _search_candidate(monkeypatch, "layer2", list(_FakeBackend.LAYERS), max_float_fraction=1.0)
    assert report["meets_budget"] and _FakeCandidate.most_alive <= 2
    assert candidate.float_layers == [f["name"] for f in report["float_layers"]] == ["layer0", "layer1", "layer2"]


def test_a_candidate_that_cannot_run_a_check_image_is_the_worst_and_the_search_goes_on(monkeypatch):
    """Faster R-CNN's int8 RPN left one check image without a proposal, and ONNX Runtime failed on the zero rows
    its box head got: the search crashed and the int8 artifact was "export failed". Such a candidate is now the
    worst there is: the layers go back to float until one runs and meets the budget."""
    from exporter.quant import search

    def failing_until_fixed(self, x):
        if self.error:  # every candidate but the one with the culprit in float
            raise search.CandidateFailed("Fail: Reshape of 0 rows")
        return self.model(x)

    monkeypatch.setattr(_FakeCandidate, "__call__", failing_until_fixed)
    report = _search(monkeypatch, "layer1", list(_FakeBackend.LAYERS), max_float_fraction=1.0)
    assert (
        report["before"]["psnr_db"] is None
        and "does not run on every check image" in report["before"]["reasons"][0]
        and "Reshape of 0 rows" in report["before"]["reasons"][0]
    )
    assert report["meets_budget"] and [f["name"] for f in report["float_layers"]] == ["layer0", "layer1"]
    never = _search(monkeypatch, "no-such-layer", list(_FakeBackend.LAYERS), max_float_fraction=1.0)
    assert not never["meets_budget"] and "does not run on every check image" in never["note"]


def test_search_respects_the_cap_and_no_fallback(monkeypatch):
    capped = _search(monkeypatch, "layer7", list(_FakeBackend.LAYERS), max_float_fraction=0.25)
    assert [s["float_layers"] for s in capped["steps"][2:]] == [1, 2] and "cap of 2" in capped["note"]
    plain = _search(monkeypatch, "layer0", list(_FakeBackend.LAYERS), fallback=False)
    assert plain["float_layers"] == [] and len(plain["steps"]) == 2 and "--no-fallback" in plain["note"]


def test_the_cap_and_the_steps_count_the_layers_floated_beside_a_layer(monkeypatch):
    """On ExecuTorch a layer's producer goes float with it (XNNPACK runs a quantized op only with a quantized
    output): a step of one layer can be two in float. The cap holds for all of them, and a layer already float
    beside another is not a step of its own."""
    producer = {"layer7": "layer6", "layer5": "layer4"}
    monkeypatch.setattr(
        _FakeBackend,
        "float_closure",
        lambda self, layers: list(dict.fromkeys([*layers, *(producer[n] for n in layers if n in producer)])),
    )
    # ranking: layer7 (floats layer6 with it), layer6 (already float: no step), layer5 (+ layer4), ...
    ranking = ["layer7", "layer6", "layer5", "layer0", "layer1", "layer2", "layer3", "layer4"]
    report = _search(monkeypatch, "layer3", ranking, max_float_fraction=0.5)  # cap: 4 layers
    fallback = report["steps"][2:]
    assert [s["float_layers"] for s in fallback] == [2, 4, 5] and fallback[-1]["over_cap"], fallback
    assert len(report["float_layers"]) <= 4 and "over the cap of 4" in report["note"], report


def test_a_missed_budget_says_when_the_model_itself_amplifies_small_errors(monkeypatch):
    """A digits-trained EfficientNet-B1 missed its int8 budget on both runtimes: eager itself, its
    input perturbed at 40 dB SNR, moved to 30.5 dB. Here a model reads an input channel that never varies with a
    1000x weight: noise there, as int8 rounding adds anywhere, is amplified; the same model with a unit weight is not."""
    from exporter.quant import SETTINGS, search
    from exporter.quant.sensitivity import Sensitivity

    monkeypatch.setattr(
        search,
        "layer_sensitivity",
        lambda *a, **k: Sensitivity({n: 10.0 for n in _FakeBackend.LAYERS}, {n: 5.0 for n in _FakeBackend.LAYERS}),
    )
    torch.manual_seed(0)
    images = [torch.cat([torch.randn(1, 3), torch.zeros(1, 1)], 1) for _ in range(20)]
    reports = {}
    for gain in (1.0, 1000.0):
        model = torch.nn.Linear(4, 10)
        with torch.no_grad():
            model.weight[:, 3] = gain
        calibration = Calibration(images, None, {"psnr_db": 30.0}, {**SETTINGS, "max_float_fraction": 1.0})
        reports[gain] = search.quantize_with_budget(model, _FakeBackend(model, None), calibration)[1]
    quiet, loud = reports[1.0], reports[1000.0]
    assert not quiet["meets_budget"] and not loud["meets_budget"]
    assert quiet["perturbation"] == {"input_snr_db": 40.0, "output_psnr_db": quiet["perturbation"]["output_psnr_db"]}
    assert quiet["perturbation"]["output_psnr_db"] >= 32 and "amplifies" not in quiet["note"]
    assert loud["perturbation"]["output_psnr_db"] < 30 and "the model amplifies small errors" in loud["note"]
    assert "perturbation" not in _search(monkeypatch, "layer0", list(_FakeBackend.LAYERS), max_float_fraction=1.0)


class _KindsBackend(_FakeBackend):
    """A backend that also quantizes adds: its candidate's error is `add_error` unless every add is float, plus
    `layer_error` unless the culprit layer is float."""

    range_methods = ("histogram",)
    op_fallbacks = ("add",)

    def __init__(self, model, culprit, add_error, layer_error):
        super().__init__(model, culprit)
        self.add_error, self.layer_error = add_error, layer_error

    def float_ops(self, float_layers, float_kinds=()):
        return {**super().float_ops(float_layers), **({"add": 3} if "add" in float_kinds else {})}

    def quantize(self, float_layers, range_images, method, float_kinds=()):
        error = (0.0 if "add" in float_kinds else self.add_error) + (
            0.0 if self.culprit in float_layers else self.layer_error
        )
        candidate = _FakeCandidate(self.model, error, list(float_layers), method)
        candidate.kinds = tuple(float_kinds)
        return candidate


def _search_fake(monkeypatch, make_backend, max_float_fraction=1.0, **settings):
    """quantize_with_budget on make_backend(model), layers ranked in their order, a 30 dB budget."""
    from exporter.quant import search
    from exporter.quant.sensitivity import Sensitivity

    ranking = list(_FakeBackend.LAYERS)
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
        [torch.randn(1, 4) for _ in range(20)],
        None,
        {"psnr_db": 30.0},
        {**SETTINGS, "max_float_fraction": max_float_fraction, **settings},
    )
    _FakeCandidate.most_alive = _FakeCandidate.alive
    return search.quantize_with_budget(model, make_backend(model), calibration)


def _search_kinds(monkeypatch, add_error, layer_error, culprit="layer1"):
    return _search_fake(monkeypatch, lambda model: _KindsBackend(model, culprit, add_error, layer_error))


def test_an_error_spread_over_every_add_is_kept_float_by_kind_before_layers_are(monkeypatch):
    """EfficientNetV2-S trained on digits: its 35 residual adds, each requantizing a stream that grows to ±300,
    cost 6.6 dB together and no more than 1.9 dB each, so no layer in float recovered them. When plain PTQ misses
    the budget, every add in float is tried first; the layer search goes on from it, and it is kept only if it
    gains."""
    candidate, report = _search_kinds(monkeypatch, add_error=0.2, layer_error=0.2)
    kinds_step = report["steps"][1]
    assert kinds_step["float_kinds"] == ["add"] and kinds_step["float_layers"] == 0
    assert kinds_step["psnr_db"] > report["before"]["psnr_db"] + 0.5 and not kinds_step["meets_budget"]
    assert report["meets_budget"] and report["float_kinds"] == ["add"] and report["float_ops"]["add"] == 3
    *layer_steps, without_adds = report["steps"][2:]
    assert all(s["float_kinds"] == ["add"] for s in layer_steps)  # every layer step keeps the adds float
    assert "float_kinds" not in without_adds and not without_adds["meets_budget"]  # the layers alone: tried, missed
    assert [f["name"] for f in report["float_layers"]] == ["layer0", "layer1"]
    assert candidate.kinds == ("add",) and candidate.float_layers == ["layer0", "layer1"] and candidate.error == 0
    assert _FakeCandidate.most_alive <= 2
    del candidate

    # the layers meet the budget without the adds too: the adds go back to int8 (float adds only cost speed)
    candidate, report = _search_kinds(monkeypatch, add_error=0.02, layer_error=0.3)
    assert report["steps"][1]["float_kinds"] == ["add"] and report["meets_budget"], report["steps"]
    assert "float_kinds" not in report and "float_kinds" not in report["after"]
    assert candidate.kinds == () and candidate.float_layers == ["layer0", "layer1"]
    del candidate

    # the budget is missed whatever the search floats: the adds-only step is kept, and made again
    candidate, report = _search_kinds(monkeypatch, add_error=0.05, layer_error=0.3, culprit=None)
    assert not report["meets_budget"] and report["float_kinds"] == ["add"] and report["float_layers"] == []
    assert candidate.kinds == ("add",) and candidate.float_layers == [] and _FakeCandidate.most_alive <= 2
    del candidate

    # adds float alone meet the budget: no layer goes float
    candidate, report = _search_kinds(monkeypatch, add_error=0.2, layer_error=0.0)
    assert report["meets_budget"] and report["float_kinds"] == ["add"] and report["float_layers"] == []
    assert len(report["steps"]) == 2 and candidate.kinds == ("add",)
    del candidate

    # adds float gain less than 0.5 dB: they stay int8, the layers alone fix it
    candidate, report = _search_kinds(monkeypatch, add_error=0.01, layer_error=0.2)
    gain = report["steps"][1]["psnr_db"] - report["before"]["psnr_db"]
    assert report["steps"][1]["float_kinds"] == ["add"] and 0 < gain < 0.5 and "float_kinds" not in report
    assert all("float_kinds" not in s for s in report["steps"][2:]) and report["meets_budget"]
    assert candidate.kinds == () and "add" not in report["float_ops"]
    del candidate

    # plain PTQ meets the budget: nothing else is tried
    candidate, report = _search_kinds(monkeypatch, add_error=0.0, layer_error=0.0)
    assert len(report["steps"]) == 1 and "float_kinds" not in report and candidate.kinds == ()
    assert not {"dynamic_ranges", "onnx_calibration"} & set(report)  # settings no backend of this kind reads


class _DynamicBackend(_FakeBackend):
    """A backend with a fallback range method: its candidates' error is `static_error` with static ranges and
    `dynamic_error` with ranges chosen per inference, plus `layer_error` unless the culprit layer is float."""

    range_methods = ("histogram",)
    fallback_range_methods = ("dynamic",)
    settings = ("dynamic_ranges", "static_ranges")

    def __init__(self, model, culprit, static_error, dynamic_error, layer_error=0.0, unquantized=()):
        super().__init__(model, culprit)
        self.errors, self.layer_error = {"histogram": static_error, "dynamic": dynamic_error}, layer_error
        self.unquantized = list(unquantized)  # layers the dynamic method leaves float whatever is asked

    def float_closure(self, float_layers, method="histogram"):
        return list(dict.fromkeys([*float_layers, *(self.unquantized if method == "dynamic" else [])]))

    def float_ops(self, float_layers, float_kinds=(), method=None):
        return {"linear": len(float_layers), **({"add": 3} if method == "dynamic" else {})}

    def quantize(self, float_layers, range_images, method):
        if self.errors[method] is None:
            raise RuntimeError("no dynamic kernel for this graph\nsecond line")
        error = self.errors[method] + (0.0 if self.culprit in float_layers else self.layer_error)
        return _FakeCandidate(self.model, error, list(float_layers), method)


def _search_dynamic(
    monkeypatch, static_error, dynamic_error, layer_error=0.0, unquantized=(), fraction=1.0, **settings
):
    return _search_fake(
        monkeypatch,
        lambda model: _DynamicBackend(model, "layer1", static_error, dynamic_error, layer_error, unquantized),
        fraction,
        **settings,
    )


def test_ranges_chosen_per_inference_are_tried_only_when_static_ranges_miss_and_kept_when_they_gain(monkeypatch):
    """EfficientNet-B2 trained on the digits: static ranges 25.1 dB from eager, ranges chosen per inference 37.2 dB
    with every layer still int8. The fallback range method is tried before any op or layer goes float; a build
    whose static ranges meet the budget never tries it (they are faster where the two differ)."""
    candidate, report = _search_dynamic(monkeypatch, static_error=0.001, dynamic_error=0.0)
    assert [s["ranges"] for s in report["steps"]] == ["histogram"] and candidate.method == "histogram"
    assert report["dynamic_ranges"] is True and "onnx_calibration" not in report  # only the settings it reads
    del candidate

    candidate, report = _search_dynamic(monkeypatch, static_error=0.2, dynamic_error=0.001)
    assert [s["ranges"] for s in report["steps"]] == ["histogram", "dynamic"], report["steps"]
    assert report["meets_budget"] and report["after"]["ranges"] == "dynamic" and report["float_layers"] == []
    assert report["calibration_method"] == "dynamic" and report["float_ops"] == {"linear": 0, "add": 3}
    assert not report["before"]["meets_budget"] and candidate.method == "dynamic" and candidate.error == 0.001
    del candidate

    # it gains but misses: the layer search goes on from it, with the same ranges
    candidate, report = _search_dynamic(monkeypatch, static_error=0.2, dynamic_error=0.0, layer_error=0.2)
    assert report["meets_budget"] and all(s["ranges"] == "dynamic" for s in report["steps"][1:])
    assert candidate.method == "dynamic" and candidate.float_layers == ["layer0", "layer1"]
    del candidate

    # it does not gain: the static candidate goes on and is the one kept
    candidate, report = _search_dynamic(monkeypatch, static_error=0.2, dynamic_error=0.25, layer_error=0.0)
    assert report["steps"][1]["ranges"] == "dynamic" and report["after"]["ranges"] == "histogram"
    assert candidate.method == "histogram" and report["calibration_method"] == "histogram"
    del candidate

    # layers it cannot quantize (a depthwise conv) are float layers: reported, and counted against the cap
    candidate, report = _search_dynamic(monkeypatch, static_error=0.2, dynamic_error=0.0, unquantized=["layer5"])
    assert (
        report["after"]["ranges"] == "dynamic"
        and report["int8_layers"] == 7
        and report["steps"][1]["float_layers"] == 1
    )
    assert [(f["name"], "why" in f) for f in report["float_layers"]] == [("layer5", True)]
    del candidate
    candidate, report = _search_dynamic(
        monkeypatch,
        static_error=0.2,
        dynamic_error=0.0,
        layer_error=0.0,
        unquantized=["layer3", "layer4", "layer5"],
        fraction=0.25,
    )
    assert report["steps"][1]["ranges"] == "dynamic" and report["steps"][1]["over_cap"]
    assert report["after"]["ranges"] == "histogram" and candidate.method == "histogram"
    del candidate

    # it cannot quantize the graph at all: left out and said, the static search goes on
    candidate, report = _search_dynamic(monkeypatch, static_error=0.2, dynamic_error=None)
    assert report["range_methods_unusable"] == {"dynamic": "RuntimeError: no dynamic kernel for this graph"}
    assert candidate.method == "histogram" and all(s["ranges"] == "histogram" for s in report["steps"])
    del candidate


def test_a_build_whose_calibrated_ranges_failed_validation_starts_from_ranges_chosen_per_inference(monkeypatch):
    """static_ranges=False (set by a build, exporter.engine.pipeline._made_again): the search starts from the fallback
    range method even where static ranges would meet the budget, and never tries those; without a fallback method,
    or with dynamic ranges turned off, it is the static search as before."""
    candidate, report = _search_dynamic(monkeypatch, static_error=0.0, dynamic_error=0.001, static_ranges=False)
    assert [s["ranges"] for s in report["steps"]] == ["dynamic"] and candidate.method == "dynamic"
    assert report["after"]["ranges"] == "dynamic" and report["meets_budget"] and report["static_ranges"] is False
    del candidate
    # missing the budget with them goes on to layers in float, with the same ranges
    candidate, report = _search_dynamic(
        monkeypatch, static_error=0.0, dynamic_error=0.0, layer_error=0.2, static_ranges=False
    )
    assert {s["ranges"] for s in report["steps"]} == {"dynamic"} and candidate.float_layers == ["layer0", "layer1"]
    del candidate
    candidate, report = _search_dynamic(
        monkeypatch, static_error=0.0, dynamic_error=0.001, static_ranges=False, dynamic_ranges=False
    )
    assert [s["ranges"] for s in report["steps"]] == ["histogram"] and candidate.method == "histogram"
    del candidate
    # a per-inference candidate over the cap on float layers is not made (the build keeps its first artifact)
    with pytest.raises(ValueError, match="over the cap of 2"):
        _search_dynamic(
            monkeypatch,
            static_error=0.0,
            dynamic_error=0.0,
            unquantized=["layer3", "layer4", "layer5"],
            fraction=0.25,
            static_ranges=False,
        )
    candidate, report = _search_fake(monkeypatch, lambda model: _FakeBackend(model, "layer1"), static_ranges=False)
    assert report["steps"][0]["ranges"] == "coarse" and "static_ranges" not in report  # a backend without them
    del candidate


def _add_to_add_edges(adds, qdq) -> list[bool]:
    """Per input of an add that another add computed: whether it went through int8 (quantize, dequantize) on the way."""
    edges = []
    for add in adds:
        for arg in add.args[:2]:
            rounded = False
            while getattr(arg, "target", None) in qdq:
                arg, rounded = arg.args[0], True
            if arg in adds:
                edges.append(rounded)
    return edges


def test_every_add_kept_float_leaves_no_add_int8_and_lowers_whole(tmp_path, digits_model):
    """The trained digits MobileNetV3-Small (residual adds in its inverted-residual blocks): with every add in
    float, the stream from add to add is never rounded to int8, XNNPACK still takes the whole graph and the .pte computes that int8 graph;
    on held-out digits it is no further from eager than plain PTQ."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    from exporter import validation, weights
    from exporter.formats import executorch
    from exporter.quant.pt2e import OP_KINDS, Pt2eBackend

    loaded = weights.load(digits_model.weight, digits_model.checkpoint, verify=False)
    task = weights.bind_task(loaded.weights, loaded.num_classes)
    inputs = task.load_data(digits_model.data_dir, task.transform(loaded.weights), 32, 48, 0)
    eager, images = loaded.eager.float().eval(), inputs.validation
    reference = validation.run_all(eager, images)
    backend = Pt2eBackend(eager, images[:1])
    qdq = {
        torch.ops.quantized_decomposed.quantize_per_tensor.default,
        torch.ops.quantized_decomposed.dequantize_per_tensor.default,
    }
    psnr = {}
    for kinds in ((), ("add",)):
        quantized = backend.quantize([], inputs.calibration, "histogram", kinds)
        adds = [n for n in quantized.graph.nodes if n.op == "call_function" and n.target in OP_KINDS["add"]]
        assert len(adds) == 6  # MobileNetV3-Small's residual blocks
        stream = _add_to_add_edges(adds, qdq)  # the residual stream from block to block: rounded or not
        assert stream and set(stream) == {not kinds}, stream
        assert (backend.float_ops([], kinds).get("add_", 0) == len(adds)) == bool(kinds)  # the in-place add
        psnr[kinds] = task.fidelity(reference, validation.run_all(quantized, images))["psnr_db"]
    # lowered with the adds float only (plain PTQ's delegation: test_android; each lowering here took 50 s)
    edge = to_edge_transform_and_lower(
        torch.export.export(quantized, (images[:1],)), partitioner=[XnnpackPartitioner()]
    )
    delegation = executorch._delegation(edge.exported_program())
    assert delegation["ops_outside_on_tensors"] == {} and delegation["delegated_subgraphs"] == 1, delegation
    path = tmp_path / "adds_float.pte"
    path.write_bytes(edge.to_executorch().buffer)
    out = validation.run_all(executorch.load(path, threads=1), images)
    expected = validation.run_all(quantized, images)
    assert (out - expected).abs().max().item() <= 0.05 * expected.abs().max().item()
    assert psnr[("add",)] >= psnr[()] - 0.5, psnr


class _ResidualBlocks(torch.nn.Module):
    """Two ResNet basic blocks: each add is followed by a ReLU, which the XNNPACK quantizer fuses with it."""

    def __init__(self):
        super().__init__()
        nn = torch.nn
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1)) for _ in range(2)
        )

    def forward(self, x):
        x = self.stem(x).relu()
        for block in self.blocks:
            x = (x + block(x)).relu()
        return x


def test_every_add_kept_float_takes_the_relu_fused_after_it_and_lowers_whole(tmp_path):
    """add + ReLU is one int8 pattern (inputs on the add, output on the ReLU): kept float, the ReLU's output is not
    rounded before the next add, and the .pte computes its quantized graph."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    from exporter.formats import executorch
    from exporter.quant.pt2e import OP_KINDS, Pt2eBackend

    torch.manual_seed(0)
    model, example = _ResidualBlocks().eval(), torch.randn(1, 3, 12, 12)
    qdq = {
        torch.ops.quantized_decomposed.quantize_per_tensor.default,
        torch.ops.quantized_decomposed.dequantize_per_tensor.default,
    }
    backend = Pt2eBackend(model, example)
    for kinds in ((), ("add",)):
        quantized = backend.quantize([], [torch.randn(1, 3, 12, 12) for _ in range(4)], "histogram", kinds)
        adds = [n for n in quantized.graph.nodes if n.op == "call_function" and n.target in OP_KINDS["add"]]
        (first, second) = adds
        stream = second.args[0]  # the first block's output, through its ReLU
        rounded = stream.target in qdq
        while stream.target in qdq:
            stream = stream.args[0]
        assert stream.args[0] is first and rounded == (not kinds), (kinds, second.args)
    edge = to_edge_transform_and_lower(torch.export.export(quantized, (example,)), partitioner=[XnnpackPartitioner()])
    delegation = executorch._delegation(edge.exported_program())
    assert delegation["ops_outside_on_tensors"] == {} and delegation["delegated_subgraphs"] == 1, delegation
    path = tmp_path / "blocks.pte"
    path.write_bytes(edge.to_executorch().buffer)
    out = executorch.load(path, threads=1)(example)
    with torch.no_grad():
        expected = quantized(example)
    assert (out - expected).abs().max().item() <= 0.05 * expected.abs().max().item()


class _TinyTransformer(torch.nn.Module):
    """Patch embedding, pre-norm attention and a GELU MLP: the ops a ViT has, at toy size."""

    def __init__(self):
        super().__init__()
        nn = torch.nn
        self.patch, self.norm = nn.Conv2d(3, 16, 4, 4), nn.LayerNorm(16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        t = self.patch(x).flatten(2).transpose(1, 2)
        h = self.norm(t)
        t = t + self.attn(h, h, h, need_weights=False)[0]
        t = t + self.mlp(self.norm(t))
        return self.head(t.mean(1))


def test_the_report_names_the_ops_int8_leaves_in_float(tmp_path):
    """LayerNorm, GELU and attention have no int8 pattern in the XNNPACK quantizer; the Q/DQ ONNX puts Q/DQ on
    Conv/Gemm only. Each backend says which compute ops stay float, and a layer kept in float joins them."""
    import onnx

    from exporter.formats.onnx import INPUT, _export_graph
    from exporter.quant.onnx_qdq import OnnxQdqBackend
    from exporter.quant.pt2e import Pt2eBackend

    torch.manual_seed(0)
    model, example = _TinyTransformer().eval(), torch.randn(1, 3, 16, 16)
    pt2e = Pt2eBackend(model, example)
    assert pt2e.layers() == ["patch", "mlp.0", "mlp.2", "head"]
    plain = pt2e.float_ops([])
    assert {"layer_norm", "gelu", "scaled_dot_product_attention"} <= set(plain), plain
    assert not {"conv2d", "linear", "view", "transpose"} & set(plain), plain
    assert pt2e.float_ops(["head"]).get("linear") == 1

    fp32 = tmp_path / "fp32.onnx"
    _export_graph(model, example, 18, fp32)
    qdq = OnnxQdqBackend(model, fp32, INPUT, "minmax", tmp_path)
    # the MLP's Linears are MatMuls in ONNX (3-D input), found by their weights; the attention's
    # packed input projection and its score MatMuls are no Linear layer's
    assert sorted(qdq.layers()) == ["attn.out_proj", "head", "mlp.0", "mlp.2", "patch"]
    onnx_plain = qdq.float_ops([])
    assert "Conv" not in onnx_plain and {"LayerNormalization", "Softmax"} & set(onnx_plain), onnx_plain
    assert qdq.float_ops(["patch"]).get("Conv") == 1
    assert qdq.float_ops(["mlp.0"]).get("MatMul", 0) == onnx_plain.get("MatMul", 0) + 1
    candidate = qdq.quantize(["mlp.2"], [torch.randn(1, 3, 16, 16) for _ in range(4)], "minmax")
    graph = onnx.load(str(candidate.path)).graph
    producers = {o: n.op_type for n in graph.node for o in n.output}
    fed_by_dq = {n.name: [producers.get(i) for i in n.input[:2]] for n in graph.node if n.op_type == "MatMul"}
    ((mlp_in, _),) = qdq._nodes["mlp.0"]
    ((mlp_out, _),) = qdq._nodes["mlp.2"]
    assert fed_by_dq[mlp_in] == ["DequantizeLinear", "DequantizeLinear"], fed_by_dq
    assert "DequantizeLinear" not in fed_by_dq[mlp_out] and set(qdq._unmapped) <= set(fed_by_dq)
    assert all("DequantizeLinear" not in fed_by_dq[n] for n in qdq._unmapped)
    with torch.no_grad():
        x = torch.randn(1, 3, 16, 16)
        assert torch.allclose(candidate(x), model(x), atol=0.1)
    # a candidate the search let go and then chose is its file again, not another calibration
    again = qdq.quantize(["mlp.2"], [], "minmax")
    assert again.path == candidate.path and again is not candidate and len(list(tmp_path.glob("attempt*.onnx"))) == 1


def test_ort_calibration_holds_one_image_at_a_time(tmp_path, monkeypatch):
    """ONNX Runtime's percentile calibrator keeps every calibrated tensor of the images it is given until it has
    their histograms (MViT-V2-S's 8 clips: past 14 GB): the backend gives it one image per window, and the
    int8 graph still computes what the model does."""
    from onnxruntime.quantization.calibrate import HistogramCalibrater

    from exporter.formats.onnx import INPUT, _export_graph
    from exporter.quant.onnx_qdq import OnnxQdqBackend

    windows = []
    collect = HistogramCalibrater.collect_data

    def counting(self, reader):
        seen, get_next = 0, reader.get_next

        def counted():
            nonlocal seen
            batch = get_next()
            seen += batch is not None
            return batch

        reader.get_next = counted
        collect(self, reader)
        windows.append(seen)

    monkeypatch.setattr(HistogramCalibrater, "collect_data", counting)
    torch.manual_seed(0)
    model, example = _TinyTransformer().eval(), torch.randn(1, 3, 16, 16)
    fp32 = tmp_path / "fp32.onnx"
    _export_graph(model, example, 18, fp32)
    candidate = OnnxQdqBackend(model, fp32, INPUT, "percentile", tmp_path).quantize(
        [], [torch.randn(1, 3, 16, 16) for _ in range(5)], "percentile"
    )
    assert windows == [1] * 5
    with torch.no_grad():
        x = torch.randn(1, 3, 16, 16)
        assert torch.allclose(candidate(x), model(x), atol=0.1)


# --- whole builds ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def digits_int8(tmp_path_factory, digits_model):
    out = tmp_path_factory.mktemp("digits_int8") / "build"
    result = run_cli(*build_args(digits_model, out, *INT8, *STRICT))
    return out, result


@pytest.mark.slow
def test_digits_int8_meets_the_strict_budget_on_its_check_images_and_is_judged_on_the_rest(digits_int8):
    """What the budget guarantees: met on the held-out check images (the search floats layers until it is), then
    judged on the validation digits like any artifact. Whether those 120 digits also hold a 0.5-point drop depends
    on the stand-in, which is trained on the host (one trained on an AMD EPYC without AVX-512 lost 1 and 2 of them):
    the verdict must be honest, not a pass."""
    out, result = digits_int8
    artifacts = _int8_artifacts(out)
    failed = [name for name, a in artifacts.items() if a["status"] == "failed"]
    assert result.exit_code == (1 if failed else 0), result.output
    for name in ("executorch_int8", "onnx_int8"):
        a = artifacts[name]
        assert (a["status"] == "passed") == (a["reasons"] == []), (name, a["reasons"])
        assert set(r.split()[0] for r in a["reasons"]) <= {"accuracy_drop", "top1_agreement"}, a["reasons"]
        assert a["fidelity"]["top1_agreement"] >= 0.97 and a["fidelity"]["psnr_db"] >= 30
        q = a["details"]["quantization"]
        assert q["meets_budget"] and q["check_images"] > 0 and q["check_labeled"]
        assert q["after"]["drop"] <= 0.5 and q["after"]["agreement"] >= 0.99  # on the check images
        assert q["int8_layers"] + len(q["float_layers"]) == q["layers"] > 50
        assert q["budget"]["psnr_db"] == 30 + q["psnr_margin_db"]
    page = (out / "report.html").read_text()
    assert "int8: budget and layer sensitivity" in page


@pytest.fixture(scope="module")
def fragile_builds(tmp_path_factory, digits_model, fragile_checkpoint):
    root = tmp_path_factory.mktemp("fragile_builds")
    plain = run_cli(*_fragile_args(digits_model, fragile_checkpoint, root / "plain", "--no-fallback"))
    # static ranges only: the layer search is what this build tests (ranges chosen per inference: the next one)
    budgeted = run_cli(
        *_fragile_args(digits_model, fragile_checkpoint, root / "budgeted", "--quant-budget", "dynamic_ranges=false")
    )
    args = build_args(digits_model, root / "dynamic", "--target", "android", "--format", "executorch:int8")
    args[args.index("--checkpoint") + 1] = fragile_checkpoint
    dynamic = run_cli(*args)
    return (root / "plain", plain), (root / "budgeted", budgeted), (root / "dynamic", dynamic)


@pytest.mark.slow
def test_plain_ptq_breaks_on_the_fragile_layer(fragile_builds):
    (out, result), *_ = fragile_builds
    assert result.exit_code == 1, result.output
    for name, a in _int8_artifacts(out).items():
        assert a["status"] == "failed" and any(r.startswith("psnr_db") for r in a["reasons"]), name
        q = a["details"]["quantization"]
        assert q["float_layers"] == [] and not q["meets_budget"] and "--no-fallback" in q["note"]


@pytest.mark.slow
def test_budgeted_build_keeps_the_fragile_layer_in_float_and_recovers(fragile_builds):
    """The fragile layer (plain PTQ: under 10 dB, about chance) is found and kept float, and the artifact is back
    near eager; its last point of accuracy on 120 digits is the host-trained stand-in's (see the test above)."""
    _, (out, result), _ = fragile_builds
    artifacts = _int8_artifacts(out)
    failed = [name for name, a in artifacts.items() if a["status"] == "failed"]
    assert result.exit_code == (1 if failed else 0), result.output
    for name, a in artifacts.items():
        assert (a["status"] == "passed") == (a["reasons"] == []), (name, a["reasons"])
        assert all(r.startswith("accuracy_drop") for r in a["reasons"]), (name, a["reasons"])
        assert a["fidelity"]["psnr_db"] >= 30 and a["accuracy"]["drop_points"] <= 3, (name, a["accuracy"])
        q = a["details"]["quantization"]
        kept = [f["name"] for f in q["float_layers"]]
        assert digits.FRAGILE_LAYER in kept, (name, kept)
        assert not q["before"]["meets_budget"] and q["after"]["meets_budget"]
        assert q["after"]["psnr_db"] >= q["budget"]["psnr_db"] > q["before"]["psnr_db"]
        assert len(kept) <= q["max_float_fraction"] * q["layers"]
        if name == "executorch_int8":  # the float layers stay inside the XNNPACK delegate
            assert a["details"]["delegation"]["ops_outside_on_tensors"] == {}
    notes = (out / "android" / "report.md").read_text()
    kept_line = next(line for line in notes.splitlines() if line.startswith("- `executorch_int8`: int8 budget met"))
    assert digits.FRAGILE_LAYER in kept_line.split("kept in float: ")[1]
    assert (out / "report.html").read_text().count('aria-label="int8 layer sensitivity') == 2


@pytest.mark.slow
def test_ranges_chosen_per_inference_are_tried_on_the_fragile_model_before_any_layer_goes_float(fragile_builds):
    """The same fragile model, .pte, default settings: static ranges miss (one channel 1000x the others sets the
    tensor's range), and ranges chosen per inference are tried before any layer goes float. What must hold is
    the verdict and the accounting, not which fallback won on this host: every layer XNNPACK's dynamic patterns
    leave float (its depthwise convs) is a float layer, within the cap if kept."""
    *_, (out, result) = fragile_builds
    a = json.loads((out / "manifest.json").read_text())["artifacts"][0]
    assert a["name"] == "executorch_int8" and result.exit_code == (1 if a["status"] == "failed" else 0), result.output
    assert all(r.startswith("accuracy_drop") for r in a["reasons"]), a["reasons"]
    q = a["details"]["quantization"]
    assert not q["before"]["meets_budget"] and q["before"]["ranges"] == "histogram"
    tried = q["steps"][1]
    assert tried["ranges"] == "dynamic" and tried["float_layers"] > 0, q["steps"]  # its depthwise convs at least
    cap = q["max_float_fraction"] * q["layers"]
    assert tried.get("over_cap", False) == (tried["float_layers"] > cap)
    assert q["int8_layers"] == q["layers"] - len(q["float_layers"]) and len(q["float_layers"]) <= cap
    if q["after"]["ranges"] == "dynamic":
        assert q["after"]["float_layers"] == len(q["float_layers"]) and "dynamic" in q["calibration_method"]
    assert a["fidelity"]["psnr_db"] >= 30 and a["details"]["delegation"]["ops_outside_on_tensors"] == {}


@pytest.mark.slow
def test_a_second_trained_architecture_gets_an_honest_verdict_and_report(tmp_path, quantized_digits):
    """ShuffleNetV2 (channel shuffles, splits, no squeeze-excite), trained on the digits: an architecture
    the search was not built on. Nothing guarantees it passes; what must hold is that the verdict follows
    the thresholds, the exit code follows the verdicts, and the report says what the search did (its
    PT2E check on the reference graph has read lower than the .pte measures: 30 vs 36 dB on one host)."""
    from exporter.thresholds import breaches

    out = tmp_path / "shufflenet"
    weight = "ShuffleNet_V2_X0_5_Weights.IMAGENET1K_V1"
    args = [
        "build",
        weight,
        "--checkpoint",
        quantized_digits.float_checkpoint,
        "--data",
        quantized_digits.data_dir,
        "--labels",
        quantized_digits.labels_file,
        "--out",
        out,
        "--quiet",
        *FAST,
        *INT8,
    ]
    result = run_cli(*args)
    artifacts = _int8_artifacts(out)
    assert result.exit_code == (1 if any(a["status"] == "failed" for a in artifacts.values()) else 0), result.output
    for name, a in artifacts.items():
        q = a["details"]["quantization"]
        assert a["reasons"] == breaches(a, a["thresholds"]) and a["status"] == ("failed" if a["reasons"] else "passed")
        assert q["meets_budget"] == q["after"]["meets_budget"] and (q["meets_budget"] or "budget not met" in q["note"])
        asked = [f for f in q["float_layers"] if "why" not in f]
        assert q["layers"] > 20 and len(asked) <= q["max_float_fraction"] * q["layers"]
        assert q["int8_layers"] == q["layers"] - len(q["float_layers"])


@pytest.mark.slow
def test_json_stdout_stays_a_manifest_through_onnx_calibration(tmp_path, digits_model):
    # ONNX Runtime's percentile calibrator prints to stdout, which carries the manifest under --json
    result = run_cli(
        "build",
        digits_model.weight,
        "--checkpoint",
        digits_model.checkpoint,
        "--out",
        tmp_path / "out",
        "--target",
        "jetson",
        "--format",
        "onnx:int8",
        "--calib-size",
        "16",
        "--val-size",
        "16",
        "--iterations",
        "3",
        "--quant-budget",
        "onnx_calibration=percentile",
        "--json",
    )
    doc = json.loads(result.stdout)
    (entry,) = doc["artifacts"]
    q = entry["details"]["quantization"]
    assert q["calibration_method"].startswith("percentile") and q["onnx_calibration"] == "percentile"
    assert "dynamic_ranges" not in q  # a .pte setting


class _PatchMerging(torch.nn.Module):
    """A convolution, Swin's pad of its odd-sized map (zeros, or nothing at an even size), then a float op
    (LayerNorm) or an int8 one (a convolution)."""

    def __init__(self, pad, then):
        super().__init__()
        self.pad, self.then = pad, then
        self.conv, self.norm, self.conv2 = torch.nn.Conv2d(3, 8, 3), torch.nn.LayerNorm(8), torch.nn.Conv2d(8, 8, 3)

    def forward(self, x):
        y = torch.nn.functional.pad(self.conv(x), self.pad)
        return self.norm(y.permute(0, 2, 3, 1)) if self.then == "norm" else self.conv2(y)


def _int8_pte_against_its_quantized_graph(model, example, tmp_path, method="histogram"):
    """Quantize (no layer in float), lower to XNNPACK, load and run the .pte; returns its output, the same int8
    graph's output in PyTorch's reference kernels, and the .pte's size."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    from exporter.formats import executorch
    from exporter.quant.pt2e import Pt2eBackend

    quantized = Pt2eBackend(model, example).quantize([], [torch.randn(example.shape) for _ in range(4)], method)
    edge = to_edge_transform_and_lower(torch.export.export(quantized, (example,)), partitioner=[XnnpackPartitioner()])
    path = tmp_path / "int8.pte"
    path.write_bytes(edge.to_executorch().buffer)
    out = executorch.load(path, threads=1)(example)
    with torch.no_grad():
        expected = quantized(example)
    assert out.shape == expected.shape
    return out, expected, path.stat().st_size


@pytest.mark.parametrize("pad, then", [((0, 1, 0, 1), "norm"), ((0, 0, 0, 0), "norm"), ((0, 1, 0, 1), "conv")])
def test_an_int8_pad_before_a_float_op_loads_and_matches_its_quantized_graph(tmp_path, pad, then):
    """Unannotated, a pad of an int8 tensor before a float op was lowered with an int8 input and a float output,
    and the .pte failed to load (XNNPACK: StaticConstantPad invalid parameter; Swin-T's int8 .pte)."""
    torch.manual_seed(0)
    out, expected, _ = _int8_pte_against_its_quantized_graph(
        _PatchMerging(pad, then).eval(), torch.randn(1, 3, 15, 15), tmp_path
    )
    # the same int8 graph: at most a rounding step apart
    assert (out - expected).abs().max().item() <= 0.05 * expected.abs().max().item()


class _ReluNet(torch.nn.Module):
    """Conv, BatchNorm, ReLU as ResNet's and VGG's layers are (BatchNorm folded into the conv before annotating
    leaves a conv whose only user is a ReLU), a depthwise conv, and a linear head."""

    def __init__(self):
        super().__init__()
        nn = torch.nn
        self.body = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.Conv2d(16, 16, 3, padding=1, groups=16),
            nn.ReLU(),
            nn.Conv2d(16, 32, 1),
            nn.BatchNorm2d(32),
            nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(32, 10),
        )

    def forward(self, x):
        return self.body(x)


def test_ranges_chosen_per_inference_quantize_a_conv_before_a_relu(tmp_path):
    """XNNPACK's quantizer gives a conv whose only user is a ReLU to its conv+ReLU pattern, which is static only:
    with ranges chosen per inference every such conv stayed float (ResNet18 trained on the digits: 9 of its 21
    layers, over the cap, so the step was never kept for a ReLU network). Now only the depthwise conv (XNNPACK has
    no dynamic kernel for it) stays float, and the .pte computes what the int8 graph does."""
    from exporter.quant.pt2e import Pt2eBackend

    torch.manual_seed(0)
    model, example = _ReluNet().eval(), torch.randn(1, 3, 16, 16)
    backend = Pt2eBackend(model, example)
    quantized = backend.quantize([], [example], "dynamic")
    assert backend.float_closure([], "dynamic") == ["body.3"] and backend.float_ops([], (), "dynamic")["conv2d"] == 1
    chosen = [n for n in quantized.graph.nodes if "choose_qparams" in str(n.target)]
    assert len(chosen) == 3, [str(n.target) for n in quantized.graph.nodes]  # per-inference ranges: 2 convs, the linear
    out, expected, _ = _int8_pte_against_its_quantized_graph(model, example, tmp_path, "dynamic")
    assert (out - expected).abs().max().item() <= 0.05 * expected.abs().max().item()


class _SharedInput(torch.nn.Module):
    """A ReLU's output read by a 3x3 and a 1x1 conv, as ResNet50's blocks and SqueezeNet's fire modules read theirs;
    or (shuffle) read by a 1x1 conv through ShuffleNetV2's channel shuffle."""

    def __init__(self, shuffle: bool):
        super().__init__()
        nn = torch.nn
        self.shuffle = shuffle
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU())
        self.wide, self.narrow = nn.Conv2d(16, 16, 3, padding=1), nn.Conv2d(16, 16, 1)

    def forward(self, x):
        y = self.stem(x)
        if self.shuffle:
            b, c, h, w = y.shape
            return self.narrow(y.view(b, 2, c // 2, h, w).transpose(1, 2).reshape(b, c, h, w))
        return self.wide(y) + self.narrow(y)


@pytest.mark.parametrize("shuffle", [False, True])
def test_a_per_inference_int8_pte_computes_what_its_graph_does(tmp_path, shuffle):
    """Two inputs XNNPACK lowers wrong with ranges chosen per inference: one dynamic quantize read by a 3x3 and a 1x1
    conv (ResNet50's .pte was 6.7 dB from its own int8 graph), and a conv reading a channel shuffle (a toy's .pte
    was garbage, ShuffleNetV2's failed to run). Each layer gets a quantize of its own; the conv after the shuffle
    stays float."""
    from exporter.quant.pt2e import Pt2eBackend

    torch.manual_seed(0)
    model, example = _SharedInput(shuffle).eval(), torch.randn(1, 3, 16, 16)
    backend = Pt2eBackend(model, example)
    backend.quantize([], [example], "dynamic")
    assert backend.float_closure([], "dynamic") == (["narrow"] if shuffle else [])
    out, expected, _ = _int8_pte_against_its_quantized_graph(model, example, tmp_path, "dynamic")
    assert (out - expected).abs().max().item() <= 0.05 * expected.abs().max().item()


def test_a_lowering_that_breaks_the_budget_its_graph_met_is_made_again_with_static_ranges(tmp_path, monkeypatch):
    """The search scores graphs; ExecuTorch lowers them. With its workaround off, the shared dynamic quantize that
    XNNPACK lowers wrong is back: the graph with ranges chosen per inference meets the budget, its program does not.
    The export scores the program on the check images, says so, and makes the program again with static ranges."""
    from exporter.formats import executorch
    from exporter.quant import Calibration, pt2e
    from exporter.validation import run_all

    torch.manual_seed(0)
    model, example = _SharedInput(False).eval(), torch.randn(1, 3, 16, 16)
    images = [torch.randn(1, 3, 16, 16) for _ in range(16)]
    check = torch.cat(images[1::2])  # the check images Calibration.split holds out at check_fraction 0.5

    def graph_psnr(method):
        from exporter.tasks import Classification

        reference = run_all(model, check)
        out = run_all(pt2e.Pt2eBackend(model, example).quantize([], images[::2], method), check)
        return Classification(reference.shape[1], (16, 16)).fidelity(reference, out)["psnr_db"]

    static, dynamic = graph_psnr("histogram"), graph_psnr("dynamic")
    assert dynamic > static + 2, (static, dynamic)
    # a PSNR budget (with the search's 2 dB margin) between the two: static ranges miss it, dynamic ones meet it
    calibration = Calibration(images, budget={"psnr_db": (static + dynamic) / 2 - 2})

    quantization = executorch.export(model, example, "int8", calibration, tmp_path / "ok.pte", {})["quantization"]
    assert quantization["after"]["ranges"] == "dynamic" and "lowering_fault" not in quantization
    assert quantization["program"]["meets_budget"]

    monkeypatch.setattr(pt2e, "_own_dynamic_quantize", lambda module: module)
    quantization = executorch.export(model, example, "int8", calibration, tmp_path / "x.pte", {})["quantization"]
    fault = quantization["lowering_fault"]
    assert fault["ranges"] == "dynamic" and fault["graph"]["meets_budget"] and not fault["program"]["meets_budget"]
    assert fault["kept"] == "static" and fault["static_program"] == quantization["program"]
    assert quantization["after"]["ranges"] == "histogram" and quantization["dynamic_ranges"] is True  # as asked
    # what was shipped is the static program, scored as such: within a rounding step of its own graph
    assert abs(quantization["program"]["psnr_db"] - quantization["after"]["psnr_db"]) < 1
    import jsonschema

    from exporter.release import manifest

    jsonschema.validate(quantization, {"$defs": manifest.schema()["$defs"], "$ref": "#/$defs/quantization"})
    from exporter.release.report import quantization_summary

    assert "made again with static ranges" in quantization_summary(quantization)


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
        assert not score["meets_budget"] and score["psnr_db"] is None and "does not run" in score["reasons"][0]
        assert lowering_broke(graph, score)
    itself = lowered_quality(model, lambda: model, calibration)
    assert itself["meets_budget"] and not lowering_broke(graph, itself)
    # under the budget by a rounding of its graph: not a lowering fault
    assert not lowering_broke({"meets_budget": True, "psnr_db": 32.3}, {"meets_budget": False, "psnr_db": 31.9})


class _SharedHead(torch.nn.Module):
    """One head (conv tower and output conv) applied to two feature levels, as RetinaNet and FCOS apply theirs."""

    def __init__(self):
        super().__init__()
        nn = torch.nn
        self.stem, self.down = nn.Conv2d(3, 64, 3, 2, 1), nn.Conv2d(64, 64, 3, 2, 1)
        self.tower = nn.Sequential(
            nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1), nn.ReLU()
        )
        self.out = nn.Conv2d(64, 8, 3, padding=1)

    def forward(self, x):
        a = self.stem(x)
        return torch.cat([self.out(self.tower(level)).flatten(2) for level in (a, self.down(a))], 2)


def test_a_head_shared_by_levels_is_int8_at_every_call_and_stored_once(tmp_path):
    """The quantizer annotated a shared conv at its first call only; the later calls ran float on its int8 weight
    and the .pte failed to load (RetinaNet's and FCOS's int8 .pte). Copies of the weights that shared one name
    then shared one packed bias in XNNPACK: the second level was 25 rounding steps off."""
    torch.manual_seed(0)
    model = _SharedHead().eval()
    out, expected, size = _int8_pte_against_its_quantized_graph(model, torch.randn(1, 3, 32, 32), tmp_path)
    levels = {"first": slice(0, 256), "second": slice(256, 320)}
    for level, positions in levels.items():
        gap = (out[..., positions] - expected[..., positions]).abs().max().item()
        assert gap <= 0.05 * expected[..., positions].abs().max().item(), (level, gap)
    params = sum(p.numel() for p in model.parameters())
    shared = sum(p.numel() for m in (model.tower, model.out) for p in m.parameters())
    assert size < params + shared, (size, params, shared)  # one byte a weight, and the shared head's stored once


def test_a_head_shared_by_levels_gets_q_dq_at_every_call_in_onnx(tmp_path):
    """The Q/DQ search tied a layer to one ONNX node: a head run on every FPN level (RetinaNet, FCOS, Faster R-CNN's
    RPN head) was int8 at its last call only. Every call is one node on the same weight: all are int8, or, the
    layer kept in float, none; its activation range covers every call's input."""
    import onnx

    from exporter.formats.onnx import INPUT, _export_graph
    from exporter.quant.onnx_qdq import OnnxQdqBackend
    from exporter.quant.sensitivity import activation_scales

    torch.manual_seed(0)
    model, example = _SharedHead().eval(), torch.randn(1, 3, 32, 32)
    fp32 = tmp_path / "fp32.onnx"
    _export_graph(model, example, 18, fp32)
    qdq = OnnxQdqBackend(model, fp32, INPUT, "mse", tmp_path)
    assert sorted(qdq.layers()) == ["down", "out", "stem", "tower.0", "tower.2"]
    assert [len(qdq._nodes[name]) for name in ("stem", "tower.0", "out")] == [1, 2, 2]
    images = [torch.randn(1, 3, 32, 32) for _ in range(4)]

    def int8_convs(candidate):
        graph = onnx.load(str(candidate.path)).graph
        producers = {o: n.op_type for n in graph.node for o in n.output}
        # by the weight: an input tensor shared with a quantized layer comes through its Q/DQ either way
        return sorted(
            n.name for n in graph.node if n.op_type == "Conv" and producers.get(n.input[1]) == "DequantizeLinear"
        )

    every = [node for name in qdq.layers() for node, _ in qdq._nodes[name]]
    assert int8_convs(qdq.quantize([], images, "mse")) == sorted(every)
    assert int8_convs(qdq.quantize(["tower.0"], images, "mse")) == sorted(
        set(every) - {n for n, _ in qdq._nodes["tower.0"]}
    )
    assert qdq.float_ops(["tower.0"]) == {"Conv": 2, **qdq.float_ops([])}
    with torch.no_grad():  # the range of the shared layer's input: the larger of its two calls' inputs
        first, second = model.stem(example), model.down(model.stem(example))
    scale = activation_scales(model, ["tower.0"], example)["tower.0"]
    assert scale * 127 <= max(first.abs().max(), second.abs().max()) + 1e-6
    assert scale * 127 > min(first.abs().max(), second.abs().max()) * 1e-3


class _ComputedBias(torch.nn.Module):
    """Swin V2's attention projection: its bias is cloned and a third of it zeroed on every call."""

    def __init__(self):
        super().__init__()
        self.embed, self.qkv, self.head = torch.nn.Conv2d(3, 24, 4, 4), torch.nn.Linear(24, 72), torch.nn.Linear(72, 5)

    def forward(self, x):
        bias = self.qkv.bias.clone()
        bias[24:48].zero_()
        tokens = self.embed(x).flatten(2).transpose(1, 2)
        return self.head(torch.nn.functional.linear(tokens, self.qkv.weight, bias).relu()).mean(1)


def test_a_layer_with_a_bias_computed_from_constants_is_lowered_whole(tmp_path):
    """Quantized, the projection with a run-time bias left its weight's per-channel dequantize outside XNNPACK,
    which ExecuTorch has no kernel for: the export failed (Swin-V2-T's int8 .pte)."""
    torch.manual_seed(0)
    model = _ComputedBias().eval()
    out, expected, _ = _int8_pte_against_its_quantized_graph(model, torch.randn(1, 3, 16, 16), tmp_path)
    assert (out - expected).abs().max().item() <= 0.05 * expected.abs().max().item()


class _ConvReadTwice(torch.nn.Module):
    """MaxViT's stem and first block: one conv's output read by a pre-norm BatchNorm and by an AvgPool shortcut."""

    def __init__(self):
        super().__init__()
        nn = torch.nn
        self.stem, self.norm = nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.body, self.shortcut = nn.Conv2d(16, 16, 3, padding=1), nn.Sequential(nn.AvgPool2d(2), nn.Conv2d(16, 16, 1))
        with torch.no_grad():  # statistics far from identity, as a trained or settled model's are
            self.norm.running_mean.uniform_(2, 4), self.norm.running_var.uniform_(0.02, 0.1)

    def forward(self, x):
        y = self.stem(x)
        return torch.nn.functional.avg_pool2d(self.body(self.norm(y)), 2) + self.shortcut(y)


def test_a_batchnorm_on_a_conv_read_elsewhere_is_not_folded_into_the_other_reader(tmp_path):
    """prepare_pt2e folds a BatchNorm into the conv before it whoever else reads that conv: the shortcut got the
    normalised tensor, and MaxViT-T's int8 graph (and its .pte) was 11.9 dB from eager before any rounding."""
    torch.manual_seed(0)
    model = _ConvReadTwice().eval()
    example = torch.randn(1, 3, 16, 16)
    out, quantized, _ = _int8_pte_against_its_quantized_graph(model, example, tmp_path)
    with torch.no_grad():
        eager = model(example)
    scale = eager.abs().max().item()
    assert (quantized - eager).abs().max().item() <= 0.1 * scale  # int8 rounding, not another function
    assert (out - quantized).abs().max().item() <= 0.05 * scale


def test_a_range_method_that_cannot_measure_the_model_is_left_out_and_said(monkeypatch):
    """ONNX Runtime's percentile calibrator raised on a random RetinaNet (a histogram of a tensor with no range)
    and the whole ONNX int8 export failed, though its other two range methods work."""

    def quantize(self, float_layers, range_images, method):
        if method == "coarse":
            raise ValueError("Too many bins for data range. Cannot create 2048 finite-sized bins.")
        return real(self, float_layers, range_images, method)

    real = _FakeBackend.quantize
    monkeypatch.setattr(_FakeBackend, "quantize", quantize)
    report = _search(monkeypatch, "layer3", [f"layer{i}" for i in range(8)], max_float_fraction=1.0)
    assert report["calibration_method"] == "fine" and {s["ranges"] for s in report["steps"]} == {"fine"}
    assert "Too many bins" in report["range_methods_unusable"]["coarse"]

    monkeypatch.setattr(_FakeBackend, "range_methods", ("coarse",))  # nothing else to try: the error stands
    with pytest.raises(ValueError, match="Too many bins"):
        _search(monkeypatch, "layer3", [f"layer{i}" for i in range(8)])


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


class _UntraceableConvBn(torch.nn.Module):
    """A Conv and its BatchNorm right under a module torch.fx cannot trace (a branch on a value), beside a child
    it can: folding by parts folds the child's pair only, and the TorchScript exporter folds the other itself,
    naming the folded weight onnx::Conv_<n>, a name no module has."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8)
        self.child = torch.nn.Sequential(torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.BatchNorm2d(8))

    def forward(self, x):
        y = self.bn(self.conv(x))
        if y.mean() > 1e9:  # never, but torch.fx cannot know
            y = -y
        return self.child(y).mean((2, 3))


def test_a_conv_whose_weight_the_onnx_exporter_named_stays_float_instead_of_failing_the_search(tmp_path):
    from exporter.formats.onnx import INPUT, _export_graph, _fold_batchnorms
    from exporter.quant.onnx_qdq import OnnxQdqBackend

    torch.manual_seed(0)
    model, folding = _fold_batchnorms(_UntraceableConvBn().eval(), by_parts=True)
    assert folding == {"batchnorms": 2, "folded": 1}
    fp32 = tmp_path / "fp32.onnx"
    _export_graph(model, torch.randn(1, 3, 16, 16), 18, fp32, exporter="torchscript")
    qdq = OnnxQdqBackend(model, fp32, INPUT, "mse", tmp_path)
    assert qdq.layers() == ["child.0"] and len(qdq._unmapped) == 1
    candidate = qdq.quantize([], [torch.randn(1, 3, 16, 16) for _ in range(4)], "mse")
    assert candidate.path.is_file() and qdq.float_ops([]).get("Conv") == 1


class _SharedOutlierInput(torch.nn.Module):
    """A stem whose one outlier channel feeds two convs (a ResNet block's conv1 and downsample, Inception's
    branches); only `a` matters to the output."""

    def __init__(self):
        super().__init__()
        self.stem, self.a, self.b = (
            torch.nn.Conv2d(3, 8, 1),
            torch.nn.Conv2d(8, 8, 3, padding=1),
            torch.nn.Conv2d(8, 8, 1),
        )
        self.fc = torch.nn.Linear(8, 10)
        with torch.no_grad():
            self.stem.weight[0] *= 1000
            self.stem.bias[0] *= 1000
            self.a.weight[:, 0] /= 1000
            self.b.weight[:, 0] /= 1000

    def forward(self, x):
        y = torch.relu(self.stem(x))
        return self.fc(torch.relu(self.a(y)).mean((2, 3)) + 0.01 * torch.relu(self.b(y)).mean((2, 3)))


def test_a_layer_kept_float_reads_a_float_input_even_where_a_quantized_layer_shares_it(tmp_path):
    """ONNX Runtime's nodes_to_exclude left `a`'s input int8 because `b` reads the same tensor: `a` "in float"
    gained 1 dB where a float input gives it back (measured 12.0 against 48.3 dB). Biases stay float too
    (TensorRT's rule)."""
    import onnx

    from exporter.formats.onnx import INPUT, _export_graph
    from exporter.quant.onnx_qdq import OnnxQdqBackend
    from exporter.tasks.base import logit_fidelity

    torch.manual_seed(0)
    model = _SharedOutlierInput().eval()
    images = [torch.randn(1, 3, 16, 16) for _ in range(24)]
    fp32 = tmp_path / "fp32.onnx"
    _export_graph(model, images[0], 18, fp32)
    qdq = OnnxQdqBackend(model, fp32, INPUT, "minmax", tmp_path)
    check = torch.cat(images[16:])
    with torch.no_grad():
        reference = model(check)

    def psnr(float_layers):
        candidate = qdq.quantize(float_layers, images[:16], "minmax")
        return candidate, logit_fidelity(reference, torch.cat([candidate(x[None]) for x in check]))["psnr_db"]

    (_, plain), (candidate, kept) = psnr([]), psnr(["a"])
    assert kept > plain + 20 and kept > 40, (plain, kept)
    graph = onnx.load(str(candidate.path)).graph
    producers = {o: n for n in graph.node for o in n.output}
    ((a_node, _),) = qdq._nodes["a"]
    ((b_node, _),) = qdq._nodes["b"]
    inputs = {n.name: [producers[i].op_type if i in producers else "initializer" for i in n.input] for n in graph.node}
    assert "DequantizeLinear" not in inputs[a_node] and inputs[b_node][:2] == ["DequantizeLinear", "DequantizeLinear"]
    # no Q/DQ left without a reader, and no int32 (quantized) bias
    read = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
    assert all(n.output[0] in read for n in graph.node)
    int32 = {i.name for i in graph.initializer if i.data_type == onnx.TensorProto.INT32}
    assert not [n for n in graph.node if n.op_type == "DequantizeLinear" and n.input[0] in int32]


@pytest.mark.slow
def test_calibrated_ranges_that_fail_validation_are_made_again_per_inference(tmp_path, monkeypatch, digits_model):
    """Validation inputs the calibration images did not cover (here the validation digits at 4x contrast; found on
    EfficientNet-V2-M trained on the digits, where 6 of 172 validation digits drove squeeze-and-excitation gates 150x
    past their calibrated ranges): the static .pte meets its budget on the check images and fails validation, so the
    build makes it again with ranges chosen per inference, judges it on the same inputs, and keeps it if it passes;
    when the remade one fails too, the first is put back. The manifest keeps both verdicts either way."""
    import dataclasses

    from exporter.engine import pipeline
    from exporter.formats import executorch

    load = pipeline._load_inputs
    monkeypatch.setattr(
        pipeline,
        "_load_inputs",
        lambda *args: (lambda inputs: dataclasses.replace(inputs, validation=inputs.validation * 4))(load(*args)),
    )
    # judged on PSNR only: at 4x contrast the stand-in's top-1 is near chance (a fresh clone's: eager acc@1 12.5 %),
    # so its logits are near ties and top-1 agreement says little. The clipping shows in PSNR: 9-12 dB with static
    # ranges, about 40 dB per inference; 20 dB sits far from both, so neither verdict hangs on the host's training
    args = (
        "--target",
        "android",
        "--format",
        "executorch:int8",
        "--val-size",
        "40",
        "--threshold",
        "int8.psnr_db=20",
        "--threshold",
        "int8.top1_agreement=0",
        "--threshold",
        "int8.accuracy_drop=100",
    )

    out = tmp_path / "kept"
    result = run_cli(*build_args(digits_model, out, *args))
    assert result.exit_code == 0, result.output
    [a] = json.loads((out / "manifest.json").read_text())["artifacts"]
    first = a["details"]["validation_retry"]["first"]
    assert first["ranges"] == "histogram" and first["status"] == "failed", first
    assert any(r.startswith("psnr_db") for r in first["reasons"]), first["reasons"]
    q = a["details"]["quantization"]
    assert a["status"] == "passed" and q["after"]["ranges"] == "dynamic" and q["static_ranges"] is False
    assert {s["ranges"] for s in q["steps"]} == {"dynamic"}  # started from them: static ranges not searched again
    assert files.sha256(out / a["path"]) == a["sha256"]  # the file on disk is the one judged
    assert sorted(p.name for p in out.glob("*.pte")) == [a["path"]]  # no staged copy left
    assert "made again with ranges chosen per inference" in (out / "report.md").read_text()

    # the remade artifact fails too (plain static PTQ, no margin: the same clipping): the first is put back
    hook = executorch.per_inference_ranges
    monkeypatch.setattr(
        executorch,
        "per_inference_ranges",
        lambda calib, details: dataclasses.replace(
            hook(calib, details),
            settings={**calib.settings, "dynamic_ranges": False, "fallback": False, "psnr_margin_db": 0.0},
        ),
    )
    out = tmp_path / "restored"
    result = run_cli(*build_args(digits_model, out, *args, "--iterations", "9"))  # not the first build's replay
    assert result.exit_code == 1, result.output
    [b] = json.loads((out / "manifest.json").read_text())["artifacts"]
    retry = b["details"]["validation_retry"]
    assert retry["kept"] == "calibrated ranges" and retry["per_inference"]["status"] == "failed"
    assert b["status"] == "failed" and b["reasons"] == first["reasons"] and b["fidelity"] == first["fidelity"]
    q = b["details"]["quantization"]
    assert q["meets_budget"] and q["after"]["ranges"] == "histogram"
    assert files.sha256(out / b["path"]) == b["sha256"] and sorted(p.name for p in out.glob("*.pte")) == [b["path"]]
    assert (out / b["preview"]).is_file()
