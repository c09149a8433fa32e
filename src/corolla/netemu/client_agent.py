"""A corolla client in its own process (run inside an emulated host), driven by JSON lines on stdin.

    python -m corolla.netemu.client_agent MODEL --initial-peers ADDR... [--swarm-key PATH] [--config JSON]

Prints {"ready": true, "peer_id": ...} once connected (or {"ready": false, "error": ...} and exits 1), then answers
one JSON line per command:
    {"op": "generate", "ids": [[...]], "max_new_tokens": N}   -> {"ok": true, "tokens": [[...]], "seconds": s}
    {"op": "servers"}            -> {"ok": true, "blocks": [{peer: {"state", "relayed", "maddrs", "next_pings"}}, ...],
                                      "rtts": {peer: seconds}} (fresh DHT read; the client's measured round trips)
    {"op": "route"}              -> {"ok": true, "route": [[peer, start, end], ...]} (an inference route now)
    {"op": "timed_decode", "ids": [[...]], "new_tokens": N, "repeats": R}
                                  -> {"ok": true, "ttft_s": [...], "decode_s_per_token": [...],
                                      "exchanges_per_token": x (requests the client waited for, counted, per decode
                                      step),
                                      "tokens": [[...]] (prompt + greedy tokens, last repeat),
                                      "route": [[peer, start, end], ...], "pushed_steps": n (last repeat's session)}
A failed command answers {"ok": false, "error": "..."}; the agent keeps running until stdin closes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--initial-peers", nargs="+", required=True)
    parser.add_argument("--swarm-key", default=None)
    parser.add_argument("--config", default="{}", help="ClientConfig fields as JSON")
    args = parser.parse_args()

    import torch

    from corolla import AutoDistributedModelForCausalLM
    from corolla.client.config import ClientConfig
    from corolla.client.event_loop import run_sync

    try:
        config = ClientConfig(**json.loads(args.config))
        model = AutoDistributedModelForCausalLM.from_pretrained(
            args.model,
            initial_peers=args.initial_peers,
            swarm_key=args.swarm_key,
            client_config=config,
            torch_dtype=torch.float32,
        )
    except Exception as e:
        print(json.dumps({"ready": False, "error": f"{type(e).__name__}: {e}"}), flush=True)
        return 1
    manager = model.sequence_manager
    print(json.dumps({"ready": True, "peer_id": manager.node.peer_id}), flush=True)

    for line in sys.stdin:
        if not line.strip():
            continue
        command = json.loads(line)
        try:
            reply = {"ok": True, **handle(command, model, manager, run_sync, torch)}
        except Exception as e:
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
        print(json.dumps(reply), flush=True)
    model.shutdown()
    return 0


def handle(command: dict, model, manager, run_sync, torch) -> dict:
    op = command["op"]
    if op == "generate":
        ids = torch.tensor(command["ids"])
        begin = time.perf_counter()
        out = model.generate(ids, max_new_tokens=command["max_new_tokens"], do_sample=False)
        return {"tokens": out.tolist(), "seconds": time.perf_counter() - begin}
    if op == "servers":
        run_sync(manager.update(force=True))
        return {
            "blocks": [
                {
                    peer: {
                        "state": info.state.value,
                        "relayed": info.relayed,
                        "maddrs": list(info.maddrs),
                        "next_pings": dict(info.next_pings),
                    }
                    for peer, info in servers.items()
                }
                for servers in manager.block_servers
            ],
            "rtts": dict(manager.rtts),
        }
    if op == "route":
        route = run_sync(manager.make_route(0, manager.num_blocks))
        return {"route": [[span.peer_id, span.start, span.end] for span in route]}
    if op == "timed_decode":
        return timed_decode(model, torch.tensor(command["ids"]), command["new_tokens"], command["repeats"], torch)
    if op == "timed_prefill":
        return timed_prefill(model, torch.tensor(command["ids"]), command["repeats"], torch, command.get("last"))
    raise ValueError(f"unknown op {op!r}")


def timed_decode(model, ids, new_tokens: int, repeats: int, torch) -> dict:
    """Greedy decoding by hand: time to first token (session open + prefill) and seconds per further token; the
    session's counted exchanges (client.session.inference_session) per decode step, median over the repeats; the last
    repeat's tokens (prompt included), its session's route and pushed steps."""
    ttft, per_token, exchanges = [], [], []
    with torch.no_grad():
        for _ in range(repeats):
            begin = time.perf_counter()
            with model.inference_session(max_length=ids.shape[1] + new_tokens) as session:
                hidden = session.step(model.head.embed(ids))
                token = model.head.logits(hidden[:, -1:]).argmax(-1)  # (B, 1)
                tokens = [ids, token]
                first = time.perf_counter()
                before = session.exchanges
                for _ in range(new_tokens - 1):
                    hidden = session.step(model.head.embed(token))
                    token = model.head.logits(hidden[:, -1:]).argmax(-1)
                    tokens.append(token)
                done = time.perf_counter()
                exchanges.append((session.exchanges - before) / max(1, new_tokens - 1))
                route = [[span.peer_id, span.start, span.end] for span in session.route]
                pushed = session.pushed_steps
            ttft.append(first - begin)
            per_token.append((done - first) / max(1, new_tokens - 1))
    return {
        "ttft_s": ttft,
        "decode_s_per_token": per_token,
        "exchanges_per_token": sorted(exchanges)[len(exchanges) // 2],
        "tokens": torch.cat(tokens, dim=1).tolist(),
        "route": route,
        "pushed_steps": pushed,
    }


def timed_prefill(model, ids, repeats: int, torch, last: int | None = None) -> dict:
    """Time to first token of a fresh session per repeat (opening it, the prefill of `ids`, the client's head), and
    the last position's final hidden state and greedy token of the last repeat (to compare codecs and chunkings).
    `last`: the route's last server returns only the last `last` positions (as generate asks), else all of them."""
    ttft = []
    with torch.no_grad():
        for _ in range(repeats):
            begin = time.perf_counter()
            with model.inference_session(max_length=ids.shape[1] + 1) as session:
                hidden = session.step(model.head.embed(ids), last=last)[:, -1:]  # (B, 1, H)
                token = model.head.logits(hidden).argmax(-1)
                ttft.append(time.perf_counter() - begin)
                pushed = session.pushed_steps
    return {"ttft_s": ttft, "last_hidden": hidden[0, -1].tolist(), "token": token.tolist(), "pushed_steps": pushed}


if __name__ == "__main__":
    sys.exit(main())
