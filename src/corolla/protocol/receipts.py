"""Push receipts: what a server pushed to the next one, signed, so the session's owner can hold the pusher to it.

In push mode the owner never sees what server A sends to server B, only A's copy of its output (A answers its own
owner stream) and B's answer. Without more, a lying A could push something else to B and answer the owner honestly,
and a check of B against the owner's copy would convict the honest B. So A signs every push:

    digest    = blake2b-128(dtype, shape and bytes of `hidden`; then those of `attention_mask`, if sent)
    payload   = msgpack([receiver, push secret, step_id, position, hypo_ids, push, answer, digest])
    signature = A's peer-id key over ("corolla/push/v1", payload)          (protocol.signing)

The receipt carries those fields (not the secret: the link's two servers and its owner know it). B checks it before
running the push (`PushReceipt` fields equal to the push's, digest of what arrived, A's signature) and hands it to the
owner with its answer. The owner then judges (client.chain.push_audit): a receipt that is not A's signature over this link
and this answer's step is B's lie (nobody but A can sign one); a valid receipt whose digest or step fields differ
from A's copy and the step the owner sent is A's proven lie.

Costs per push on loopback: one digest on each side (~1 GB/s) and an Ed25519 signature (~50 us) and check (~120 us).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import msgpack
import torch

from corolla.protocol.messages import PushReceipt
from corolla.protocol.signing import PeerKey, verify

RECEIPT_LABEL = "corolla/push/v1"


def tensor_digest(*tensors: torch.Tensor | None) -> str:
    """A hex digest of tensors' dtypes, shapes and bytes (a None counts, as absent); equal tensors give equal digests
    wherever they were computed."""
    digest = hashlib.blake2b(digest_size=16)
    for tensor in tensors:
        if tensor is None:
            digest.update(b"\x00none")
            continue
        tensor = tensor.detach().to("cpu").contiguous()
        digest.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _payload(receiver: str, secret: str, step_id: int, position: int, hypo_ids: Sequence[int] | None, push: bool,
             answer: int | None, digest: str) -> bytes:
    ids = None if hypo_ids is None else list(hypo_ids)
    return msgpack.packb([receiver, secret, step_id, position, ids, push, answer, digest])


def sign_receipt(key: PeerKey, receiver: str, secret: str, step_id: int, position: int,
                 hypo_ids: Sequence[int] | None, push: bool, digest: str, answer: int | None = None) -> PushReceipt:
    """`key`'s receipt of pushing tensors of digest `digest` to `receiver`, over the link of `secret`, as this step."""
    ids = None if hypo_ids is None else list(hypo_ids)
    signature = key.sign(RECEIPT_LABEL, _payload(receiver, secret, step_id, position, ids, push, answer, digest))
    return PushReceipt(pusher=key.peer_id, receiver=receiver, step_id=step_id, position=position, hypo_ids=ids,
                       push=push, answer=answer, digest=digest, signature=signature.hex(),
                       public_key=None if key.is_inline else key.public_key.hex())


def receipt_signed(receipt: PushReceipt, secret: str) -> bool:
    """Whether `receipt` is its pusher's signature of its own fields over the link of `secret`."""
    try:
        signature = bytes.fromhex(receipt.signature)
        public_key = None if receipt.public_key is None else bytes.fromhex(receipt.public_key)
    except ValueError:
        return False
    payload = _payload(receipt.receiver, secret, receipt.step_id, receipt.position, receipt.hypo_ids, receipt.push,
                       receipt.answer, receipt.digest)
    return verify(receipt.pusher, RECEIPT_LABEL, payload, signature, public_key)
