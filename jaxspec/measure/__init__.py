"""Measurement through the engines' pieces: MagicDec's cost model, the time split, SwiftSpec's
split chooser, the benchmark runner and its peers."""
