"""Text for the demo family and the prefixes and samples calibration and evaluation run on (no Ray)."""
