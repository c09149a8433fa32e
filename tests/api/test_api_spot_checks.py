"""The API engine over a real swarm whose preferred server lies (`--inject-fault corrupt`, armed from the start),
with spot checks on every step (ClientConfig.verify_rate=1): the liar is convicted (a holder of its blocks disagrees
with it, and the client computes the span itself from the checkpoint to settle who is right), each choice is
rewound to where the lie began and generated again, and what the choices return, whole or streamed, is the local
HF model's greedy output."""

from __future__ import annotations

import asyncio
import signal

import torch
from transformers import LlamaForCausalLM

from conftest import save_word_tokenizer
from corolla import AutoDistributedModelForCausalLM, ClientConfig
from corolla.api.config import ApiConfig
from corolla.api.engine import BatchedEngine
from corolla.api.handle import StreamHandle
from corolla.api.metrics import ApiMetrics
from corolla.api.sampling import SamplingParams
from corolla.api.stream import StreamEvent

PROMPT = [1, 11, 22, 33, 44]
NEW_TOKENS = 16  # the liar's outputs change HF's greedy token 12 of this prompt (tiny Llama, blocks 2:4)
PREFERRED = ["--throughput", "1000"]  # sessions are routed through this server while it is trusted
BACKUP = ["--throughput", "10"]


async def events_of(handle: StreamHandle) -> list[StreamEvent]:
    events = [await handle.next()]
    while events[-1].finish_reason is None and events[-1].error is None:
        events.append(await handle.next())
    return events


def test_api_choices_after_a_liar_is_caught_are_rewound_to_hf_greedy_streamed_and_not(
    start_swarm, tiny_llama_path, tmp_path, monkeypatch
):
    monkeypatch.setenv("COROLLA_CACHE", str(tmp_path / "client-cache"))  # the client's reputation file
    swarm = start_swarm(head=("0:2", []), corrupt=("2:4", [*PREFERRED, "--inject-fault", "corrupt"]),
                        honest=("2:4", BACKUP))
    swarm.procs["corrupt"].popen.send_signal(signal.SIGUSR1)
    hf = LlamaForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()
    expected = hf.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(PROMPT):].tolist()

    model = AutoDistributedModelForCausalLM.from_pretrained(
        tiny_llama_path, initial_peers=swarm.peers, torch_dtype=torch.float32,
        client_config=ClientConfig(verify_rate=1.0, verify_seed=0, ping_timeout=10.0))
    engine = BatchedEngine(model, save_word_tokenizer(str(tmp_path / "tokenizer")),
                           ApiConfig(model=tiny_llama_path, max_idle_sessions=0), ApiMetrics(), max_length=64)
    engine.start()
    try:
        async def both() -> list[list[StreamEvent]]:
            params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
            whole = engine.submit(PROMPT, params, 0, streamed=False)
            streamed = engine.submit(PROMPT, params, 1, streamed=True)
            return list(await asyncio.wait_for(asyncio.gather(events_of(whole), events_of(streamed)), 120))

        choices = asyncio.run(both())
        reputation = model.reputation()
    finally:
        engine.close()
        model.shutdown()
    for events in choices:
        assert [e.error for e in events if e.error is not None] == []
        assert [t for e in events for t in e.token_ids] == expected
        assert events[-1].finish_reason == "length"
    corrupt = swarm.peer_ids["corrupt"]
    assert reputation[corrupt]["distrusted"], reputation
    assert not reputation.get(swarm.peer_ids["honest"], {}).get("distrusted")
    assert engine.metrics.rewinds._value.get() >= 2  # both choices were rewound
