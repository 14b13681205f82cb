"""System benchmarks: what the P/D path adds, chaos under load, control-plane mTLS."""
