"""The generic backend: any decoder-only model of the installed transformers whose layers fit, served by calling
its own decoder layer classes (generic.adapter) on corolla's caches (generic.kv), with a client head built from its
own embedding, norm and LM head modules (generic.head). ``generic_parts(config)`` describes one config for the
registry, or raises ``UnsupportedArchitecture`` naming what does not fit."""

from corolla.models.generic.architecture import GenericArchitecture, UnsupportedArchitecture, inspect_architecture
from corolla.models.generic.block import LAYER, GenericBlock
from corolla.models.generic.head import GenericClientHead
from corolla.models.generic.kv import cache_length, ring_slots

__all__ = [
    "LAYER",
    "GenericArchitecture",
    "GenericBlock",
    "GenericClientHead",
    "UnsupportedArchitecture",
    "cache_length",
    "inspect_architecture",
    "ring_slots",
]
