package org.example.bundleclassifier

import android.content.Context
import android.graphics.Bitmap
import android.graphics.Canvas
import android.graphics.Color
import android.graphics.Paint
import org.json.JSONArray
import org.json.JSONObject
import java.io.File
import kotlin.math.exp

/** Class names an overlay leaves unpainted (torchvision's first). */
val BACKGROUND = setOf("__background__", "background")
private const val OVERLAY_ALPHA = 128

/**
 * Pascal VOC's colour of a class index as 0xRRGGBB: the index's bits, three at a time, fill red, green
 * and blue from their top bit down (1 dark red, 2 green, 3 olive, ..., 15 pink).
 */
fun palette(index: Int): Int {
    var r = 0
    var g = 0
    var b = 0
    var value = index
    var bit = 7
    while (value != 0 && bit >= 0) {
        r = r or ((value and 1) shl bit)
        g = g or ((value shr 1 and 1) shl bit)
        b = b or ((value shr 2 and 1) shl bit)
        value = value shr 3
        bit--
    }
    return (r shl 16) or (g shl 8) or b
}

/** A segmentation mask at the model's output size: the class of each pixel, row by row. */
class Segmentation(val width: Int, val height: Int, val mask: IntArray, val fractions: List<Pair<String, Float>>)

/** The output layout each task's model has (bundle.json task.output.layout). */
private val LAYOUTS = mapOf("classification" to "NC", "segmentation" to "NCHW", "detection" to "NAK")

/** The artifact formats (bundle.json artifacts[].format) this app has a runtime for. */
private val RUNTIMES = listOf("executorch", "litert")

/**
 * An image classifier, segmenter or object detector over the bundle in the app's assets. bundle.json
 * says which (its "task"; a bundle without one is a classifier) and picks the model file (in its order: the
 * ExecuTorch int8 program first, fp32 as fallback, then the LiteRT files; [runtime], when given, keeps one
 * runtime's files only), preprocessing.json says how to resize (and crop) a Bitmap ([Preprocessing], torchvision's
 * resize to the byte) and the artifact's `input` whether it takes those bytes or normalized floats, labels.txt names
 * the classes; a detector's anchors and decode parameters come from bundle.json's task.decode. Nothing
 * model-specific is in the code.
 */
class BundleClassifier(context: Context, runtime: String? = null) {
    private val bundle = JSONObject(asset(context, "bundle.json"))
    private val task = bundle.optJSONObject("task")
    /** "classification" (top5), "segmentation" (segment, overlay) or "detection" (detect, drawBoxes). */
    val taskName: String = task?.getString("name") ?: "classification"
    private val inputSize = task?.getJSONArray("input_size")?.ints() // (h, w)
    private val labels = asset(context, bundle.getString("labels")).lines().filter { it.isNotEmpty() }
    private val preprocessing = Preprocessing(JSONObject(asset(context, bundle.getString("preprocessing"))))
    /** The artifact running (bundle.json artifacts[].name), with its status when it did not pass. */
    val artifactName: String
    private val runner: ModelRunner
    /** Whether it takes the resized RGB bytes (uint8-nhwc: the graph normalizes) rather than float32 NCHW. */
    private val feedsBytes: Boolean

    init {
        require(taskName in LAYOUTS) { "this app runs ${LAYOUTS.keys.joinToString()} bundles; this one is $taskName" }
        val layout = task?.getJSONObject("output")?.getString("layout")
        require(layout == null || layout == LAYOUTS[taskName]) {
            "a $taskName model with $layout output is not one this app reads"
        }
        val (artifact, loaded) = loadFirstThatLoads(context, runtime)
        val status = artifact.getString("status")
        artifactName = artifact.getString("name") + (if (status == "passed") "" else " ($status)")
        runner = loaded
        feedsBytes = takesBytes(artifact)
    }

    // after the checks above: a detector's boxes come from its raw heads, the anchors and task.decode
    private val detector: DetectionDecoder? = if (taskName != "detection") null else task!!.getJSONObject("decode").let {
        val anchors = NpyArray.parse(context.assets.open(it.getString("anchors")).use { input -> input.readBytes() })
        DetectionDecoder(it, anchors, inputSize!![0], inputSize[1])
    }

    /**
     * The first artifact in bundle.json's order that passed, has a runtime here (or is of the one [runtime] names),
     * needs no CPU feature this device lacks (cpu_needs: an fp16 program on a core without FP16 arithmetic) and
     * loads; one that did not pass only when none of those loads.
     */
    private fun loadFirstThatLoads(context: Context, runtime: String?): Pair<JSONObject, ModelRunner> {
        val formats = if (runtime.isNullOrEmpty()) RUNTIMES else listOf(runtime)
        require(formats.all { it in RUNTIMES }) { "runtime $runtime: this app has ${RUNTIMES.joinToString(" and ")}" }
        val artifacts = bundle.getJSONArray("artifacts")
        val features = cpuFeatures(File("/proc/cpuinfo").readText())
        val candidates = (0 until artifacts.length()).map { artifacts.getJSONObject(it) }
            .filter { it.getString("format") in formats && servable(it, features) }
            .sortedBy { it.getString("status") != "passed" } // stable: keeps the bundle's order otherwise
        check(candidates.isNotEmpty()) { "the bundle has no ${formats.joinToString(" or ")} file" }
        val errors = mutableListOf<String>()
        for (artifact in candidates) {
            val name = artifact.getString("file")
            val file = File(context.filesDir, name)
            context.assets.open(name).use { input -> file.outputStream().use { input.copyTo(it) } }
            try {
                return artifact to runnerFor(artifact, file)
            } catch (e: RuntimeException) {
                errors += "$name: ${e.message}"
            }
        }
        throw IllegalStateException("no ${formats.joinToString(" or ")} file in the bundle loads: ${errors.joinToString("; ")}")
    }

    private fun runnerFor(artifact: JSONObject, file: File): ModelRunner {
        if (artifact.getString("format") == "executorch") return ExecuTorchRunner(file)
        // LiteRT: the interface the build read from the file (runtime.io): float32 or uint8 in, float32 out
        val io = artifact.getJSONObject("runtime").getJSONObject("io")
        val input = io.getJSONArray("inputs").getJSONObject(0)
        val outputs = io.getJSONArray("outputs").let { list -> (0 until list.length()).map { list.getJSONObject(it) } }
        val inputType = if (takesBytes(artifact)) "uint8" else "float32"
        require(input.getString("dtype") == inputType) {
            "${input.getString("name")} is ${input.getString("dtype")}; the artifact's input says $inputType"
        }
        for (tensor in outputs) {
            require(tensor.getString("dtype") == "float32") {
                "${tensor.getString("name")} is ${tensor.getString("dtype")}; this app reads float32 outputs"
            }
        }
        val shape = input.getJSONArray("shape").ints().toIntArray()
        return LiteRtRunner(file, shape, inputType == "uint8", outputs.map { it.getString("name") })
    }

    /**
     * preprocessing.json's resize (and crop) of the bitmap, computed as torchvision computes it ([Preprocessing]),
     * then what the artifact takes: those bytes (1 x H x W x 3), or scaled to [0, 1] and normalized (1 x 3 x H x W).
     */
    fun preprocess(bitmap: Bitmap): ModelInput {
        val argb = IntArray(bitmap.width * bitmap.height)
        bitmap.getPixels(argb, 0, bitmap.width, 0, 0, bitmap.width, bitmap.height)
        val image = preprocessing.resizeAndCrop(argb, bitmap.width, bitmap.height)
        val (h, w) = image.height.toLong() to image.width.toLong()
        check(inputSize == null || inputSize == listOf(image.height, image.width)) {
            "preprocessing.json makes a ${h}x$w input; the model takes ${inputSize!![0]}x${inputSize[1]}"
        }
        if (feedsBytes) return ModelInput.Bytes(longArrayOf(1, h, w, 3), image.bytes)
        return ModelInput.Floats(FloatTensor(longArrayOf(1, 3, h, w), preprocessing.normalized(image)))
    }

    fun top5(bitmap: Bitmap): List<Pair<String, Float>> {
        check(taskName == "classification") { "top5 needs a classification bundle; this one is $taskName" }
        val logits = runner.run(preprocess(bitmap))[0].data
        check(logits.size == labels.size) { "model outputs ${logits.size} classes, labels.txt has ${labels.size}" }
        val max = logits.max()
        val weights = logits.map { exp(it - max) }
        val total = weights.sum()
        return logits.indices.sortedByDescending { logits[it] }.take(5).map { labels[it] to weights[it] / total }
    }

    /** The argmax over C of the 1 x C x H x W logits, and each present class's share of the pixels, largest first. */
    fun segment(bitmap: Bitmap): Segmentation {
        check(taskName == "segmentation") { "segment needs a segmentation bundle; this one is $taskName" }
        val output = runner.run(preprocess(bitmap))[0]
        val shape = output.shape
        check(shape.size == 4 && shape[0] == 1L && shape[1] == labels.size.toLong()) {
            "model outputs ${shape.joinToString(" x ")}; labels.txt has ${labels.size} classes, so 1 x ${labels.size} x H x W"
        }
        val (height, width) = shape[2].toInt() to shape[3].toInt()
        val logits = output.data
        val plane = height * width
        val mask = IntArray(plane)
        val counts = IntArray(labels.size)
        for (i in 0 until plane) {
            var best = 0
            for (c in 1 until labels.size) if (logits[c * plane + i] > logits[best * plane + i]) best = c
            mask[i] = best
            counts[best]++
        }
        val fractions = counts.indices.filter { counts[it] > 0 }.sortedByDescending { counts[it] }
            .map { labels[it] to counts[it].toFloat() / plane }
        return Segmentation(width, height, mask, fractions)
    }

    /**
     * The objects scoring at least task.decode.match_score, best first, their boxes scaled from the model's
     * input size to the bitmap's (the preprocessing resized it to exactly that size).
     */
    fun detect(bitmap: Bitmap): List<Detection> {
        val decoder = checkNotNull(detector) { "detect needs a detection bundle; this one is $taskName" }
        val output = runner.run(preprocess(bitmap))[0]
        val shape = output.shape
        check(shape.size == 3 && shape[0] == 1L && shape[1] == decoder.anchorCount.toLong() && shape[2] == 4L + labels.size) {
            "model outputs ${shape.joinToString(" x ")}; the bundle has ${decoder.anchorCount} anchors and ${labels.size} classes, " +
                "so 1 x ${decoder.anchorCount} x ${4 + labels.size}"
        }
        val scaleX = bitmap.width.toFloat() / inputSize!![1]
        val scaleY = bitmap.height.toFloat() / inputSize[0]
        return decoder.decode(output.data).filter { it.score >= decoder.matchScore }.map {
            val (x0, y0, x1, y1) = it.box
            Detection(it.label, it.score, floatArrayOf(x0 * scaleX, y0 * scaleY, x1 * scaleX, y1 * scaleY))
        }
    }

    fun labelOf(detection: Detection): String = labels[detection.label]

    /** The boxes over a copy of the image, each in its class's palette colour, named and scored at its top left. */
    fun drawBoxes(image: Bitmap, detections: List<Detection>): Bitmap {
        val result = image.copy(Bitmap.Config.ARGB_8888, true)
        val canvas = Canvas(result)
        val line = maxOf(2f, maxOf(image.width, image.height) / 320f)
        val stroke = Paint().apply { style = Paint.Style.STROKE; strokeWidth = line }
        val tag = Paint().apply { style = Paint.Style.FILL }
        val text = Paint().apply { color = Color.WHITE; textSize = 6 * line; isAntiAlias = true }
        for (detection in detections) {
            val (x0, y0, x1, y1) = detection.box
            stroke.color = Color.BLACK or palette(detection.label)
            tag.color = stroke.color
            canvas.drawRect(x0, y0, x1, y1, stroke)
            val caption = "${labels[detection.label]} ${"%.2f".format(detection.score)}"
            canvas.drawRect(x0, y0, x0 + text.measureText(caption) + 2 * line, y0 + text.textSize + 2 * line, tag)
            canvas.drawText(caption, x0 + line, y0 + line + text.textSize - text.descent(), text)
        }
        return result
    }

    /** The mask in palette colours, half transparent, over the image at its size (scaled nearest neighbour); background pixels keep the image. */
    fun overlay(image: Bitmap, segmentation: Segmentation): Bitmap {
        val colours = IntArray(segmentation.mask.size) {
            val c = segmentation.mask[it]
            if (labels[c] in BACKGROUND) Color.TRANSPARENT else (OVERLAY_ALPHA shl 24) or palette(c)
        }
        val mask = Bitmap.createBitmap(colours, segmentation.width, segmentation.height, Bitmap.Config.ARGB_8888)
        val result = image.copy(Bitmap.Config.ARGB_8888, true)
        Canvas(result).drawBitmap(Bitmap.createScaledBitmap(mask, image.width, image.height, false), 0f, 0f, null)
        return result
    }

    private companion object {
        fun asset(context: Context, name: String): String = context.assets.open(name).bufferedReader().use { it.readText() }
        fun JSONArray.ints(): List<Int> = (0 until length()).map { getInt(it) }
    }
}
