package org.example.bundleclassifier

import android.content.Context
import org.json.JSONObject
import org.pytorch.executorch.EValue
import org.pytorch.executorch.Module
import org.pytorch.executorch.Tensor
import java.io.File
import kotlin.math.abs

/** One artifact's self-test: its `.bpte` run on this phone and held to the bundle's rtol/atol. */
data class SelfTestResult(val artifact: String, val file: String, val passed: Boolean, val cases: Int, val error: String?) {
    override fun toString() = "${if (passed) "PASSED" else "FAILED"} $artifact ($file, $cases cases)" + (error?.let { ": $it" } ?: "")
}

/**
 * The bundle's ExecuTorch golden programs (`.bpte`, bundle.json `artifacts[].bundled_program`) checked on this
 * phone: for every case, the program the `.bpte` holds runs the case's input with this app's ExecuTorch
 * runtime, and each output element must satisfy ExecuTorch's own rule (`verify_method_outputs`, C++
 * `elem_is_close`): |out − expected| <= atol + |rtol × out|, NaN equal to NaN, an infinity equal to the same
 * infinity, with the rtol/atol bundle.json gives (derived by the build from what it measured).
 *
 * ExecuTorch's Android library (`org.pytorch:executorch-android`) has no binding for bundled programs: its
 * `Module` loads, runs and dumps a program, nothing more, and `verify_method_outputs` is C++ in ExecuTorch's
 * devtools, not in the AAR. So this reads the `.bpte` itself (a FlatBuffer; [Bpte], a port of
 * `exporter/formats/bundled_program.py`'s `read`) and applies the verifier's rule in Kotlin. The build ran
 * ExecuTorch's verifier itself on the same file, on x86 and on emulated ARM CPUs (bundle.json `verified`).
 * Not compiled here (no Android SDK on the exporter's host).
 */
class SelfTest(private val context: Context) {
    private val bundle = JSONObject(context.assets.open("bundle.json").bufferedReader().use { it.readText() })

    /** Every artifact that has a `.bpte`, in bundle.json's order; empty when the bundle has none. */
    fun run(): List<SelfTestResult> {
        val artifacts = bundle.getJSONArray("artifacts")
        return (0 until artifacts.length()).map { artifacts.getJSONObject(it) }
            .filter { it.optJSONObject("bundled_program") != null }
            .map { check(it.getString("name"), it.getJSONObject("bundled_program")) }
    }

    private fun check(name: String, spec: JSONObject): SelfTestResult {
        val file = spec.getString("file")
        val rtol = spec.getDouble("rtol")
        val atol = spec.getDouble("atol")
        var module: Module? = null
        var cases = 0
        return try {
            val bpte = Bpte.read(context.assets.open(file).use { it.readBytes() })
            cases = bpte.cases.size
            // the program inside the .bpte (the .pte it was made from, byte for byte) is what gets run
            val program = File(context.cacheDir, "$file.pte")
            program.writeBytes(bpte.program)
            val loaded = Module.load(program.absolutePath)
            module = loaded
            loaded.loadMethod(bpte.method) // throws ExecutorchRuntimeException (a RuntimeException) with the error code
            for ((i, case) in bpte.cases.withIndex()) {
                val inputs = case.inputs.map {
                    EValue.from(if (it.bytes != null) Tensor.fromBlobUnsigned(it.bytes, it.sizes) else Tensor.fromBlob(it.floats!!, it.sizes))
                }
                val outputs = loaded.execute(bpte.method, *inputs.toTypedArray())
                if (outputs.size != case.expected.size) {
                    return SelfTestResult(name, file, false, cases, "case $i: ${outputs.size} outputs, ${case.expected.size} expected")
                }
                for ((k, expected) in case.expected.withIndex()) {
                    val out = outputs[k].toTensor().dataAsFloatArray
                    val values = expected.floats ?: return SelfTestResult(name, file, false, cases, "case $i: output $k expected as uint8")
                    mismatch(out, values, rtol, atol)?.let {
                        return SelfTestResult(name, file, false, cases, "case $i of $cases, output $k: $it (rtol $rtol, atol $atol)")
                    }
                }
            }
            SelfTestResult(name, file, true, cases, null)
        } catch (e: Exception) {
            SelfTestResult(name, file, false, cases, "${e.javaClass.simpleName}: ${e.message}")
        } finally {
            module?.destroy()
        }
    }

    companion object {
        /** Null when every element passes ExecuTorch's rule; else the worst element and how many fail. */
        fun mismatch(out: FloatArray, expected: FloatArray, rtol: Double, atol: Double): String? {
            if (out.size != expected.size) return "${out.size} elements, ${expected.size} expected"
            var outside = 0
            var worst = -1
            var worstExcess = Double.NEGATIVE_INFINITY
            for (j in out.indices) {
                val a = out[j].toDouble()
                val b = expected[j].toDouble()
                if (a.isNaN() && b.isNaN()) continue
                if (a.isInfinite() && b.isInfinite() && (a > 0) == (b > 0)) continue
                val error = abs(a - b)
                val allowed = atol + abs(rtol * a)
                if (!error.isFinite() || error > allowed) {
                    outside++
                    val excess = if (error.isFinite()) error - allowed else Double.POSITIVE_INFINITY
                    if (excess > worstExcess) { worstExcess = excess; worst = j }
                }
            }
            if (outside == 0) return null
            return "element $worst: |out - expected| %.3g where %.3g is allowed; %d of %d elements outside".format(
                abs(out[worst].toDouble() - expected[worst].toDouble()), atol + abs(rtol * out[worst]), outside, out.size)
        }
    }
}
