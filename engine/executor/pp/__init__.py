"""Pipeline parallelism: the layers split into P stages over a P × N grid of processes
(``executor``: rank 0, the engine's process; ``worker``: every other process)."""
