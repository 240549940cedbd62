import CoreGraphics
import ExporterBundle
import Foundation
import ImageIO
import UniformTypeIdentifiers

// swift run classify BUNDLE_DIR IMAGE... [--overlay PNG]   (macOS: Core ML runs there too)
// A classifier prints the top-5 per image; a segmenter each class's share of the pixels and, with
// --overlay, writes the mask over the image; a detector each object's score, class and box and, with
// --overlay, the boxes over the image (PNG is the file for one image, a directory for several).
func fail(_ message: String) -> Never {
    FileHandle.standardError.write(Data("error: \(message)\n".utf8))
    exit(2)
}

func writePNG(_ image: CGImage, to url: URL) throws {
    try FileManager.default.createDirectory(at: url.deletingLastPathComponent(), withIntermediateDirectories: true)
    guard let destination = CGImageDestinationCreateWithURL(url as CFURL, UTType.png.identifier as CFString, 1, nil) else {
        throw BundleError(description: "cannot write \(url.path)")
    }
    CGImageDestinationAddImage(destination, image, nil)
    guard CGImageDestinationFinalize(destination) else {
        throw BundleError(description: "cannot write \(url.path)")
    }
}

var arguments = Array(CommandLine.arguments.dropFirst())
var overlayPath: String?
if let flag = arguments.firstIndex(of: "--overlay") {
    guard flag + 1 < arguments.count else { fail("--overlay needs a PNG path") }
    overlayPath = arguments[flag + 1]
    arguments.removeSubrange(flag...(flag + 1))
}
guard arguments.count >= 2 else {
    fail("usage: classify BUNDLE_DIR IMAGE... [--overlay PNG]")
}
let images = arguments.dropFirst().map { URL(fileURLWithPath: $0) }
do {
    let classifier = try await BundleClassifier(bundle: URL(fileURLWithPath: arguments[0]))
    if overlayPath != nil && classifier.task == "classification" {
        fail("--overlay draws a segmentation mask or detected boxes; this is a \(classifier.task) bundle")
    }
    print("model: \(classifier.artifactName)")
    for url in images {
        print(url.path)
        guard classifier.task != "classification" else {
            for (label, probability) in try classifier.top5(imageAt: url) {
                print("  \(String(format: "%6.2f", probability * 100))%  \(label)")
            }
            continue
        }
        let image = try BundleClassifier.image(at: url)
        let picture: () throws -> CGImage  // drawn only for --overlay
        if classifier.task == "detection" {
            let detections = try classifier.detect(image)
            for detection in detections {
                let box = detection.box.map { String(format: "%.1f", $0) }.joined(separator: ", ")
                print("  \(String(format: "%6.2f", detection.score * 100))%  \(classifier.label(of: detection))  [\(box)]")
            }
            picture = { try classifier.drawBoxes(image, detections) }
        } else {
            let segmentation = try classifier.segment(image)
            for (label, fraction) in segmentation.fractions {
                print("  \(String(format: "%6.2f", fraction * 100))%  \(label)")
            }
            picture = { try classifier.overlay(image, segmentation) }
        }
        if let path = overlayPath {
            let target = images.count == 1
                ? URL(fileURLWithPath: path)
                : URL(fileURLWithPath: path).appendingPathComponent(url.deletingPathExtension().lastPathComponent).appendingPathExtension("png")
            try writePNG(try picture(), to: target)
            print("  overlay: \(target.path)")
        }
    }
} catch {
    fail("\(error)")
}
