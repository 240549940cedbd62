import CoreGraphics
import CoreML
import CoreVideo
import Foundation
import ImageIO

public struct BundleError: Error, CustomStringConvertible {
    public let description: String
}

/// A Core ML image classifier over an exporter bundle directory (`exporter bundle OUT_DIR` on an
/// ios build). bundle.json picks the package: the first Core ML package with an image input, in
/// the bundle's order of preference. preprocessing.json gives resize, crop and interpolation;
/// labels.txt names the logits. The package applies mean/std inside its graph, so the app only
/// resizes, crops and hands over the 8-bit RGB pixels.
public final class BundleClassifier {
    public let artifactName: String
    private let model: MLModel
    private let inputName: String
    private let labels: [String]
    private let spec: Preprocessing

    // The keys are spelled out so that what the app reads from a bundle can be checked against one.
    private struct Manifest: Decodable {
        let labels: String
        let preprocessing: String
        let artifacts: [Artifact]

        enum CodingKeys: String, CodingKey {
            case labels = "labels", preprocessing = "preprocessing", artifacts = "artifacts"
        }
    }

    private struct Artifact: Decodable {
        let name: String
        let file: String
        let format: String
        let status: String
        let input: Input?

        enum CodingKeys: String, CodingKey {
            case name = "name", file = "file", format = "format", status = "status", input = "input"
        }
    }

    private struct Input: Decodable {
        let name: String
        let type: String

        enum CodingKeys: String, CodingKey {
            case name = "name", type = "type"
        }
    }

    private struct Preprocessing: Decodable {
        let resizeSize: [Int]
        let cropSize: [Int]
        let interpolation: String

        enum CodingKeys: String, CodingKey {
            case resizeSize = "resize_size"
            case cropSize = "crop_size"
            case interpolation = "interpolation"
        }
    }

    public init(bundle directory: URL, configuration: MLModelConfiguration = MLModelConfiguration()) async throws {
        let decoder = JSONDecoder()
        let manifest = try decoder.decode(Manifest.self, from: Data(contentsOf: directory.appendingPathComponent("bundle.json")))
        spec = try decoder.decode(Preprocessing.self, from: Data(contentsOf: directory.appendingPathComponent(manifest.preprocessing)))
        labels = try String(contentsOf: directory.appendingPathComponent(manifest.labels), encoding: .utf8)
            .split(separator: "\n").map(String.init)
        let candidates = manifest.artifacts.filter { $0.format == "coreml" && $0.input?.type == "image" }
        guard let artifact = candidates.first(where: { $0.status != "failed" }) ?? candidates.first, let input = artifact.input else {
            throw BundleError(description: "\(directory.path) lists no Core ML package with an image input")
        }
        let package = directory.appendingPathComponent(artifact.file)
        // A package compiled ahead of time (xcrun coremlcompiler compile) sits beside it as .mlmodelc
        let precompiled = package.deletingPathExtension().appendingPathExtension("mlmodelc")
        if FileManager.default.fileExists(atPath: precompiled.path) {
            model = try MLModel(contentsOf: precompiled, configuration: configuration)
        } else {
            model = try MLModel(contentsOf: try await MLModel.compileModel(at: package), configuration: configuration)
        }
        artifactName = artifact.name
        inputName = input.name
    }

    public func top5(imageAt url: URL) throws -> [(label: String, probability: Float)] {
        guard let source = CGImageSourceCreateWithURL(url as CFURL, nil),
              let image = CGImageSourceCreateImageAtIndex(source, 0, nil) else {
            throw BundleError(description: "cannot read an image from \(url.path)")
        }
        return try top5(image)
    }

    public func top5(_ image: CGImage) throws -> [(label: String, probability: Float)] {
        let features = try MLDictionaryFeatureProvider(dictionary: [inputName: MLFeatureValue(pixelBuffer: try pixelBuffer(image))])
        guard let logits = try model.prediction(from: features).featureValue(for: "logits")?.multiArrayValue else {
            throw BundleError(description: "the package has no logits output")
        }
        let values = (0..<logits.count).map { logits[$0].floatValue }
        guard values.count == labels.count else {
            throw BundleError(description: "the package outputs \(values.count) classes, labels.txt has \(labels.count)")
        }
        let peak = values.max() ?? 0
        let weights = values.map { exp($0 - peak) }
        let total = weights.reduce(0, +)
        return values.indices.sorted { values[$0] > values[$1] }.prefix(5).map { (label: labels[$0], probability: weights[$0] / total) }
    }

    /// torchvision's resize: one size sets the shorter side (the longer one truncated); two are (h, w).
    private func resizedSize(width: Int, height: Int) -> (width: Int, height: Int) {
        if spec.resizeSize.count == 2 { return (spec.resizeSize[1], spec.resizeSize[0]) }
        let short = min(width, height), long = max(width, height)
        let newLong = spec.resizeSize[0] * long / short
        return width <= height ? (spec.resizeSize[0], newLong) : (newLong, spec.resizeSize[0])
    }

    /// Resize and center crop as the weight's transforms do, drawn into a BGRA buffer of the crop size.
    private func pixelBuffer(_ image: CGImage) throws -> CVPixelBuffer {
        let cropHeight = spec.cropSize[0], cropWidth = spec.cropSize.count == 2 ? spec.cropSize[1] : spec.cropSize[0]
        let (width, height) = resizedSize(width: image.width, height: image.height)
        // torchvision's center_crop rounds halves to even (Python's round)
        let top = (Double(height - cropHeight) / 2).rounded(.toNearestOrEven)
        let left = (Double(width - cropWidth) / 2).rounded(.toNearestOrEven)
        var created: CVPixelBuffer?
        let attributes = [kCVPixelBufferCGImageCompatibilityKey: true, kCVPixelBufferCGBitmapContextCompatibilityKey: true] as CFDictionary
        guard CVPixelBufferCreate(kCFAllocatorDefault, cropWidth, cropHeight, kCVPixelFormatType_32BGRA, attributes, &created) == kCVReturnSuccess,
              let buffer = created else {
            throw BundleError(description: "cannot allocate a \(cropWidth)x\(cropHeight) pixel buffer")
        }
        CVPixelBufferLockBaseAddress(buffer, [])
        defer { CVPixelBufferUnlockBaseAddress(buffer, []) }
        guard let context = CGContext(
            data: CVPixelBufferGetBaseAddress(buffer), width: cropWidth, height: cropHeight, bitsPerComponent: 8,
            bytesPerRow: CVPixelBufferGetBytesPerRow(buffer), space: CGColorSpaceCreateDeviceRGB(),
            bitmapInfo: CGImageAlphaInfo.noneSkipFirst.rawValue | CGBitmapInfo.byteOrder32Little.rawValue
        ) else {
            throw BundleError(description: "cannot draw into the pixel buffer")
        }
        context.interpolationQuality = spec.interpolation == "nearest" ? .none : .high
        // Core Graphics' origin is the bottom left: shift so the crop's top row lands on the buffer's top row
        context.draw(image, in: CGRect(x: -left, y: top + Double(cropHeight - height), width: Double(width), height: Double(height)))
        return buffer
    }
}
