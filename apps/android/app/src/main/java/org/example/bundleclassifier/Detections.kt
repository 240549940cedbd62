package org.example.bundleclassifier

import org.json.JSONObject
import java.nio.ByteBuffer
import java.nio.ByteOrder
import kotlin.math.exp
import kotlin.math.max
import kotlin.math.min

/** One detected object: class index (0 is background, never reported), score, box (x0, y0, x1, y1) in pixels. */
class Detection(val label: Int, val score: Float, val box: FloatArray)

/** A float32 array from a .npy file: numpy's magic and header, then little-endian values in C order. */
class NpyArray(val shape: IntArray, val values: FloatArray) {
    companion object {
        fun parse(bytes: ByteArray): NpyArray {
            require(bytes.size > 10 && bytes[0] == 0x93.toByte() && String(bytes, 1, 5, Charsets.US_ASCII) == "NUMPY") {
                "not a .npy file"
            }
            val buffer = ByteBuffer.wrap(bytes).order(ByteOrder.LITTLE_ENDIAN)
            // version 1 stores the header length in 2 bytes, versions 2 and 3 in 4
            val (start, headerLength) = if (bytes[6].toInt() == 1) 10 to (buffer.getShort(8).toInt() and 0xFFFF) else 12 to buffer.getInt(8)
            val header = String(bytes, start, headerLength, Charsets.ISO_8859_1)
            require("'descr': '<f4'" in header && "'fortran_order': False" in header) {
                "expected a little-endian float32 array in C order; the .npy header says $header"
            }
            val dims = Regex("'shape': \\(([^)]*)\\)").find(header)?.groupValues?.get(1)
                ?: throw IllegalArgumentException("the .npy header has no shape: $header")
            val shape = dims.split(",").map { it.trim() }.filter { it.isNotEmpty() }.map { it.toInt() }.toIntArray()
            val values = FloatArray(shape.fold(1) { total, dim -> total * dim })
            require(bytes.size >= start + headerLength + 4 * values.size) { "the .npy file is truncated" }
            buffer.position(start + headerLength)
            buffer.asFloatBuffer().get(values)
            return NpyArray(shape, values)
        }
    }
}

/**
 * Raw SSD heads -> detections, step for step what the bundle's detection_decode.py does (torchvision's SSD
 * post-processing), with bundle.json's task.decode parameters and the bundle's anchors (x0, y0, x1, y1 in
 * pixels of the input_size image):
 * per anchor, softmax over the class logits and the box from its 4 deltas (divided by box_coder_weights,
 * width and height deltas clipped at bbox_xform_clip), clipped to the image; per class but background,
 * the anchors scoring above score_thresh, best topk_candidates of them; then greedy NMS per class
 * (a box suppresses the lower-scored boxes of its class overlapping it by IoU > nms_thresh), best
 * detections_per_img kept. Boxes come out in input pixels, best first.
 */
class DetectionDecoder(decode: JSONObject, anchors: NpyArray, private val inputHeight: Int, private val inputWidth: Int) {
    init {
        // RetinaNet and FCOS score with sigmoids and code boxes otherwise: refused before reading their parameters
        val kind = decode.optString("kind", "ssd")
        require(kind == "ssd") { "this app decodes SSD heads only; the bundle's detector is $kind (the bundle's detection_decode.py decodes it)" }
    }
    private val weights = decode.getJSONArray("box_coder_weights").let { a -> FloatArray(a.length()) { a.getDouble(it).toFloat() } }
    private val scoreThresh = decode.getDouble("score_thresh").toFloat()
    private val nmsThresh = decode.getDouble("nms_thresh").toFloat()
    private val topkCandidates = decode.getInt("topk_candidates")
    private val detectionsPerImage = decode.getInt("detections_per_img")
    private val xformClip = decode.getDouble("bbox_xform_clip").toFloat()
    /** The score from which an app shows an object (and the build compared artifacts with eager). */
    val matchScore = decode.getDouble("match_score").toFloat()
    private val anchorBoxes = anchors.values // x0, y0, x1, y1 per anchor
    val anchorCount = anchors.shape[0]

    init {
        require(anchors.shape.size == 2 && anchors.shape[1] == 4) { "anchors are ${anchors.shape.joinToString(" x ")}; expected N x 4" }
        require(weights.size == 4) { "box_coder_weights has ${weights.size} values; expected 4" }
    }

    /** head: anchors x (4 + classes), row by row. */
    fun decode(head: FloatArray): List<Detection> {
        val stride = head.size / anchorCount
        require(stride > 4 && head.size == anchorCount * stride) { "a head of ${head.size} values does not fit $anchorCount anchors" }
        val classes = stride - 4
        val boxes = FloatArray(4 * anchorCount)
        val probabilities = FloatArray(classes * anchorCount)
        for (a in 0 until anchorCount) {
            decodeBox(head, a * stride, a, boxes)
            softmax(head, a * stride + 4, classes, probabilities, a * classes)
        }
        val candidates = mutableListOf<Detection>()
        for (c in 1 until classes) {
            (0 until anchorCount)
                .filter { probabilities[it * classes + c] > scoreThresh }
                .sortedByDescending { probabilities[it * classes + c] } // stable: equal scores keep anchor order
                .take(topkCandidates)
                .forEach { candidates += Detection(c, probabilities[it * classes + c], boxes.copyOfRange(4 * it, 4 * it + 4)) }
        }
        return nonMaximumSuppression(candidates)
    }

    private fun decodeBox(head: FloatArray, at: Int, anchor: Int, boxes: FloatArray) {
        val (ax0, ay0, ax1, ay1) = anchorBoxes.copyOfRange(4 * anchor, 4 * anchor + 4)
        val width = ax1 - ax0
        val height = ay1 - ay0
        val centreX = ax0 + 0.5f * width + head[at] / weights[0] * width
        val centreY = ay0 + 0.5f * height + head[at + 1] / weights[1] * height
        val halfWidth = 0.5f * exp(min(head[at + 2] / weights[2], xformClip)) * width
        val halfHeight = 0.5f * exp(min(head[at + 3] / weights[3], xformClip)) * height
        boxes[4 * anchor] = (centreX - halfWidth).coerceIn(0f, inputWidth.toFloat())
        boxes[4 * anchor + 1] = (centreY - halfHeight).coerceIn(0f, inputHeight.toFloat())
        boxes[4 * anchor + 2] = (centreX + halfWidth).coerceIn(0f, inputWidth.toFloat())
        boxes[4 * anchor + 3] = (centreY + halfHeight).coerceIn(0f, inputHeight.toFloat())
    }

    private fun nonMaximumSuppression(candidates: List<Detection>): List<Detection> {
        val order = candidates.indices.sortedByDescending { candidates[it].score }
        val suppressed = BooleanArray(candidates.size)
        val kept = mutableListOf<Detection>()
        for ((rank, index) in order.withIndex()) {
            if (suppressed[index]) continue
            val best = candidates[index]
            kept += best
            if (kept.size == detectionsPerImage) break
            for (other in order.subList(rank + 1, order.size)) {
                if (candidates[other].label == best.label && iou(best.box, candidates[other].box) > nmsThresh) suppressed[other] = true
            }
        }
        return kept
    }

    private companion object {
        fun softmax(logits: FloatArray, from: Int, count: Int, into: FloatArray, at: Int) {
            var peak = logits[from]
            for (i in 1 until count) peak = max(peak, logits[from + i])
            var total = 0f
            for (i in 0 until count) {
                into[at + i] = exp(logits[from + i] - peak)
                total += into[at + i]
            }
            for (i in 0 until count) into[at + i] /= total
        }

        fun iou(a: FloatArray, b: FloatArray): Float {
            val inter = max(0f, min(a[2], b[2]) - max(a[0], b[0])) * max(0f, min(a[3], b[3]) - max(a[1], b[1]))
            val union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
            return if (union > 0f) inter / union else 0f
        }
    }
}
