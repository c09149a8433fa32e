"""Which records a storing node keeps under a crowded key, and which it answers a lookup with: pure rules.

Peer ids cost nothing, so a flood of fresh identities must not be able to decide what a key holds. Every record a
node stores was sent by its own writer (dht.record_storage: a record stored on someone else's behalf is refused),
and the node asks each writer what it serves (dht.verifier: one rpc_info per writer per VERIFIED_TTL). That gives
each record a *rank*:

    VERIFIED  2   its writer answered rpc_info and serves this key (a block of its announced range, or any model:
                  the model index)
    UNKNOWN   1   not asked yet (a check is queued when the record arrives)
    FAILED    0   its writer did not answer, or answered that it serves other blocks

and a *group*: records whose values are equal (the model index's entries of one model) form one group; a server's
block record is a group of its own.

Admission (`evict_for`): a key keeps up to `capacity` writers (record_storage.MAX_SUBKEYS_PER_KEY). A refreshed
record always stays. A new writer under a full key takes the place of the incumbent that ranks lowest, if that one
ranks below it, or ranks the same in a group larger than the newcomer's would be once admitted (so a model with a
thousand entries in the index gives way to one with none, groups end balanced rather than taking turns, and two block
records, each a group of one, never push each other out). Otherwise
the newcomer is refused, and its writer and the incumbents not yet asked are checked, so that at its next refresh a
real server finds the fakes ranked FAILED and takes their place: fake records never push real ones out, and a real
one gets in within one announce period.

Answers (`answer_order`): a lookup is answered with at most ANSWER_RECORDS records per key (bytes per answer are
bounded however many servers a block has): VERIFIED first, then UNKNOWN, then FAILED; within a rank the first of
each group before the second of any, in an order drawn anew for each answer, so readers asking several nodes see
different servers of a crowded block, and every model of the index.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

VERIFIED, UNKNOWN, FAILED = 2, 1, 0
ANSWER_RECORDS = 64  # records per key in one answer to a lookup (each at most signed_records.MAX_RECORD_BYTES)


@dataclass(frozen=True)
class Held:
    """One record under a key, as admission sees it."""

    subkey: str  # its writer's peer id
    rank: int  # VERIFIED, UNKNOWN or FAILED
    group: bytes  # records with equal values share a group (a digest of the value)
    expiration: float


def evict_for(held: Sequence[Held], newcomer: Held, capacity: int) -> Held | None | bool:
    """What admitting `newcomer` (a writer not under the key yet) takes: True if there is room, the incumbent to evict
    for it, or None if it is refused (see the module doc)."""
    if len(held) < capacity:
        return True
    if not held:
        return None
    groups = Counter(record.group for record in held)

    def weakness(record: Held) -> tuple[int, int, float]:  # the lowest ranks first, then the largest groups
        return record.rank, -groups[record.group], record.expiration

    victim = min(held, key=weakness)
    if victim.rank < newcomer.rank:
        return victim
    if victim.rank == newcomer.rank and groups[victim.group] > groups[newcomer.group] + 1:
        return victim
    return None


def answer_order(held: Sequence[Held], limit: int = ANSWER_RECORDS, rng: random.Random | None = None) -> list[str]:
    """The subkeys of the at most `limit` records to answer a lookup with, in order (see the module doc)."""
    draw = rng or random.Random()
    shuffled = list(held)
    draw.shuffle(shuffled)
    seen: Counter[bytes] = Counter()
    keyed = []
    for record in shuffled:
        keyed.append((-record.rank, seen[record.group], len(keyed), record.subkey))
        seen[record.group] += 1
    return [subkey for *_, subkey in sorted(keyed)[:limit]]
