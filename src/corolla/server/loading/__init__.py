"""Loading a server's blocks: how many fit and which tensors to read (`blocks`: quantized, tensor-parallel), peft
LoRA adapters (`adapters`), and the compute dtype (`dtype_choice`).

May import: cache, compute.
"""
