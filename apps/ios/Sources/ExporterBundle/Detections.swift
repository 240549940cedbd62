import Foundation

/// One detected object: class index (0 is background, never reported), score, box (x0, y0, x1, y1) in
/// pixels, y pointing down.
public struct Detection {
    public let label: Int
    public let score: Float
    public let box: [Float]
}

/// A float32 array from a .npy file: numpy's magic and header, then little-endian values in C order.
public struct NpyArray {
    public let shape: [Int]
    public let values: [Float]

    public init(contentsOf url: URL) throws {
        let bytes = [UInt8](try Data(contentsOf: url))
        func fail(_ why: String) -> BundleError { BundleError(description: "\(url.lastPathComponent): \(why)") }
        guard bytes.count > 10, bytes[0] == 0x93, String(decoding: bytes[1..<6], as: UTF8.self) == "NUMPY" else {
            throw fail("not a .npy file")
        }
        // version 1 stores the header length in 2 bytes, versions 2 and 3 in 4
        let (start, headerLength) = bytes[6] == 1
            ? (10, Int(bytes[8]) | Int(bytes[9]) << 8)
            : (12, Int(bytes[8]) | Int(bytes[9]) << 8 | Int(bytes[10]) << 16 | Int(bytes[11]) << 24)
        guard bytes.count >= start + headerLength else { throw fail("truncated header") }
        let header = String(decoding: bytes[start..<start + headerLength], as: UTF8.self)
        guard header.contains("'descr': '<f4'"), header.contains("'fortran_order': False") else {
            throw fail("expected a little-endian float32 array in C order; the header says \(header)")
        }
        guard let open = header.range(of: "'shape': ("), let close = header[open.upperBound...].firstIndex(of: ")") else {
            throw fail("the header has no shape: \(header)")
        }
        shape = header[open.upperBound..<close].split(separator: ",").compactMap { Int($0.trimmingCharacters(in: .whitespaces)) }
        let count = shape.reduce(1, *)
        let offset = start + headerLength
        guard bytes.count >= offset + 4 * count else { throw fail("truncated data") }
        values = (0..<count).map { i in
            let at = offset + 4 * i
            let bits = UInt32(bytes[at]) | UInt32(bytes[at + 1]) << 8 | UInt32(bytes[at + 2]) << 16 | UInt32(bytes[at + 3]) << 24
            return Float(bitPattern: bits)
        }
    }
}

/// bundle.json's task.decode: the parameters of the decode and where the anchors are.
public struct DecodeParameters: Decodable {
    let boxCoderWeights: [Float]
    let scoreThresh: Float
    let nmsThresh: Float
    let topkCandidates: Int
    let detectionsPerImg: Int
    let bboxXformClip: Float
    /// The score from which an app shows an object (and the build compared artifacts with eager).
    public let matchScore: Float
    let anchors: String

    enum CodingKeys: String, CodingKey {
        case boxCoderWeights = "box_coder_weights", scoreThresh = "score_thresh", nmsThresh = "nms_thresh"
        case topkCandidates = "topk_candidates", detectionsPerImg = "detections_per_img", bboxXformClip = "bbox_xform_clip"
        case matchScore = "match_score", anchors = "anchors", kind = "kind"
    }

    /// Refuses a detector this port does not decode (RetinaNet and FCOS score with sigmoids and code boxes
    /// otherwise) before reading parameters it may not have.
    public init(from decoder: Decoder) throws {
        let values = try decoder.container(keyedBy: CodingKeys.self)
        let kind = try values.decodeIfPresent(String.self, forKey: .kind) ?? "ssd"
        guard kind == "ssd" else {
            throw BundleError(description: "this app decodes SSD heads only; the bundle's detector is \(kind) "
                + "(the bundle's detection_decode.py decodes it)")
        }
        boxCoderWeights = try values.decode([Float].self, forKey: .boxCoderWeights)
        scoreThresh = try values.decode(Float.self, forKey: .scoreThresh)
        nmsThresh = try values.decode(Float.self, forKey: .nmsThresh)
        topkCandidates = try values.decode(Int.self, forKey: .topkCandidates)
        detectionsPerImg = try values.decode(Int.self, forKey: .detectionsPerImg)
        bboxXformClip = try values.decode(Float.self, forKey: .bboxXformClip)
        matchScore = try values.decode(Float.self, forKey: .matchScore)
        anchors = try values.decode(String.self, forKey: .anchors)
    }
}

/// Raw SSD heads -> detections, step for step what the bundle's detection_decode.py does (torchvision's
/// SSD post-processing), with task.decode's parameters and the bundle's anchors (x0, y0, x1, y1 in
/// pixels of the input_size image): per anchor, softmax over the class logits and the box from its 4
/// deltas (divided by box_coder_weights, width and height deltas clipped at bbox_xform_clip), clipped
/// to the image; per class but background, the anchors scoring above score_thresh, best
/// topk_candidates of them; then greedy NMS per class (a box suppresses the lower-scored boxes of its
/// class overlapping it by IoU > nms_thresh), best detections_per_img kept. Boxes come out in input
/// pixels, best first.
public struct DetectionDecoder {
    public let parameters: DecodeParameters
    let anchors: NpyArray
    let inputHeight: Float
    let inputWidth: Float

    public var anchorCount: Int { anchors.shape[0] }

    public init(parameters: DecodeParameters, anchors: NpyArray, inputSize: [Int]) throws {
        guard anchors.shape.count == 2, anchors.shape[1] == 4 else {
            throw BundleError(description: "anchors are \(anchors.shape); expected [N, 4]")
        }
        guard parameters.boxCoderWeights.count == 4, inputSize.count == 2 else {
            throw BundleError(description: "box_coder_weights needs 4 values and input_size 2")
        }
        self.parameters = parameters
        self.anchors = anchors
        inputHeight = Float(inputSize[0])
        inputWidth = Float(inputSize[1])
    }

    /// head: anchors x (4 + classes), row by row.
    public func decode(_ head: [Float]) throws -> [Detection] {
        let count = anchorCount
        let stride = head.count / count
        guard stride > 4, head.count == count * stride else {
            throw BundleError(description: "a head of \(head.count) values does not fit \(count) anchors")
        }
        let classes = stride - 4
        var boxes = [[Float]]()
        boxes.reserveCapacity(count)
        var probabilities = [Float](repeating: 0, count: count * classes)
        for a in 0..<count {
            boxes.append(box(head, at: a * stride, anchor: a))
            let logits = head[(a * stride + 4)..<((a + 1) * stride)]
            let peak = logits.max() ?? 0
            let exps = logits.map { exp($0 - peak) }
            let total = exps.reduce(0, +)
            for c in 0..<classes {
                probabilities[a * classes + c] = exps[c] / total
            }
        }
        var candidates = [Detection]()
        for c in 1..<classes {
            let score = { (a: Int) in probabilities[a * classes + c] }
            // best first; equal scores keep the anchor order, as numpy's stable sort does
            let ranked = (0..<count).filter { score($0) > parameters.scoreThresh }
                .sorted { score($0) != score($1) ? score($0) > score($1) : $0 < $1 }
            for a in ranked.prefix(parameters.topkCandidates) {
                candidates.append(Detection(label: c, score: score(a), box: boxes[a]))
            }
        }
        return nonMaximumSuppression(candidates)
    }

    private func box(_ head: [Float], at i: Int, anchor a: Int) -> [Float] {
        let w = parameters.boxCoderWeights
        let x0 = anchors.values[4 * a], y0 = anchors.values[4 * a + 1]
        let width = anchors.values[4 * a + 2] - x0, height = anchors.values[4 * a + 3] - y0
        let centreX = x0 + 0.5 * width + head[i] / w[0] * width
        let centreY = y0 + 0.5 * height + head[i + 1] / w[1] * height
        let halfWidth = 0.5 * exp(min(head[i + 2] / w[2], parameters.bboxXformClip)) * width
        let halfHeight = 0.5 * exp(min(head[i + 3] / w[3], parameters.bboxXformClip)) * height
        return [min(max(centreX - halfWidth, 0), inputWidth), min(max(centreY - halfHeight, 0), inputHeight),
                min(max(centreX + halfWidth, 0), inputWidth), min(max(centreY + halfHeight, 0), inputHeight)]
    }

    private func nonMaximumSuppression(_ candidates: [Detection]) -> [Detection] {
        let order = candidates.indices.sorted {
            candidates[$0].score != candidates[$1].score ? candidates[$0].score > candidates[$1].score : $0 < $1
        }
        var suppressed = [Bool](repeating: false, count: candidates.count)
        var kept = [Detection]()
        for (rank, index) in order.enumerated() where !suppressed[index] {
            let best = candidates[index]
            kept.append(best)
            if kept.count == parameters.detectionsPerImg { break }
            for other in order[(rank + 1)...] where candidates[other].label == best.label {
                if DetectionDecoder.iou(best.box, candidates[other].box) > parameters.nmsThresh {
                    suppressed[other] = true
                }
            }
        }
        return kept
    }

    static func iou(_ a: [Float], _ b: [Float]) -> Float {
        let inter = max(0, min(a[2], b[2]) - max(a[0], b[0])) * max(0, min(a[3], b[3]) - max(a[1], b[1]))
        let union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
        return union > 0 ? inter / union : 0
    }
}
