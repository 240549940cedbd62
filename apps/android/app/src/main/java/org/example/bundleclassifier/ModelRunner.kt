package org.example.bundleclassifier

import org.pytorch.executorch.EValue
import org.pytorch.executorch.Module
import org.pytorch.executorch.Tensor
import org.tensorflow.lite.Interpreter
import java.io.File
import java.nio.ByteBuffer
import java.nio.ByteOrder
import java.nio.FloatBuffer

/** A float32 tensor, row-major, in PyTorch's layout (an image input is 1 x 3 x H x W). */
class FloatTensor(val shape: LongArray, val data: FloatArray)

/** One loaded model file: the preprocessed input in, its raw float outputs out, in the model's order. */
interface ModelRunner : AutoCloseable {
    fun run(input: FloatTensor): List<FloatTensor>
}

/** A `.pte` in ExecuTorch's `Module`, its `forward` loaded up front so that a file this runtime cannot run fails here. */
class ExecuTorchRunner(file: File) : ModelRunner {
    private val module = Module.load(file.absolutePath)

    init {
        try {
            module.loadMethod("forward") // throws ExecutorchRuntimeException (a RuntimeException) with the error code
        } catch (e: RuntimeException) {
            module.destroy()
            throw e
        }
    }

    override fun run(input: FloatTensor): List<FloatTensor> =
        module.forward(EValue.from(Tensor.fromBlob(input.data, input.shape))).map {
            val tensor = it.toTensor()
            FloatTensor(tensor.shape(), tensor.dataAsFloatArray)
        }

    override fun close() = module.destroy()
}

/**
 * A `.tflite` in LiteRT's `Interpreter`: `org.tensorflow.lite.Interpreter`, which the LiteRT 2.x AAR
 * (`com.google.ai.edge.litert:litert`) still ships beside its CompiledModel API, CPU only. It is the interpreter
 * the build validated the file with (ai-edge-litert's, in Python), and like it applies the XNNPACK delegate unless
 * told not to (`InterpreterApi.Options.getUseXNNPACK`: unset means on).
 *
 * [inputShape] and [outputNames] are bundle.json's `runtime.io` of the file: a float32 NCHW input of exactly that
 * shape (no resize), and the outputs in the order the build read them, found by tensor name (the interpreter's
 * own output order need not be the signature's).
 */
class LiteRtRunner(file: File, private val inputShape: IntArray, outputNames: List<String>) : ModelRunner {
    private val interpreter = Interpreter(file, Interpreter.Options().setNumThreads(THREADS))
    private val outputs = try {
        outputNames.map { interpreter.getOutputIndex(it) }
    } catch (e: IllegalArgumentException) {
        interpreter.close()
        throw e
    }

    // the interpreter copies a direct, native-order buffer as it is; its capacity must be the tensor's exactly
    private val inputBuffer = ByteBuffer.allocateDirect(4 * inputShape.fold(1, Int::times)).order(ByteOrder.nativeOrder())

    override fun run(input: FloatTensor): List<FloatTensor> {
        require(input.shape.map(Long::toInt) == inputShape.toList()) {
            "the .tflite takes ${inputShape.joinToString(" x ")}; the preprocessing made ${input.shape.joinToString(" x ")}"
        }
        inputBuffer.rewind()
        inputBuffer.asFloatBuffer().put(input.data)
        val results = outputs.associateWith { FloatBuffer.allocate(interpreter.getOutputTensor(it).numElements()) }
        interpreter.runForMultipleInputsOutputs(arrayOf(inputBuffer), results)
        return outputs.map { index ->
            val shape = interpreter.getOutputTensor(index).shape()
            FloatTensor(LongArray(shape.size) { shape[it].toLong() }, results.getValue(index).array())
        }
    }

    override fun close() = interpreter.close()

    private companion object {
        // LiteRT's default (-1) runs XNNPACK on one thread (kDefaultNumThreadpoolThreads in tflite/kernels/
        // cpu_backend_context.cc); 4 at most, a guess at a phone's big cores (not measured)
        val THREADS = minOf(4, Runtime.getRuntime().availableProcessors())
    }
}
