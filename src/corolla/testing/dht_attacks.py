"""Attacks on the swarm's DHT records from a hostile peer: what the trust model says no peer can do ("cannot change,
expire or erase another peer's DHT records"; fake records cannot stall readers), performed for real.

Each attack starts its own hostile node with `corolla.dht.node.create_swarm_node` (a full DHT node, a member of a
private swarm when given its key) and makes it lawless: no record validator and hivemind's plain storage, so it
stores whatever it likes (`node.dht.store(...)`), answers lookups with it, and also sends hand-made records
straight to every peer it knows (hivemind's `call_store`). Then an honest newcomer (a fresh client node) looks at
the swarm, and the attack reports whether it worked:

- `hijack_record`: an OFFLINE copy of a live server's record under its peer id (unsigned, and signed by the
  attacker's own key), expiring later than the real one;
- `squat_key`: a plain value (no subkey) over a block key, expiring in an hour and in a year;
- `shadow_key`: the attacker answers lookups of a block key with an empty dictionary "valid until +inf";
- `replay_older_record`: a server's own older (validly signed) record replayed after it announced a newer one;
- `erase_member_record`: the first three from a member of a private swarm (holding the swarm key);
- `flood_model_index`: fake entries in the model index (each validly signed by a fresh key, or unsigned), with a
  monitor refreshing meanwhile;
- `flood_block_keys`: block keys filled with as many records of the largest size as honest nodes keep, each
  validly signed by a fresh key, so that one answer for several keys exceeds what a message may hold;
- `sybil_fill_block_keys`: block keys filled with valid server records of 256 fresh identities before a real server
  starts there (it must still be found within one announce period);
- `sybil_model_claims`: 255 fresh identities' index entries claiming a real model's prefix with 4,096 blocks (the
  monitor must still show the real model).

Each returns an AttackResult; nothing here asserts. All nodes an attack starts are shut down before it returns.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable, Sequence

from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DHTLocalStorage, DictionaryDHTValue
from hivemind.utils import get_dht_time
from hivemind.utils.serializer import MSGPackSerializer

from corolla.dht.lookup import lookup
from corolla.dht.model_index import MODEL_INDEX_KEY, IndexEntry
from corolla.dht.node import SwarmNode, create_swarm_node
from corolla.dht.records import block_key, fetch_block_servers
from corolla.dht.signed_records import seal
from corolla.membership import SwarmKey
from corolla.protocol import PROTOCOL_VERSION
from corolla.protocol.messages import ServerInfo, ServerState
from corolla.protocol.signing import PeerKey
from corolla.testing.results import AttackResult

BATCH = 256  # records per hand-made store request


@asynccontextmanager
async def hostile_node(initial_peers: Sequence[str], swarm_key: SwarmKey | None = None) -> AsyncIterator[SwarmNode]:
    """A full DHT node of the swarm that keeps and sends anything (see the module docstring); shut down after."""
    node = await create_swarm_node(initial_peers, swarm_key=swarm_key)
    try:
        node.dht.protocol.record_validator = None
        node.dht.protocol.storage, node.dht.protocol.cache = DHTLocalStorage(), DHTLocalStorage()
        yield node
    finally:
        await node.shutdown()


async def store_everywhere(node: SwarmNode, key: str, subkeys: Sequence[str | None], values: Sequence[bytes],
                           expiration: float) -> int:
    """Send raw records (values already serialized, signed or not) under `key` to every DHT peer `node` knows and
    into its own storage; returns how many (peer, record) stores the peers accepted."""
    key_id = DHTID.generate(source=key)
    await node.dht.find_nearest_nodes([key_id])  # meet the nodes near the key
    peers = list(node.dht.protocol.routing_table.peer_id_to_uid)
    accepted = 0
    for start in range(0, len(values), BATCH):
        part = slice(start, start + BATCH)
        part_subkeys, part_values = list(subkeys[part]), list(values[part])
        answers = await asyncio.gather(*(node.dht.protocol.call_store(
            peer, [key_id] * len(part_values), part_values, expiration,
            subkeys=part_subkeys if any(s is not None for s in part_subkeys) else None) for peer in peers))
        accepted += sum(sum(bool(ok) for ok in answer) for answer in answers if answer)
        for subkey, value in zip(part_subkeys, part_values):
            node.dht.protocol.storage.store(key_id, value, expiration, subkey=subkey)
    return accepted


async def read_block(initial_peers: Sequence[str], prefix: str, block: int, swarm_key: SwarmKey | None = None
                     ) -> dict[str, ServerInfo]:
    """What an honest newcomer reads under one block key: peer id -> ServerInfo."""
    reader = await create_swarm_node(initial_peers, client_mode=True, swarm_key=swarm_key)
    try:
        return (await fetch_block_servers(reader.dht, prefix, [block]))[0]
    finally:
        await reader.shutdown()


async def _victim_record(initial_peers: Sequence[str], prefix: str, block: int, victim: str,
                         swarm_key: SwarmKey | None) -> ServerInfo:
    record = (await read_block(initial_peers, prefix, block, swarm_key)).get(victim)
    if record is None or record.state != ServerState.ONLINE:
        raise ValueError(f"{victim} has no ONLINE record under {block_key(prefix, block)} to attack")
    return record


def _is_online(servers: dict[str, ServerInfo], victim: str) -> bool:
    return victim in servers and servers[victim].state == ServerState.ONLINE


async def hijack_record(initial_peers: Sequence[str], prefix: str, block: int, victim: str,
                        swarm_key: SwarmKey | None = None) -> AttackResult:
    """Attack 1: store an OFFLINE copy of `victim`'s record under its peer id, expiring 10 minutes from now."""
    record = await _victim_record(initial_peers, prefix, block, victim, swarm_key)
    forged = record.model_copy(update={"state": ServerState.OFFLINE}).model_dump(mode="json")
    key, expiration = block_key(prefix, block), get_dht_time() + 600
    async with hostile_node(initial_peers, swarm_key) as node:
        stored = await node.dht.store(key, forged, expiration, subkey=victim)  # unsigned
        raw = MSGPackSerializer.dumps(forged)
        signed_by_us = seal(node.key, DHTID.generate(source=key).to_bytes(), raw, expiration)  # our signature, their id
        accepted = await store_everywhere(node, key, [victim, victim], [raw, signed_by_us], expiration)
        accepted += await store_dictionary_everywhere(node, key, {victim: (signed_by_us, expiration)})
        after = await read_block(initial_peers, prefix, block, swarm_key)
    state = after[victim].state.value if victim in after else "missing"
    return AttackResult("hijack_record", not _is_online(after, victim),
                        f"dht.store -> {stored}; hand-made stores (single records and a whole dictionary) accepted "
                        f"by peers: {accepted}; a newcomer reads the victim as {state}")


async def store_dictionary_everywhere(node: SwarmNode, key: str, records: dict[str, tuple[bytes, float]]) -> int:
    """Send one whole dictionary (subkey -> (raw value, expiration)) under `key` to every DHT peer `node` knows, as
    nodes pass dictionaries on to each other; returns how many peers accepted it."""
    key_id = DHTID.generate(source=key)
    dictionary = DictionaryDHTValue()
    for subkey, (value, expiration) in records.items():
        dictionary.store(subkey, value, expiration)
    await node.dht.find_nearest_nodes([key_id])
    peers = list(node.dht.protocol.routing_table.peer_id_to_uid)
    answers = await asyncio.gather(*(node.dht.protocol.call_store(
        peer, [key_id], [dictionary], dictionary.latest_expiration_time) for peer in peers))
    return sum(bool(answer and answer[0]) for answer in answers)


async def squat_key(initial_peers: Sequence[str], prefix: str, block: int,
                    swarm_key: SwarmKey | None = None) -> AttackResult:
    """Attack 2: store a plain value (no subkey) over a block key, expiring in an hour (dht.store) and in a year."""
    before = await read_block(initial_peers, prefix, block, swarm_key)
    key = block_key(prefix, block)
    async with hostile_node(initial_peers, swarm_key) as node:
        stored = await node.dht.store(key, "squatted", get_dht_time() + 3600)
        accepted = await store_everywhere(node, key, [None], [MSGPackSerializer.dumps("squatted")],
                                          get_dht_time() + 365 * 86400)
        after = await read_block(initial_peers, prefix, block, swarm_key)
    gone = sorted(set(before) - set(after))
    return AttackResult("squat_key", bool(gone) or not before,
                        f"dht.store -> {stored}; hand-made stores accepted by peers: {accepted}; servers before "
                        f"{len(before)}, after {len(after)}, gone: {gone}")


async def shadow_key(initial_peers: Sequence[str], prefix: str, block: int, victim: str,
                     swarm_key: SwarmKey | None = None, reads: int = 5) -> AttackResult:
    """Answer every lookup of a block key with an empty dictionary "valid until +inf", then read it `reads` times."""
    await _victim_record(initial_peers, prefix, block, victim, swarm_key)
    key_id = DHTID.generate(source=block_key(prefix, block))
    async with hostile_node(initial_peers, swarm_key) as node:
        node.dht.protocol.storage.store(key_id, DictionaryDHTValue(), float("inf"))
        await node.dht.find_nearest_nodes([key_id])
        seen = [_is_online(await read_block(initial_peers, prefix, block, swarm_key), victim) for _ in range(reads)]
    return AttackResult("shadow_key", not all(seen), f"the victim was visible in {sum(seen)} of {reads} reads")


async def replay_older_record(initial_peers: Sequence[str], prefix: str, block: int, victim: str,
                              swarm_key: SwarmKey | None = None, newer_timeout: float = 60.0,
                              max_wait: float = 120.0, captured: asyncio.Event | None = None) -> AttackResult:
    """Capture `victim`'s signed record as the DHT holds it (then set `captured`), wait (up to `newer_timeout` s) for
    it to announce a newer one, replay the older to every peer, wait until the older would have expired (up to
    `max_wait` s), and read."""
    key = block_key(prefix, block)
    async with hostile_node(initial_peers, swarm_key) as node:
        older = await _raw_record(node, key, victim)
        if older is None:
            raise ValueError(f"{victim} has no record under {key} to capture")
        if captured is not None:
            captured.set()
        deadline = time.monotonic() + newer_timeout
        while (newer := await _raw_record(node, key, victim)) is None or newer[1] <= older[1]:
            if time.monotonic() > deadline:
                return AttackResult("replay_older_record", False, f"the victim announced nothing newer within "
                                                                  f"{newer_timeout:.0f}s: nothing to replay over")
            await asyncio.sleep(0.5)
        accepted = await store_everywhere(node, key, [victim], [older[0]], older[1])
        await asyncio.sleep(max(0.0, min(max_wait, older[1] - get_dht_time() + 1.0)))
        reader = await create_swarm_node(initial_peers, client_mode=True, swarm_key=swarm_key)
        try:
            found = (await lookup(reader.dht, [key]))[key].get(victim)
        finally:
            await reader.shutdown()
    if found is None:
        return AttackResult("replay_older_record", True, f"replay accepted by {accepted} store(s); the victim's newer "
                                                         "record vanished when the replayed one expired")
    return AttackResult("replay_older_record", found[1] < newer[1],
                        f"replay accepted by {accepted} store(s); a newcomer reads the record expiring at "
                        f"{found[1]:.1f} (older {older[1]:.1f}, newer {newer[1]:.1f})")


async def _raw_record(node: SwarmNode, key: str, peer: str) -> tuple[bytes, float] | None:
    """`peer`'s record under `key` as the attacker's neighbours hold it (signed value bytes, expiration): the latest."""
    key_id = DHTID.generate(source=key)
    await node.dht.find_nearest_nodes([key_id])
    best = None
    for target in list(node.dht.protocol.routing_table.peer_id_to_uid):
        answer = await node.dht.protocol.call_find(target, [key_id])
        found = answer.get(key_id, (None, None))[0] if answer else None
        if found is not None and isinstance(found.value, DictionaryDHTValue):
            item = found.value.get(peer)
            if item is not None and (best is None or item.expiration_time > best[1]):
                best = (item.value, item.expiration_time)
    return best


async def erase_member_record(initial_peers: Sequence[str], prefix: str, block: int, victim: str,
                              swarm_key: SwarmKey) -> AttackResult:
    """Attack 3: hijack, squat and shadow from a member of a private swarm (it holds the swarm key)."""
    results = [await hijack_record(initial_peers, prefix, block, victim, swarm_key),
               await squat_key(initial_peers, prefix, block, swarm_key),
               await shadow_key(initial_peers, prefix, block, victim, swarm_key)]
    return AttackResult("erase_member_record", any(r.succeeded for r in results),
                        "; ".join(f"{r.attack}: {'SUCCEEDED' if r.succeeded else 'failed'} ({r.details})"
                                  for r in results))


async def flood_model_index(
    initial_peers: Sequence[str],
    entries: int = 64,
    *,
    swarm_key: SwarmKey | None = None,
    num_blocks: int = 4096,
    signed: bool = True,
    refresh_period: float = 0.5,
    window: float = 8.0,
) -> AttackResult:
    """Attack 4: a monitor refreshing every `refresh_period` s is watched for `window` s; then `entries` fake model
    index entries are stored (models "fake-N" of `num_blocks` blocks; each signed by a fresh key of its own when
    `signed`, else unsigned) and a fresh monitor is watched as long. It succeeds when the flooded monitor refreshed
    less than half as often as the first one."""
    baseline = await _watch_monitor(initial_peers, swarm_key, refresh_period, window)
    key_bytes = DHTID.generate(source=MODEL_INDEX_KEY).to_bytes()
    expiration = get_dht_time() + 1800
    subkeys, values = [], []
    for i in range(entries):
        sybil = PeerKey.generate()
        raw = MSGPackSerializer.dumps(
            IndexEntry(prefix=f"fake-{i:05d}", num_blocks=num_blocks, model_type="llama").model_dump(mode="json")
        )
        subkeys.append(sybil.peer_id)
        values.append(seal(sybil, key_bytes, raw, expiration) if signed else raw)
    async with hostile_node(initial_peers, swarm_key) as node:
        accepted = await store_everywhere(node, MODEL_INDEX_KEY, subkeys, values, expiration)
        flooded = await _watch_monitor(initial_peers, swarm_key, refresh_period, window)
    fakes = sum(m.dht_prefix.startswith("fake-") for m in flooded.models)
    return AttackResult(
        "flood_model_index",
        flooded.refreshes < baseline.refreshes / 2,
        f"{entries} {'signed' if signed else 'unsigned'} entries, {accepted} accepted by peers; in "
        f"{window:.0f}s a monitor refreshed {baseline.refreshes} times before, {flooded.refreshes} "
        f"after (period {refresh_period}s; slowest refresh {flooded.slowest:.2f}s); {fakes} fake "
        f"model(s) shown; the real ones: {flooded.real}",
    )


@dataclass(frozen=True)
class MonitorWatch:
    refreshes: int
    slowest: float  # seconds
    models: tuple  # ModelViews of the last refresh
    real: tuple[str, ...]  # prefixes of the models shown that are not fakes


async def _watch_monitor(
    initial_peers: Sequence[str], swarm_key: SwarmKey | None, refresh_period: float, window: float
) -> MonitorWatch:
    from corolla.monitor.config import MonitorConfig
    from corolla.monitor.source import SwarmMonitor

    reader = await create_swarm_node(initial_peers, client_mode=True, swarm_key=swarm_key)
    slowest = 0.0
    try:
        monitor = SwarmMonitor(reader, MonitorConfig(initial_peers=tuple(initial_peers), refresh_period=refresh_period))
        task = asyncio.create_task(monitor.run())
        deadline = time.monotonic() + window
        while time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            slowest = max(slowest, monitor.last_refresh_seconds)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    finally:
        await reader.shutdown()
    models = tuple(monitor.latest.models) if monitor.latest else ()
    return MonitorWatch(
        monitor.refreshes, slowest, models, tuple(m.dht_prefix for m in models if not m.dht_prefix.startswith("fake-"))
    )


async def flood_block_keys(
    initial_peers: Sequence[str],
    prefix: str,
    blocks: Sequence[int],
    victim: str,
    *,
    swarm_key: SwarmKey | None = None,
    per_key: int = 256,
    read_timeout: float = 60.0,
) -> AttackResult:
    """Fill each block key with `per_key` records of nearly MAX_RECORD_BYTES, each signed by a fresh key; then a
    newcomer reads the blocks (within `read_timeout` s). It succeeds when the victim is missing from a block."""
    from corolla.dht.signed_records import MAX_RECORD_BYTES

    expiration = get_dht_time() + 1800
    padding = "x" * (MAX_RECORD_BYTES - 400)
    accepted = 0
    async with hostile_node(initial_peers, swarm_key) as node:
        for block in blocks:
            key = block_key(prefix, block)
            key_bytes = DHTID.generate(source=key).to_bytes()
            sybils = [PeerKey.generate() for _ in range(per_key)]
            values = [seal(s, key_bytes, MSGPackSerializer.dumps({"padding": padding}), expiration) for s in sybils]
            accepted += await store_everywhere(node, key, [s.peer_id for s in sybils], values, expiration)
        reader = await create_swarm_node(initial_peers, client_mode=True, swarm_key=swarm_key)
        try:
            begin = time.monotonic()
            servers = await asyncio.wait_for(fetch_block_servers(reader.dht, prefix, blocks), read_timeout)
            seconds = time.monotonic() - begin
        finally:
            await reader.shutdown()
    missing = [b for b, by_peer in zip(blocks, servers) if not _is_online(by_peer, victim)]
    return AttackResult(
        "flood_block_keys",
        bool(missing),
        f"{per_key} records of ~{MAX_RECORD_BYTES} bytes under each of {len(blocks)} keys, "
        f"{accepted} accepted by peers; a newcomer read them in {seconds:.1f}s; the victim is "
        f"missing from blocks {missing}",
    )


def _sybil_records(key: str, record: object, sybils: int, expiration: float) -> tuple[list[str], list[bytes]]:
    """`record` signed by `sybils` freshly minted keys for `key`: (their peer ids, the signed values)."""
    key_bytes = DHTID.generate(source=key).to_bytes()
    raw = MSGPackSerializer.dumps(record)
    keys = [PeerKey.generate() for _ in range(sybils)]
    return [k.peer_id for k in keys], [seal(k, key_bytes, raw, expiration) for k in keys]


async def sybil_fill_block_keys(
    initial_peers: Sequence[str],
    prefix: str,
    blocks: Sequence[int],
    start_server: Callable[[], Awaitable[str]],
    *,
    swarm_key: SwarmKey | None = None,
    sybils: int = 256,
    wait: float = 30.0,
) -> AttackResult:
    """Attack 3 (sybils fill a block key): valid ONLINE server records of `blocks`, each signed by one of `sybils`
    fresh keys, stored from one peer on every storing node; then `start_server()` starts a real server of those blocks
    (returning its peer id), and newcomers read the blocks for up to `wait` seconds (one announce period and some). It
    succeeds when the new server is still missing from a block then."""
    expiration = get_dht_time() + 1800
    fake = ServerInfo(state=ServerState.ONLINE, start_block=min(blocks), end_block=max(blocks) + 1, throughput=1e6,
                      cache_tokens_total=1 << 20, cache_tokens_free=1 << 20, torch_dtype="float32", version="sybil",
                      protocol_version=PROTOCOL_VERSION, max_session_length=1 << 16).model_dump(mode="json")
    accepted = 0
    async with hostile_node(initial_peers, swarm_key) as node:
        for block in blocks:
            key = block_key(prefix, block)
            subkeys, values = _sybil_records(key, fake, sybils, expiration)
            accepted += await store_everywhere(node, key, subkeys, values, expiration)
        server = await start_server()
        begin = time.monotonic()
        missing = list(blocks)
        while missing and time.monotonic() - begin < wait:
            found = await read_blocks(initial_peers, prefix, blocks, swarm_key)
            missing = [b for b, by_peer in zip(blocks, found) if not _is_online(by_peer, server)]
            if missing:
                await asyncio.sleep(1.0)
    seconds = time.monotonic() - begin
    return AttackResult(
        "sybil_fill_block_keys",
        bool(missing),
        f"{sybils} sybil server records under each of {len(blocks)} block keys, {accepted} accepted by peers; a server "
        f"started afterwards was " + (f"missing from blocks {missing} after {seconds:.1f}s" if missing else
                                      f"found under every block {seconds:.1f}s after it was ready"),
    )


async def sybil_model_claims(
    initial_peers: Sequence[str],
    prefix: str,
    num_blocks: int,
    *,
    swarm_key: SwarmKey | None = None,
    sybils: int = 255,
    claimed_blocks: int = 4096,
    window: float = 3.0,
) -> AttackResult:
    """Attack 4 (sybils hide a real model from the monitor): `sybils` model index entries, each signed by a fresh
    key, claiming the real model's `prefix` with `claimed_blocks` blocks, stored from one peer on every storing node;
    then a fresh monitor refreshes for `window` seconds. It succeeds when the monitor does not show `prefix` with its
    real `num_blocks` and every block covered."""
    expiration = get_dht_time() + 1800
    claim = IndexEntry(prefix=prefix, num_blocks=claimed_blocks, model_type="llama").model_dump(mode="json")
    async with hostile_node(initial_peers, swarm_key) as node:
        subkeys, values = _sybil_records(MODEL_INDEX_KEY, claim, sybils, expiration)
        accepted = await store_everywhere(node, MODEL_INDEX_KEY, subkeys, values, expiration)
        watched = await _watch_monitor(initial_peers, swarm_key, 0.5, window)
    shown = next((m for m in watched.models if m.dht_prefix == prefix), None)
    seen = "absent" if shown is None else f"{shown.num_blocks} blocks, healthy={shown.healthy}"
    return AttackResult(
        "sybil_model_claims",
        shown is None or shown.num_blocks != num_blocks or not shown.healthy,
        f"{sybils} entries claiming {prefix} with {claimed_blocks} blocks, {accepted} accepted by peers; the monitor "
        f"shows it: {seen}",
    )


async def read_blocks(initial_peers: Sequence[str], prefix: str, blocks: Sequence[int],
                      swarm_key: SwarmKey | None = None) -> list[dict[str, ServerInfo]]:
    """What an honest newcomer reads under several block keys."""
    reader = await create_swarm_node(initial_peers, client_mode=True, swarm_key=swarm_key)
    try:
        return await fetch_block_servers(reader.dht, prefix, list(blocks))
    finally:
        await reader.shutdown()
