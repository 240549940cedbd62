package org.example.bundleclassifier

import org.pytorch.executorch.EValue
import org.pytorch.executorch.Module
import org.pytorch.executorch.Tensor
import org.tensorflow.lite.Interpreter
import java.io.File
import java.nio.ByteBuffer
import java.nio.ByteOrder
import java.nio.FloatBuffer

/** A float32 tensor, row-major (a model's output, or a float32-nchw input: 1 x 3 x H x W). */
class FloatTensor(val shape: LongArray, val data: FloatArray)

/**
 * An artifact's image input, as bundle.json's artifacts[].input says it takes it: float32 NCHW, normalized by the
 * app, or (uint8-nhwc) the resized RGB bytes, 1 x H x W x 3, which the graph scales and normalizes itself.
 */
sealed class ModelInput(val shape: LongArray) {
    class Floats(val tensor: FloatTensor) : ModelInput(tensor.shape)
    class Bytes(shape: LongArray, val data: ByteArray) : ModelInput(shape)
}

/** One loaded model file: the preprocessed input in, its raw float outputs out, in the model's order. */
interface ModelRunner : AutoCloseable {
    fun run(input: ModelInput): List<FloatTensor>
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

    override fun run(input: ModelInput): List<FloatTensor> {
        val tensor = when (input) {
            is ModelInput.Floats -> Tensor.fromBlob(input.tensor.data, input.shape)
            is ModelInput.Bytes -> Tensor.fromBlobUnsigned(input.data, input.shape) // dtype uint8
        }
        return module.forward(EValue.from(tensor)).map {
            val tensor = it.toTensor()
            FloatTensor(tensor.shape(), tensor.dataAsFloatArray)
        }
    }

    override fun close() = module.destroy()
}

/**
 * A `.tflite` in LiteRT's `Interpreter`: `org.tensorflow.lite.Interpreter`, which the LiteRT 2.x AAR
 * (`com.google.ai.edge.litert:litert`) still ships beside its CompiledModel API, CPU only. It is the interpreter
 * the build validated the file with (ai-edge-litert's, in Python), and like it applies the XNNPACK delegate unless
 * told not to (`InterpreterApi.Options.getUseXNNPACK`: unset means on).
 *
 * [inputShape], [inputBytes] and [outputNames] are bundle.json's `runtime.io` of the file: an input of exactly that
 * shape (no resize), uint8 NHWC when [inputBytes], else float32 NCHW, and float32 outputs in the order the build
 * read them, found by tensor name (the interpreter's own output order need not be the signature's).
 */
class LiteRtRunner(
    file: File,
    private val inputShape: IntArray,
    private val inputBytes: Boolean,
    outputNames: List<String>
) : ModelRunner {
    private val interpreter = Interpreter(file, Interpreter.Options().setNumThreads(THREADS))
    private val outputs = try {
        outputNames.map { interpreter.getOutputIndex(it) }
    } catch (e: IllegalArgumentException) {
        interpreter.close()
        throw e
    }

    // the interpreter copies a direct, native-order buffer as it is; its capacity must be the tensor's exactly
    private val inputBuffer =
        ByteBuffer.allocateDirect((if (inputBytes) 1 else 4) * inputShape.fold(1, Int::times)).order(ByteOrder.nativeOrder())

    override fun run(input: ModelInput): List<FloatTensor> {
        require(input.shape.map(Long::toInt) == inputShape.toList()) {
            "the .tflite takes ${inputShape.joinToString(" x ")}; the preprocessing made ${input.shape.joinToString(" x ")}"
        }
        require((input is ModelInput.Bytes) == inputBytes) {
            "the .tflite takes ${if (inputBytes) "uint8 NHWC" else "float32 NCHW"}; the preprocessing made the other"
        }
        inputBuffer.rewind()
        when (input) {
            is ModelInput.Bytes -> inputBuffer.put(input.data)
            is ModelInput.Floats -> inputBuffer.asFloatBuffer().put(input.tensor.data)
        }
        inputBuffer.rewind()
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
