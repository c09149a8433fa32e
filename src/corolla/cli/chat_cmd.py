"""`corolla chat MODEL`: an interactive conversation that keeps one inference session for all turns."""

from __future__ import annotations

import argparse
import sys

from corolla.cli.generate_cmd import add_client_arguments, load_client, sampling_kwargs

DEFAULT_SESSION_LENGTH = 2048


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("chat", help="chat with a model through the swarm",
                              description="Chat in the terminal; one inference session keeps the whole conversation. "
                                          "An empty line or Ctrl+D ends it.")
    add_client_arguments(p)
    p.add_argument("--max-length", type=int, default=DEFAULT_SESSION_LENGTH,
                   help=f"tokens the whole conversation may reach (default: {DEFAULT_SESSION_LENGTH})")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from transformers import TextStreamer

    tokenizer, model = load_client(args)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    try:
        with model.inference_session(max_length=args.max_length) as session:
            while True:
                try:
                    line = input("you> ")
                except EOFError:
                    break
                if not line.strip():
                    break
                ids = tokenizer(("\n" if session.position else "") + line + "\n", return_tensors="pt", add_special_tokens=session.position == 0)["input_ids"]
                used = 0 if session.output_ids is None else session.output_ids.shape[1]
                room = args.max_length - used - ids.shape[1]
                if room <= 0:
                    print("[the conversation reached --max-length; start a new chat]", file=sys.stderr)
                    break
                print("model> ", end="", flush=True)
                model.generate(ids, session=session, streamer=streamer, **{**sampling_kwargs(args), "max_new_tokens": min(args.max_new_tokens, room)})
                sys.stdout.flush()
    finally:
        model.shutdown()
    return 0
