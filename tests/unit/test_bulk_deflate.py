"""The client's steps of many positions travel deflated (ClientConfig.deflate_bulk), in process: real servers'
handlers over in-memory streams (inprocess_swarm). The prompt, and a failover's replay into the replacement, cross
the wire in fewer bytes, and every output is bit-equal to a session that sent them as they are."""

from __future__ import annotations

import pytest
import torch

from inprocess_swarm import InProcessSwarm

H = 64  # the tiny Llama's hidden size
PROMPT = 48


def inputs(t: int, seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randn(1, t, H) * torch.rand(1, t, 1) * 3  # rows of different scales, as hidden states have


def run(tiny_llama_path, push: bool, deflate: bool) -> tuple[int, int, list[torch.Tensor]]:
    """A session on a fresh swarm: a prompt, a token, its middle server crashed, a token. Returns the bytes of the
    prompt's frame to the first server, those of the replacement's frames, and the three outputs."""
    swarm = InProcessSwarm(tiny_llama_path, [(0, 2), (2, 4), (2, 4)])
    try:
        with swarm.session(max_length=64, push=push, deflate_bulk=deflate) as session:
            outputs = [session.step(inputs(PROMPT))]
            prompt_bytes = session.chain.spans[0].bytes_sent
            outputs.append(session.step(inputs(1, 1)))
            victim = session.route[1].peer_id
            swarm.crash(victim)
            outputs.append(session.step(inputs(1, 2)))  # the replacement gets the span's 49 positions replayed
            replacement = session.chain.spans[1]
            assert replacement.span.peer_id != victim and replacement.history.shape[1] == PROMPT + 2
            replay_bytes = replacement.bytes_sent
        assert swarm.caches_free(), "a session's cache was not freed"
    finally:
        swarm.close()
    return prompt_bytes, replay_bytes, outputs


@pytest.mark.parametrize("push", [True, False])
def test_prompt_and_replay_cross_in_fewer_bytes_with_the_same_outputs(tiny_llama_path, push):
    plain, deflated = run(tiny_llama_path, push, False), run(tiny_llama_path, push, True)
    raw = PROMPT * H * 4
    assert plain[0] >= raw and deflated[0] < 0.95 * raw  # the prompt's frame to the first server
    # the replacement's frames: the replay (49 positions), then the third step's one position
    assert plain[1] >= (PROMPT + 1) * H * 4 and deflated[1] < 0.95 * (PROMPT + 1) * H * 4
    for a, b in zip(plain[2], deflated[2]):
        assert torch.equal(a, b)
