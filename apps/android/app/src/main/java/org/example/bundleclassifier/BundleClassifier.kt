package org.example.bundleclassifier

import android.content.Context
import android.graphics.Bitmap
import org.json.JSONArray
import org.json.JSONObject
import org.pytorch.executorch.EValue
import org.pytorch.executorch.Module
import org.pytorch.executorch.Tensor
import java.io.File
import kotlin.math.exp
import kotlin.math.round

/**
 * An image classifier over the bundle in the app's assets. bundle.json picks the .pte (in its
 * order: the int8 program first, the fp32 one as fallback), preprocessing.json says how to turn a
 * Bitmap into the input tensor, labels.txt names the outputs. Nothing model-specific is in the code.
 */
class BundleClassifier(context: Context) {
    private val bundle = JSONObject(asset(context, "bundle.json"))
    private val labels = asset(context, bundle.getString("labels")).lines().filter { it.isNotEmpty() }
    private val spec = JSONObject(asset(context, bundle.getString("preprocessing")))
    private val resize = spec.getJSONArray("resize_size").ints()
    private val crop = spec.getJSONArray("crop_size").ints().let { if (it.size == 1) listOf(it[0], it[0]) else it } // (h, w)
    private val mean = spec.getJSONArray("mean").floats()
    private val std = spec.getJSONArray("std").floats()
    private val bilinear = spec.getString("interpolation") != "nearest"
    val artifactName: String
    private val module: Module

    init {
        require(spec.getString("layout") == "NCHW" && spec.getString("dtype") == "float32") {
            "this app feeds NCHW float32; preprocessing.json asks for ${spec.getString("layout")} ${spec.getString("dtype")}"
        }
        val (name, loaded) = loadFirstThatLoads(context)
        artifactName = name
        module = loaded
    }

    private fun loadFirstThatLoads(context: Context): Pair<String, Module> {
        val candidates = (0 until bundle.getJSONArray("artifacts").length())
            .map { bundle.getJSONArray("artifacts").getJSONObject(it) }
            .filter { it.getString("format") == "executorch" }
            .sortedBy { it.getString("status") == "failed" } // stable: keeps the bundle's order otherwise
        val errors = mutableListOf<String>()
        for (artifact in candidates) {
            val file = File(context.filesDir, artifact.getString("file"))
            context.assets.open(artifact.getString("file")).use { input -> file.outputStream().use { input.copyTo(it) } }
            try {
                val module = Module.load(file.absolutePath)
                val status = module.loadMethod("forward")
                if (status == 0) return artifact.getString("name") to module
                module.destroy()
                errors += "${artifact.getString("file")}: ExecuTorch error 0x${status.toString(16)}"
            } catch (e: RuntimeException) {
                errors += "${artifact.getString("file")}: ${e.message}"
            }
        }
        throw IllegalStateException("no .pte in the bundle loads: ${errors.joinToString("; ")}")
    }

    /** torchvision's ImageClassification transform: resize, center crop, scale to [0, 1], normalize. */
    fun preprocess(bitmap: Bitmap): Tensor {
        val (width, height) = resizedSize(bitmap.width, bitmap.height)
        val resized = Bitmap.createScaledBitmap(bitmap, width, height, bilinear)
        val (cropH, cropW) = crop
        // Python's round() in torchvision's center_crop rounds halves to even, as kotlin.math.round does
        val top = round((height - cropH) / 2.0).toInt()
        val left = round((width - cropW) / 2.0).toInt()
        val pixels = IntArray(cropW * cropH)
        resized.getPixels(pixels, 0, cropW, left, top, cropW, cropH)
        val plane = cropW * cropH
        val data = FloatArray(3 * plane)
        for (i in 0 until plane) {
            val p = pixels[i]
            data[i] = ((p shr 16 and 0xFF) / 255f - mean[0]) / std[0]
            data[plane + i] = ((p shr 8 and 0xFF) / 255f - mean[1]) / std[1]
            data[2 * plane + i] = ((p and 0xFF) / 255f - mean[2]) / std[2]
        }
        return Tensor.fromBlob(data, longArrayOf(1, 3, cropH.toLong(), cropW.toLong()))
    }

    /** One size sets the shorter side (the longer one truncated, as torchvision does); two are (h, w). */
    private fun resizedSize(width: Int, height: Int): Pair<Int, Int> {
        if (resize.size == 2) return resize[1] to resize[0]
        val short = minOf(width, height)
        val long = maxOf(width, height)
        val newLong = (resize[0].toLong() * long / short).toInt()
        return if (width <= height) resize[0] to newLong else newLong to resize[0]
    }

    fun top5(bitmap: Bitmap): List<Pair<String, Float>> {
        val logits = module.forward(EValue.from(preprocess(bitmap)))[0].toTensor().dataAsFloatArray
        check(logits.size == labels.size) { "model outputs ${logits.size} classes, labels.txt has ${labels.size}" }
        val max = logits.max()
        val weights = logits.map { exp(it - max) }
        val total = weights.sum()
        return logits.indices.sortedByDescending { logits[it] }.take(5).map { labels[it] to weights[it] / total }
    }

    private companion object {
        fun asset(context: Context, name: String): String = context.assets.open(name).bufferedReader().use { it.readText() }
        fun JSONArray.ints(): List<Int> = (0 until length()).map { getInt(it) }
        fun JSONArray.floats(): FloatArray = FloatArray(length()) { getDouble(it).toFloat() }
    }
}
