#!/usr/bin/env python3
"""Distil corolla's embedded demo model into a small draft model for speculative decoding.

The draft keeps the demo model's tokenizer, embeddings, final norm and LM head, and only ``--layers`` of its six
transformer layers (evenly spaced, first and last included), so it starts close to the teacher. It is then trained
to match the teacher's next-token distribution (KL divergence on random corpus windows, teacher in float32, no
gradient) for a bounded number of steps and wall-clock minutes. What matters for speculative decoding is how often
the draft's greedy token equals the teacher's, so that rate (on held-out windows) is printed and written to
``training_log.json`` beside the weights (bfloat16 safetensors).

Usage (corpus from ``scripts/build_demo_corpus.py``)::

    python scripts/train_draft_model.py --corpus /tmp/corpus.txt --out src/corolla/demo_model/draft
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoTokenizer, LlamaForCausalLM

DEMO_MODEL = Path(__file__).resolve().parent.parent / "src" / "corolla" / "demo_model"


def layer_subset(num_layers: int, keep: int) -> list[int]:
    """``keep`` layer indices spread evenly over ``range(num_layers)``, first and last included."""
    if keep >= num_layers:
        return list(range(num_layers))
    if keep == 1:
        return [0]
    return sorted({round(i * (num_layers - 1) / (keep - 1)) for i in range(keep)})


def build_draft(teacher: LlamaForCausalLM, keep: int) -> LlamaForCausalLM:
    """A copy of the teacher with only the layers of ``layer_subset`` (config renumbered)."""
    indices = layer_subset(teacher.config.num_hidden_layers, keep)
    config = copy.deepcopy(teacher.config)
    config.num_hidden_layers = len(indices)
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[i] for i in indices]
    draft = LlamaForCausalLM(config)
    state = teacher.state_dict()
    renamed = {}
    for name, tensor in state.items():
        if name.startswith("model.layers."):
            index, rest = name[len("model.layers."):].split(".", 1)
            if int(index) not in indices:
                continue
            name = f"model.layers.{indices.index(int(index))}.{rest}"
        renamed[name] = tensor.clone()
    draft.load_state_dict(renamed)
    for i, layer in enumerate(draft.model.layers):
        layer.self_attn.layer_idx = i
    return draft


def windows(tokens: torch.Tensor, batch: int, context: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(tokens) - context, (batch,), generator=gen)
    return torch.stack([tokens[s:s + context] for s in starts.tolist()]).long()


@torch.no_grad()
def agreement(draft, teacher, val: torch.Tensor, context: int, max_windows: int) -> tuple[float, float]:
    """(greedy agreement, mean KL) of draft vs teacher over consecutive held-out windows."""
    draft.eval()
    n = min(max_windows, len(val) // context)
    batch = torch.stack([val[i * context:(i + 1) * context] for i in range(n)]).long()
    agree, kl, count = 0.0, 0.0, 0
    for chunk in batch.split(16):
        t = teacher(input_ids=chunk).logits.float()
        d = draft(input_ids=chunk).logits.float()
        agree += (t.argmax(-1) == d.argmax(-1)).float().sum().item()
        kl += F.kl_div(F.log_softmax(d, -1), F.log_softmax(t, -1), log_target=True, reduction="sum").item()
        count += chunk.numel()
    draft.train()
    return agree / count, kl / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--teacher", default=str(DEMO_MODEL))
    parser.add_argument("--layers", type=int, default=2, help="teacher layers the draft keeps")
    parser.add_argument("--init", default=None, help="continue training this draft (a directory this script wrote) "
                                                     "instead of starting from the teacher's layers")
    parser.add_argument("--steps", type=int, default=1500, help="most optimizer steps")
    parser.add_argument("--minutes", type=float, default=20.0, help="wall-clock budget")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0, help="seed of the initialisation and the training windows")
    parser.add_argument("--split-seed", type=int, default=0, help="seed of the held-out split (keep it when continuing)")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.teacher)
    teacher = LlamaForCausalLM.from_pretrained(args.teacher, dtype=torch.float32).eval().requires_grad_(False)
    if args.init:
        draft = LlamaForCausalLM.from_pretrained(args.init, dtype=torch.float32).train()
        kept = json.loads((Path(args.init) / "training_log.json").read_text())["layers_kept"]
    else:
        draft = build_draft(teacher, args.layers).float().train()
        kept = layer_subset(teacher.config.num_hidden_layers, args.layers)

    docs = [d for d in Path(args.corpus).read_text(encoding="utf-8").split("\n\n") if d.strip()]
    random.Random(args.split_seed).shuffle(docs)
    n_val = max(1, round(0.02 * len(docs)))
    encode = lambda ds: torch.tensor([t for d in ds for t in tokenizer(d)["input_ids"] + [tokenizer.eos_token_id]])  # noqa: E731
    val, train = encode(docs[:n_val]), encode(docs[n_val:])
    before = agreement(draft, teacher, val, args.context, 64)
    print(f"draft keeps layers {kept}{' (continued from ' + args.init + ')' if args.init else ''}; "
          f"before training: greedy agreement {before[0]:.3f}, KL {before[1]:.3f}", flush=True)

    optimizer = torch.optim.AdamW(draft.parameters(), lr=args.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(args.seed)
    start, step, history = time.time(), 0, []
    while step < args.steps and time.time() - start < args.minutes * 60:
        progress = step / args.steps
        for group in optimizer.param_groups:
            group["lr"] = args.lr * min(1.0, (step + 1) / 50) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        batch = windows(train, args.batch, args.context, gen)
        with torch.no_grad():
            target = F.log_softmax(teacher(input_ids=batch).logits.float(), -1)
        predicted = F.log_softmax(draft(input_ids=batch).logits.float(), -1)
        loss = F.kl_div(predicted.flatten(0, 1), target.flatten(0, 1), log_target=True, reduction="batchmean")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        if step % 100 == 0:
            history.append({"step": step, "minutes": round((time.time() - start) / 60, 2), "kl": round(loss.item(), 4)})
            print(f"step {step} | {history[-1]['minutes']} min | train KL {loss.item():.3f}", flush=True)

    after = agreement(draft, teacher, val, args.context, 64)
    print(f"after {step} steps: greedy agreement {after[0]:.3f}, KL {after[1]:.3f}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    draft.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    log = {
        "teacher": "corolla demo model", "layers_kept": kept,
        "continued_from": args.init,
        "steps": step, "minutes": round((time.time() - start) / 60, 2),
        "greedy_agreement_before": round(before[0], 4), "greedy_agreement_after": round(after[0], 4),
        "kl_before": round(before[1], 4), "kl_after": round(after[1], 4),
        "parameters": sum(p.numel() for p in draft.parameters()), "history": history,
    }
    (out / "training_log.json").write_text(json.dumps(log, indent=1) + "\n")
    for path in out.iterdir():
        path.chmod(0o644)
    print(f"saved to {out}", flush=True)


if __name__ == "__main__":
    main()
