"""The distributed causal LM: local embeddings / final norm / LM head, remote transformer blocks."""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from contextlib import contextmanager
from dataclasses import replace
from typing import Iterator, Sequence

import torch
from torch import nn
from transformers import GenerationConfig, PretrainedConfig
from transformers.modeling_outputs import CausalLMOutputWithPast

from corolla.checkpoint import load_config, load_tensors
from corolla.client.config import ClientConfig
from corolla.client.event_loop import run_sync
from corolla.client.decoding.generation import generate as _generate
from corolla.client.session.inference_session import InferenceSession
from corolla.client.model.ptune import PromptTuning, make_prompt_tuning
from corolla.client.trust.referee import Referee
from corolla.client.model.sequential import RemoteSequential
from corolla.client.swarm.sequence_manager import SequenceManager
from corolla.client.trust.spot_checks import client_checks
from corolla.dht import SwarmNode, create_swarm_node, model_dht_prefix
from corolla.membership import load_swarm_key
from corolla.models import get_family

logger = logging.getLogger(__name__)

_live_nodes: "weakref.WeakSet[SwarmNode]" = weakref.WeakSet()
_atexit_lock = threading.Lock()


class DistributedModelForCausalLM(nn.Module):
    """A causal LM whose blocks run in the swarm. Call it like an HF model; `generate` takes HF arguments.

    The Hugging Face surface: `config`, `generation_config`, `device`, `dtype`, `get_input_embeddings()` /
    `set_input_embeddings()`, `get_output_embeddings()`, `model(input_ids | inputs_embeds, attention_mask, labels)`
    with HF's `.loss`, and `generate`. It also is what generation sees of a model (client.decoding.generation's
    GenerationModel: `embed`, `lm_logits`, `open_session`).
    """

    main_input_name = "input_ids"

    def __init__(self, config: PretrainedConfig, head: nn.Module, transformer: RemoteSequential, node: SwarmNode,
                 generation_config: GenerationConfig, name_or_path: str, ptune: PromptTuning | None = None):
        super().__init__()
        self.ptune = ptune  # trainable prompts (tuning_mode="ptune"/"deep_ptune"), or None
        self.config = config
        self.head = head
        self.transformer = transformer
        self.generation_config = generation_config
        self.name_or_path = name_or_path
        self._node = node
        self._active = threading.local()  # per thread: the session of the innermost `with inference_session()`

    @property
    def swarm_node(self) -> SwarmNode:
        """This model's node in the swarm (its DHT peer and P2P host, `.p2p`), e.g. to ask a server for its info;
        raises RuntimeError after `shutdown()`."""
        if self._node is None:
            raise RuntimeError("this model was shut down: it has no swarm node")
        return self._node

    @property
    def sequence_manager(self) -> SequenceManager:
        """The client's view of the swarm (client.swarm.sequence_manager): servers, routes, bans; what `corolla api` reads
        the swarm's capacity from."""
        return self.transformer.manager

    @property
    def dtype(self) -> torch.dtype:
        return next(self.head.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.head.parameters()).device

    # ------------------------------------------------------------------ embeddings
    def get_input_embeddings(self) -> nn.Embedding:
        """The token embedding table (vocab, H); its outputs are what `inputs_embeds` takes."""
        return getattr(self.head, _embedding_name(self.head))

    def set_input_embeddings(self, value: nn.Module) -> None:
        """Use `value` (ids (B, T) -> (B, T, H)) as the token embeddings; a tied LM head keeps the old table."""
        setattr(self.head, _embedding_name(self.head), value)

    def get_output_embeddings(self) -> nn.Module:
        """The LM head (H -> vocab)."""
        return self.head.lm_head

    def embed(self, input_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """The first block's input (B, T, H) for input_ids (B, T) or inputs_embeds (B, T, H), the outputs of
        get_input_embeddings() (for BLOOM, the embedding LayerNorm is applied to them, as HF's BloomModel does)."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        if input_ids is not None:
            return self.head.embed(input_ids.to(self.device))
        assert inputs_embeds is not None
        if inputs_embeds.ndim != 3:
            raise ValueError(f"inputs_embeds must have shape (batch, length, hidden), got {tuple(inputs_embeds.shape)}")
        norm = getattr(self.head, "word_embeddings_layernorm", None)
        return inputs_embeds if norm is None else norm(inputs_embeds)

    def lm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The last block's output (B, T, H) -> logits (B, T, vocab): final norm, then the LM head."""
        return self.head.logits(hidden)

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
    ) -> CausalLMOutputWithPast:
        """Full forward through the swarm (no cache): logits (B, T, vocab), from input_ids (B, T) or inputs_embeds
        (B, T, H). Differentiable w.r.t. inputs_embeds and the prompts when grad is enabled (rpc_backward).

        With `attention_mask` (B, T) of 0/1 (e.g. a left-padded batch), each row's real tokens give the logits
        that row alone would; logits at padded slots are meaningless, as in HF. With `labels` (B, T), `loss` is HF's
        causal-LM loss: mean cross-entropy (float32) of the logits at t against labels at t + 1, -100 ignored.
        """
        logits = self.lm_logits(self.block_outputs(input_ids, inputs_embeds, attention_mask))
        return CausalLMOutputWithPast(loss=None if labels is None else causal_lm_loss(logits, labels), logits=logits)

    def block_outputs(
        self,
        input_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The last block's hidden states (B, T, H) for input_ids (B, T) or inputs_embeds (B, T, H), before the
        final norm; with prompt tuning the prompts run through the blocks too and are dropped from the result."""
        hidden = self.embed(input_ids, inputs_embeds)  # (B, T, H)
        mask = None if attention_mask is None or _right_padded(attention_mask) else attention_mask
        if self.ptune is not None:
            return self.ptune.run(self.transformer, hidden, mask)
        return self.transformer(hidden, mask).to(hidden.dtype)

    # ------------------------------------------------------------------ sessions and generation
    @contextmanager
    def inference_session(
        self, max_length: int, batch_size: int = 1, active_adapter: str | None = None, standby: int | None = None
    ) -> Iterator[InferenceSession]:
        """Open a KV-cached session on the servers; `generate` inside the block uses it unless given another.

        `active_adapter` runs this session with that LoRA adapter (default: the model's, see from_pretrained).
        `standby=1` gives each span of its route a standby replica, promoted if its server fails (client.chain.standby;
        default ClientConfig.standby, 0). With prompt tuning the servers reserve pre_seq_len positions more."""
        session = self.open_session(max_length, batch_size, active_adapter, standby)
        previous = getattr(self._active, "session", None)
        self._active.session = session
        try:
            yield session
        finally:
            self._active.session = previous
            session.close()

    def open_session(self, max_length: int, batch_size: int = 1, active_adapter: str | None = None,
                     standby: int | None = None) -> InferenceSession:
        """A new InferenceSession for `max_length` tokens (the caller closes it), with `standby` replicas (0 or 1,
        default ClientConfig.standby). With prompt tuning it holds pre_seq_len positions more and carries the
        prompts (deep ones too) as they are now."""
        prefix = deep = None
        if self.ptune is not None:
            prefix = self.ptune.prompts.detach().clone()
            deep = None if self.ptune.deep_prompts is None else self.ptune.deep_prompts.detach().clone()
        return self.transformer.inference_session(
            max_length + self.prompt_length, batch_size, active_adapter, deep, prefix, standby
        )

    @property
    def prompt_length(self) -> int:
        """Positions the prompts of prompt tuning take in front of every sequence (0 without tuning)."""
        return 0 if self.ptune is None else self.ptune.pre_seq_len

    def generate(self, input_ids: torch.LongTensor | None = None, **kwargs) -> torch.LongTensor:
        """HF-style generation; see corolla.client.decoding.generation.generate for the arguments. Inside a
        `with model.inference_session(...)` block it uses that session unless given another."""
        active = getattr(self._active, "session", None)
        if kwargs.get("session") is None and active is not None:
            kwargs["session"] = active
        return _generate(self, input_ids, **kwargs)

    def reputation(self) -> dict[str, dict[str, object]]:
        """Spot checks (ClientConfig.verify_rate): this client's record per server peer id, {"passed": checks its
        outputs passed, "failed": checks that found them wrong, "distrusted": never routed through again, "last":
        unix time of its last check}. Empty while nothing was checked. `corolla status` shows the same counts, merged
        over the clients of this user (client.trust.reputation)."""
        from corolla.client.trust.spot_checks import client_checks  # spot checks: kept out of the model's imports

        return client_checks(self.transformer.manager).reputation.snapshot()

    def shutdown(self) -> None:
        """Stop this model's DHT node and p2pd (also done at interpreter exit)."""
        node = self._node
        if node is not None:
            self._node = None
            _live_nodes.discard(node)
            run_sync(self.transformer.manager.close(), timeout=10)
            run_sync(node.shutdown(), timeout=10)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """HF's causal-LM loss: logits (B, T, V) at t predict labels (B, T) at t + 1; mean float32 cross-entropy over the
    labels that are not `ignore_index` (HF pads the labels on the right and shifts them, as here)."""
    if labels.shape != logits.shape[:2]:
        raise ValueError(f"labels must have shape {tuple(logits.shape[:2])}, got {tuple(labels.shape)}")
    labels = nn.functional.pad(labels.to(logits.device), (0, 1), value=ignore_index)[:, 1:]  # (B, T)
    return nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=ignore_index)


def _embedding_name(head: nn.Module) -> str:
    """The head's attribute holding the token embedding table (Llama family: embed_tokens; BLOOM, Falcon:
    word_embeddings)."""
    for name in ("embed_tokens", "word_embeddings"):
        if isinstance(getattr(head, name, None), nn.Module):
            return name
    raise AttributeError(f"{type(head).__name__} has no token embeddings named embed_tokens or word_embeddings")


class AutoDistributedModelForCausalLM:
    """Entry point: `AutoDistributedModelForCausalLM.from_pretrained(model, initial_peers=[...])`."""

    @staticmethod
    def from_pretrained(
        model_name_or_path: str,
        initial_peers: Sequence[str] | None = None,
        *,
        torch_dtype: torch.dtype | str | None = None,
        dtype: torch.dtype | str | None = None,
        dht_prefix: str | None = None,
        client_config: ClientConfig | None = None,
        cache_dir: str | None = None,
        revision: str | None = None,
        token: str | None = None,
        active_adapter: str | None = None,
        tuning_mode: str | None = None,
        pre_seq_len: int = 0,
        swarm_key: str | None = None,
        compression: str | None = None,
    ) -> DistributedModelForCausalLM:
        """Load the client-side weights of a local directory or hub repo and connect to the swarm.

        Only the embeddings, final norm and LM head are read from the checkpoint. `initial_peers` (or
        client_config.initial_peers) must name at least one peer of the swarm. `active_adapter` (or
        client_config.active_adapter) runs every request with that LoRA adapter, as servers announce it (the repo id or
        path given to `corolla serve --adapters`); only servers holding it are used.
        `tuning_mode` "ptune" / "deep_ptune" with `pre_seq_len` P adds trainable prompts (see client.model.ptune); they
        are the model's only parameters with requires_grad. `dtype` (transformers 5's name) or `torch_dtype`: the
        client-side weights' dtype (None or "auto": float32); ValueError if both are given and differ. `swarm_key`
        (or client_config.swarm_key) is the key file of a private swarm. `compression` (or client_config.compression):
        how hidden states travel, "none" (exact, the default), "deflate" (exact, fewer bytes), "bf16", "fp16", "int8"
        or "4bit" (protocol.codecs);
        ValueError for another name.
        """
        config = client_config or ClientConfig()
        if initial_peers is not None:
            if isinstance(initial_peers, str):
                initial_peers = [initial_peers]
            config = replace(config, initial_peers=tuple(initial_peers))
        if dht_prefix is not None:
            config = replace(config, dht_prefix=dht_prefix)
        if active_adapter is not None:
            config = replace(config, active_adapter=active_adapter)
        if swarm_key is not None:
            config = replace(config, swarm_key=swarm_key)
        if compression is not None:
            config = replace(config, compression=compression)  # checked by ClientConfig
        if not config.initial_peers:
            raise ValueError("initial_peers is required: the multiaddr of a DHT peer of the swarm (see `corolla dht`)")
        if torch_dtype is not None and dtype is not None and _resolve_dtype(torch_dtype) != _resolve_dtype(dtype):
            raise ValueError(f"dtype={dtype!r} and torch_dtype={torch_dtype!r} disagree: pass one of them")
        model_dtype = _resolve_dtype(torch_dtype if torch_dtype is not None else dtype)

        hf_config = load_config(model_name_or_path, cache_dir=cache_dir, revision=revision, token=token)
        family = get_family(hf_config)
        tensors = load_tensors(
            model_name_or_path,
            family.is_head_tensor,
            dtype=model_dtype,
            cache_dir=cache_dir,
            revision=revision,
            token=token,
            rename=family.canonical_name,
        )
        default_dtype = torch.get_default_dtype()
        try:
            torch.set_default_dtype(model_dtype)
            head = family.head_class(hf_config)
        finally:
            torch.set_default_dtype(default_dtype)
        head.load_hf_state_dict(tensors)
        head = head.to(model_dtype).eval().requires_grad_(False)
        generation_config = _load_generation_config(model_name_or_path, hf_config, cache_dir, revision, token)

        node = run_sync(_join_swarm(config))
        _live_nodes.add(node)
        _register_atexit()
        prefix = config.dht_prefix or model_dht_prefix(model_name_or_path)
        manager = SequenceManager(node, prefix, family.num_blocks(hf_config), config)
        # disputes (a spot check's, or a standby's disagreement with its primary: any session may ask for standbys)
        # are settled by the client itself; the referee reads the checkpoint only when one needs it
        if config.verify_referee:
            client_checks(manager).referee = Referee(model_name_or_path, family, hf_config, cache_dir, revision, token)
        ptune = make_prompt_tuning(
            tuning_mode, pre_seq_len, head, hf_config.hidden_size, manager.num_blocks, model_dtype
        )
        model = DistributedModelForCausalLM(
            hf_config, head, RemoteSequential(manager), node, generation_config, model_name_or_path, ptune
        )
        logger.info(
            "connected to the swarm for %s (dht prefix %s, %d blocks)", model_name_or_path, prefix, manager.num_blocks
        )
        return model


async def _join_swarm(config: ClientConfig) -> SwarmNode:
    """The client's DHT node (client mode), kept joined through network outages."""
    node = await create_swarm_node(
        config.initial_peers,
        client_mode=True,
        use_relay=config.use_relay,
        swarm_key=load_swarm_key(config.swarm_key) if config.swarm_key else None,
    )
    node.start_watch(config.rejoin_period)
    return node


def _resolve_dtype(value: torch.dtype | str | None) -> torch.dtype:
    if value is None or value == "auto":
        return torch.float32
    if isinstance(value, torch.dtype):
        return value
    resolved = getattr(torch, str(value), None)
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"unknown dtype {value!r}")
    return resolved


def _load_generation_config(model: str, config: PretrainedConfig, cache_dir, revision, token) -> GenerationConfig:
    try:
        return GenerationConfig.from_pretrained(model, cache_dir=cache_dir, revision=revision, token=token)
    except (OSError, ValueError):
        return GenerationConfig.from_model_config(config)


_atexit_registered = False


def _register_atexit() -> None:
    global _atexit_registered
    with _atexit_lock:
        if not _atexit_registered:
            atexit.register(_shutdown_all_nodes)
            _atexit_registered = True


def _shutdown_all_nodes() -> None:
    for node in list(_live_nodes):
        try:
            run_sync(node.shutdown(), timeout=5)
        except Exception:  # best effort at interpreter exit
            pass


def _right_padded(mask: torch.Tensor) -> bool:
    """True if every row of mask (B, T) is ones then zeros: causal attention then keeps the padding out by itself."""
    mask = mask.to(torch.bool)
    lengths = mask.sum(-1, keepdim=True)  # (B, 1)
    return bool(torch.equal(mask, torch.arange(mask.shape[1], device=mask.device)[None, :] < lengths))
