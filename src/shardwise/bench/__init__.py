"""Benchmarks: ours and the torch rival in the same run, interleaved; ratios and one JSON line."""
