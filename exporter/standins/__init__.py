"""Really trained offline models (scikit-learn's digits) that stand in for downloaded weights in the demo and tests.

Not on the product's path: a build never imports this package."""
