"""Tasks: what a weight's exported graph returns and how an artifact of it is judged.

One module per task, one class each, in the spirit of torchvision's models/_api.py: the data a task
reads, the wrapper that makes its model return one tensor, its fidelity metrics against eager, its
labeled metrics, its golden files and what the manifest and bundles say about its output. Formats
never see the task (only the output layout in `meta["task"]`); validation asks the task for metrics.

A task object is bound to one build: `Task(num_classes, input_size)`. Outputs reach it as they are
stored, one flattened row per image (N, C) or (N, C*H*W).
"""

from __future__ import annotations

from ..errors import UsageError
from .base import Task
from .classification import Classification
from .detection import Detection
from .segmentation import Segmentation

TASKS: dict[str, type[Task]] = {task.name: task for task in (Classification, Segmentation, Detection)}

# torchvision's model groups (weights.TASK_MODULES) -> our task; the quantized classifiers are classifiers
GROUPS = {"classification": Classification, "quantization": Classification, "segmentation": Segmentation,
          "detection": Detection}
# what breaks, measured 2026-11-23 (torch 2.14.1, ExecuTorch 1.5.1, coremltools 9.0, ONNX Runtime 1.32; random
# weights, BN statistics settled; docs/tasks.md): ONNX Runtime ran every video model and raft_small matching
# eager, so what is missing for Jetson is a clip task, not an exporter
_VIDEO_ANDROID = ("ExecuTorch: XNNPACK has no 3-D convolution and the portable conv kernel refuses 5-D input "
                  "('Expect input tensor to be 3-D or 4-D')")
_VIDEO = {
    "r3d_18": "Core ML: coremltools 9 has no adaptive_avg_pool3d",
    "mc3_18": "Core ML: coremltools 9 has no adaptive_avg_pool3d",
    "r2plus1d_18": "Core ML: coremltools 9 has no adaptive_avg_pool3d",
    "s3d": "ExecuTorch also lacks max_pool3d/avg_pool3d kernels",
    "swin3d_t": "the .pte fails to load (XNNPACK: xnn_status_unsupported_parameter defining a tensor); Core ML stops "
                "at aten.alias",
    "mvit_v2_s": "the .pte fails to load (XNNPACK: xnn_status_unsupported_parameter defining a tensor); Core ML stops "
                 "at a rank-6 reshape (its limit is 5)",
}
NOT_YET = {
    "video": "video weights are not supported: " + _VIDEO_ANDROID + "{detail}; ONNX Runtime runs them, but the "
             "exporter has no clip (N, 3, T, H, W) task yet",
    "optical_flow": "optical flow weights are not supported: ExecuTorch's XNNPACK lowering of RAFT did not finish in "
                    "400 s; Core ML rejects its integer sqrt and rank-6 correlation volume; ONNX exports only at a "
                    "fixed batch, and the exporter has no two-image flow task",
}


def _not_yet(group: str, model_name: str) -> str:
    detail = _VIDEO.get(model_name) if group == "video" else None
    return NOT_YET.get(group, f"{group} weights are not supported").replace("{detail}", f"; {detail}" if detail else "")


def for_group(group: str, weight_name: str, model_name: str) -> type[Task]:
    """The task class for a torchvision model group, or a one-line refusal saying why not."""
    if group in GROUPS:
        refusal = GROUPS[group].refusal(model_name)
        if refusal:
            raise UsageError(f"{weight_name}: {refusal}")
        return GROUPS[group]
    raise UsageError(f"{weight_name}: {_not_yet(group, model_name)}")


__all__ = ["TASKS", "Task", "Classification", "Detection", "Segmentation", "for_group"]
