#!/usr/bin/env python3
"""Train corolla's embedded demo model from scratch on a CPU, within a wall-clock budget.

Steps: train a byte-level BPE tokenizer (vocab 4096) on the corpus, wrap it as a
``transformers.PreTrainedTokenizerFast``, then train a ~6.5M-parameter ``LlamaForCausalLM``
(6 layers, hidden 256, 4 query / 2 key-value heads) on random 256-token windows with AdamW and a
warmup + cosine learning rate that decays over the time budget. 2% of the documents are held out;
validation loss is printed periodically and the best weights are kept. The output directory gets
the model in bfloat16 (safetensors), the tokenizer files and ``training_log.json``.

Usage (corpus from ``scripts/build_demo_corpus.py``)::

    python scripts/train_demo_model.py --corpus /tmp/corpus.txt --out src/corolla/demo_model --minutes 20
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]  # ids 0..3
UNK_ID, BOS_ID, EOS_ID, PAD_ID = range(4)


def train_tokenizer(docs: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer that prepends ``<s>`` to every encoded sequence."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        pad_token="<pad>", model_max_length=512,
    )


def encode_docs(tokenizer: PreTrainedTokenizerFast, docs: list[str]) -> torch.Tensor:
    """Concatenate ``<s> doc </s>`` for every document into one flat token tensor."""
    ids: list[int] = []
    for enc in tokenizer.backend_tokenizer.encode_batch(docs):  # post-processor adds <s>
        ids.extend(enc.ids)
        ids.append(EOS_ID)
    return torch.tensor(ids, dtype=torch.int32)


def build_model(vocab_size: int) -> LlamaForCausalLM:
    """The demo architecture: 6 layers, hidden 256, GQA 4/2 heads, untied embeddings (~6.5M)."""
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=256, intermediate_size=688, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    return LlamaForCausalLM(config)


def random_batch(tokens: torch.Tensor, batch: int, context: int, gen: torch.Generator) -> torch.Tensor:
    """``batch`` random windows of ``context + 1`` tokens, as int64."""
    starts = torch.randint(0, len(tokens) - context - 1, (batch,), generator=gen)
    return torch.stack([tokens[s:s + context + 1] for s in starts.tolist()]).long()


def loss_on(model, window: torch.Tensor, bf16: bool) -> torch.Tensor:
    """Mean next-token cross-entropy on a batch of windows."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logits = model(input_ids=window[:, :-1]).logits
    return F.cross_entropy(logits.float().flatten(0, 1), window[:, 1:].flatten())


@torch.no_grad()
def evaluate(model, val: torch.Tensor, context: int, max_windows: int, bf16: bool) -> float:
    """Average loss over consecutive non-overlapping validation windows (deterministic)."""
    model.eval()
    n = min(max_windows, (len(val) - 1) // context)
    windows = torch.stack([val[i * context:i * context + context + 1] for i in range(n)]).long()
    losses = [loss_on(model, chunk, bf16).item() * len(chunk) for chunk in windows.split(32)]
    model.train()
    return sum(losses) / n


def pick_bf16(model, tokens: torch.Tensor, batch: int, context: int) -> bool:
    """Time a few eager forward/backward passes in float32 and under bf16 autocast."""
    gen = torch.Generator().manual_seed(1)
    timings = {}
    for bf16 in (False, True):
        for i in range(4):
            if i == 1:
                start = time.perf_counter()
            loss_on(model, random_batch(tokens, batch, context, gen), bf16).backward()
        timings[bf16] = (time.perf_counter() - start) / 3
    model.zero_grad(set_to_none=True)
    print(f"step time: fp32 {timings[False]:.2f}s, bf16 autocast {timings[True]:.2f}s", flush=True)
    return timings[True] < 0.9 * timings[False]


def main() -> None:
    """Tokenizer, training loop, and export."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--minutes", type=float, default=20.0, help="wall-clock training budget")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--min-lr-ratio", type=float, default=0.1)
    parser.add_argument("--warmup", type=int, default=150, help="warmup steps")
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--eval-every", type=float, default=1.5, help="minutes between evaluations")
    parser.add_argument("--eval-windows", type=int, default=512, help="max validation windows")
    parser.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    text = Path(args.corpus).read_text(encoding="utf-8")
    docs = [d for d in text.split("\n\n") if d.strip()]
    random.Random(args.seed).shuffle(docs)
    n_val = max(1, round(0.02 * len(docs)))
    train_docs, val_docs = docs[n_val:], docs[:n_val]

    t0 = time.time()
    tokenizer = train_tokenizer(train_docs, args.vocab)
    train_tokens, val_tokens = encode_docs(tokenizer, train_docs), encode_docs(tokenizer, val_docs)
    print(f"corpus {len(text.encode()) / 1e6:.2f} MB, {len(docs)} docs; tokenizer trained in "
          f"{time.time() - t0:.0f}s; train {len(train_tokens):,} tokens, val {len(val_tokens):,}; "
          f"{len(text.encode()) / (len(train_tokens) + len(val_tokens)):.2f} bytes/token", flush=True)

    model = build_model(len(tokenizer))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters", flush=True)
    bf16 = {"fp32": False, "bf16": True}.get(args.precision)
    if bf16 is None:
        bf16 = pick_bf16(model, train_tokens, args.batch, args.context)
    print(f"precision: {'bf16 autocast' if bf16 else 'fp32'}", flush=True)

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
    )
    train_model = model if args.no_compile else torch.compile(model)
    gen = torch.Generator().manual_seed(args.seed)

    budget = args.minutes * 60
    start = last_eval = time.time()
    step, tokens_seen, recent = 0, 0, []
    best_loss, best_state, history = math.inf, None, []
    while True:
        elapsed = time.time() - start
        done = elapsed >= budget
        if done or time.time() - last_eval >= args.eval_every * 60:
            val_loss = evaluate(model, val_tokens, args.context, args.eval_windows, bf16)
            train_loss = sum(recent) / max(1, len(recent))
            recent, last_eval = [], time.time()
            history.append({"step": step, "tokens": tokens_seen, "minutes": round(elapsed / 60, 2),
                            "train_loss": round(train_loss, 4), "val_loss": round(val_loss, 4)})
            print(f"step {step:5d} | {elapsed / 60:5.1f} min | {tokens_seen / 1e6:6.2f}M tok | "
                  f"{tokens_seen / max(elapsed, 1e-9):5.0f} tok/s | lr {optimizer.param_groups[0]['lr']:.2e} | "
                  f"train {train_loss:.3f} | val {val_loss:.3f}", flush=True)
            if val_loss < best_loss:
                best_loss = val_loss
                best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            if done:
                break

        progress = min(1.0, elapsed / budget)
        cosine = args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        lr = args.lr * min(1.0, (step + 1) / args.warmup) * cosine
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = random_batch(train_tokens, args.batch, args.context, gen)
        try:
            loss = loss_on(train_model, batch, bf16)
        except Exception as exc:  # torch.compile can fail on odd toolchains
            if train_model is model:
                raise
            print(f"torch.compile failed ({type(exc).__name__}: {exc}); continuing eagerly", flush=True)
            train_model = model
            loss = loss_on(train_model, batch, bf16)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        recent.append(loss.item())
        step += 1
        tokens_seen += batch.numel() - len(batch)

    minutes = (time.time() - start) / 60
    final_loss = history[-1]["val_loss"]
    model.load_state_dict(best_state)
    if best_loss < final_loss:  # the saved weights are the best evaluated ones
        final_loss = evaluate(model, val_tokens, args.context, args.eval_windows, bf16)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    log = {
        "final_val_loss": round(final_loss, 4), "tokens_seen": tokens_seen, "steps": step,
        "minutes": round(minutes, 2), "corpus_bytes": len(text.encode()), "corpus_documents": len(docs),
        "train_tokens": len(train_tokens), "val_tokens": len(val_tokens), "parameters": n_params,
        "precision": "bf16-autocast" if bf16 else "fp32", "batch": args.batch, "context": args.context,
        "lr": args.lr, "threads": args.threads, "history": history,
    }
    (out / "training_log.json").write_text(json.dumps(log, indent=1) + "\n")
    for path in out.iterdir():  # save_pretrained may create owner-only files
        path.chmod(0o644)
    print(f"saved to {out}: val loss {final_loss:.3f}, {tokens_seen / 1e6:.2f}M tokens, "
          f"{step} steps, {minutes:.1f} min", flush=True)


if __name__ == "__main__":
    main()
