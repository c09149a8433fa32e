"""ServerConfig: every knob of a server, with its default and unit. The CLI is generated from these fields."""

from __future__ import annotations

import os
from dataclasses import dataclass, field


def _opt(help: str, **kw: object) -> dict[str, object]:
    return {"help": help, **kw}


@dataclass(frozen=True)
class ServerConfig:
    model: str = field(metadata=_opt("HF repo id or local directory of the checkpoint", positional=True))
    initial_peers: tuple[str, ...] = field(
        default=(), metadata=_opt("multiaddrs of DHT peers to join (/ip4/HOST/tcp/PORT/p2p/PEERID)", nargs="+")
    )
    new_swarm: bool = field(default=False, metadata=_opt("start a new swarm: this server is its own bootstrap peer"))
    host: str = field(default="127.0.0.1", metadata=_opt("address to listen on (0.0.0.0: every interface)"))
    port: int = field(default=0, metadata=_opt("TCP port to listen on; 0 = chosen by the OS"))
    identity: str | None = field(
        default=None,
        metadata=_opt(
            "private key file (created, mode 0600, if missing): the server keeps its peer id across restarts"
        ),
    )
    announce_maddrs: tuple[str, ...] = field(
        default=(),
        metadata=_opt(
            "addresses other peers should dial, e.g. /ip4/PUBLIC_IP/tcp/PORT when a NAT forwards that port "
            "here (default: the addresses listened on)",
            nargs="+",
        ),
    )
    use_relay: bool = field(
        default=True, metadata=_opt("dial peers that are behind NATs through the relays they announce")
    )
    relays: tuple[str, ...] = field(
        default=(),
        metadata=_opt(
            "for a server that accepts no inbound connections (behind a NAT): reserve a relayed address at these "
            "public peers (`corolla dht --relay`) and announce it; clients reach the server through them (an extra "
            "hop per step). The bundled p2pd reserves about 20 s after start when it knows 4 or more relays, after "
            "about 3 minutes otherwise",
            nargs="+",
        ),
    )
    swarm_key: str | None = field(
        default=None,
        metadata=_opt(
            "private swarm: the swarm key file (`corolla swarm-key PATH`); only peers holding it may read "
            "the DHT or use this server"
        ),
    )
    rejoin_period: float = field(
        default=5.0,
        metadata=_opt("how often to check contact with the swarm and, after an outage, retry rejoining it, seconds"),
    )
    blocks: str | None = field(default=None, metadata=_opt("serve exactly these blocks, 'A:B' (half-open)"))
    num_blocks: int | None = field(
        default=None, metadata=_opt("serve this many consecutive blocks, chosen where the swarm is weakest")
    )
    balance_period: float = field(
        default=120.0,
        metadata=_opt(
            "when the server chose its blocks (no --blocks): how often it checks whether moving to other blocks would "
            "strengthen the swarm's weakest ones, seconds; 0 = never move"
        ),
    )
    balance_quality: float = field(
        default=0.2,
        metadata=_opt(
            "move only for a gain above this fraction of the weakest block's throughput (0.2: 20 percent); "
            "the margin that keeps servers from chasing each other"
        ),
    )
    # placement at scale (server.presence.rebalancing): each knob in seconds
    join_delay: float = field(
        default=2.0,
        metadata=_opt("a server choosing its blocks first waits up to this long, at random, so that servers started "
                      "together read different views of the swarm, seconds"),
    )
    settle_delay: float = field(
        default=2.0,
        metadata=_opt("after announcing its choice (JOINING), a server waits up to this long, at random, re-reads "
                      "the swarm and moves before loading if another server took the same blocks, seconds"),
    )
    watch_period: float = field(
        default=5.0,
        metadata=_opt("while some block has fewer than 5 servers, how often a server pings up to 8 of their servers "
                      "(the thinnest blocks' first) to move at once onto a block left with none, seconds"),
    )
    move_stagger: float = field(
        default=10.0,
        metadata=_opt("a server that decided to move waits up to this long, at random, then re-reads the swarm and "
                      "decides again (another server may have moved already), seconds; a tenth of it when a block "
                      "has no server"),
    )
    move_cooldown: float = field(
        default=600.0,
        metadata=_opt("no move within this long of the last one, except onto a block with no server, seconds"),
    )
    drain_timeout: float = field(
        default=60.0,
        metadata=_opt("a moving server stops taking sessions and serves its open ones up to this long before it "
                      "leaves their blocks (none when it moves onto a block with no server), seconds"),
    )
    device: str = field(default="cpu", metadata=_opt("torch device for the blocks"))
    tensor_parallel_devices: tuple[str, ...] = field(
        default=(),
        metadata=_opt(
            "split every hosted block over these devices (e.g. cuda:0 cuda:1): attention heads and MLP columns are "
            "sharded and the partial outputs summed on the first device; replaces --device",
            nargs="+",
        ),
    )
    dtype: str = field(
        default="float32",
        metadata=_opt(
            "dtype the blocks compute in; auto = the checkpoint's dtype on an accelerator, float32 on the CPU",
            choices=("auto", "float32", "bfloat16", "float16"),
        ),
    )
    quant: str = field(
        default="none",
        metadata=_opt(
            "weight quantization of the blocks' linear layers (bitsandbytes): int8 = LLM.int8(), nf4 = 4-bit "
            "NormalFloat",
            choices=("none", "int8", "nf4"),
        ),
    )
    dht_prefix: str | None = field(default=None, metadata=_opt("DHT namespace of the model (default: its name)"))
    cache_tokens: int | None = field(
        default=None, metadata=_opt("KV-cache budget in tokens over all sessions (default: sized from free memory)")
    )
    max_session_length: int = field(default=8192, metadata=_opt("longest max_length a session may reserve, tokens"))
    max_alloc_timeout: float = field(default=60.0, metadata=_opt("cap on a client's cache-allocation wait, seconds"))
    cache_queue_patience: float = field(
        default=5.0,
        metadata=_opt(
            "a session waiting for cache is overtaken by later ones that fit for this long; after that, for as "
            "long again at most, later sessions of peers already holding cache wait behind it, if those that "
            "overtook it are what keeps it out (no starvation of large sessions; 0: plain first fit), seconds"
        ),
    )
    # per-peer limits (server.rpc.peer_limits): what one peer id may hold of this server at once
    max_peer_cache_share: float = field(
        default=1.0,
        metadata=_opt(
            "most of the KV-cache budget one peer may hold and wait for, as a fraction (0.5 = half); a "
            "session past it is refused at once with server_full. 1.0 lets one client (e.g. one `corolla "
            "api` serving many users) fill the server; public servers may want 0.5"
        ),
    )
    max_peer_sessions: int = field(
        default=384,
        metadata=_opt(
            "most inference sessions one peer may have open or waiting for cache (`corolla api` keeps up "
            "to its --max-streams 256 generating plus its kept ones); more are refused with server_full"
        ),
    )
    max_peer_streams: int = field(
        default=512,
        metadata=_opt(
            "most streams of any RPC one peer may have open at once (each holds a socket of this "
            "process); more are refused at once with peer_limit"
        ),
    )
    max_peer_passes: int = field(
        default=4,
        metadata=_opt(
            "most rpc_forward/rpc_backward calls of one peer read and run at once; its further calls wait "
            "their turn, unread, so one peer cannot fill the compute queue or the memory"
        ),
    )
    max_pass_tokens: int = field(
        default=32768,
        metadata=_opt(
            "most tokens (batch x length) of one rpc_forward/rpc_backward (at least one row of "
            "--max-session-length), which bounds its frame before it is read and its compute; clients' "
            "training chunks (4 MiB of hidden states, or one row) and spot checks of sessions up to this "
            "batch x max_length fit"
        ),
    )
    max_probe_bytes: int = field(
        default=4 << 20,
        metadata=_opt(
            "largest bandwidth probe (rpc_probe) payload this server takes or sends back, bytes; other "
            "servers measure with 4 MiB"
        ),
    )
    max_probes: int = field(
        default=4, metadata=_opt("most bandwidth probes answered at once, over all peers (one per peer at a time)")
    )
    probe_stall_timeout: float = field(
        default=5.0,
        metadata=_opt("a probe reply's reader that takes none of it for this long has its stream dropped, seconds"),
    )
    step_timeout: float = field(default=300.0, metadata=_opt("longest one inference step may compute, seconds"))
    session_timeout: float = field(default=600.0, metadata=_opt("idle time after which a session is closed, seconds"))
    announce_period: float = field(default=30.0, metadata=_opt("how often the DHT record is refreshed, seconds"))
    expiration: float = field(default=90.0, metadata=_opt("lifetime of a DHT record, seconds"))
    throughput: float | None = field(
        default=None, metadata=_opt("announced throughput, tokens/s per block (default: measured and cached)")
    )
    network_bandwidth: float | None = field(
        default=None,
        metadata=_opt(
            "this server's network bandwidth, Mbit/s (default: measured against other servers, cached a day)"
        ),
    )
    max_batch_size: int = field(
        default=64,
        metadata=_opt(
            "most sessions' decode steps run together in one batched forward (continuous batching); while batches "
            "this full leave steps waiting, the server is past its peak and admits no new session"
        ),
    )
    merge_max_tokens: int = field(
        default=128,
        metadata=_opt(
            "steps up to this many tokens (x batch) run through all blocks as one task; longer prefills "
            "run block by block so other sessions' decode steps go in between"
        ),
    )
    max_chunk_tokens: int = field(
        default=2048, metadata=_opt("prefills longer than this many tokens (x batch) run in chunks")
    )
    cache_dir: str | None = field(default=None, metadata=_opt("where hub downloads go (default ~/.cache/corolla)"))
    max_disk_space: int | None = field(default=None, metadata=_opt("cap on the download cache, bytes"))
    num_threads: int | None = field(default=None, metadata=_opt("torch CPU threads (default: torch's choice)"))
    adapters: tuple[str, ...] = field(
        default=(),
        metadata=_opt(
            "peft LoRA adapters to preload (local directories or hub repos); clients pick one per session by this "
            "exact name",
            nargs="+",
        ),
    )
    ready_file: str | None = field(
        default=None,
        metadata=_opt(
            "once the server is announced ONLINE, write this file atomically (again after each move to other "
            "blocks): the JSON record `corolla serve` also prints as one line on stdout, with keys event "
            '("ready"), peer_id, maddrs (where clients dial it) and blocks ("A:B")'
        ),
    )
    metrics_port: int = field(
        default=0, metadata=_opt("serve Prometheus metrics at http://HOST:PORT/metrics on this TCP port; 0 = off")
    )
    inject_fault: str | None = field(
        default=None,
        metadata=_opt(
            "for failure and attack tests: once this process gets SIGUSR1, every inference step fails with an error "
            "(fail), has its stream dropped (drop) or never gets an answer (stall); or every output is subtly wrong, "
            "scaled by 1.01 (corrupt); or, as a hostile server: corrupts only what it pushes (corrupt-push; "
            "misdigest-push: under a receipt of the honest output; rewrite-push: as a step the client never "
            "sent), only "
            "what checkers ask (lie-to-checkers), answers NaN (nan), announces nf4 from the start and adds a bias "
            "(false-quant); or answers every step honestly, 0.1 s late (slow)",
            choices=("fail", "drop", "stall", "corrupt", "corrupt-push", "misdigest-push", "rewrite-push",
                     "lie-to-checkers", "nan", "false-quant", "slow"),
        ),
    )

    def __post_init__(self) -> None:
        if not 0.0 < self.max_peer_cache_share <= 1.0:
            raise ValueError(f"max_peer_cache_share must be within (0, 1], got {self.max_peer_cache_share!r}")
        for name in (
            "max_peer_sessions",
            "max_peer_streams",
            "max_peer_passes",
            "max_pass_tokens",
            "max_probe_bytes",
            "max_probes",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)!r}")
        if self.cache_queue_patience < 0 or self.probe_stall_timeout <= 0:
            raise ValueError("cache_queue_patience must be >= 0 and probe_stall_timeout > 0")


def public_model_name(model: str) -> str:
    """The model as a server names it to other peers (InfoReply.model): a hub repo id as given, a local checkpoint by
    its directory's name only, never its path on this machine ("/data/ckpt/tiny-llama/" -> "tiny-llama")."""
    local = os.path.isabs(model) or model.startswith((".", "~")) or os.path.exists(model) or "\\" in model
    if not local and model.count("/") <= 1:
        return model
    return os.path.basename(os.path.normpath(os.path.expanduser(model))) or "model"
