"""The math of a request: the hosted blocks (`block_stack`), forward and backward passes of a span with deep prompts
(`forward_backward`), the pure plan of one inference step (`planner`), padded batches and beam reorders (`padding`),
the scheduler carrying plans out (`scheduling`) on the batching compute thread (`worker`), LoRA adapters bound to
calls (`adapter_calls`), tensor parallelism, and emulating another kind of server for spot checks (`emulation`).

May import: cache.
"""
