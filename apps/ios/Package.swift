// swift-tools-version:5.9
import PackageDescription

let package = Package(
    name: "ExporterBundle",
    platforms: [.iOS(.v16), .macOS(.v13)],
    products: [.library(name: "ExporterBundle", targets: ["ExporterBundle"])],
    targets: [
        .target(name: "ExporterBundle"),
        .executableTarget(name: "classify", dependencies: ["ExporterBundle"]),
    ]
)
