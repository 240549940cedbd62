"""The sweep's trained tier (`exporter coverage --weights digits`): each classifier's architecture trained from
scratch on scikit-learn's digits (exporter.standins.digits, the stand-in the tests use), so that int8 and fp16
are judged on a model with confident logits and real labels instead of a random one.

A random classifier's 1000 logits are so close together that rounding flips its top-1 on its own (the sweep's
precision floor shows it), which leaves most int8 rows "ill-conditioned": no verdict. A trained model has
margins, and its held-out digits give labeled acc@1 for eager and every artifact, so the int8 budget
(accuracy_drop) is checked as a user's build checks it.

Each builder is trained once at its weight's own preprocessing (the cost grows with the weight's FLOPs and its
crop: EfficientNet-B2 took 10 to 33 minutes an epoch at 288 px here), or, with `--classifier-size N`, at N x N
and built at that size (a classifier whose graph takes only its crop keeps it), and cached under
$EXPORTER_CACHE/digits; a quantized torchvision weight gets its float model trained and then
quantized as torchvision made its int8 weights. Tasks with no digits recipe are skipped (⏭), saying so."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

TRAINED_TASKS = ("classification", "quantization")
EPOCHS = 4  # the digits stand-ins' own recipe: held-out acc@1 98-99 % for MobileNetV3-Small and ShuffleNetV2
# ...and then more, while under UNTIL on its own training digits, up to MAX_EPOCHS: after 4 epochs SqueezeNet
# (51 and 78 % held out), AlexNet (86 %) and EfficientNet-B1 (87 %) were so undertrained that near-tied logits,
# not the export, decided their int8 verdicts. Every other builder had passed 97 % held out at 4 epochs.
UNTIL, MAX_EPOCHS = 0.95, 16


def directory(cache_dir: Path | None = None) -> Path:
    from ..engine.cache import default_root

    return Path(cache_dir or default_root()) / "digits"


def restrict(candidates: list) -> list:
    """The candidates with every weight the tier cannot train marked skipped, with why."""
    out = []
    for c in candidates:
        if c.task not in TRAINED_TASKS and not (c.refused or c.skipped):
            c = dataclasses.replace(
                c,
                skipped=f"no digits recipe for {c.task} weights (the trained tier covers "
                f"{' and '.join(TRAINED_TASKS)})",
            )
        out.append(c)
    return out


def make(
    weight_name: str,
    cache: Path,
    epochs: int = EPOCHS,
    log=print,
    until: float | None = UNTIL,
    max_epochs: int = MAX_EPOCHS,
    size: int | None = None,
) -> dict:
    """The weight's digits-trained checkpoint(s), trained now or taken from `cache` (at size x size, or the weight's
    crop); returns what the build needs ({"checkpoint", "float_checkpoint", "data", "labels"}) and what the
    training reached."""
    from .. import weights
    from ..standins import digits

    started = time.perf_counter()
    w = weights.resolve(weight_name)
    name = weights.canonical_name(w)
    info = {"recipe": "digits", "epochs": epochs, "until_train_acc1": None if until is None else 100 * until}
    if weights.is_quantized(w):
        model = digits.prepare_quantized(cache, name, epochs, log=log, until=until, max_epochs=max_epochs, size=size)
        info.update(
            checkpoint=str(model.checkpoint),
            float_checkpoint=str(model.float_checkpoint),
            held_out_acc1=round(100 * model.float_accuracy, 2),
            quantized_held_out_acc1=round(100 * model.quantized_accuracy, 2),
        )
    else:
        model = digits.prepare(cache, log, name, epochs, until, max_epochs, size)
        info.update(
            checkpoint=str(model.checkpoint),
            float_checkpoint=None,
            held_out_acc1=round(100 * model.held_out_accuracy, 2),
        )
    info.update(
        epochs_trained=model.epochs,
        data=str(model.data_dir),
        labels=str(model.labels_file),
        num_classes=10,
        prepare_s=round(time.perf_counter() - started, 1),
    )
    return info
