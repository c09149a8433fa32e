"""MonitorConfig: every knob of `corolla monitor`, with its default and unit. The CLI is generated from it."""

from __future__ import annotations

from dataclasses import dataclass, field


def _opt(help: str, **kw: object) -> dict[str, object]:
    return {"help": help, **kw}


@dataclass(frozen=True)
class MonitorConfig:
    initial_peers: tuple[str, ...] = field(
        default=(), metadata=_opt("multiaddrs of DHT peers of the swarm (/ip4/HOST/tcp/PORT/p2p/PEERID)", nargs="+")
    )
    swarm_key: str | None = field(
        default=None, metadata=_opt("private swarm: the swarm key file (`corolla swarm-key PATH`)")
    )
    host: str = field(default="127.0.0.1", metadata=_opt("address the web page listens on"))
    port: int = field(default=8080, metadata=_opt("TCP port of the web page; 0 = chosen by the OS"))
    refresh_period: float = field(
        default=5.0,
        metadata=_opt("how often the DHT is read and every server pinged, seconds (the page polls as often)"),
    )
    ping_timeout: float = field(
        default=3.0, metadata=_opt("a server that does not answer rpc_info within this many seconds counts as gone")
    )
    history_length: int = field(default=720, metadata=_opt("samples of history kept in memory (720 x 5 s = 1 hour)"))
    max_pings: int = field(default=32, metadata=_opt("servers pinged at once"))

    def __post_init__(self) -> None:
        if self.refresh_period <= 0 or self.ping_timeout <= 0:
            raise ValueError("--refresh-period and --ping-timeout must be > 0 seconds")
        if self.history_length < 1 or self.max_pings < 1:
            raise ValueError("--history-length and --max-pings must be >= 1")
