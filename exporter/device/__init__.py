"""Files that ship inside bundles and run on a device with numpy alone (no torch, no exporter package).

They are copied byte for byte into builds and bundles, so nothing here may import from the exporter."""
