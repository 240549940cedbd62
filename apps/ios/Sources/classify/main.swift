import ExporterBundle
import Foundation

// swift run classify BUNDLE_DIR IMAGE...   (macOS: Core ML runs there too)
let arguments = Array(CommandLine.arguments.dropFirst())
guard arguments.count >= 2 else {
    FileHandle.standardError.write(Data("usage: classify BUNDLE_DIR IMAGE...\n".utf8))
    exit(2)
}
do {
    let classifier = try await BundleClassifier(bundle: URL(fileURLWithPath: arguments[0]))
    print("model: \(classifier.artifactName)")
    for path in arguments.dropFirst() {
        print(path)
        for (label, probability) in try classifier.top5(imageAt: URL(fileURLWithPath: path)) {
            print("  \(String(format: "%6.2f", probability * 100))%  \(label)")
        }
    }
} catch {
    FileHandle.standardError.write(Data("error: \(error)\n".utf8))
    exit(2)
}
