import groovy.json.JsonSlurper

plugins {
    id("com.android.application")
    id("org.jetbrains.kotlin.android")
}

// The bundle `exporter bundle OUT_DIR` wrote for the android target: its files become the app's
// assets, and its bundle.json names the ExecuTorch release the .pte files were exported with,
// which is the runtime release the app links.
val bundleDir = file(
    providers.gradleProperty("bundle").orNull ?: throw GradleException("pass -Pbundle=/path/to/OUT/bundle/android"),
)

@Suppress("UNCHECKED_CAST")
val executorchVersion = (JsonSlurper().parse(bundleDir.resolve("bundle.json")) as Map<String, Any?>)
    .let { it["artifacts"] as List<Map<String, Any?>> }
    .first { it["format"] == "executorch" }
    .let { (it["runtime"] as Map<String, Any?>)["executorch"] as String }

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
    }
    sourceSets["main"].assets.srcDir(bundleDir)
    compileOptions {
        sourceCompatibility = JavaVersion.VERSION_17
        targetCompatibility = JavaVersion.VERSION_17
    }
    kotlinOptions { jvmTarget = "17" }
}

dependencies {
    implementation("org.pytorch:executorch-android:$executorchVersion")
    implementation("androidx.activity:activity-ktx:1.9.3")
}
