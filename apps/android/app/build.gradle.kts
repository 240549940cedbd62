import groovy.json.JsonSlurper

plugins {
    id("com.android.application")
    id("org.jetbrains.kotlin.android")
}

// The bundle `exporter bundle OUT_DIR` wrote for the android target: its files become the app's
// assets, and its bundle.json names the ExecuTorch release the .pte files were exported with and the
// LiteRT release the .tflite files were validated with, which are the runtime releases the app links.
val bundleDir = file(
    providers.gradleProperty("bundle").orNull ?: throw GradleException("pass -Pbundle=/path/to/OUT/bundle/android"),
)

@Suppress("UNCHECKED_CAST")
val artifacts = (JsonSlurper().parse(bundleDir.resolve("bundle.json")) as Map<String, Any?>)
    .let { it["artifacts"] as List<Map<String, Any?>> }

// runtime.<key> of the bundle's first artifact of that format, null when it has none
@Suppress("UNCHECKED_CAST")
fun runtimeVersion(format: String, key: String): String? =
    artifacts.firstOrNull { it["format"] == format }?.let { (it["runtime"] as Map<String, Any?>)[key] as String? }

val executorchVersion = runtimeVersion("executorch", "executorch")
    ?: throw GradleException("$bundleDir/bundle.json has no executorch artifact: not an android bundle")

// Linked whatever the bundle holds (the app's code names LiteRT's Interpreter, so leaving the library out
// would need a second source set); for a bundle without a .tflite, at the release the exporter's [litert]
// extra brought when this was written (litert-torch 0.10.0 with ai-edge-litert 2.3.0).
val litertVersion = runtimeVersion("litert", "ai-edge-litert") ?: "2.3.0"

// -Pruntime=executorch|litert: the app runs only that runtime's files (an intent extra overrides it)
val runtime = providers.gradleProperty("runtime").orNull.orEmpty()
if (runtime !in listOf("", "executorch", "litert")) throw GradleException("-Pruntime takes executorch or litert, not $runtime")
if (runtime.isNotEmpty() && artifacts.none { it["format"] == runtime }) {
    throw GradleException("-Pruntime=$runtime: $bundleDir/bundle.json has no $runtime artifact")
}

android {
    namespace = "org.example.bundleclassifier"
    compileSdk = 35
    defaultConfig {
        applicationId = "org.example.bundleclassifier"
        minSdk = 26
        targetSdk = 35
        versionCode = 1
        versionName = "1.0"
        ndk { abiFilters += listOf("arm64-v8a", "x86_64") }
        buildConfigField("String", "RUNTIME", "\"$runtime\"")
    }
    buildFeatures { buildConfig = true }
    sourceSets["main"].assets.srcDir(bundleDir)
    compileOptions {
        sourceCompatibility = JavaVersion.VERSION_17
        targetCompatibility = JavaVersion.VERSION_17
    }
    kotlinOptions { jvmTarget = "17" }
}

dependencies {
    implementation("org.pytorch:executorch-android:$executorchVersion")
    implementation("com.google.ai.edge.litert:litert:$litertVersion") // Google's Maven, not Maven Central
    implementation("androidx.activity:activity-ktx:1.9.3")
}
