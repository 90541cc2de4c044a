"""Speculation: sampling, the lossless acceptance rules, token trees and the draft kinds."""
