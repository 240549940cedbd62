package org.example.bundleclassifier

import android.graphics.Bitmap
import android.graphics.BitmapFactory
import android.net.Uri
import android.os.Bundle
import android.util.Log
import android.widget.Button
import android.widget.ImageView
import android.widget.LinearLayout
import android.widget.TextView
import androidx.activity.ComponentActivity
import androidx.activity.result.contract.ActivityResultContracts
import java.util.concurrent.Executors

/**
 * Pick an image and run the bundled model on it: a classifier shows (and logs) the top-5 classes, a
 * segmenter the mask over the image and each class's share of the pixels, a detector the boxes over the
 * image and each object's class, score and box. "Self-test" (or launching with `--ez selftest true`) checks the
 * bundle's ExecuTorch golden programs (.bpte) on this phone ([SelfTest]) and logs PASSED/FAILED per artifact.
 * Launching with `--es runtime litert` (or `executorch`) runs only that runtime's files, over the build's
 * `-Pruntime` (BuildConfig.RUNTIME, empty: the first file of bundle.json's order that loads).
 */
class MainActivity : ComponentActivity() {
    private lateinit var output: TextView
    private lateinit var picture: ImageView
    private val worker = Executors.newSingleThreadExecutor()
    private val classifier by lazy {
        BundleClassifier(applicationContext, intent.getStringExtra("runtime") ?: BuildConfig.RUNTIME)
    }
    private val pickImage = registerForActivityResult(ActivityResultContracts.GetContent()) { uri -> uri?.let(::classify) }

    override fun onCreate(savedInstanceState: Bundle?) {
        super.onCreate(savedInstanceState)
        output = TextView(this).apply { setPadding(32, 32, 32, 32) }
        picture = ImageView(this).apply { adjustViewBounds = true }
        val pick = Button(this).apply {
            text = "Pick an image"
            setOnClickListener { pickImage.launch("image/*") }
        }
        val selfTest = Button(this).apply {
            text = "Self-test (.bpte)"
            setOnClickListener { selfTest() }
        }
        setContentView(LinearLayout(this).apply {
            orientation = LinearLayout.VERTICAL
            addView(pick)
            addView(selfTest)
            addView(picture)
            addView(output)
        })
        if (intent.getBooleanExtra("selftest", false)) selfTest()
    }

    /** Every .bpte of the bundle run here and held to its rtol/atol; one log line per artifact and a verdict. */
    private fun selfTest() {
        output.text = "Self-test…"
        picture.setImageDrawable(null)
        worker.execute {
            val results = try {
                SelfTest(applicationContext).run()
            } catch (e: Exception) {
                listOf(SelfTestResult("bundle", "bundle.json", false, 0, "${e.javaClass.simpleName}: ${e.message}"))
            }
            results.forEach { Log.i(SELF_TEST_TAG, it.toString()) }
            val verdict = when {
                results.isEmpty() -> "SELFTEST NONE: the bundle has no .bpte"
                results.all { it.passed } -> "SELFTEST PASSED"
                else -> "SELFTEST FAILED"
            }
            Log.i(SELF_TEST_TAG, verdict)
            val text = (results.map { it.toString() } + verdict).joinToString("\n")
            runOnUiThread { output.text = text }
        }
    }

    private fun classify(uri: Uri) {
        output.text = "Running…"
        picture.setImageDrawable(null)
        worker.execute {
            var shown: Bitmap? = null
            val text = try {
                val bitmap = contentResolver.openInputStream(uri).use { BitmapFactory.decodeStream(it) }
                    ?: throw IllegalArgumentException("cannot decode $uri")
                val rows = when (classifier.taskName) {
                    "segmentation" -> {
                        val segmentation = classifier.segment(bitmap)
                        shown = classifier.overlay(bitmap, segmentation)
                        segmentation.fractions.map { (label, share) -> "%6.2f%%  %s".format(share * 100, label) }
                    }
                    "detection" -> {
                        val detections = classifier.detect(bitmap)
                        shown = classifier.drawBoxes(bitmap, detections)
                        detections.map {
                            "%6.2f%%  %s  [%s]".format(it.score * 100, classifier.labelOf(it), it.box.joinToString { v -> "%.1f".format(v) })
                        }
                    }
                    else -> {
                        shown = bitmap
                        classifier.top5(bitmap).map { (label, share) -> "%6.2f%%  %s".format(share * 100, label) }
                    }
                }
                buildString {
                    appendLine(classifier.artifactName)
                    rows.forEach { appendLine(it) }
                }
            } catch (e: Exception) {
                "Error: ${e.message}"
            }
            Log.i(TAG, text)
            runOnUiThread {
                output.text = text
                picture.setImageBitmap(shown)
            }
        }
    }

    override fun onDestroy() {
        worker.shutdown()
        super.onDestroy()
    }

    private companion object {
        const val TAG = "BundleClassifier"
        const val SELF_TEST_TAG = "BundleSelfTest"
    }
}
