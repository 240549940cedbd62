package org.example.bundleclassifier

import android.graphics.BitmapFactory
import android.net.Uri
import android.os.Bundle
import android.util.Log
import android.widget.Button
import android.widget.LinearLayout
import android.widget.TextView
import androidx.activity.ComponentActivity
import androidx.activity.result.contract.ActivityResultContracts
import java.util.concurrent.Executors

/** Pick an image, classify it with the bundled model, show (and log) the top-5 classes. */
class MainActivity : ComponentActivity() {
    private lateinit var output: TextView
    private val worker = Executors.newSingleThreadExecutor()
    private val classifier by lazy { BundleClassifier(applicationContext) }
    private val pickImage = registerForActivityResult(ActivityResultContracts.GetContent()) { uri -> uri?.let(::classify) }

    override fun onCreate(savedInstanceState: Bundle?) {
        super.onCreate(savedInstanceState)
        output = TextView(this).apply { setPadding(32, 32, 32, 32) }
        val pick = Button(this).apply {
            text = "Pick an image"
            setOnClickListener { pickImage.launch("image/*") }
        }
        setContentView(LinearLayout(this).apply {
            orientation = LinearLayout.VERTICAL
            addView(pick)
            addView(output)
        })
    }

    private fun classify(uri: Uri) {
        output.text = "Running…"
        worker.execute {
            val text = try {
                val bitmap = contentResolver.openInputStream(uri).use { BitmapFactory.decodeStream(it) }
                    ?: throw IllegalArgumentException("cannot decode $uri")
                val top = classifier.top5(bitmap)
                buildString {
                    appendLine(classifier.artifactName)
                    top.forEach { (label, probability) -> appendLine("%6.2f%%  %s".format(probability * 100, label)) }
                }
            } catch (e: Exception) {
                "Error: ${e.message}"
            }
            Log.i(TAG, text)
            runOnUiThread { output.text = text }
        }
    }

    override fun onDestroy() {
        worker.shutdown()
        super.onDestroy()
    }

    private companion object {
        const val TAG = "BundleClassifier"
    }
}
