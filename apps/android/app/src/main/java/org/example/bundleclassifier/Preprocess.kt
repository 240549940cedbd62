package org.example.bundleclassifier

import org.json.JSONArray
import org.json.JSONObject
import kotlin.math.abs
import kotlin.math.ceil
import kotlin.math.max
import kotlin.math.min
import kotlin.math.round

/**
 * Whether a bundle.json artifact takes the resized RGB bytes (its `input.dtype` uint8: uint8-nhwc, the graph
 * normalizes) rather than float32 NCHW, normalized by the app; an artifact without `input` (an older bundle) takes float32.
 */
fun takesBytes(artifact: JSONObject): Boolean {
    val dtype = artifact.optJSONObject("input")?.optString("dtype", "float32") ?: "float32"
    require(dtype == "uint8" || dtype == "float32") { "${artifact.getString("name")} takes $dtype; this app feeds uint8 or float32" }
    return dtype == "uint8"
}

/**
 * The CPU features named by bundle.json's artifacts[].cpu_needs that every core of this device has, from
 * /proc/cpuinfo's Features lines (one per core: a phone's big and little cores may differ, and a thread may run on
 * either). "fp16_arithmetic" is Armv8.2-A FP16 arithmetic, the kernel's "asimdhp" flag (Cortex-A55, A75, A76 and
 * later; not Cortex-A53, A57, A72).
 */
fun cpuFeatures(cpuinfo: String): Set<String> {
    val cores = cpuinfo.lines().filter { it.startsWith("Features") }.map {
        it.substringAfter(':').trim().split(Regex("\\s+")).toSet()
    }
    return if (cores.isNotEmpty() && cores.all { "asimdhp" in it }) setOf("fp16_arithmetic") else emptySet()
}

/** Whether a device with [features] has every CPU feature a bundle.json artifact needs (cpu_needs; none: it does). */
fun servable(artifact: JSONObject, features: Set<String>): Boolean {
    val needs = artifact.optJSONArray("cpu_needs") ?: return true
    return (0 until needs.length()).all { needs.getString(it) in features }
}

/** 8-bit RGB, row by row, 3 bytes a pixel: what a uint8-nhwc artifact takes (1 x H x W x 3). */
class RgbImage(val width: Int, val height: Int, val bytes: ByteArray)

/**
 * preprocessing.json's resize and crop as torchvision does them to a PIL image, to the byte: Pillow's separable
 * filter, scaled to the reduction (so it antialiases), in its 22-bit fixed point, each pass rounded to bytes, in
 * Pillow 13's pass order. The bundle's preprocess.py is the same computation in numpy; the exporter's tests run
 * this file on a JVM and hold its bytes equal to torchvision's. Nothing here is Android's.
 */
class Preprocessing(spec: JSONObject) {
    private val resizeSize = spec.getJSONArray("resize_size").ints()
    // (h, w); none for segmentation and detection, whose resize is to the exact input size
    private val crop = if (spec.isNull("crop_size")) null else spec.getJSONArray("crop_size").ints().let {
        if (it.size == 1) intArrayOf(it[0], it[0]) else it
    }
    private val interpolation = spec.getString("interpolation")
    private val mean = spec.getJSONArray("mean").floats()
    private val std = spec.getJSONArray("std").floats()

    init {
        require(interpolation in SUPPORT) {
            "preprocessing.json resizes with $interpolation; this app has ${SUPPORT.keys.joinToString(" and ")}"
        }
    }

    /** [argb] (0xAARRGGBB row by row, as Bitmap.getPixels gives them; alpha ignored) resized, then cropped. */
    fun resizeAndCrop(argb: IntArray, width: Int, height: Int): RgbImage {
        require(argb.size == width * height) { "${argb.size} pixels are not a ${width}x$height image" }
        val rgb = ByteArray(3 * argb.size)
        for (i in argb.indices) {
            rgb[3 * i] = (argb[i] shr 16).toByte()
            rgb[3 * i + 1] = (argb[i] shr 8).toByte()
            rgb[3 * i + 2] = argb[i].toByte()
        }
        val (outHeight, outWidth) = resizedSize(height, width)
        val resized = resize(RgbImage(width, height, rgb), outHeight, outWidth)
        val (cropHeight, cropWidth) = crop?.let { it[0] to it[1] } ?: return resized
        return centerCrop(resized, cropHeight, cropWidth)
    }

    /** What a float32-nchw artifact takes for [image]: / 255, - mean, / std, 3 x H x W (batch of one). */
    fun normalized(image: RgbImage): FloatArray {
        val plane = image.width * image.height
        val data = FloatArray(3 * plane)
        for (i in 0 until plane) {
            for (c in 0 until 3) {
                val byte = image.bytes[3 * i + c].toInt() and 0xFF
                data[c * plane + i] = (byte / 255f - mean[c]) / std[c]
            }
        }
        return data
    }

    /** torchvision's size: one number sets the shorter side (the longer in proportion, truncated); two are (h, w). */
    fun resizedSize(height: Int, width: Int): Pair<Int, Int> {
        if (resizeSize.size == 2) return resizeSize[0] to resizeSize[1]
        val short = min(height, width)
        val long = max(height, width)
        val newLong = (resizeSize[0].toLong() * long / short.toDouble()).toInt() // Python's true division, then int()
        return if (height > width) newLong to resizeSize[0] else resizeSize[0] to newLong
    }

    fun resize(image: RgbImage, height: Int, width: Int): RgbImage {
        val shrinkHeight = image.height - height
        val shrinkWidth = image.width - width
        // Pillow 13 runs the vertical pass first when the height shrinks by more than twice what the width does;
        // the passes round to bytes in between, so the order shows in the last bit
        val verticalFirst = shrinkHeight > 0 && shrinkHeight > 2 * shrinkWidth
        var out = image
        for (vertical in if (verticalFirst) listOf(true, false) else listOf(false, true)) {
            if (vertical && out.height != height) out = pass(out, height, vertical = true)
            if (!vertical && out.width != width) out = pass(out, width, vertical = false)
        }
        return out
    }

    private fun pass(image: RgbImage, sizeOut: Int, vertical: Boolean): RgbImage {
        val sizeIn = if (vertical) image.height else image.width
        val (first, weights, taps) = coefficients(sizeIn, sizeOut)
        val outWidth = if (vertical) image.width else sizeOut
        val outHeight = if (vertical) sizeOut else image.height
        val out = ByteArray(3 * outWidth * outHeight)
        val lines = if (vertical) image.width else image.height // the pixels along the other axis
        for (o in 0 until sizeOut) {
            val count = min(taps, sizeIn - first[o])
            for (line in 0 until lines) {
                for (c in 0 until 3) {
                    var total = 1 shl (PRECISION_BITS - 1) // Int, as Pillow's accumulator
                    for (t in 0 until count) {
                        val at = if (vertical) (first[o] + t) * image.width + line else line * image.width + first[o] + t
                        total += (image.bytes[3 * at + c].toInt() and 0xFF) * weights[o * taps + t]
                    }
                    val value = (total shr PRECISION_BITS).coerceIn(0, 255)
                    val to = if (vertical) o * outWidth + line else line * outWidth + o
                    out[3 * to + c] = value.toByte()
                }
            }
        }
        return RgbImage(outWidth, outHeight, out)
    }

    /** Per output pixel, the first input pixel it reads and its fixed-point weights (taps per pixel, zero-padded). */
    private fun coefficients(sizeIn: Int, sizeOut: Int): Triple<IntArray, IntArray, Int> {
        val scale = sizeIn.toDouble() / sizeOut
        val filterScale = max(scale, 1.0)
        val support = SUPPORT.getValue(interpolation) * filterScale
        val taps = ceil(support).toInt() * 2 + 1
        val first = IntArray(sizeOut)
        val fixed = IntArray(sizeOut * taps)
        val w = DoubleArray(taps)
        for (i in 0 until sizeOut) {
            val center = (i + 0.5) * scale
            val lo = max((center - support + 0.5).toInt(), 0)
            val hi = min((center + support + 0.5).toInt(), sizeIn)
            var total = 0.0
            for (x in lo until hi) {
                w[x - lo] = filter((x - center + 0.5) * (1.0 / filterScale))
                total += w[x - lo]
            }
            first[i] = lo
            for (x in 0 until hi - lo) {
                val scaled = (if (total != 0.0) w[x] / total else w[x]) * (1 shl PRECISION_BITS)
                fixed[i * taps + x] = (if (scaled < 0) scaled - 0.5 else scaled + 0.5).toInt() // C's truncation
            }
        }
        return Triple(first, fixed, taps)
    }

    private fun filter(x: Double): Double {
        val a = abs(x)
        if (interpolation == "bilinear") return if (a < 1.0) 1.0 - a else 0.0
        return when { // bicubic, a = -0.5
            a < 1.0 -> ((CUBIC + 2.0) * a - (CUBIC + 3.0)) * a * a + 1
            a < 2.0 -> (((a - 5) * a + 8) * a - 4) * CUBIC
            else -> 0.0
        }
    }

    private companion object {
        const val PRECISION_BITS = 32 - 8 - 2 // Pillow's fixed point for 8-bit images
        const val CUBIC = -0.5
        val SUPPORT = mapOf("bilinear" to 1.0, "bicubic" to 2.0)

        fun centerCrop(image: RgbImage, height: Int, width: Int): RgbImage {
            // Python's round() in torchvision's center_crop rounds halves to even, as kotlin.math.round does
            val top = round((image.height - height) / 2.0).toInt()
            val left = round((image.width - width) / 2.0).toInt()
            require(top >= 0 && left >= 0) { "a ${image.height}x${image.width} image is smaller than the ${height}x$width crop" }
            val out = ByteArray(3 * width * height)
            for (y in 0 until height) {
                System.arraycopy(image.bytes, 3 * ((top + y) * image.width + left), out, 3 * y * width, 3 * width)
            }
            return RgbImage(width, height, out)
        }

        fun JSONArray.ints(): IntArray = IntArray(length()) { getInt(it) }
        fun JSONArray.floats(): FloatArray = FloatArray(length()) { getDouble(it).toFloat() }
    }
}
