"""Wire protocol shared by client and server: typed messages, DHT records, tensor framing and errors."""

PROTOCOL_VERSION = 1  # bumped on any incompatible change of a message or of the framing


def rpc_handler_name(verb: str) -> str:
    """The P2P stream-handler name of an RPC verb ("inference", "forward", "backward", "info")."""
    return f"corolla/v{PROTOCOL_VERSION}/rpc_{verb}"
