"""GPU benchmarks (H200): kernels, the engine end to end, the public API, two-GPU P/D."""
