"""`corolla chat MODEL`: an interactive conversation that keeps one inference session for all turns.

Each turn tokenizes the whole conversation and passes it with the session (the seed's chat loop); the session
sends the servers only what they do not hold yet, so the history goes over the network once."""

from __future__ import annotations

import argparse
import sys

from corolla.cli.generate_cmd import add_client_arguments, load_assistant, load_client, sampling_kwargs

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
    assistant = load_assistant(args)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    conversation = ""  # the whole text so far; each turn passes all of it, the session sends only what is new
    try:
        with model.inference_session(max_length=args.max_length, standby=args.standby) as session:
            while True:
                try:
                    line = input("you> ")
                except EOFError:
                    break
                if not line.strip():
                    break
                conversation += line + "\n"
                ids = tokenizer(conversation, return_tensors="pt")["input_ids"]
                room = args.max_length - ids.shape[1] + 1  # the last generated token is never sent
                if room <= 0:
                    print("[the conversation reached --max-length; start a new chat]", file=sys.stderr)
                    break
                print("model> ", end="", flush=True)
                out = model.generate(ids, session=session, streamer=streamer, assistant_model=assistant,
                                     **{**sampling_kwargs(args), "max_new_tokens": min(args.max_new_tokens, room)})
                sys.stdout.flush()
                conversation = tokenizer.decode(out[0], skip_special_tokens=True) + "\n"
    finally:
        model.shutdown()
    return 0
