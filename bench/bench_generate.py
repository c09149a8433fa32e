"""Benchmark: local Hugging Face greedy generation vs. the same model through a local corolla swarm.

For each model (random weights, float32, from any family corolla serves: our own blocks for Llama/Mistral/Qwen2/
Qwen3, BLOOM, Falcon, Mixtral, the generic backend for the rest, e.g. Qwen3-MoE and Gemma 3) the swarm is a DHT peer
plus two servers holding half the blocks each, all on this machine. A model name ending in ``@generic`` runs the same
checkpoint with servers forced onto the generic backend (``COROLLA_BACKEND=generic``), so ``tinyllama8@generic``
prices the generic path against our own Llama block.
Both sides run the same greedy loop and are timed the same way:

* prefill (time to first token): the prompt's forward with a KV cache, the last position's logits, argmax;
* decode: each further token's forward (one token, reusing the cache), logits, argmax; reported per token.

Every process (servers, client, local baseline) uses one torch thread, so that on a small machine the processes'
OpenMP pools do not fight over the cores. Prints one JSON object on stdout; progress goes to stderr.

    python bench/bench_generate.py --models tiny --repeats 3
    python bench/bench_generate.py --models families     # one 8-layer realistic-shape checkpoint per family
    python bench/bench_generate.py --models generic      # Qwen3-MoE and Gemma-3 shapes; our Llama block vs generic
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
import weakref
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    BloomConfig,
    FalconConfig,
    Gemma3TextConfig,
    LlamaConfig,
    MixtralConfig,
    PretrainedConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

# Token ids every checkpoint gets; eos_token_id=None: greedy runs never stop early.
SPECIAL_TOKENS = {"bos_token_id": 1, "eos_token_id": None, "pad_token_id": None}
TINY = {"hidden_size": 64, "num_attention_heads": 4, "vocab_size": 128}  # shared by the tiny-* smoke-test models
FALCON_ROTARY = {"parallel_attn": True, "bias": False, "alibi": False}  # rotary Falcon (corolla rejects ALiBi)

# name -> (HF config class, its arguments). The per-family models are 8 layers of a real 1B-7B shape with
# vocab 32000 (the real vocabularies range 32k-250k; one size keeps the client's embeddings/LM head comparable).
MODELS: dict[str, tuple[type[PretrainedConfig], dict]] = {
    "tiny": (LlamaConfig, {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
                           "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 128}),
    "tinyllama8": (LlamaConfig, {"hidden_size": 2048, "num_hidden_layers": 8, "num_attention_heads": 32,
                                 "num_key_value_heads": 4, "intermediate_size": 5632, "vocab_size": 32000,
                                 "rms_norm_eps": 1e-5}),
    # one realistic shape per family (the `families` shortcut), each with goal decode <= 1.10x local
    "qwen3-0.6b8": (Qwen3Config, {"hidden_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 16,
                                  "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 3072,
                                  "vocab_size": 32000, "rms_norm_eps": 1e-6, "tie_word_embeddings": True}),
    "bloom-1b1-8": (BloomConfig, {"hidden_size": 1536, "n_layer": 8, "n_head": 16, "vocab_size": 32000}),
    "falcon40b-shape-1b8": (FalconConfig, {"hidden_size": 2048, "num_hidden_layers": 8, "num_attention_heads": 32,
                                           "num_kv_heads": 4, "new_decoder_architecture": True, "vocab_size": 32000,
                                           **FALCON_ROTARY}),
    "mixtral-1b8": (MixtralConfig, {"hidden_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 16,
                                    "num_key_value_heads": 8, "intermediate_size": 3584, "num_local_experts": 8,
                                    "num_experts_per_tok": 2, "sliding_window": None, "vocab_size": 32000}),
    "falcon-7b8": (FalconConfig, {"hidden_size": 4544, "num_hidden_layers": 8, "num_attention_heads": 71,
                                  "multi_query": True, "new_decoder_architecture": False, "vocab_size": 32000,
                                  **FALCON_ROTARY}),
    # generic backend (the `generic` shortcut): 8 layers at the real models' widths, vocab 32000.
    # Qwen3-30B-A3B's widths, 32 of its 128 experts (the same 8 active per token; 128 would not fit in memory here)
    "qwen3moe8": (Qwen3MoeConfig, {"hidden_size": 2048, "num_hidden_layers": 8, "num_attention_heads": 32,
                                   "num_key_value_heads": 4, "head_dim": 128, "moe_intermediate_size": 768,
                                   "intermediate_size": 6144, "num_experts": 32, "num_experts_per_tok": 8,
                                   "norm_topk_prob": True, "vocab_size": 32000, "rms_norm_eps": 1e-6}),
    # Gemma-3-4B's widths: 5 sliding layers (window 1024, rotary base 1e4) per global one (base 1e6), head_dim 256
    "gemma3-4b8": (Gemma3TextConfig, {"hidden_size": 2560, "num_hidden_layers": 8, "num_attention_heads": 8,
                                      "num_key_value_heads": 4, "head_dim": 256, "intermediate_size": 10240,
                                      "sliding_window": 1024, "query_pre_attn_scalar": 256, "vocab_size": 32000,
                                      "layer_types": ["sliding_attention"] * 5 + ["full_attention"]
                                      + ["sliding_attention"] * 2}),
    # the same families at hidden 64 (the `tiny-families` shortcut): a quick check that every code path runs
    "tiny-qwen3": (Qwen3Config, {**TINY, "num_hidden_layers": 4, "num_key_value_heads": 2, "head_dim": 32,
                                 "intermediate_size": 128, "tie_word_embeddings": True}),
    "tiny-bloom": (BloomConfig, {"hidden_size": 64, "n_layer": 4, "n_head": 4, "vocab_size": 128}),
    "tiny-falcon40b": (FalconConfig, {**TINY, "num_hidden_layers": 4, "num_kv_heads": 2,
                                      "new_decoder_architecture": True, **FALCON_ROTARY}),
    "tiny-mixtral": (MixtralConfig, {**TINY, "num_hidden_layers": 4, "num_key_value_heads": 2, "intermediate_size": 128,
                                     "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None}),
    "tiny-falcon7b": (FalconConfig, {**TINY, "num_hidden_layers": 4, "multi_query": True,
                                     "new_decoder_architecture": False, **FALCON_ROTARY}),
    "tiny-qwen3moe": (Qwen3MoeConfig, {**TINY, "num_hidden_layers": 4, "num_key_value_heads": 2, "head_dim": 16,
                                       "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2}),
    "tiny-gemma3": (Gemma3TextConfig, {**TINY, "num_hidden_layers": 4, "num_key_value_heads": 2, "head_dim": 16,
                                       "intermediate_size": 128, "sliding_window": 4, "query_pre_attn_scalar": 16,
                                       "layer_types": ["sliding_attention", "full_attention"] * 2}),
}
GENERIC_SUFFIX = "@generic"  # e.g. tinyllama8@generic: that checkpoint, servers forced onto the generic backend
FAMILY_MODELS = ("qwen3-0.6b8", "bloom-1b1-8", "falcon40b-shape-1b8", "mixtral-1b8", "falcon-7b8")  # smallest first
GENERIC_MODELS = ("qwen3moe8", "gemma3-4b8", "tinyllama8", f"tinyllama8{GENERIC_SUFFIX}")
SHORTCUTS = {"families": FAMILY_MODELS, "tiny-families": tuple(n for n in MODELS if n.startswith("tiny-")),
             "generic": GENERIC_MODELS}
CACHED = {"tinyllama8", *FAMILY_MODELS, "qwen3moe8", "gemma3-4b8"}  # built once into the cache dir and reused
METHOD = (
    "Identical greedy loop on both sides, each timed with perf_counter after one untimed warm-up run. "
    "prefill_s = prompt forward with KV cache + logits of the last position only (local: "
    "model(ids, use_cache=True, logits_to_keep=1), as HF generate does; swarm: head.embed + session.step + "
    "head.logits on the last position, the session being opened lazily by that first step, as in generate) + argmax. "
    "decode_ms_per_token = time of the remaining new_tokens-1 single-token steps (local: model(tok, "
    "past_key_values=...); swarm: embed + session.step + logits) / (new_tokens-1). Median over repeats; a fresh "
    "KV cache / inference session per repeat. One torch thread in every process (client, local baseline and each "
    "server via --num-threads 1). The local model is timed before the swarm starts (no competing processes). "
    "Diagnostic, not used in ratios: swarm.prefill_open_session_s = the same prefill re-run after rolling the "
    "open session back to position 0, i.e. prefill without the cost of opening the session. "
    "A name ending in @generic: the same checkpoint and local baseline, servers started with COROLLA_BACKEND=generic "
    "(client unchanged)."
)


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def base_name(name: str) -> str:
    """The checkpoint a benchmark name runs: `name` without a backend suffix."""
    return name.removesuffix(GENERIC_SUFFIX)


def model_config(name: str) -> PretrainedConfig:
    """The HF config of benchmark model `name` (MODELS' arguments plus SPECIAL_TOKENS)."""
    config_class, kwargs = MODELS[base_name(name)]
    return config_class(**kwargs, **SPECIAL_TOKENS)


def build_model(name: str, cache_root: Path, tmp_root: Path) -> Path:
    """Write a random-weight float32 checkpoint for `name` (reusing a cached one) and return its directory.

    The model exists only inside this call: it is deleted and collected before returning, so that the
    checkpoints of several models are never in memory together, nor with the local baseline loaded next.
    """
    name = base_name(name)
    path = (cache_root if name in CACHED else tmp_root) / name
    if (path / "COMPLETE").exists():
        log(f"{name}: reusing {path}")
        return path
    log(f"{name}: building random checkpoint in {path}")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(model_config(name), dtype=torch.float32)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    del model
    gc.collect()
    (path / "COMPLETE").write_text("ok\n")
    return path


def median_timings(run_once, repeats: int) -> tuple[dict, list[int]]:
    """Call run_once() -> ({metric: seconds}, tokens) once untimed, then `repeats` times; report the medians.

    decode_s_per_token is reported as decode_ms_per_token; the other metrics stay in seconds.
    """
    _, tokens = run_once()
    runs: dict[str, list[float]] = {}
    for _ in range(repeats):
        metrics, tokens_again = run_once()
        if tokens_again != tokens:
            raise RuntimeError("greedy tokens changed between runs")
        for key, value in metrics.items():
            if key == "decode_s_per_token":
                key, value = "decode_ms_per_token", value * 1e3
            runs.setdefault(key, []).append(round(value, 5))
    result = {key: round(statistics.median(values), 5) for key, values in runs.items()}
    return {**result, "runs": runs}, tokens


def greedy_loop(first_step, next_step, new_tokens: int) -> tuple[dict, list[int]]:
    """Time first_step() -> token, then new_tokens-1 calls of next_step(token) -> token."""
    begin = time.perf_counter()
    token = first_step()
    prefill = time.perf_counter() - begin
    tokens = [int(token)]
    begin = time.perf_counter()
    for _ in range(new_tokens - 1):
        token = next_step(token)
        tokens.append(int(token))
    decode = (time.perf_counter() - begin) / max(new_tokens - 1, 1)
    return {"prefill_s": prefill, "decode_s_per_token": decode}, tokens


def bench_local(path: Path, ids: torch.Tensor, new_tokens: int, repeats: int) -> tuple[dict, list[int], bool, int]:
    """Time the HF model in this process; also check the loop's tokens against HF generate.

    Returns (timings, tokens, loop tokens == HF generate's, parameter count). The model is freed before this
    returns (raises RuntimeError if something still holds it), so the swarm's servers never load their
    blocks while a full local copy of the weights is still in memory.
    """
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    n_params = sum(p.numel() for p in model.parameters())  # tied embeddings counted once
    result, tokens, matches_generate = time_local(model, ids, new_tokens, repeats)
    alive = weakref.ref(model)
    del model
    gc.collect()
    if alive() is not None:
        raise RuntimeError("the local model is still referenced; the swarm would start with a second copy in memory")
    return result, tokens, matches_generate, n_params


@torch.inference_mode()
def time_local(
    model: torch.nn.Module, ids: torch.Tensor, new_tokens: int, repeats: int
) -> tuple[dict, list[int], bool]:
    """The greedy loop timed on the HF `model`; returns (timings, tokens, loop tokens == HF generate's)."""

    def run_once():
        state = {}

        def first():
            out = model(ids, use_cache=True, logits_to_keep=1)
            state["past"] = out.past_key_values
            return out.logits[:, -1].argmax(-1)  # (1,)

        def step(token):
            out = model(token[:, None], past_key_values=state["past"], use_cache=True)
            state["past"] = out.past_key_values
            return out.logits[:, -1].argmax(-1)

        return greedy_loop(first, step, new_tokens)

    result, tokens = median_timings(run_once, repeats)
    generated = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    matches_generate = generated[0, ids.shape[1]:].tolist() == tokens
    return result, tokens, matches_generate


@torch.inference_mode()
def bench_swarm(path: Path, ids: torch.Tensor, new_tokens: int, repeats: int, num_layers: int,
                server_env: dict[str, str] | None = None, compression: str = "none") -> tuple[dict, list[int], bool]:
    """Start a DHT peer and two servers (half the blocks each; `server_env` added to their environment), time the
    same loop through an inference session whose hidden states cross the network in codec `compression`."""
    from corolla import AutoDistributedModelForCausalLM
    from corolla.cli.local_swarm import LocalSwarm

    half = num_layers // 2
    with LocalSwarm(env=server_env) as swarm:
        peers = swarm.start_dht()
        servers = [swarm.start_server(str(path), ["--blocks", blocks, "--num-threads", "1"], wait=False)
                   for blocks in (f"0:{half}", f"{half}:{num_layers}")]
        for server in servers:
            swarm.wait_ready(server, timeout=600)
        log("swarm ready")
        model = AutoDistributedModelForCausalLM.from_pretrained(str(path), initial_peers=peers,
                                                                torch_dtype=torch.float32, compression=compression)
        try:
            head = model.head

            def run_once():
                with model.inference_session(max_length=ids.shape[1] + new_tokens) as session:

                    def step(tokens):  # (1, t) -> (1,)
                        hidden = session.step(head.embed(tokens))
                        return head.logits(hidden[:, -1:])[:, -1].argmax(-1)

                    metrics, tokens = greedy_loop(lambda: step(ids), lambda token: step(token[:, None]), new_tokens)
                    session.position = 0  # roll back: the same prefill again, on the already-open session
                    begin = time.perf_counter()
                    step(ids)
                    metrics["prefill_open_session_s"] = time.perf_counter() - begin
                    return metrics, tokens

            result, tokens = median_timings(run_once, repeats)
            generated = model.generate(ids, max_new_tokens=new_tokens)
            matches_generate = generated[0, ids.shape[1] :].tolist() == tokens
            result["servers_peak_rss_mb"] = [peak_rss_mb(server.pid) for server in servers]
        finally:
            model.shutdown()
    return result, tokens, matches_generate


def peak_rss_mb(pid: int | None = None) -> float | None:
    """Peak resident memory (MB) of process `pid` (VmHWM), or of this process when None; None if unreadable."""
    if pid is None:
        return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)  # ru_maxrss is in KiB on Linux
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)  # "VmHWM:  123456 kB"
    except OSError:
        pass
    return None


def bench_model(
    name: str, args: argparse.Namespace, cache_root: Path, tmp_root: Path, locals_done: dict[str, tuple]
) -> dict:
    path = build_model(name, cache_root, tmp_root)
    config = model_config(name)
    ids = torch.randint(3, config.vocab_size, (1, args.prompt_tokens), generator=torch.Generator().manual_seed(0))
    if base_name(name) in locals_done:  # the same checkpoint's baseline, already timed in this run
        local, local_tokens, local_gen_ok, n_params = locals_done[base_name(name)]
    else:
        log(f"{name}: local HF ({args.repeats} repeats)")
        local, local_tokens, local_gen_ok, n_params = bench_local(path, ids, args.new_tokens, args.repeats)
        locals_done[base_name(name)] = (local, local_tokens, local_gen_ok, n_params)
    log(f"{name}: local {local['prefill_s']} s prefill, {local['decode_ms_per_token']} ms/token; starting swarm")
    env = {"COROLLA_BACKEND": "generic"} if name.endswith(GENERIC_SUFFIX) else None
    swarm, swarm_tokens, swarm_gen_ok = bench_swarm(
        path, ids, args.new_tokens, args.repeats, config.num_hidden_layers, env, args.compression
    )
    log(f"{name}: swarm {swarm['prefill_s']} s prefill, {swarm['decode_ms_per_token']} ms/token")
    size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    return {
        "config": {
            "model_type": config.model_type,
            **MODELS[base_name(name)][1],
            "parameters": n_params,
            "checkpoint_bytes": size,
            "server_backend": backend_of(name, config),
        },
        "local": local,
        "swarm": swarm,
        "ratios": {
            "prefill": round(swarm["prefill_s"] / local["prefill_s"], 3),
            "decode": round(swarm["decode_ms_per_token"] / local["decode_ms_per_token"], 3),
        },
        "decode_overhead_ms_per_token": round(swarm["decode_ms_per_token"] - local["decode_ms_per_token"], 3),
        "tokens_equal": swarm_tokens == local_tokens,
        "local_loop_equals_hf_generate": local_gen_ok,
        "swarm_loop_equals_swarm_generate": swarm_gen_ok,
        "bench_process_peak_rss_mb_so_far": peak_rss_mb(),  # this process: checkpoint build, local model, client
    }


def backend_of(name: str, config: PretrainedConfig) -> str:
    """Which backend the servers of benchmark `name` run: "generic" or our own family's name."""
    from corolla.models.registry import _BY_MODEL_TYPE

    family = _BY_MODEL_TYPE.get(config.model_type)
    return "generic" if name.endswith(GENERIC_SUFFIX) or family is None else family.name


def goals(results: dict) -> dict:
    """The issue's targets, each True/False (None when that model was not run), and the generic path's cost."""
    tiny, big = results.get("tiny"), results.get("tinyllama8")
    return {
        "tinyllama8_decode_le_1.10x_local": None if big is None else big["ratios"]["decode"] <= 1.10,
        "tiny_decode_le_local_plus_2ms": None if tiny is None else tiny["decode_overhead_ms_per_token"] <= 2.0,
        **{
            f"{name}_decode_le_1.10x_local": results[name]["ratios"]["decode"] <= 1.10
            for name in (*FAMILY_MODELS, *GENERIC_MODELS)
            if name in results
        },  # only the models that were run
        "prefill_le_1.2x_local": {name: r["ratios"]["prefill"] <= 1.2 for name, r in results.items()},
        # our own block vs the generic backend on one checkpoint (X and X@generic): swarm time, generic / ours
        "generic_vs_our_block": {
            name: {
                key: round(r["swarm"][key] / results[base_name(name)]["swarm"][key], 3)
                for key in ("decode_ms_per_token", "prefill_s")
            }
            for name, r in results.items()
            if name.endswith(GENERIC_SUFFIX) and base_name(name) in results
        },
    }


def expand_models(spec: str) -> list[str]:
    """A comma-separated --models value -> model names in order, shortcuts expanded, duplicates dropped."""
    names: list[str] = []
    for item in (n.strip() for n in spec.split(",")):
        for name in SHORTCUTS.get(item, (item,) if item else ()):
            if name not in names:
                names.append(name)
    return names


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--models",
        default="tiny,tinyllama8",
        help=f"comma-separated, from {list(MODELS)}; shortcuts: {sorted(SHORTCUTS)}",
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per side (median reported)")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens generated per run")
    parser.add_argument("--prompt-tokens", type=int, default=128, help="random prompt length")
    parser.add_argument("--compression", default="none", help="the swarm session's activation codec (none: exact)")
    parser.add_argument(
        "--cache-dir",
        default=os.environ.get("COROLLA_BENCH_CACHE", "/tmp/corolla-bench"),
        help="where the large checkpoints are built once and reused ($COROLLA_BENCH_CACHE)",
    )
    args = parser.parse_args()
    names = expand_models(args.models)
    unknown = [n for n in names if base_name(n) not in MODELS]
    if unknown or args.repeats < 1 or args.new_tokens < 2 or args.prompt_tokens < 1:
        parser.error(
            f"unknown models {unknown}" if unknown else "need repeats >= 1, new-tokens >= 2, prompt-tokens >= 1"
        )

    torch.set_num_threads(1)
    started = time.perf_counter()
    results = {}
    with tempfile.TemporaryDirectory(prefix="corolla-bench-") as tmp:
        locals_done: dict[str, tuple] = {}
        for name in names:
            results[name] = bench_model(name, args, Path(args.cache_dir), Path(tmp), locals_done)
    report = {
        "models": results,
        "goals": goals(results),
        "settings": {
            "prompt_tokens": args.prompt_tokens,
            "new_tokens": args.new_tokens,
            "repeats": args.repeats,
            "dtype": "float32",
            "greedy": True,
            "servers": 2,
            "compression": args.compression,
            "blocks_per_server": "half each",
        },
        "method": METHOD,
        "machine": {
            "cpu_count": os.cpu_count(),
            "torch": torch.__version__,
            "torch_threads_client": torch.get_num_threads(),
            "torch_threads_local_baseline": 1,
            "torch_threads_servers": 1,
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "wall_s": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
