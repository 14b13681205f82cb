"""Engine benchmarks: the CPU engine against transformers, host overhead per step, the C
decode kernel, speculative decoding, tensor-parallel steps."""
