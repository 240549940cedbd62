"""Q/DQ int8 ONNX (exporter.quant.onnx_qdq): which nodes get Q/DQ, layers kept in float with float inputs,
shared heads, and ONNX Runtime's calibrators."""

from __future__ import annotations

import torch

from .quant_models import SharedHead, SharedOutlierInput, TinyTransformer, UntraceableConvBn


def test_the_report_names_the_ops_int8_leaves_in_float(tmp_path):
    """LayerNorm, GELU and attention have no int8 pattern in the XNNPACK quantizer; the Q/DQ ONNX puts Q/DQ on
    Conv/Gemm only. Each backend says which compute ops stay float, and a layer kept in float joins them."""
    import onnx

    from exporter.formats.onnx import INPUT, _export_graph
    from exporter.quant.onnx_qdq import OnnxQdqBackend
    from exporter.quant.pt2e import Pt2eBackend

    torch.manual_seed(0)
    model, example = TinyTransformer().eval(), torch.randn(1, 3, 16, 16)
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
    model, example = TinyTransformer().eval(), torch.randn(1, 3, 16, 16)
    fp32 = tmp_path / "fp32.onnx"
    _export_graph(model, example, 18, fp32)
    candidate = OnnxQdqBackend(model, fp32, INPUT, "percentile", tmp_path).quantize(
        [], [torch.randn(1, 3, 16, 16) for _ in range(5)], "percentile"
    )
    assert windows == [1] * 5
    with torch.no_grad():
        x = torch.randn(1, 3, 16, 16)
        assert torch.allclose(candidate(x), model(x), atol=0.1)


def test_a_head_shared_by_levels_gets_q_dq_at_every_call_in_onnx(tmp_path):
    """The Q/DQ search tied a layer to one ONNX node: a head run on every FPN level (RetinaNet, FCOS, Faster R-CNN's
    RPN head) was int8 at its last call only. Every call is one node on the same weight: all are int8, or, the
    layer kept in float, none; its activation range covers every call's input."""
    import onnx

    from exporter.formats.onnx import INPUT, _export_graph
    from exporter.quant.onnx_qdq import OnnxQdqBackend
    from exporter.quant.sensitivity import activation_scales

    torch.manual_seed(0)
    model, example = SharedHead().eval(), torch.randn(1, 3, 32, 32)
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


def test_a_conv_whose_weight_the_onnx_exporter_named_stays_float_instead_of_failing_the_search(tmp_path):
    from exporter.formats.half import fold_batchnorms
    from exporter.formats.onnx import INPUT, _export_graph
    from exporter.quant.onnx_qdq import OnnxQdqBackend

    torch.manual_seed(0)
    model, folding = fold_batchnorms(UntraceableConvBn().eval(), by_parts=True)
    assert folding == {"batchnorms": 2, "folded": 1}
    fp32 = tmp_path / "fp32.onnx"
    _export_graph(model, torch.randn(1, 3, 16, 16), 18, fp32, exporter="torchscript")
    qdq = OnnxQdqBackend(model, fp32, INPUT, "mse", tmp_path)
    assert qdq.layers() == ["child.0"] and len(qdq._unmapped) == 1
    candidate = qdq.quantize([], [torch.randn(1, 3, 16, 16) for _ in range(4)], "mse")
    assert candidate.path.is_file() and qdq.float_ops([]).get("Conv") == 1


def test_a_layer_kept_float_reads_a_float_input_even_where_a_quantized_layer_shares_it(tmp_path):
    """ONNX Runtime's nodes_to_exclude left `a`'s input int8 because `b` reads the same tensor: `a` "in float"
    gained 1 dB where a float input gives it back (measured 12.0 against 48.3 dB). Biases stay float too
    (TensorRT's rule)."""
    import onnx

    from exporter.formats.onnx import INPUT, _export_graph
    from exporter.quant.onnx_qdq import OnnxQdqBackend
    from exporter.tasks.base import logit_fidelity

    torch.manual_seed(0)
    model = SharedOutlierInput().eval()
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
