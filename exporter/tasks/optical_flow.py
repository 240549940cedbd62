"""Optical flow (RAFT): two frames in, the flow of frame 1's pixels out.

The graph takes the two frames stacked on channels, (N, 6, H, W): frame 1's RGB, then frame 2's, each scaled to
[0, 1] and normalized to [-1, 1] as torchvision's OpticalFlow preset does; one input keeps every format, runner and
device kit as they are. It returns RAFT's last flow estimate (N, 2, H, W): per pixel of frame 1, dx (right) and dy
(down) in pixels of the input. Fidelity: the flow's PSNR and end-point error against eager's, and the share of
pixels within 1 px of eager's; labeled metrics: EPE and Fl-all (KITTI's outliers: EPE > 3 px and > 5 % of the
true flow) against ground-truth flow.

Data: FlyingChairs' layout, `DIR/<stem>_img1.<ext>`, `DIR/<stem>_img2.<ext>` and `DIR/<stem>_flow.flo` (Middlebury
.flo; without any .flo the pairs are unlabeled). Frames and flow are resized to the input size, the flow scaled with
them; flow above 1e9 (Middlebury's "unknown") is left out of the metrics.

Formats, measured 2026-11-23 and 2026-11-27 (torch 2.14.1, ExecuTorch 1.5.1, coremltools 9.0, ONNX Runtime 1.32;
RAFT-Small at 128x128): the dynamo ONNX exporter's graph fails onnxscript's optimizer at a dynamic batch, so ONNX
goes the TorchScript-based route at batch 1 (as Faster R-CNN's: GridSample, InstanceNormalization; ONNX Runtime
within 3e-5 px of eager); the TorchScript lite interpreter runs the traced graph exactly (.ptl); REFUSED says why
not the others."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..data import IMAGE_SUFFIXES, Inputs, split
from ..errors import UsageError
from .base import Task, logit_fidelity

DEFAULT_SIZE = (384, 512)  # FlyingChairs' frames; RAFT needs multiples of 8
MULTIPLE = 8
PAN = (3, 2)  # a synthetic pair: frame 2 is frame 1 moved this far (x, y)
UNKNOWN_FLOW = 1e9  # Middlebury: a component above this means no ground truth at that pixel
FLO_MAGIC = 202021.25
NORMALIZE = {"mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5]}  # torchvision's OpticalFlow preset: [0, 1] -> [-1, 1]
TRACED_ROUTE = {"exporter": "torchscript", "batch": "1:1:1"}
REFUSED = {
    "executorch": "ExecuTorch's XNNPACK lowering of RAFT did not finish in 400 s (measured 2026-11-23, RAFT-Small at "
    "128x128); the TorchScript lite .ptl is the Android route",
    "coreml": "coremltools 9 rejects RAFT's correlation step: an integer sqrt in CorrBlock, then a rank-6 "
    "correlation volume (Core ML's limit is rank 5)",
    "litert": "not attempted yet: LiteRT (.tflite) is built for classification, segmentation and single-stage "
    "detection graphs (issue 62); RAFT's correlation and update steps are not measured there; the TorchScript "
    "lite .ptl is the Android route",
}


class FlowGraph(nn.Module):
    """RAFT on the two frames stacked on channels: its last (most refined) flow."""

    # fp16 graphs compute the encoders in half; the correlation and the update steps stay float (RAFT makes its
    # coordinate grids in float32, and a half model traced by running it stops: "expected scalar type Half")
    half_modules = ("model.feature_encoder", "model.context_encoder")

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x[:, :3], x[:, 3:])[-1]


def read_flo(path: Path) -> np.ndarray:
    """A Middlebury .flo file: (H, W, 2) float32, dx then dy."""
    raw = Path(path).read_bytes()
    if len(raw) < 12 or np.frombuffer(raw[:4], "<f4")[0] != FLO_MAGIC:
        raise UsageError(f"{path} is not a Middlebury .flo file (no {FLO_MAGIC} magic)")
    width, height = (int(v) for v in np.frombuffer(raw[4:12], "<i4"))
    if width <= 0 or height <= 0 or len(raw) != 12 + 8 * width * height:
        raise UsageError(
            f"{path}: a .flo of {width}x{height} needs {12 + 8 * max(width * height, 0)} bytes, it has {len(raw)}"
        )
    return np.frombuffer(raw[12:], "<f4").reshape(height, width, 2).copy()


def write_flo(path: Path, flow: np.ndarray) -> None:
    height, width, _ = flow.shape
    Path(path).write_bytes(
        np.array([FLO_MAGIC], "<f4").tobytes()
        + np.array([width, height], "<i4").tobytes()
        + np.ascontiguousarray(flow, dtype="<f4").tobytes()
    )


def resized_flow(flow: np.ndarray, size: tuple[int, int]) -> torch.Tensor:
    """(H, W, 2) flow at `size` (h, w), its vectors scaled with the frame; pixels with no ground truth are NaN.
    Known and unknown pixels are resized apart (a weighted mean of the known ones only), so a hole in the ground
    truth does not spread to its neighbours, nor sparse ground truth vanish, as NaN would through interpolation."""
    tensor = torch.from_numpy(flow).permute(2, 0, 1).float().clone()  # the caller's array is left as it was
    known = (tensor.abs() <= UNKNOWN_FLOW).all(0)  # NaN or infinity in a file: unknown too
    height, width = tensor.shape[1:]
    if (height, width) != tuple(size):

        def resize(t):
            return nn.functional.interpolate(t[None], size=tuple(size), mode="bilinear", align_corners=False)[0]

        if known.all():
            tensor = resize(tensor)
        else:
            weight = resize(known[None].float())[0]
            tensor = resize(torch.where(known, tensor, 0.0)) / weight.clamp_min(1e-12)
            known = weight > 1e-6
        tensor = tensor * torch.tensor([size[1] / width, size[0] / height])[:, None, None]
    tensor[:, ~known] = float("nan")
    return tensor


class OpticalFlow(Task):
    name = "optical_flow"
    image_bytes_refusal = "an optical flow graph takes a pair of frames (N x 6 x H x W): not offered for flow weights"
    agreement = "flow_agreement"
    drop = "epe_increase"

    @classmethod
    def format_refusal(cls, format_name: str, precision: str | None = None) -> str | None:
        return REFUSED.get(format_name)

    @classmethod
    def format_options(cls) -> dict[str, dict]:
        return {"onnx": dict(TRACED_ROUTE), "tensorrt": dict(TRACED_ROUTE)}

    @classmethod
    def input_size_of(cls, weights, model_name, requested):
        size = tuple(int(v) for v in (requested or DEFAULT_SIZE))
        least = tuple(weights.meta.get("min_size") or (MULTIPLE, MULTIPLE))
        if any(s % MULTIPLE or s < m for s, m in zip(size, least)):
            raise UsageError(
                f"--input-size: {model_name} takes frames in multiples of {MULTIPLE}, at least {least[0]}x{least[1]}"
            )
        return size

    @classmethod
    def num_classes_in(cls, state, model_name, default):
        return 2  # the flow's two components

    @classmethod
    def construct(cls, model_name, num_classes, state, arch=None):
        from torchvision.models import get_model

        return get_model(model_name, weights=None, **(arch or {}))

    @classmethod
    def graph(cls, model):
        return FlowGraph(model).eval()

    def preprocessing(self, weights):
        return {
            "task": self.name,
            "input_size": list(self.input_size),
            "resize_size": list(self.input_size),  # exactly, aspect ratio not kept; the flow is scaled with it
            "crop_size": None,
            "interpolation": "bilinear",
            "antialias": True,
            **NORMALIZE,
            "layout": "NCHW",
            "channels": "frame 1's RGB, then frame 2's (6)",
            "dtype": "float32",
            "range": "RGB scaled to [0, 1] before normalization, both frames alike",
            "output": self.output(),
        }

    def transform(self, weights):
        return _PairTransform(self.input_size)

    def output(self):
        h, w = self.input_size
        return {
            "name": self.output_name,
            "layout": "NCHW",
            "shape": [1, 2, h, w],
            "meaning": "flow of frame 1's pixels to frame 2: channel 0 dx (right), channel 1 dy (down), in "
            "pixels of the input",
        }

    # --- data: DIR/<stem>_img1.<ext>, DIR/<stem>_img2.<ext>, DIR/<stem>_flow.flo ---
    def _pairs(self, root: Path) -> list[tuple[Path, Path, Path | None]]:
        if not root.is_dir():
            raise UsageError(f"--data {root} is not a directory")
        pairs = []
        for first in sorted(
            p for p in root.iterdir() if p.stem.endswith("_img1") and p.suffix.lower() in IMAGE_SUFFIXES
        ):
            stem = first.stem.removesuffix("_img1")
            second, flow = first.with_name(f"{stem}_img2{first.suffix}"), root / f"{stem}_flow.flo"
            if not second.is_file():
                raise UsageError(f"--data {root}: {first.name} has no second frame {second.name}")
            pairs.append((first, second, flow if flow.is_file() else None))
        if not pairs:
            raise UsageError(
                f"--data {root} has no frame pairs: optical flow expects FlyingChairs' layout, "
                "DIR/<stem>_img1.png, DIR/<stem>_img2.png and DIR/<stem>_flow.flo"
            )
        flows = sum(flow is not None for *_, flow in pairs)
        if 0 < flows < len(pairs):
            missing = next(first for first, _, flow in pairs if flow is None)
            raise UsageError(
                f"--data {root}: {missing.name} has no {missing.stem.removesuffix('_img1')}_flow.flo "
                f"while {flows} other pairs have theirs"
            )
        return pairs

    def _read(self, pair, transform) -> tuple[torch.Tensor, torch.Tensor | None]:
        from PIL import Image, UnidentifiedImageError

        frames = []
        for path in pair[:2]:
            try:
                with Image.open(path) as im:
                    frames.append(im.convert("RGB"))
            except (UnidentifiedImageError, OSError) as e:
                raise UsageError(f"cannot read image {path}: {e}") from None
        if frames[0].size != frames[1].size:
            raise UsageError(
                f"{pair[0].name} is {frames[0].size[0]}x{frames[0].size[1]} but {pair[1].name} is "
                f"{frames[1].size[0]}x{frames[1].size[1]}"
            )
        if pair[2] is None:
            return transform(tuple(frames)), None
        flow = read_flo(pair[2])
        if flow.shape[1::-1] != frames[0].size:
            raise UsageError(
                f"{pair[2].name} is {flow.shape[1]}x{flow.shape[0]} but its frames are "
                f"{frames[0].size[0]}x{frames[0].size[1]}"
            )
        return transform(tuple(frames)), resized_flow(flow, self.input_size).reshape(-1)

    def load_data(self, root, transform, calib_size, val_size, seed, class_names=None):
        root = Path(root)
        pairs = self._pairs(root)
        calib_idx, val_idx = split(len(pairs), calib_size, val_size, seed)
        calibration = [self._read(pairs[i], transform) for i in calib_idx]
        validation = [self._read(pairs[i], transform) for i in val_idx]
        labeled = pairs[0][2] is not None
        if labeled and validation and all(f.isnan().all() for _, f in validation):
            raise UsageError(
                f"--data {root}: no pixel of the validation pairs' flow is known (every value is over "
                f"{UNKNOWN_FLOW:g}, Middlebury's 'unknown')"
            )
        return Inputs(
            [x[None] for x, _ in calibration],
            torch.stack([x for x, _ in validation]),
            torch.stack([f for _, f in validation]) if labeled else None,
            None,
            calibration_labels=torch.stack([f for _, f in calibration]) if labeled and calibration else None,
            description={
                "source": str(root.resolve()),
                "labeled": labeled,
                "format": "FlyingChairs layout: <stem>_img1, <stem>_img2, <stem>_flow.flo",
                "pairs": len(pairs),
                "calibration": len(calib_idx),
                "validation": len(val_idx),
                "seed": seed,
            },
        )

    # --- metrics ---
    def _flows(self, rows: torch.Tensor) -> torch.Tensor:
        return rows.reshape(len(rows), 2, *self.input_size).double()

    def fidelity(self, reference, outputs):
        error = (self._flows(outputs) - self._flows(reference)).norm(dim=1)
        return {
            **logit_fidelity(reference, outputs),
            "pixels": error.numel(),
            "flow_agreement": (error < 1.0).double().mean().item(),
            "epe_vs_eager": error.mean().item(),
        }

    def labeled(self, outputs, labels):
        truth = self._flows(labels)
        known = ~truth.isnan().any(1)
        error = (self._flows(outputs) - truth).norm(dim=1)[known]
        magnitude = truth.norm(dim=1)[known]
        outliers = (error > 3.0) & (error > 0.05 * magnitude)
        return {"epe": error.mean().item(), "fl_all": 100.0 * outliers.double().mean().item()}

    def vs_eager(self, eager, artifact):
        return {
            "eager_epe": eager["epe"],
            "eager_fl_all": eager["fl_all"],
            "epe": artifact["epe"],
            "fl_all": artifact["fl_all"],
            "epe_increase": artifact["epe"] - eager["epe"],
        }

    def golden(self, inputs, reference, labels):
        files = {
            "inputs.npy": inputs.numpy().astype(np.float32),
            "eager_logits.npy": self._flows(reference).numpy().astype(np.float32),
        }
        if labels is not None:
            files["flows.npy"] = self._flows(labels).numpy().astype(np.float32)
        return files

    def departure(self, reference, outputs):
        epe = (self._flows(outputs) - self._flows(reference)).norm(dim=1).flatten(1).mean(1)
        return {"epe_vs_eager": epe, **super().departure(reference, outputs)}

    def preview(self, image, eager_row, artifact_row, preprocessing, labels=None):
        """frame 1 | eager's flow | the artifact's flow, coloured by direction (hue) and length (saturation), on
        one scale: the longest of eager's vectors is full colour."""
        from PIL import Image

        mean, std = (
            torch.tensor(preprocessing["mean"])[:, None, None],
            torch.tensor(preprocessing["std"])[:, None, None],
        )
        rgb = ((image[:3] * std + mean).clamp(0, 1) * 255).round().byte().permute(1, 2, 0).numpy()
        eager, artifact = self._flows(eager_row[None])[0], self._flows(artifact_row[None])[0]
        scale = max(float(eager.norm(dim=0).max()), 1e-6)
        gap = np.full((rgb.shape[0], 4, 3), 255, np.uint8)
        return Image.fromarray(
            np.concatenate([rgb, gap, flow_colours(eager, scale), gap, flow_colours(artifact, scale)], axis=1), "RGB"
        )


def flow_colours(flow: torch.Tensor, scale: float) -> np.ndarray:
    """(2, H, W) flow as an (H, W, 3) uint8 picture: hue the direction, saturation the length over `scale`."""
    from PIL import Image

    angle = (torch.atan2(-flow[1], -flow[0]) / (2 * np.pi) + 0.5) * 255
    length = (flow.norm(dim=0) / scale).clamp(0, 1) * 255
    hsv = torch.stack([angle, length, torch.full_like(angle, 255)], -1).round().byte().numpy()
    return np.asarray(Image.fromarray(hsv, "HSV").convert("RGB"))


class _PairTransform:
    """Two frames (PIL images; one image: a synthetic pair, frame 2 that image moved by PAN) -> (6, H, W)."""

    def __init__(self, size: tuple[int, int]):
        from torchvision.transforms import v2

        self.preset = v2.Compose(
            [
                v2.Resize(list(size), antialias=True),
                v2.PILToTensor(),
                v2.ToDtype(torch.float32, scale=True),
                v2.Normalize(NORMALIZE["mean"], NORMALIZE["std"]),
            ]
        )

    def __call__(self, frames) -> torch.Tensor:
        if not isinstance(frames, (list, tuple)):
            from PIL import ImageChops

            frames = (frames, ImageChops.offset(frames, *PAN))
        return torch.cat([self.preset(frame.convert("RGB")) for frame in frames])
