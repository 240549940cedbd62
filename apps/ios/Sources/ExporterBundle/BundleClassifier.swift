import CoreGraphics
import CoreML
import CoreText
import CoreVideo
import Foundation
import ImageIO

public struct BundleError: Error, CustomStringConvertible {
    public let description: String

    public init(description: String) {
        self.description = description
    }
}

/// A segmentation mask at the model's output size: the class of each pixel, row by row, and each
/// present class's share of the pixels, largest first.
public struct Segmentation {
    public let width: Int
    public let height: Int
    public let mask: [Int]
    public let fractions: [(label: String, fraction: Float)]
}

/// A Core ML image classifier, segmenter or object detector over an exporter bundle directory
/// (`exporter bundle OUT_DIR` on an ios build). bundle.json says which (its task; a bundle without one is
/// a classifier) and picks the package: the first Core ML package with an image input, in the bundle's
/// order of preference. preprocessing.json gives resize, crop (none for segmentation and detection) and
/// interpolation; labels.txt names the classes; a detector's anchors and decode parameters come from
/// bundle.json's task.decode. The package applies mean/std inside its graph, so the app only resizes,
/// crops and hands over the 8-bit RGB pixels.
public final class BundleClassifier {
    public static let background: Set<String> = ["__background__", "background"]  // left unpainted by overlay (torchvision's first)
    static let overlayAlpha: Float = 0.5

    public let artifactName: String
    /// "classification" (top5), "segmentation" (segment, overlay) or "detection" (detect, drawBoxes).
    public let task: String
    private let model: MLModel
    private let inputName: String
    private let outputName: String
    private let inputSize: [Int]?
    private let labels: [String]
    private let spec: Preprocessing
    private let detector: DetectionDecoder?

    // The keys are spelled out so that what the app reads from a bundle can be checked against one.
    private struct Manifest: Decodable {
        let labels: String
        let preprocessing: String
        let task: TaskEntry?
        let artifacts: [Artifact]

        enum CodingKeys: String, CodingKey {
            case labels = "labels", preprocessing = "preprocessing", task = "task", artifacts = "artifacts"
        }
    }

    private struct TaskEntry: Decodable {
        let name: String
        let inputSize: [Int]
        let output: Output
        let decode: DecodeParameters?  // detection only

        enum CodingKeys: String, CodingKey {
            case name = "name", inputSize = "input_size", output = "output", decode = "decode"
        }
    }

    private struct Output: Decodable {
        let name: String
        let layout: String

        enum CodingKeys: String, CodingKey {
            case name = "name", layout = "layout"
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
        let cropSize: [Int]?  // null for segmentation: the resize is to the exact input size
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
        let task = manifest.task?.name ?? "classification"
        let layouts = ["classification": "NC", "segmentation": "NCHW", "detection": "NAK"]
        guard let layout = layouts[task] else {
            throw BundleError(description: "this app runs classification, segmentation and detection bundles; this one is \(task)")
        }
        if let output = manifest.task?.output, output.layout != layout {
            throw BundleError(description: "a \(task) model with \(output.layout) output is not one this app reads")
        }
        self.task = task
        outputName = manifest.task?.output.name ?? "logits"
        inputSize = manifest.task?.inputSize
        if task == "detection" {
            guard let entry = manifest.task, let decode = entry.decode else {
                throw BundleError(description: "bundle.json's detection task has no decode parameters")
            }
            let anchors = try NpyArray(contentsOf: directory.appendingPathComponent(decode.anchors))
            detector = try DetectionDecoder(parameters: decode, anchors: anchors, inputSize: entry.inputSize)
        } else {
            detector = nil
        }
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

    public static func image(at url: URL) throws -> CGImage {
        guard let source = CGImageSourceCreateWithURL(url as CFURL, nil),
              let image = CGImageSourceCreateImageAtIndex(source, 0, nil) else {
            throw BundleError(description: "cannot read an image from \(url.path)")
        }
        return image
    }

    public func top5(imageAt url: URL) throws -> [(label: String, probability: Float)] {
        try top5(BundleClassifier.image(at: url))
    }

    private func predict(_ image: CGImage) throws -> MLMultiArray {
        let features = try MLDictionaryFeatureProvider(dictionary: [inputName: MLFeatureValue(pixelBuffer: try pixelBuffer(image))])
        guard let output = try model.prediction(from: features).featureValue(for: outputName)?.multiArrayValue else {
            throw BundleError(description: "the package has no \(outputName) output")
        }
        return output
    }

    public func top5(_ image: CGImage) throws -> [(label: String, probability: Float)] {
        guard task == "classification" else {
            throw BundleError(description: "top5 needs a classification bundle; this one is \(task)")
        }
        let logits = try predict(image)
        let values = (0..<logits.count).map { logits[$0].floatValue }
        guard values.count == labels.count else {
            throw BundleError(description: "the package outputs \(values.count) classes, labels.txt has \(labels.count)")
        }
        let peak = values.max() ?? 0
        let weights = values.map { exp($0 - peak) }
        let total = weights.reduce(0, +)
        return values.indices.sorted { values[$0] > values[$1] }.prefix(5).map { (label: labels[$0], probability: weights[$0] / total) }
    }

    /// The argmax over C of the 1 x C x H x W logits, and each present class's share of the pixels.
    public func segment(_ image: CGImage) throws -> Segmentation {
        guard task == "segmentation" else {
            throw BundleError(description: "segment needs a segmentation bundle; this one is \(task)")
        }
        let output = try predict(image)
        let shape = output.shape.map(\.intValue)
        guard shape.count == 4, shape[0] == 1, shape[1] == labels.count else {
            throw BundleError(description: "the package outputs \(shape); labels.txt has \(labels.count) classes, so [1, \(labels.count), H, W]")
        }
        let (height, width) = (shape[2], shape[3])
        let logits = MLShapedArray<Float>(converting: output).scalars  // row-major, whatever the array's strides or type
        let plane = height * width
        var mask = [Int](repeating: 0, count: plane)
        var counts = [Int](repeating: 0, count: labels.count)
        for pixel in 0..<plane {
            var best = 0
            for c in 1..<labels.count where logits[c * plane + pixel] > logits[best * plane + pixel] {
                best = c
            }
            mask[pixel] = best
            counts[best] += 1
        }
        let fractions = counts.indices.filter { counts[$0] > 0 }.sorted { counts[$0] > counts[$1] }
            .map { (label: labels[$0], fraction: Float(counts[$0]) / Float(plane)) }
        return Segmentation(width: width, height: height, mask: mask, fractions: fractions)
    }

    /// The objects scoring at least task.decode.match_score, best first, their boxes scaled from the
    /// model's input size to the image's (the preprocessing resized it to exactly that size).
    public func detect(_ image: CGImage) throws -> [Detection] {
        guard let detector = detector, let size = inputSize else {
            throw BundleError(description: "detect needs a detection bundle; this one is \(task)")
        }
        let output = try predict(image)
        let shape = output.shape.map(\.intValue)
        guard shape == [1, detector.anchorCount, 4 + labels.count] else {
            throw BundleError(description: "the package outputs \(shape); the bundle has \(detector.anchorCount) anchors and "
                              + "\(labels.count) classes, so [1, \(detector.anchorCount), \(4 + labels.count)]")
        }
        let head = MLShapedArray<Float>(converting: output).scalars  // row-major, whatever the array's strides or type
        let scaleX = Float(image.width) / Float(size[1]), scaleY = Float(image.height) / Float(size[0])
        return try detector.decode(head).filter { $0.score >= detector.parameters.matchScore }.map {
            Detection(label: $0.label, score: $0.score,
                      box: [$0.box[0] * scaleX, $0.box[1] * scaleY, $0.box[2] * scaleX, $0.box[3] * scaleY])
        }
    }

    public func label(of detection: Detection) -> String {
        labels[detection.label]
    }

    /// The boxes over the image, each in its class's palette colour, named and scored at its top left.
    public func drawBoxes(_ image: CGImage, _ detections: [Detection]) throws -> CGImage {
        let space = CGColorSpaceCreateDeviceRGB()
        guard let context = CGContext(data: nil, width: image.width, height: image.height, bitsPerComponent: 8, bytesPerRow: 0,
                                      space: space, bitmapInfo: CGImageAlphaInfo.premultipliedLast.rawValue) else {
            throw BundleError(description: "cannot draw a \(image.width)x\(image.height) picture")
        }
        let height = CGFloat(image.height)
        context.draw(image, in: CGRect(x: 0, y: 0, width: image.width, height: image.height))
        let line = max(2, CGFloat(max(image.width, image.height)) / 320)
        let font = CTFontCreateWithName("Helvetica" as CFString, 6 * line, nil)
        let white = CGColor(red: 1, green: 1, blue: 1, alpha: 1)
        context.setLineWidth(line)
        for detection in detections {
            let rgb = BundleClassifier.palette(detection.label)
            let colour = CGColor(red: CGFloat(rgb.red) / 255, green: CGFloat(rgb.green) / 255, blue: CGFloat(rgb.blue) / 255, alpha: 1)
            // Core Graphics' origin is the bottom left: the box's top is height - y0
            let (x0, y0, x1, y1) = (CGFloat(detection.box[0]), CGFloat(detection.box[1]), CGFloat(detection.box[2]), CGFloat(detection.box[3]))
            context.setStrokeColor(colour)
            context.stroke(CGRect(x: x0, y: height - y1, width: x1 - x0, height: y1 - y0))
            let caption = NSAttributedString(string: "\(labels[detection.label]) \(String(format: "%.2f", detection.score))", attributes: [
                NSAttributedString.Key(kCTFontAttributeName as String): font,
                NSAttributedString.Key(kCTForegroundColorAttributeName as String): white,
            ])
            let text = CTLineCreateWithAttributedString(caption)
            let textWidth = CGFloat(CTLineGetTypographicBounds(text, nil, nil, nil))
            let tagHeight = CTFontGetSize(font) + 2 * line
            context.setFillColor(colour)
            context.fill(CGRect(x: x0, y: height - y0 - tagHeight, width: textWidth + 2 * line, height: tagHeight))
            context.textPosition = CGPoint(x: x0 + line, y: height - y0 - tagHeight + line + CTFontGetDescent(font))
            CTLineDraw(text, context)
        }
        guard let result = context.makeImage() else {
            throw BundleError(description: "cannot draw a \(image.width)x\(image.height) picture")
        }
        return result
    }

    /// The mask in palette colours, half transparent, over the image at its size (scaled nearest
    /// neighbour); background pixels keep the image.
    public func overlay(_ image: CGImage, _ segmentation: Segmentation) throws -> CGImage {
        let alpha = BundleClassifier.overlayAlpha
        var rgba = [UInt8](repeating: 0, count: 4 * segmentation.mask.count)  // premultiplied: transparent is all zero
        for (pixel, c) in segmentation.mask.enumerated() where !BundleClassifier.background.contains(labels[c]) {
            let colour = BundleClassifier.palette(c)
            for (channel, value) in [colour.red, colour.green, colour.blue].enumerated() {
                rgba[4 * pixel + channel] = UInt8((Float(value) * alpha).rounded())
            }
            rgba[4 * pixel + 3] = UInt8((255 * alpha).rounded())
        }
        let space = CGColorSpaceCreateDeviceRGB()
        let premultiplied = CGImageAlphaInfo.premultipliedLast.rawValue
        guard let provider = CGDataProvider(data: Data(rgba) as CFData),
              let mask = CGImage(width: segmentation.width, height: segmentation.height, bitsPerComponent: 8, bitsPerPixel: 32,
                                 bytesPerRow: 4 * segmentation.width, space: space, bitmapInfo: CGBitmapInfo(rawValue: premultiplied),
                                 provider: provider, decode: nil, shouldInterpolate: false, intent: .defaultIntent),
              let context = CGContext(data: nil, width: image.width, height: image.height, bitsPerComponent: 8, bytesPerRow: 0,
                                      space: space, bitmapInfo: premultiplied) else {
            throw BundleError(description: "cannot draw a \(image.width)x\(image.height) overlay")
        }
        let bounds = CGRect(x: 0, y: 0, width: image.width, height: image.height)
        context.draw(image, in: bounds)
        context.interpolationQuality = .none
        context.draw(mask, in: bounds)
        guard let result = context.makeImage() else {
            throw BundleError(description: "cannot draw a \(image.width)x\(image.height) overlay")
        }
        return result
    }

    /// Pascal VOC's colour of a class index: its bits, three at a time, fill red, green and blue from
    /// their top bit down (1 dark red, 2 green, 3 olive, ..., 15 pink).
    public static func palette(_ index: Int) -> (red: UInt8, green: UInt8, blue: UInt8) {
        var rgb = [0, 0, 0]
        var value = index, bit = 7
        while value != 0 && bit >= 0 {
            for channel in 0..<3 {
                rgb[channel] |= ((value >> channel) & 1) << bit
            }
            value >>= 3
            bit -= 1
        }
        return (UInt8(rgb[0]), UInt8(rgb[1]), UInt8(rgb[2]))
    }

    /// torchvision's resize: one size sets the shorter side (the longer one truncated); two are (h, w).
    private func resizedSize(width: Int, height: Int) -> (width: Int, height: Int) {
        if spec.resizeSize.count == 2 { return (spec.resizeSize[1], spec.resizeSize[0]) }
        let short = min(width, height), long = max(width, height)
        let newLong = spec.resizeSize[0] * long / short
        return width <= height ? (spec.resizeSize[0], newLong) : (newLong, spec.resizeSize[0])
    }

    /// Resize and center crop as the weight's transforms do, drawn into a BGRA buffer of the crop size
    /// (of the resized image when there is no crop).
    private func pixelBuffer(_ image: CGImage) throws -> CVPixelBuffer {
        let (width, height) = resizedSize(width: image.width, height: image.height)
        let cropHeight = spec.cropSize?[0] ?? height
        let cropWidth = spec.cropSize.map { $0.count == 2 ? $0[1] : $0[0] } ?? width
        if let size = inputSize, size != [cropHeight, cropWidth] {
            throw BundleError(description: "preprocessing.json makes a \(cropHeight)x\(cropWidth) input; the model takes \(size[0])x\(size[1])")
        }
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
