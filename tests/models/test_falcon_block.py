"""What is specific to Falcon: the configurations we reject with a clear error (ALiBi Falcon, and layouts
HF itself cannot run).

The checks every family shares (blocks, stack, decoding, loading, head, registry, across the 7B, 40B, 11B
and multi-head layouts) are in ``test_family_blocks.py``; the cases are in ``block_cases.py``.
"""

from __future__ import annotations

import pytest
from block_cases import falcon_config

from corolla.models.falcon import FalconBlock, FalconClientHead


def test_alibi_falcon_is_rejected_with_a_clear_error() -> None:
    config = falcon_config(alibi=True, multi_query=False)
    with pytest.raises(ValueError, match="alibi=True .* not supported"):
        FalconBlock(config, 0)
    with pytest.raises(ValueError, match="alibi=True .* not supported"):
        FalconClientHead(config)


@pytest.mark.parametrize("overrides, message", [
    ({"new_decoder_architecture": True, "num_kv_heads": 2, "parallel_attn": False}, "parallel_attn=False"),
    ({"num_ln_in_parallel_attn": 2}, "needs new_decoder_architecture=True"),
    ({"new_decoder_architecture": True, "num_kv_heads": 3}, "not a multiple of num_kv_heads=3"),
])
def test_configs_hf_cannot_run_either_are_rejected(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FalconBlock(falcon_config(**overrides), 0)
