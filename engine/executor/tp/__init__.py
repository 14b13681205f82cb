"""Tensor parallelism: ``MultiprocExecutor`` (``executor``) is rank 0 and starts ranks
1..N-1 (``worker``, ``python -m engine.executor.tp.worker``); ``procs`` picks each rank's
device, checks the GPUs can hold the ranks and stops the workers; each step's host inputs
reach the workers as ``step_wire`` messages, and ``watch`` notices a rank lost in the
middle of a step."""
