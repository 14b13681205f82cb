"""Tensor-parallel process groups and their collectives (``tp_group``), each with a
deadline; used by the sharded model layers, the model runner and the executor."""
