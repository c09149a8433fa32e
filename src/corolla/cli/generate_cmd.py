"""`corolla generate MODEL "prompt"` and `corolla chat MODEL`: use a running swarm from the terminal."""

from __future__ import annotations

import argparse
import sys

from corolla.cli.common import add_initial_peers_argument, load_tokenizer, model_config
from corolla.protocol.codecs import CODECS

DEFAULT_MAX_NEW_TOKENS = 64


def add_client_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="HF repo id or local directory of the checkpoint (only its head is loaded)")
    add_initial_peers_argument(p, "multiaddrs of DHT peers of the swarm", required=True, default=None)
    p.add_argument("--dht-prefix", default=None, help="DHT namespace of the model (default: its name)")
    p.add_argument("--swarm-key", default=None, help="private swarm: the swarm key file (`corolla swarm-key PATH`)")
    p.add_argument("--compression", default="none", choices=CODECS,
                   help="how hidden states travel through the swarm: none (exact, default), deflate (exact, "
                        "~0.72-0.86 of the bytes), bf16, fp16, int8, 4bit (smaller: faster long prompts over slow "
                        "links, less exact)")
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=DEFAULT_MAX_NEW_TOKENS,
        help=f"tokens to generate (default: {DEFAULT_MAX_NEW_TOKENS})",
    )
    p.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument(
        "--temperature", type=float, default=None, help="sampling temperature (default: the model's, else 1.0)"
    )
    p.add_argument(
        "--top-k", type=int, default=None, help="sample among the k most likely tokens (default: the model's, else 50)"
    )
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass (default: the model's, else 1.0)")
    p.add_argument("--repetition-penalty", type=float, default=None, help="penalty for repeated tokens (default: 1.0)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    p.add_argument("--standby", type=int, choices=(0, 1), default=None, metavar="N",
                   help="1: a standby replica per span of the session's route, fed the same hidden states, so a "
                        "server leaving costs about one token's time instead of a replay (another server computes "
                        "every span twice; the client uploads each span's inputs once more); default "
                        "ClientConfig.standby (0)")
    add_speculation_arguments(p)


def add_speculation_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--assistant-model",
        default=None,
        metavar="PATH",
        help="speculative decoding: a small local model with the same tokenizer drafts tokens that the swarm "
        "verifies several at a time (greedy output is unchanged); 'demo' = the draft shipped for the demo "
        "model",
    )
    p.add_argument(
        "--num-assistant-tokens",
        type=int,
        default=None,
        help="most tokens the assistant drafts per step (default: its generation_config's, else 20)",
    )
    p.add_argument(
        "--prompt-lookup",
        type=int,
        default=None,
        metavar="N",
        help="speculative decoding without a model: draft up to N tokens copied from where the text's last "
        "words appeared before (HF's prompt_lookup_num_tokens)",
    )
    p.add_argument(
        "--passes-in-flight",
        type=_passes_in_flight,
        default=None,
        metavar="N|auto",
        help="speculative decoding: verify passes in flight through the servers at once (1: sequential; "
        "default auto: by the measured round trip and how often drafts are kept)",
    )


def _passes_in_flight(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected 'auto' or an integer >= 1, got {text!r}")
    return value


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "generate",
        help="generate text from a prompt through the swarm",
        description="Generate a continuation of PROMPT through a running swarm, streamed to stdout.",
    )
    add_client_arguments(p)
    p.add_argument("prompt", help="the text to continue")
    p.set_defaults(func=run)


def sampling_kwargs(args: argparse.Namespace) -> dict[str, object]:
    kwargs: dict[str, object] = {"max_new_tokens": args.max_new_tokens, "do_sample": args.do_sample}
    for name in ("temperature", "top_k", "top_p", "repetition_penalty", "num_assistant_tokens"):
        if getattr(args, name, None) is not None:
            kwargs[name] = getattr(args, name)
    if getattr(args, "prompt_lookup", None) is not None:
        kwargs["prompt_lookup_num_tokens"] = args.prompt_lookup
    if getattr(args, "passes_in_flight", None) is not None:
        kwargs["passes_in_flight"] = args.passes_in_flight
    return kwargs


def load_assistant(args: argparse.Namespace):
    """The --assistant-model checkpoint as a float32 local HF model ('demo': the shipped draft), or None."""
    path = getattr(args, "assistant_model", None)
    if path is None:
        return None
    import torch
    from transformers import AutoModelForCausalLM

    if path == "demo":
        from corolla.cli.demo_cmd import demo_draft_path

        path = str(demo_draft_path())
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def load_client(args: argparse.Namespace):
    import torch

    from corolla import AutoDistributedModelForCausalLM

    model_config(args.model)  # a model that is not there: one clear error before anything slow
    if args.seed is not None:
        torch.manual_seed(args.seed)
    tokenizer = load_tokenizer(args.model)
    model = AutoDistributedModelForCausalLM.from_pretrained(
        args.model,
        initial_peers=args.initial_peers,
        dht_prefix=args.dht_prefix,
        swarm_key=args.swarm_key,
        compression=args.compression,
    )
    return tokenizer, model


def run(args: argparse.Namespace) -> int:
    from transformers import TextStreamer

    tokenizer, model = load_client(args)
    try:
        input_ids = tokenizer(args.prompt, return_tensors="pt")["input_ids"]
        streamer = TextStreamer(tokenizer, skip_special_tokens=True)
        model.generate(input_ids, streamer=streamer, assistant_model=load_assistant(args), standby=args.standby,
                       **sampling_kwargs(args))
        sys.stdout.flush()
    finally:
        model.shutdown()
    return 0
