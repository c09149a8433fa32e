"""Model families: our own block and client-head implementations, found by ``get_family(config)``."""

from corolla.models.registry import ModelFamily, UnsupportedModelError, get_family, supported_model_types

__all__ = ["ModelFamily", "UnsupportedModelError", "get_family", "supported_model_types"]
