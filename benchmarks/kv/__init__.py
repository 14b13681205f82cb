"""KV benchmarks: connector throughput, the record MAC, p2p handoff, FP8 KV accuracy."""
