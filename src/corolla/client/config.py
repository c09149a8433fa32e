"""ClientConfig: how a client finds servers, waits for them and recovers from their failures."""

from __future__ import annotations

from dataclasses import dataclass

from corolla.protocol.codecs import check_codec
from corolla.protocol.messages import QUANT_MODES, QuantMode


@dataclass(frozen=True)
class ClientConfig:
    initial_peers: tuple[str, ...] = ()  # multiaddrs of DHT peers (/ip4/HOST/tcp/PORT/p2p/PEERID)
    dht_prefix: str | None = None  # DHT namespace of the model (default: the model's name)
    connect_timeout: float = 10.0  # seconds to open a stream and get a session opened
    request_timeout: float = 60.0  # seconds one step or forward may take before the server is abandoned
    alloc_timeout: float = 10.0  # seconds a server may keep us in its cache-allocation queue
    update_period: float = 30.0  # seconds between refreshes of the swarm's server list
    max_retries: int = 5  # attempts of one step or forward across failing servers before giving up
    min_backoff: float = 0.5  # seconds a failing peer is first banned for; doubles on each further failure
    max_backoff: float = 60.0  # cap on a peer's ban, seconds
    unreachable_ban: float = 30.0  # seconds a peer that could not be dialed is skipped, at least
    missing_blocks_wait: float = 5.0  # seconds to wait for servers of uncovered blocks before MissingBlocks
    hop_cost: float = 0.002  # routing: seconds of overhead charged per server hop
    default_rtt: float = 0.05  # routing: assumed round trip to a server not measured yet, seconds
    ping_timeout: float = 2.0  # seconds a round-trip measurement may take
    relay_cost: float = 0.02  # routing: extra seconds charged per step for a server reachable only through a relay
    use_relay: bool = True  # dial servers behind NATs through the relays they announce
    swarm_key: str | None = None  # private swarm: path of the swarm key file (`corolla swarm-key PATH`)
    rejoin_period: float = 5.0  # seconds between checks of contact with the swarm (rejoining after an outage)
    active_adapter: str | None = None  # LoRA adapter (as servers announce it) for every request; None: base model
    # inference steps go to the first server with the rest of the route, and each server pushes its output straight
    # to the next one (one network crossing per hop, not two); False: the client relays every hop (Petals' way)
    push: bool = True
    # standby replicas (client.chain.standby): 1 = every span of a session's route gets a second server of the same
    # blocks, fed the same hidden states every step (its own KV cache at the same position), promoted when the
    # primary fails: a failover costs about one step instead of a replay of the whole history. It costs that server
    # the span's compute and cache, and the client one more upload of each span's inputs (the prompt too), so it is
    # the user's choice: 0 (the default) = off. Per session: `inference_session(..., standby=...)`
    standby: int = 0

    # spot checks (client.trust.spot_checks): the probability that a step's output of a span is recomputed by another
    # server holding those blocks and compared. 0 (the default) = off: a check costs a second server a forward over
    # the session's whole history, so it is the user's choice; 0.05-0.1 catches a lying server within tens of steps
    verify_rate: float = 0.0
    verify_seed: int | None = None  # seed of the spot checks' random draws (None: unseeded); tests and benchmarks
    verify_wait: float = 30.0  # seconds `generate` waits for the checks still running before it returns
    # when two servers disagree and no other server settles it, the client reads the disputed span's blocks from the
    # checkpoint and computes them itself (client.trust.referee); off: such a dispute leaves the output unverified
    verify_referee: bool = True

    max_chunk_bytes: int = 4 << 20  # training: largest hidden-state tensor per forward/backward message, bytes
    # how hidden states travel between the client and servers and from server to server (protocol.codecs): "none"
    # (exact, the default), "deflate" (exact, ~0.72-0.86 of the bytes), "bf16", "fp16", "int8" (blockwise absmax) or
    # "4bit" (Hadamard-rotated blocks); the lossy ones pay off for long prompts over slow links, and cost accuracy
    # (docs: their measured quality)
    compression: str = "none"
    # with compression "none", steps of many positions the client sends (prompts, a failover's replay, a standby's
    # catch-up) travel in the lossless "deflate" codec to servers that take it: ~14% fewer bytes in float32, ~28% in
    # bfloat16, the same tensors; False: as they are (a client whose CPU is slower than its links)
    deflate_bulk: bool = True
    # pipelined prefill (client.chain.pipelined_prefill): a long step crosses a push route in chunks of this many tokens,
    # so servers compute and push chunk k while chunk k + 1 arrives; None = chosen by the bytes per token (~1 MiB
    # chunks)
    prefill_chunk_tokens: int | None = None

    # route only through servers whose announced quantization is one of these (QuantMode, or its strings "none",
    # "int8", "nf4"); None = any. ("none",) keeps outputs exact; a swarm without such servers for some block raises
    # MissingBlocks
    allowed_quant: tuple[QuantMode, ...] | None = None

    def __post_init__(self) -> None:
        check_codec(self.compression)
        if self.prefill_chunk_tokens is not None and self.prefill_chunk_tokens < 1:
            raise ValueError(f"prefill_chunk_tokens must be at least 1, got {self.prefill_chunk_tokens!r}")
        if self.standby not in (0, 1):
            raise ValueError(f"standby must be 0 or 1, got {self.standby!r}")
        if not 0.0 <= self.verify_rate <= 1.0:
            raise ValueError(f"verify_rate must be within [0, 1], got {self.verify_rate!r}")
        if self.allowed_quant is not None:
            if (
                isinstance(self.allowed_quant, str)
                or not set(self.allowed_quant) <= set(QUANT_MODES)
                or not self.allowed_quant
            ):
                raise ValueError(
                    f"allowed_quant must be None or a non-empty tuple of {QUANT_MODES}, got {self.allowed_quant!r}"
                )
            # strings and lists are accepted too; kept as a tuple of QuantMode
            object.__setattr__(self, "allowed_quant", tuple(QuantMode(mode) for mode in self.allowed_quant))
