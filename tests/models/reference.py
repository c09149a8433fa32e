"""Test helpers shared by the family tests: HF reference models, our blocks and head loaded through the
registry, token ids, KV caches, running a stack of blocks, and per-family adapters that say where each
family's HF model keeps its layers, norms and embeddings.

Imported by the tests in this folder as ``from reference import ...`` (pytest puts this folder on
``sys.path``, as it does ``tests/`` for ``conftest``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from operator import attrgetter

import torch
from torch import Tensor, nn
from transformers import (
    AutoModelForCausalLM,
    BloomConfig,
    FalconConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

from corolla.models import get_family

ATOL = 1e-5  # float32 tolerance against the HF reference
# Per-layer outputs reach |x| ~ 6-9 here, where one float32 ulp is ~5e-7: kernels that sum in another order (other
# CPUs, thread counts) may differ by tens of ulps. Allowed on top of ATOL in the per-layer check only; a wrong slope,
# split, mask or residual is off by 1e-2 or more.
LAYER_RTOL = 1e-5
VOCAB = 128  # vocabulary of the tiny test configs
Caches = list[tuple[Tensor, Tensor]]  # one (k_cache, v_cache) per block, each (B, n_kv_heads, S_max, head_dim)
TINY_BASE = dict(vocab_size=64, hidden_size=64, num_attention_heads=4, initializer_range=0.1)
TINY_LLAMA = dict(TINY_BASE, intermediate_size=96, num_hidden_layers=2, num_key_value_heads=2)
# one tiny config per family variant, for the tests that run every family's blocks
FAMILY_CONFIGS = {
    "llama": LlamaConfig(**TINY_LLAMA),
    "mistral-window3": MistralConfig(**TINY_LLAMA, sliding_window=3),
    "qwen2": Qwen2Config(**TINY_LLAMA),
    "qwen3": Qwen3Config(**TINY_LLAMA, head_dim=16),
    "mixtral": MixtralConfig(**TINY_LLAMA, num_local_experts=4, num_experts_per_tok=2),
    "bloom": BloomConfig(**TINY_BASE, n_layer=2),
    "falcon-7b-style": FalconConfig(**TINY_BASE, num_hidden_layers=2, multi_query=True, new_decoder_architecture=False),
    "falcon-40b-style": FalconConfig(**TINY_BASE, num_hidden_layers=2, new_decoder_architecture=True, num_kv_heads=2),
}
# prefill 7, five single steps, a 3-token chunk
DECODE_CHUNKS: tuple[tuple[int, int], ...] = ((0, 7), *((t, t + 1) for t in range(7, 12)), (12, 15))


def make_reference(config: PretrainedConfig, seed: int = 0, *, norms: str | tuple[str, ...] = "norm.weight",
                   **from_config: object) -> nn.Module:
    """HF model with eager attention, eval mode, float32, weights N(0, 0.1) and norm weights near 1.

    A parameter whose name ends with ``norms`` is a norm weight (drawn 1 + N(0, 0.1)); ``from_config``
    goes on to ``AutoModelForCausalLM.from_config`` (e.g. ``experts_implementation="eager"``). The weights
    are re-drawn larger than HF's init so that attention is far from uniform.
    """
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", **from_config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(norms):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.1)
    return model


@dataclass(frozen=True)
class FamilyAdapter:
    """Where one family's HF model and our client head keep what the family-generic tests reach into."""

    layers: str  # attribute path of the HF decoder layers in the model, e.g. "model.layers"
    final_norm: str  # attribute path of the HF final norm, e.g. "model.norm"
    head_embedding: str  # our client head's embedding module, e.g. "embed_tokens"
    not_head_tensors: tuple[str, ...] = ()  # names outside the HF state dict that is_head_tensor must reject
    reference_kwargs: Mapping[str, object] = dataclasses.field(default_factory=dict)  # for make_reference
    embedding_norm: str | None = None  # attribute path of a LayerNorm HF applies to the embeddings (BLOOM)
    rotary: bool = True  # False: relative positions (ALiBi), so a position offset leaves HF's logits unchanged

    def hf_layers(self, model: nn.Module) -> Sequence[nn.Module]:
        """The HF model's decoder layers, in order."""
        return attrgetter(self.layers)(model)

    def hf_embed(self, model: nn.Module, ids: Tensor) -> Tensor:
        """HF's input to its first decoder layer: token ids (B, T) -> (B, T, H)."""
        hidden = model.get_input_embeddings()(ids)  # (B, T, H)
        return attrgetter(self.embedding_norm)(model)(hidden) if self.embedding_norm else hidden

    def hf_logits(self, model: nn.Module, hidden: Tensor) -> Tensor:
        """HF's final norm and LM head: hidden states (B, T, H) -> logits (B, T, V)."""
        return model.lm_head(attrgetter(self.final_norm)(model)(hidden))

    def hf_logits_at(self, model: nn.Module, ids: Tensor, position: int) -> Tensor:
        """HF's logits (B, T, V) for token ids (B, T) placed at positions ``[position, position + T)``."""
        if not self.rotary:
            return model(ids).logits
        B, T = ids.shape
        return model(ids, position_ids=torch.arange(position, position + T)[None].expand(B, -1)).logits


LLAMA_ADAPTER = FamilyAdapter(layers="model.layers", final_norm="model.norm", head_embedding="embed_tokens")
# keyed by config.model_type, so that picking the adapter does not rely on the registry under test
ADAPTERS: dict[str, FamilyAdapter] = {
    "llama": LLAMA_ADAPTER, "mistral": LLAMA_ADAPTER, "qwen2": LLAMA_ADAPTER, "qwen3": LLAMA_ADAPTER,
    "mixtral": dataclasses.replace(  # HF's eager expert loop; the per-expert hub names are not head tensors
        LLAMA_ADAPTER, reference_kwargs={"experts_implementation": "eager"},
        not_head_tensors=("model.layers.0.block_sparse_moe.experts.0.w1.weight",)),
    "bloom": FamilyAdapter(
        layers="transformer.h", final_norm="transformer.ln_f", head_embedding="word_embeddings",
        not_head_tensors=("ln_f.weight",),  # head names are canonical: "transformer.ln_f.weight"
        reference_kwargs={"norms": ("layernorm.weight", "ln_f.weight")},
        embedding_norm="transformer.word_embeddings_layernorm", rotary=False),
    "falcon": FamilyAdapter(
        layers="transformer.h", final_norm="transformer.ln_f", head_embedding="word_embeddings",
        reference_kwargs={"norms": ("input_layernorm.weight", "post_attention_layernorm.weight", "ln_attn.weight",
                                    "ln_mlp.weight", "ln_f.weight")}),
}


def family_adapter(config: PretrainedConfig) -> FamilyAdapter:
    """The adapter for ``config``'s model type."""
    return ADAPTERS[config.model_type]


def make_family_reference(config: PretrainedConfig, seed: int = 0) -> nn.Module:
    """``make_reference`` with the family's norm names and options (e.g. Mixtral's eager expert loop)."""
    return make_reference(config, seed, **family_adapter(config).reference_kwargs)


def load_blocks(config: PretrainedConfig, state: dict[str, Tensor]) -> list[nn.Module]:
    """Our blocks in eval mode, loaded through the registry from a checkpoint under its full stored names."""
    family = get_family(config)
    state = {family.canonical_name(k): v for k, v in state.items()}
    return [family.load_block(config, i, state).eval() for i in range(family.num_blocks(config))]


def load_ours(config: PretrainedConfig, state: dict[str, Tensor]) -> tuple[list[nn.Module], nn.Module]:
    """Our blocks and head in eval mode, loaded through the registry from a checkpoint under its full stored names."""
    family = get_family(config)
    head = family.head_class(config)
    head.load_hf_state_dict({family.canonical_name(k): v for k, v in state.items()
                             if family.is_head_tensor(family.canonical_name(k))})
    return load_blocks(config, state), head.eval()


def token_ids(batch: int = 2, length: int = 15, seed: int = 1) -> Tensor:
    """Random token ids (batch, length) int64 in ``[0, VOCAB)``, the same for the same arguments."""
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def make_caches(config: PretrainedConfig, batch: int, s_max: int, dtype: torch.dtype = torch.float32) -> Caches:
    """Zeroed KV caches for every block of ``config``, laid out as the family's ``kv_layout`` says."""
    n_kv_heads, head_dim = get_family(config).kv_layout(config)
    return [(torch.zeros(batch, n_kv_heads, s_max, head_dim, dtype=dtype),
             torch.zeros(batch, n_kv_heads, s_max, head_dim, dtype=dtype))
            for _ in range(config.num_hidden_layers)]


def run_blocks(blocks: Sequence[nn.Module], hidden: Tensor, caches: Caches | None = None, position: int = 0) -> Tensor:
    """Hidden states (B, T, H) through every block, block i using ``caches[i]`` (or no cache)."""
    for i, block in enumerate(blocks):
        hidden = block(hidden, caches[i] if caches is not None else None, position)
    return hidden


def run_stack(blocks: Sequence[nn.Module], head: nn.Module, ids: Tensor, *, position: int = 0,
              caches: Caches | None = None) -> Tensor:
    """Token ids (B, T) -> logits (B, T, V): embed, every block, then the head's logits."""
    return head.logits(run_blocks(blocks, head.embed(ids), caches, position))


def hf_layer_outputs(model: nn.Module, layers: Sequence[nn.Module], ids: Tensor) -> list[Tensor]:
    """The hidden states each HF decoder layer in ``layers`` outputs while ``model`` runs on ``ids``."""
    outputs: list[Tensor] = []
    hooks = [layer.register_forward_hook(lambda _m, _a, out: outputs.append(out[0] if isinstance(out, tuple) else out))
             for layer in layers]
    try:
        model(ids)
    finally:
        for hook in hooks:
            hook.remove()
    return outputs


def assert_blocks_match_hf_layers(model: nn.Module, layers: Sequence[nn.Module], blocks: Sequence[nn.Module],
                                  head: nn.Module) -> None:
    """Each of our blocks, fed HF's input to that layer, gives HF's layer output (within ``ATOL + LAYER_RTOL |x|``)."""
    ids = token_ids()
    outputs = hf_layer_outputs(model, layers, ids)
    inputs = [head.embed(ids), *outputs[:-1]]
    for i, block in enumerate(blocks):
        torch.testing.assert_close(block(inputs[i]), outputs[i], atol=ATOL, rtol=LAYER_RTOL, msg=lambda m: f"layer {i}: {m}")


def assert_decode_steps_match_full_sequence(model: nn.Module, blocks: Sequence[nn.Module], head: nn.Module,
                                            caches: Caches) -> None:
    """Feeding 15 tokens in ``DECODE_CHUNKS`` through ``caches`` gives HF's full-sequence logits (within ``ATOL``)."""
    ids = token_ids(length=15)
    expected = model(ids).logits  # (B, 15, V)
    for start, end in DECODE_CHUNKS:
        got = run_stack(blocks, head, ids[:, start:end], position=start, caches=caches)
        torch.testing.assert_close(got, expected[:, start:end], atol=ATOL, rtol=0,
                                   msg=lambda m: f"tokens [{start}, {end}): {m}")


def assert_bfloat16_close_to_hf(model_bf16: nn.Module, chunks: Sequence[tuple[int, int]] = ((0, 8), (8, 15))) -> None:
    """Our stack loaded from a bfloat16 HF model runs in bfloat16 and stays close to that model's logits,
    both on the whole 15 tokens and fed in ``chunks`` through bfloat16 caches (atol 0.1, rtol 0.05)."""
    blocks, head = load_ours(model_bf16.config, model_bf16.state_dict())
    blocks, head = [b.to(torch.bfloat16) for b in blocks], head.to(torch.bfloat16)
    ids = token_ids()
    got = run_stack(blocks, head, ids)
    assert got.dtype == torch.bfloat16
    caches = make_caches(model_bf16.config, batch=2, s_max=16, dtype=torch.bfloat16)
    stepped = torch.cat([run_stack(blocks, head, ids[:, start:end], position=start, caches=caches)
                         for start, end in chunks], dim=1)
    expected = model_bf16(ids).logits.float()
    torch.testing.assert_close(got.float(), expected, atol=0.1, rtol=0.05)
    torch.testing.assert_close(stepped.float(), expected, atol=0.1, rtol=0.05)


@contextlib.contextmanager
def assert_unchanged(module: nn.Module) -> Iterator[None]:
    """Assert on exit that ``module``'s state dict equals, bit for bit, what it was on entry."""
    before = {k: v.clone() for k, v in module.state_dict().items()}
    yield
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())
