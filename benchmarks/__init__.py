"""pdserve's benchmarks, grouped by area; run each as a module from the repository root,
e.g. ``python -m benchmarks.engine.engine_cpu`` (README.md lists the current results)."""
