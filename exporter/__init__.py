"""exporter: named torchvision weights to verified artifacts for phones and edge devices."""

__version__ = "0.1.0"


def build(request):
    """See exporter.build.BuildRequest. Imported lazily: torch is heavy."""
    from .build import build as _build

    return _build(request)
