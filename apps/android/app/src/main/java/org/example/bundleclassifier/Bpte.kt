package org.example.bundleclassifier

import java.nio.ByteBuffer
import java.nio.ByteOrder

/** A tensor of a `.bpte`: its sizes and its elements, float32 or (a uint8-nhwc program's input) uint8. */
class BpteTensor(val sizes: LongArray, val floats: FloatArray?, val bytes: ByteArray?) {
    val count: Int get() = floats?.size ?: bytes!!.size
}

class BpteCase(val inputs: List<BpteTensor>, val expected: List<BpteTensor>)

class Bpte(val version: Long, val method: String, val cases: List<BpteCase>, val program: ByteArray) {
    /**
     * A reader of ExecuTorch's BundledProgram FlatBuffer (schema `bundled_program_schema.fbs`, file identifier
     * "BP08"), only as far as our `.bpte` files go: the first method test suite, float32 and uint8 tensor values.
     * FlatBuffers: little-endian; a table starts with an int32 back-offset to its vtable, whose uint16 entries
     * (after two uint16 sizes) give each field's offset in the table (0: absent); references are uint32
     * forward offsets; a vector is a uint32 length then its elements.
     */
    companion object {
        private const val BYTE = 0 // executorch_flatbuffer.ScalarType.BYTE (uint8): the default, so often absent
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
                require(scalar == FLOAT || scalar == BYTE) { "only float32 and uint8 tensors are read (scalar type $scalar)" }
                val (sizesAt, rank) = vector(t, 1)
                val sizes = LongArray(rank) { b.getInt(sizesAt + 4 * it).toLong() }
                val (dataAt, n) = vector(t, 2)
                val read = if (scalar == FLOAT) {
                    BpteTensor(sizes, FloatArray(n / 4) { b.getFloat(dataAt + 4 * it) }, null)
                } else {
                    BpteTensor(sizes, null, bytes.copyOfRange(dataAt, dataAt + n))
                }
                require(read.count.toLong() == sizes.fold(1L) { p, s -> p * s }) { "tensor data does not match its sizes" }
                return read
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
