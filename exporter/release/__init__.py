"""What a build hands over: the manifest, report.md, report.html, app bundles and the Jetson device kit."""
