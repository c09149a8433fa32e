"""Wire protocol shared by client and server: typed messages, DHT records, tensor framing and errors."""

# bumped on any incompatible change of a message or of the framing. v4: push links set by the owner, signed push
# receipts, codecs; v3: server-to-server push
PROTOCOL_VERSION = 4
# v1: tensors after a frame's header were unnamed and told apart by dtype. v2: every tensor is named
# (protocol.messages.TensorSlots), frame headers carry the version, quantization modes and error codes are enums.


def rpc_handler_name(verb: str, version: int = PROTOCOL_VERSION) -> str:
    """The P2P stream-handler name of an RPC verb ("inference", "forward", "backward", "info", "probe") in protocol
    `version`. Peers of different versions therefore never share a stream handler (see protocol.compat)."""
    return f"corolla/v{version}/rpc_{verb}"
