"""Benchmark: what each activation codec (protocol.codecs) does to a model's outputs, on the demo model.

The swarm applies a session's codec wherever hidden states cross the network: into the first server, between
servers, and back to the client. This script reproduces exactly that on the local HF demo model (6 blocks, routed
as two servers 0:3 and 3:6, so three crossings: before block 0, after block 2, after block 5), by replacing the hidden
states at those points with what the codec decodes (`roundtrip`). The codecs work per position, so a cached decode
step sees the same numbers as in a session.

Per codec, against `none` (exact):
- greedy agreement: of `--prompts` prompts (passages of Python's own documentation, pydoc_data, part of the demo
  model's training text), the share whose `--new-tokens` greedy continuation is identical, and the mean length of
  the identical prefix;
- perplexity of the model on `--eval-tokens` tokens of held-out documentation text, and its change;
- logits error: the relative L2 error of the next-token logits, max and mean over the prompts.

    python bench/bench_codecs.py [--prompts 100 --new-tokens 64]
Prints one JSON object on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from corolla.cli.demo_cmd import demo_model_path
from corolla.protocol.codecs import CODECS, roundtrip

BOUNDARIES = (0, 3, 6)  # crossings before these blocks (6 = after the last block, back to the client)


def log(message: str) -> None:
    print(f"[bench_codecs {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


class Crossings:
    """Hooks on the model's decoder layers that pass hidden states through `codec` where they cross the network."""

    def __init__(self, model) -> None:
        self.codec = "none"
        layers = model.model.layers
        for boundary in BOUNDARIES:
            if boundary < len(layers):
                layers[boundary].register_forward_pre_hook(self._before, with_kwargs=True)
            else:
                layers[-1].register_forward_hook(self._after)

    def _code(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden if self.codec == "none" else roundtrip(self.codec, hidden)

    def _before(self, module, args, kwargs):
        if args:
            return (self._code(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": self._code(kwargs["hidden_states"])}

    def _after(self, module, args, output):
        if isinstance(output, tuple):
            return (self._code(output[0]), *output[1:])
        return self._code(output)


def passages(tokenizer, count: int, length: int, skip: int = 0) -> list[torch.Tensor]:
    """`count` prompts of `length` tokens cut from pydoc topics (in sorted order, after skipping `skip` topics)."""
    import pydoc_data.topics as topics

    out = []
    for name in sorted(topics.topics)[skip:]:
        ids = tokenizer(topics.topics[name], return_tensors="pt")["input_ids"][0]
        for start in range(0, max(0, ids.shape[0] - length), length * 8):
            out.append(ids[start : start + length][None])
            if len(out) == count:
                return out
    return out


@torch.no_grad()
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=100)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--eval-tokens", type=int, default=8192, help="tokens of held-out text for perplexity")
    args = parser.parse_args()
    torch.manual_seed(0)
    path = str(demo_model_path())
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    crossings = Crossings(model)
    prompts = passages(tokenizer, args.prompts, args.prompt_tokens)
    held_out = passages(tokenizer, max(1, args.eval_tokens // 256), 256, skip=40)
    log(f"{len(prompts)} prompts of {args.prompt_tokens} tokens, {len(held_out)} x 256 tokens held out")

    results: dict = {"model": "demo", "route": "0:3 -> 3:6 (3 crossings)", "prompts": len(prompts),
                     "new_tokens": args.new_tokens, "codecs": {}}
    reference: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for codec in CODECS:
        crossings.codec = codec
        begin = time.perf_counter()
        same, prefixes, errors = 0, [], []
        for i, ids in enumerate(prompts):
            out = model.generate(ids, max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)[0, ids.shape[1]:]
            logits = model(ids).logits[0, -1]
            if codec == "none":
                reference[i] = (out, logits)
            exact, exact_logits = reference[i]
            n = min(len(out), len(exact))
            agree = (out[:n] == exact[:n]).long()
            prefixes.append(int(agree.cumprod(0).sum()))
            same += int(n == len(exact) == len(out) and bool(agree.all()))
            errors.append(float((logits - exact_logits).norm() / exact_logits.norm()))
        nll, count = 0.0, 0
        for ids in held_out:
            loss = model(ids, labels=ids).loss
            nll += float(loss) * (ids.shape[1] - 1)
            count += ids.shape[1] - 1
        perplexity = math.exp(nll / count)
        results["codecs"][codec] = {
            "greedy_identical": round(same / len(prompts), 3),
            "mean_identical_prefix_tokens": round(statistics.mean(prefixes), 1),
            "perplexity": round(perplexity, 3),
            "logits_rel_error_max": round(max(errors), 5),
            "logits_rel_error_mean": round(statistics.mean(errors), 5),
            "seconds": round(time.perf_counter() - begin, 1),
        }
        log(f"{codec}: {json.dumps(results['codecs'][codec])}")
    base = results["codecs"]["none"]["perplexity"]
    for entry in results["codecs"].values():
        entry["perplexity_change_pct"] = round(100 * (entry["perplexity"] / base - 1), 3)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
