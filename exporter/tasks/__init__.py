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
from .detections_in_graph import DetectionsInGraph
from .optical_flow import OpticalFlow
from .region_detection import RegionDetection
from .segmentation import Segmentation
from .video import Video

TASKS: dict[str, type[Task]] = {
    task.name: task for task in (Classification, Segmentation, Detection, Video, OpticalFlow)
}

# torchvision's model groups (weights.TASK_MODULES) -> our task; the quantized classifiers are classifiers
GROUPS = {
    "classification": Classification,
    "quantization": Classification,
    "segmentation": Segmentation,
    "detection": Detection,
    "video": Video,
    "optical_flow": OpticalFlow,
}


def for_group(group: str, weight_name: str, model_name: str) -> type[Task]:
    """The task class for a torchvision model group, or a one-line refusal saying why not."""
    if group in GROUPS:
        task = GROUPS[group].for_model(model_name)
        refusal = task.unsupported_model(model_name)
        if refusal:
            raise UsageError(f"{weight_name}: {refusal}")
        return task
    raise UsageError(f"{weight_name}: {group} weights are not supported")


__all__ = [
    "TASKS",
    "Task",
    "Classification",
    "Detection",
    "DetectionsInGraph",
    "OpticalFlow",
    "RegionDetection",
    "Segmentation",
    "Video",
    "for_group",
]
