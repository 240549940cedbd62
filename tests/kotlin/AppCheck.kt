package org.example.bundleclassifier

import org.json.JSONArray
import org.json.JSONObject
import java.io.File
import java.nio.ByteBuffer
import java.nio.ByteOrder

/**
 * The Android app's pure-Kotlin code (Preprocess.kt, Detections.kt, Bpte.kt) run on a JVM by the exporter's tests
 * (tests/kotlin_app.py): each directory under args[0] is one case, its case.json saying which check; the results
 * are written beside the inputs for Python to compare with torchvision and the exporter.
 */
fun main(args: Array<String>) {
    val cases = File(args[0]).listFiles()!!.filter { it.isDirectory }.sortedBy { it.name }
    for (case in cases) {
        val spec = JSONObject(File(case, "case.json").readText())
        when (val check = spec.getString("check")) {
            "preprocess" -> preprocess(case, spec)
            "decode" -> decode(case, spec)
            "bpte" -> bpte(case)
            "takes" -> takes(case, spec)
            "servable" -> servable(case, spec)
            else -> throw IllegalArgumentException("unknown check $check")
        }
    }
}

/** photo.rgb (H x W x 3 bytes) -> pixels.rgb (resized, cropped) and input.f32 (normalized, 3 x H x W). */
private fun preprocess(case: File, spec: JSONObject) {
    val width = spec.getInt("width")
    val height = spec.getInt("height")
    val rgb = File(case, "photo.rgb").readBytes()
    val argb = IntArray(width * height) {
        (0xFF shl 24) or ((rgb[3 * it].toInt() and 0xFF) shl 16) or ((rgb[3 * it + 1].toInt() and 0xFF) shl 8) or
            (rgb[3 * it + 2].toInt() and 0xFF)
    }
    val preprocessing = Preprocessing(spec.getJSONObject("preprocessing"))
    val image = preprocessing.resizeAndCrop(argb, width, height)
    File(case, "pixels.rgb").writeBytes(image.bytes)
    File(case, "shape.txt").writeText("${image.height} ${image.width}")
    File(case, "input.f32").writeBytes(littleEndian(preprocessing.normalized(image)))
}

/** head.npy and anchors.npy with case.json's decode -> detections.f32: label, score, x0, y0, x1, y1 per row. */
private fun decode(case: File, spec: JSONObject) {
    val anchors = NpyArray.parse(File(case, "anchors.npy").readBytes())
    val head = NpyArray.parse(File(case, "head.npy").readBytes())
    val decoder = DetectionDecoder(spec.getJSONObject("decode"), anchors, spec.getInt("height"), spec.getInt("width"))
    val rows = decoder.decode(head.values).flatMap { listOf(it.label.toFloat(), it.score) + it.box.toList() }
    File(case, "detections.f32").writeBytes(littleEndian(rows.toFloatArray()))
}

/** program.bpte -> read.json (version, method, per case the dtype, sizes and file of each tensor) and program.pte. */
private fun bpte(case: File) {
    val read = Bpte.read(File(case, "program.bpte").readBytes())
    File(case, "program.pte").writeBytes(read.program)
    val cases = read.cases.mapIndexed { i, c ->
        val described = JSONObject()
        for ((role, list) in listOf("inputs" to c.inputs, "expected" to c.expected)) {
            described.put(role, JSONArray(list.mapIndexed { k, t ->
                val name = "case$i-$role$k.bin"
                File(case, name).writeBytes(t.bytes ?: littleEndian(t.floats!!))
                JSONObject().put("file", name).put("dtype", if (t.bytes != null) "uint8" else "float32").put("sizes", JSONArray(t.sizes.toList()))
            }))
        }
        described
    }
    val described = JSONObject().put("version", read.version).put("method", read.method).put("cases", JSONArray(cases))
    File(case, "read.json").writeText(described.toString())
}

/** case.json's bundle -> takes.json: what the app feeds each artifact (uint8 or float32), or why it refuses. */
private fun takes(case: File, spec: JSONObject) {
    val artifacts = spec.getJSONObject("bundle").getJSONArray("artifacts")
    val fed = JSONObject()
    for (i in 0 until artifacts.length()) {
        val artifact = artifacts.getJSONObject(i)
        val feeds = try {
            if (takesBytes(artifact)) "uint8" else "float32"
        } catch (e: IllegalArgumentException) {
            "refused: ${e.message}"
        }
        fed.put(artifact.getString("name"), feeds)
    }
    File(case, "takes.json").writeText(fed.toString())
}

/** case.json's cpuinfo and bundle -> servable.json: the features read, and per artifact whether it is kept. */
private fun servable(case: File, spec: JSONObject) {
    val features = cpuFeatures(spec.getString("cpuinfo"))
    val artifacts = spec.getJSONObject("bundle").getJSONArray("artifacts")
    val kept = JSONObject()
    for (i in 0 until artifacts.length()) {
        val artifact = artifacts.getJSONObject(i)
        kept.put(artifact.getString("name"), servable(artifact, features))
    }
    File(case, "servable.json").writeText(JSONObject().put("features", JSONArray(features.sorted())).put("kept", kept).toString())
}

private fun littleEndian(values: FloatArray): ByteArray {
    val buffer = ByteBuffer.allocate(4 * values.size).order(ByteOrder.LITTLE_ENDIAN)
    buffer.asFloatBuffer().put(values)
    return buffer.array()
}
