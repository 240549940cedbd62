"""exporter: named torchvision weights to verified artifacts for phones and edge devices.

The Python API (the CLI is a thin layer over it):

    from exporter.build import BuildRequest, build, build_targets, validate_build
    manifest = build(BuildRequest("mobilenet_v3_large", target="android", data=Path("val")))

docs/architecture.md maps the packages and how a request travels through them.
"""

__version__ = "0.1.0"
