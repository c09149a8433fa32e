"""ApiConfig: every knob of `corolla api`, with its default and unit. The CLI is generated from these fields."""

from __future__ import annotations

from dataclasses import dataclass, field

from corolla.protocol.codecs import CODECS


def _opt(help: str, **kw: object) -> dict[str, object]:
    return {"help": help, **kw}


@dataclass(frozen=True)
class ApiConfig:
    model: str = field(
        metadata=_opt(
            "HF repo id or local directory of the checkpoint (its tokenizer and head are loaded)", positional=True
        )
    )
    initial_peers: tuple[str, ...] = field(
        default=(),
        metadata=_opt("multiaddrs of DHT peers of the swarm (/ip4/HOST/tcp/PORT/p2p/PEERID); required", nargs="+"),
    )
    swarm_key: str | None = field(
        default=None, metadata=_opt("private swarm: the swarm key file (`corolla swarm-key PATH`)")
    )
    host: str = field(default="127.0.0.1", metadata=_opt("address the HTTP server listens on"))
    port: int = field(
        default=8000, metadata=_opt("TCP port of the HTTP server; 0 = chosen by the OS (the log shows it)")
    )
    model_name: str | None = field(
        default=None, metadata=_opt("the model id clients ask for (default: the MODEL argument)")
    )
    dht_prefix: str | None = field(default=None, metadata=_opt("DHT namespace of the model (default: its name)"))
    dtype: str = field(
        default="float32",
        metadata=_opt("dtype of the local embeddings and LM head", choices=("float32", "bfloat16", "float16")),
    )
    chat_template: str | None = field(
        default=None, metadata=_opt("a Jinja chat template file to use instead of the tokenizer's")
    )
    max_length: int | None = field(
        default=None,
        metadata=_opt(
            "tokens one request may span, prompt and completion (default: the model's "
            "max_position_embeddings, at most 8192)"
        ),
    )
    session_headroom: int = field(
        default=256,
        metadata=_opt(
            "tokens a new session reserves on the servers beyond prompt + max_tokens, so a follow-up turn "
            "can continue it (dropped when the servers are full)"
        ),
    )
    max_idle_sessions: int = field(
        default=8, metadata=_opt("finished sessions kept open for prefix reuse; 0 = close every session at once")
    )
    idle_timeout: float = field(default=120.0, metadata=_opt("seconds a finished session is kept for prefix reuse"))
    min_reuse_tokens: int = field(
        default=8, metadata=_opt("a kept session is continued only if it shares at least this many prompt tokens")
    )
    max_streams: int = field(
        default=256, metadata=_opt("most streams generating at once (n choices count each); more requests wait")
    )
    pipeline_groups: int = field(
        default=1,
        metadata=_opt(
            "streams are split into this many groups that step in turn, so that while one group's step "
            "runs on the later servers of the route the next group's runs on the first ones; 1 = one "
            "batch (2 measured 0.91x of it on one 2-core machine, where the servers share the cores)"
        ),
    )
    max_n: int = field(default=16, metadata=_opt("largest `n` (choices per prompt) a request may ask for"))
    request_timeout: float = field(default=60.0, metadata=_opt("seconds one step through the swarm may take"))
    compression: str = field(
        default="none",
        metadata=_opt(
            "how hidden states travel through the swarm: none (exact), deflate (exact, fewer bytes), bf16, fp16, int8, "
            "4bit (protocol.codecs)",
            choices=CODECS,
        ),
    )
    verify_rate: float = field(
        default=0.0,
        metadata=_opt(
            "spot checks: the share of decode steps whose outputs another server holding the same blocks computes "
            "again, in [0, 1] (ClientConfig.verify_rate); a server caught lying is never used again and the choices "
            "it served are generated again from where it began; 0 = off"
        ),
    )
    alloc_timeout: float = field(
        default=10.0, metadata=_opt("seconds a new session may wait in a full server's allocation queue")
    )
    num_threads: int | None = field(default=None, metadata=_opt("torch CPU threads (default: torch's choice)"))
    api_keys: str | None = field(
        default=None,
        metadata=_opt(
            "file of API keys, one per line (blank lines and # comments ignored): every request then needs "
            "`Authorization: Bearer KEY`, and kept sessions, prefix reuse and stream quotas are per key; "
            "without it there is no auth and the server listens on loopback addresses only"
        ),
    )
    insecure_no_auth: bool = field(
        default=False,
        metadata=_opt("listen beyond loopback without --api-keys: anyone who can reach the port may use the API"),
    )
    allowed_hosts: tuple[str, ...] = field(
        default=(),
        metadata=_opt(
            "Host header names accepted besides localhost names, the --host address and the address a "
            "connection arrived on (DNS-rebinding protection); '*' accepts any",
            nargs="+",
        ),
    )
    public_metrics: bool = field(
        default=False,
        metadata=_opt(
            "with --api-keys, serve /metrics (server-wide counts: every key's requests, tokens and kept "
            "sessions) to any key's holder; by default only to clients on a loopback address"
        ),
    )
    max_body_bytes: int = field(
        default=4 * 1024 * 1024, metadata=_opt("bytes of a request body; larger bodies get 413 before being read")
    )
    max_streams_per_key: int = field(
        default=64,
        metadata=_opt(
            "streams (n choices count each) one API key may have generating or waiting at once; more get "
            "429 (only with --api-keys)"
        ),
    )

    def __post_init__(self) -> None:
        for name in ("session_headroom", "max_idle_sessions", "min_reuse_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0")
        for name in ("max_streams", "max_n", "pipeline_groups", "max_body_bytes", "max_streams_per_key"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.max_length is not None and self.max_length < 2:
            raise ValueError("--max-length must be at least 2 tokens")
        if not 0.0 <= self.verify_rate <= 1.0:
            raise ValueError("--verify-rate must be within [0, 1]")
        if self.idle_timeout <= 0 or self.request_timeout <= 0 or self.alloc_timeout < 0:
            raise ValueError("--idle-timeout and --request-timeout must be positive, --alloc-timeout >= 0")
