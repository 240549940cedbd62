"""PT2E int8 for ExecuTorch (exporter.quant.pt2e): layers and op kinds kept in float, ranges chosen per inference,
and graphs that lowered wrong or failed to load; each int8 graph is lowered to an XNNPACK .pte and checked
against what its quantized graph computes."""

from __future__ import annotations

import pytest
import torch

from .quant_models import ComputedBias, ConvReadTwice, PatchMerging, ReluNet, ResidualBlocks, SharedHead, SharedInput


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
    out = validation.run_all(executorch.FORMAT.load(path, threads=1), images)
    expected = validation.run_all(quantized, images)
    assert (out - expected).abs().max().item() <= 0.05 * expected.abs().max().item()
    assert psnr[("add",)] >= psnr[()] - 0.5, psnr


def test_every_add_kept_float_takes_the_relu_fused_after_it_and_lowers_whole(tmp_path):
    """add + ReLU is one int8 pattern (inputs on the add, output on the ReLU): kept float, the ReLU's output is not
    rounded before the next add, and the .pte computes its quantized graph."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    from exporter.formats import executorch
    from exporter.quant.pt2e import OP_KINDS, Pt2eBackend

    torch.manual_seed(0)
    model, example = ResidualBlocks().eval(), torch.randn(1, 3, 12, 12)
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
    out = executorch.FORMAT.load(path, threads=1)(example)
    with torch.no_grad():
        expected = quantized(example)
    assert (out - expected).abs().max().item() <= 0.05 * expected.abs().max().item()


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
    out = executorch.FORMAT.load(path, threads=1)(example)
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
        PatchMerging(pad, then).eval(), torch.randn(1, 3, 15, 15), tmp_path
    )
    # the same int8 graph: at most a rounding step apart
    assert (out - expected).abs().max().item() <= 0.05 * expected.abs().max().item()


def test_ranges_chosen_per_inference_quantize_a_conv_before_a_relu(tmp_path):
    """XNNPACK's quantizer gives a conv whose only user is a ReLU to its conv+ReLU pattern, which is static only:
    with ranges chosen per inference every such conv stayed float (ResNet18 trained on the digits: 9 of its 21
    layers, over the cap, so the step was never kept for a ReLU network). Now only the depthwise conv (XNNPACK has
    no dynamic kernel for it) stays float, and the .pte computes what the int8 graph does."""
    from exporter.quant.pt2e import Pt2eBackend

    torch.manual_seed(0)
    model, example = ReluNet().eval(), torch.randn(1, 3, 16, 16)
    backend = Pt2eBackend(model, example)
    quantized = backend.quantize([], [example], "dynamic")
    assert backend.float_closure([], "dynamic") == ["body.3"] and backend.float_ops([], (), "dynamic")["conv2d"] == 1
    chosen = [n for n in quantized.graph.nodes if "choose_qparams" in str(n.target)]
    assert len(chosen) == 3, [str(n.target) for n in quantized.graph.nodes]  # per-inference ranges: 2 convs, the linear
    out, expected, _ = _int8_pte_against_its_quantized_graph(model, example, tmp_path, "dynamic")
    assert (out - expected).abs().max().item() <= 0.05 * expected.abs().max().item()


@pytest.mark.parametrize("shuffle", [False, True])
def test_a_per_inference_int8_pte_computes_what_its_graph_does(tmp_path, shuffle):
    """Two inputs XNNPACK lowers wrong with ranges chosen per inference: one dynamic quantize read by a 3x3 and a 1x1
    conv (ResNet50's .pte was 6.7 dB from its own int8 graph), and a conv reading a channel shuffle (a toy's .pte
    was garbage, ShuffleNetV2's failed to run). Each layer gets a quantize of its own; the conv after the shuffle
    stays float."""
    from exporter.quant.pt2e import Pt2eBackend

    torch.manual_seed(0)
    model, example = SharedInput(shuffle).eval(), torch.randn(1, 3, 16, 16)
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
    model, example = SharedInput(False).eval(), torch.randn(1, 3, 16, 16)
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

    details = executorch.FORMAT.export(model, example, "int8", calibration, tmp_path / "ok.pte", {})
    quantization = details["quantization"]
    assert quantization["after"]["ranges"] == "dynamic" and "lowering_fault" not in quantization
    assert quantization["program"]["meets_budget"]

    monkeypatch.setattr(pt2e, "_own_dynamic_quantize", lambda module: module)
    quantization = executorch.FORMAT.export(model, example, "int8", calibration, tmp_path / "x.pte", {})["quantization"]
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


def test_a_head_shared_by_levels_is_int8_at_every_call_and_stored_once(tmp_path):
    """The quantizer annotated a shared conv at its first call only; the later calls ran float on its int8 weight
    and the .pte failed to load (RetinaNet's and FCOS's int8 .pte). Copies of the weights that shared one name
    then shared one packed bias in XNNPACK: the second level was 25 rounding steps off."""
    torch.manual_seed(0)
    model = SharedHead().eval()
    out, expected, size = _int8_pte_against_its_quantized_graph(model, torch.randn(1, 3, 32, 32), tmp_path)
    levels = {"first": slice(0, 256), "second": slice(256, 320)}
    for level, positions in levels.items():
        gap = (out[..., positions] - expected[..., positions]).abs().max().item()
        assert gap <= 0.05 * expected[..., positions].abs().max().item(), (level, gap)
    params = sum(p.numel() for p in model.parameters())
    shared = sum(p.numel() for m in (model.tower, model.out) for p in m.parameters())
    assert size < params + shared, (size, params, shared)  # one byte a weight, and the shared head's stored once


def test_a_layer_with_a_bias_computed_from_constants_is_lowered_whole(tmp_path):
    """Quantized, the projection with a run-time bias left its weight's per-channel dequantize outside XNNPACK,
    which ExecuTorch has no kernel for: the export failed (Swin-V2-T's int8 .pte)."""
    torch.manual_seed(0)
    model = ComputedBias().eval()
    out, expected, _ = _int8_pte_against_its_quantized_graph(model, torch.randn(1, 3, 16, 16), tmp_path)
    assert (out - expected).abs().max().item() <= 0.05 * expected.abs().max().item()


def test_a_batchnorm_on_a_conv_read_elsewhere_is_not_folded_into_the_other_reader(tmp_path):
    """prepare_pt2e folds a BatchNorm into the conv before it whoever else reads that conv: the shortcut got the
    normalised tensor, and MaxViT-T's int8 graph (and its .pte) was 11.9 dB from eager before any rounding."""
    torch.manual_seed(0)
    model = ConvReadTwice().eval()
    example = torch.randn(1, 3, 16, 16)
    out, quantized, _ = _int8_pte_against_its_quantized_graph(model, example, tmp_path)
    with torch.no_grad():
        eager = model(example)
    scale = eager.abs().max().item()
    assert (quantized - eager).abs().max().item() <= 0.1 * scale  # int8 rounding, not another function
    assert (out - quantized).abs().max().item() <= 0.05 * scale
