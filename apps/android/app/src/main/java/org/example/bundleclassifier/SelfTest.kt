package org.example.bundleclassifier

import android.content.Context
import org.json.JSONObject
import org.pytorch.executorch.EValue
import org.pytorch.executorch.Module
import org.pytorch.executorch.Tensor
import java.io.File
import java.nio.ByteBuffer
import java.nio.ByteOrder
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
                val inputs = case.inputs.map { EValue.from(Tensor.fromBlob(it.data, it.sizes)) }
                val outputs = loaded.execute(bpte.method, *inputs.toTypedArray())
                if (outputs.size != case.expected.size) {
                    return SelfTestResult(name, file, false, cases, "case $i: ${outputs.size} outputs, ${case.expected.size} expected")
                }
                for ((k, expected) in case.expected.withIndex()) {
                    val out = outputs[k].toTensor().dataAsFloatArray
                    mismatch(out, expected.data, rtol, atol)?.let {
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

/** A float32 tensor of a `.bpte`: its sizes and its elements. */
class BpteTensor(val sizes: LongArray, val data: FloatArray)

class BpteCase(val inputs: List<BpteTensor>, val expected: List<BpteTensor>)

class Bpte(val version: Long, val method: String, val cases: List<BpteCase>, val program: ByteArray) {
    /**
     * A reader of ExecuTorch's BundledProgram FlatBuffer (schema `bundled_program_schema.fbs`, file identifier
     * "BP08"), only as far as our `.bpte` files go: the first method test suite, float32 tensor values.
     * FlatBuffers: little-endian; a table starts with an int32 back-offset to its vtable, whose uint16 entries
     * (after two uint16 sizes) give each field's offset in the table (0: absent); references are uint32
     * forward offsets; a vector is a uint32 length then its elements.
     */
    companion object {
        private const val FLOAT = 6 // executorch_flatbuffer.ScalarType.FLOAT
        private const val TENSOR = 1 // ValueUnion.Tensor

        fun read(bytes: ByteArray): Bpte {
            val b = ByteBuffer.wrap(bytes).order(ByteOrder.LITTLE_ENDIAN)
            require(bytes.size > 8 && String(bytes, 4, 4, Charsets.US_ASCII) == "BP08") { "not a bundled program (no BP08 identifier)" }
            fun u32(at: Int): Int = b.getInt(at)
            fun ref(at: Int): Int = at + u32(at)
            fun field(table: Int, k: Int): Int? {
                val vtable = table - b.getInt(table)
                if (4 + 2 * k >= (b.getShort(vtable).toInt() and 0xffff)) return null
                val offset = b.getShort(vtable + 4 + 2 * k).toInt() and 0xffff
                return if (offset == 0) null else table + offset
            }
            fun vector(table: Int, k: Int): Pair<Int, Int> = field(table, k)?.let { ref(it) + 4 to u32(ref(it)) } ?: (0 to 0)
            fun tables(table: Int, k: Int): List<Int> = vector(table, k).let { (start, n) -> (0 until n).map { ref(start + 4 * it) } }
            fun tensor(value: Int): BpteTensor {
                val kind = field(value, 0)?.let { b.get(it).toInt() } ?: 0
                require(kind == TENSOR) { "only tensor values are read (value type $kind)" }
                val t = ref(field(value, 1)!!)
                val scalar = field(t, 0)?.let { b.get(it).toInt() } ?: 0
                require(scalar == FLOAT) { "only float32 tensors are read (scalar type $scalar)" }
                val (sizesAt, rank) = vector(t, 1)
                val sizes = LongArray(rank) { b.getInt(sizesAt + 4 * it).toLong() }
                val (dataAt, n) = vector(t, 2)
                val data = FloatArray(n / 4) { b.getFloat(dataAt + 4 * it) }
                require(data.size.toLong() == sizes.fold(1L) { p, s -> p * s }) { "tensor data does not match its sizes" }
                return BpteTensor(sizes, data)
            }

            val root = u32(0)
            val version = field(root, 0)?.let { u32(it).toLong() and 0xffffffffL } ?: 0L
            val suite = tables(root, 1).firstOrNull() ?: throw IllegalArgumentException("the bundled program holds no test suite")
            val nameAt = ref(field(suite, 0)!!)
            val method = String(bytes, nameAt + 4, u32(nameAt), Charsets.UTF_8)
            val cases = tables(suite, 1).map { case -> BpteCase(tables(case, 0).map(::tensor), tables(case, 1).map(::tensor)) }
            val (programAt, programSize) = vector(root, 2)
            return Bpte(version, method, cases, bytes.copyOfRange(programAt, programAt + programSize))
        }
    }
}
