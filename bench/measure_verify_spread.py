"""The honest spread of span outputs between servers of different dtype, quantization, threads and sharding.

Spot checks (client.trust.verification) compare one server's output of a span with another's for the same inputs; the
tolerance must sit above what honest servers differ by and below what `--inject-fault corrupt` changes. This
starts one server per configuration, each holding the same blocks of the same random-weight Llama, sends every
server the same inputs through rpc_forward, and prints JSON: per pair of configurations the largest relative
error (client.trust.verification.relative_error) over several input draws, and the same for the corrupt perturbation.

    PYTHONPATH=src python3 bench/measure_verify_spread.py [--hidden 256] [--layers 4] [--tokens 48] [--draws 5]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from corolla import AutoDistributedModelForCausalLM
from corolla.cli.local_swarm import LocalSwarm
from corolla.client.event_loop import run_sync
from corolla.client.swarm.remote_blocks import RemoteBlocks
from corolla.client.swarm.routing import Span
from corolla.client.trust.verification import relative_error
from corolla.server.rpc.faults import corrupted

CONFIGS = {
    "f32-t1": ["--dtype", "float32", "--num-threads", "1"],
    "f32-t2": ["--dtype", "float32", "--num-threads", "2"],
    "bf16": ["--dtype", "bfloat16", "--num-threads", "1"],
    "bf16-t2": ["--dtype", "bfloat16", "--num-threads", "2"],
    "int8": ["--dtype", "float32", "--quant", "int8", "--num-threads", "1"],
    "int8-t2": ["--dtype", "float32", "--quant", "int8", "--num-threads", "2"],
    "nf4": ["--dtype", "float32", "--quant", "nf4", "--num-threads", "1"],
    "nf4-t2": ["--dtype", "float32", "--quant", "nf4", "--num-threads", "2"],
    "f32-tp2": ["--dtype", "float32", "--num-threads", "1", "--tensor-parallel-devices", "cpu", "cpu"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--draws", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "llama"
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=512, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
                             num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                             max_position_embeddings=1024)
        LlamaForCausalLM(config).save_pretrained(path)
        with LocalSwarm(env={"COROLLA_CACHE": str(Path(tmp) / "cache")}) as local:
            local.start_dht()
            procs = {
                name: local.start_server(
                    str(path), ["--blocks", f"0:{args.layers}", "--announce-period", "5", *extra], name=name, wait=False
                )
                for name, extra in CONFIGS.items()
            }
            for proc in procs.values():
                local.wait_ready(proc)
            peers = {name: _peer_id(proc.tail(200)) for name, proc in procs.items()}
            model = AutoDistributedModelForCausalLM.from_pretrained(str(path), initial_peers=local.initial_peers)
            try:
                blocks = RemoteBlocks(model.transformer.manager, 0, args.layers)
                spread: dict[str, float] = {}
                corrupt: dict[str, float] = {}
                for draw in range(args.draws):
                    ids = torch.randint(
                        0, config.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(draw)
                    )
                    hidden = model.head.embed(ids).detach()
                    outs = {
                        name: run_sync(blocks.forward_span(Span(peer, 0, args.layers), hidden, None))
                        for name, peer in peers.items()
                    }
                    for a, b in itertools.combinations(CONFIGS, 2):
                        key = f"{a} vs {b}"
                        spread[key] = max(spread.get(key, 0.0), relative_error(outs[a], outs[b]))
                    for name in CONFIGS:
                        value = relative_error(corrupted(outs[name]), outs["f32-t1"])
                        corrupt[name] = min(corrupt.get(name, float("inf")), value)
            finally:
                model.shutdown()
    print(
        json.dumps(
            {
                "model": {"hidden": args.hidden, "layers": args.layers, "tokens": args.tokens, "draws": args.draws},
                "honest_max_relative_error": spread,
                "corrupt_vs_f32_min_relative_error": corrupt,
            },
            indent=2,
        )
    )


def _peer_id(log: str) -> str:
    for line in log.splitlines():
        if "serving blocks" in line and " as " in line:
            return line.split(" as ")[1].split()[0]
    sys.exit(f"no peer id in log:\n{log}")


if __name__ == "__main__":
    main()
