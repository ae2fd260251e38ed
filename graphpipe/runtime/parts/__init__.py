"""The parts that run inside a step for a composition: each hooks into the step's core.

``accumulation`` (``no_sync`` windows), ``data_parallel`` (gradient and loss averaging over
replicas), ``fsdp`` (FSDP2-sharded stages), ``tied`` (weights tied across pipeline ranks),
``clipping`` (the global gradient norm). Each imports the core and coordination, never another
part: the facade (``runtime.pipeline``) wires them together.
"""
