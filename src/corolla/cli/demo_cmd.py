"""`corolla demo`: a whole swarm on this machine (a DHT peer and two servers) over the embedded demo model."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from importlib import resources
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_PROMPT = "The server"


def demo_model_path() -> Path:
    """Directory of the small Llama checkpoint shipped inside the package."""
    return Path(str(resources.files("corolla") / "demo_model"))


def demo_draft_path() -> Path:
    """Directory of the demo model's draft (3 of its 6 layers, distilled) for speculative decoding."""
    return Path(str(resources.files("corolla") / "demo_draft"))


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("demo", help="start a local swarm on the embedded model and generate",
                              description="Start a DHT peer and servers on 127.0.0.1 over the embedded demo model, "
                                          "generate a continuation through them, then stop everything.")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help=f"text to continue (default: {DEFAULT_PROMPT!r})")
    p.add_argument("--max-new-tokens", type=int, default=60, help="tokens to generate (default: 60)")
    p.add_argument("--servers", type=int, default=2, help="servers to split the blocks over (default: 2)")
    p.add_argument("--greedy", action="store_true", help="greedy decoding instead of sampling (T=0.8, top_p=0.9)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    p.add_argument("--model", default=None, help="use this checkpoint instead of the embedded one")
    p.add_argument("--speculative", action="store_true",
                   help="speculative decoding with the shipped draft model: several tokens per swarm round trip, the "
                        "same greedy text (sampling keeps the model's distribution, not the same draws)")
    p.add_argument("--prompt-lookup", type=int, default=None, metavar="N",
                   help="speculative decoding from the text itself: draft up to N tokens per round trip")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TextStreamer

    from corolla import AutoDistributedModelForCausalLM
    from corolla.cli.common import model_config
    from corolla.cli.local_swarm import LocalSwarm
    from corolla.models import get_family

    model_path = args.model or str(demo_model_path())
    config = model_config(model_path)
    num_blocks = get_family(config).num_blocks(config)
    servers = max(1, min(args.servers, num_blocks))
    bounds = [round(i * num_blocks / servers) for i in range(servers + 1)]

    begin = time.perf_counter()
    with LocalSwarm() as swarm:
        peers = swarm.start_dht()
        print(f"DHT bootstrap peer: {peers[0]}", file=sys.stderr)
        procs = [
            swarm.start_server(
                model_path, ["--blocks", f"{a}:{b}", "--num-threads", "1"], name=f"server{i}", wait=False
            )
            for i, (a, b) in enumerate(zip(bounds, bounds[1:]))
        ]
        for proc, a, b in zip(procs, bounds, bounds[1:]):
            swarm.wait_ready(proc)
            print(f"server {proc.name} (pid {proc.pid}) serves blocks {a}:{b}", file=sys.stderr)
        print(
            f"swarm ready in {time.perf_counter() - begin:.1f}s; generating through {servers} server(s)\n",
            file=sys.stderr,
        )

        # one torch thread, as each server: on a small machine the processes' OpenMP pools would fight over the
        # cores (the draft model's small matmuls suffer most: 4x slower with 2 threads on 2 busy cores, measured)
        torch.set_num_threads(1)
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        model = AutoDistributedModelForCausalLM.from_pretrained(
            model_path, initial_peers=peers, torch_dtype=torch.float32
        )
        try:
            torch.manual_seed(args.seed)
            input_ids = tokenizer(args.prompt, return_tensors="pt")["input_ids"]
            sampling = {} if args.greedy else {"do_sample": True, "temperature": 0.8, "top_p": 0.9, "top_k": 0}
            if args.speculative and args.prompt_lookup is not None:
                raise SystemExit("corolla demo: pass --speculative or --prompt-lookup, not both")
            if args.speculative:
                draft = demo_draft_path() if args.model is None else None
                if draft is None:
                    raise SystemExit(
                        "corolla demo: --speculative uses the embedded model's draft; with --model, use "
                        "--prompt-lookup or `corolla generate --assistant-model`"
                    )
                sampling["assistant_model"] = AutoModelForCausalLM.from_pretrained(draft, dtype=torch.float32).eval()
            if args.prompt_lookup is not None:
                sampling["prompt_lookup_num_tokens"] = args.prompt_lookup
            with model.inference_session(max_length=input_ids.shape[1] + args.max_new_tokens) as session:
                start = time.perf_counter()
                out = model.generate(
                    input_ids,
                    max_new_tokens=args.max_new_tokens,
                    session=session,
                    streamer=TextStreamer(tokenizer, skip_special_tokens=True),
                    **sampling,
                )
                elapsed = time.perf_counter() - start
            new = out.shape[1] - input_ids.shape[1]
            print(
                f"\n\n{new} tokens in {elapsed:.2f}s ({1000 * elapsed / max(new, 1):.1f} ms/token, "
                f"{session.steps} round "
                f"trips to the swarm) through {servers} server(s)",
                file=sys.stderr,
            )
        finally:
            model.shutdown()
    return 0
