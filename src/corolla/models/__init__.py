"""Model families: our own block and client-head implementations, and the generic backend (the installed
transformers' own decoder layers) for the other decoder-only model types; ``get_family(config)`` picks one."""

from corolla.models.registry import (
    ModelFamily,
    UnsupportedModelError,
    generic_family,
    get_family,
    models_table,
    supported_model_types,
)

__all__ = [
    "ModelFamily", "UnsupportedModelError", "generic_family", "get_family", "models_table", "supported_model_types",
]
