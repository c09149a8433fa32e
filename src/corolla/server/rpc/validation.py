"""Checks on everything a client sends, before anything is allocated or computed.

Framing has already checked the message's fields and that its tensors are the ones its kind names
(protocol.framing); here each request is checked against this server (protocol version, blocks, adapters) and
each tensor against its session (dtype, shape, batch size, positions, finiteness). A failed check raises
`RequestError`, which becomes an ErrorReply to that client alone; nothing here uses `assert`.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from corolla.protocol import PROTOCOL_VERSION
from corolla.protocol.framing import HEADER_LEN_BYTES, MAX_FRAME_BYTES, MAX_HEADER_BYTES, version_mismatch
from corolla.protocol.messages import BackwardRequest, BlockRange, ErrorCode, ForwardRequest, InferenceStep, OpenSession
from corolla.server.compute.adapter_calls import AdapterCalls
from corolla.server.compute.forward_backward import FLOAT_DTYPES, check_grad_output, check_prompts
from corolla.server.compute.padding import check_hypo_ids, check_mask, check_prompt_slots
from corolla.server.compute.planner import Step
from corolla.server.errors import RequestError, bad_request


class RequestChecks:
    """The checks of one server: its blocks [start, end), its hidden size, its adapters, its session limit (tokens
    of one session) and its pass limit (tokens, batch x length, of one forward or backward; at least one row of
    the session limit)."""

    def __init__(self, start: int, end: int, hidden_size: int, adapters: AdapterCalls, max_session_length: int,
                 max_pass_tokens: int):
        self.start = start
        self.end = end
        self.hidden_size = hidden_size
        self.adapters = adapters
        self.max_session_length = max_session_length
        self.max_pass_tokens = max(max_pass_tokens, max_session_length)  # one row of a whole session always fits

    # ------------------------------------------------------------------ requests
    def version(self, version: int) -> None:
        if version != PROTOCOL_VERSION:
            raise RequestError(ErrorCode.BAD_REQUEST, version_mismatch(version))

    def blocks(self, blocks: BlockRange) -> None:
        if blocks.start < self.start or blocks.end > self.end:
            raise RequestError(
                ErrorCode.NOT_SERVED, f"blocks {blocks} are not served here (this server holds {self.start}:{self.end})"
            )

    def adapter(self, name: str | None) -> None:
        bad_request(self.adapters.problem(name))

    def open_session(self, request: OpenSession) -> None:
        """An OpenSession this server can serve: version, blocks, adapter and max_length."""
        self.version(request.protocol_version)
        self.blocks(request.blocks)
        self.adapter(request.active_adapter)
        if request.max_length > self.max_session_length:
            raise RequestError(
                ErrorCode.BAD_REQUEST,
                f"max_length={request.max_length} exceeds this server's limit of {self.max_session_length} tokens",
            )

    def stateless(self, request: ForwardRequest | BackwardRequest) -> None:
        self.version(request.protocol_version)
        self.blocks(request.blocks)
        self.adapter(request.active_adapter)

    def step_frame_limit(self, batch_size: int, max_length: int, num_blocks: int) -> int:
        """The most bytes a frame of a session of `batch_size` rows, `max_length` tokens and `num_blocks` blocks may
        take: a step's hidden states (B, L, H) and deep prompts (num_blocks, L, H) in float32, its attention mask
        (B, L) in int64, and a header. A longer frame is refused unread, so what a session's stream can make the
        server hold follows its cache reservation."""
        floats = (batch_size + num_blocks) * max_length * self.hidden_size * 4
        return floats + batch_size * max_length * 8 + HEADER_LEN_BYTES + MAX_HEADER_BYTES

    def pass_frame_limit(self, backward: bool) -> int:
        """The most bytes the frame of a forward (or, with `backward`, a backward) may take: its hidden states (and
        grad_output) of max_pass_tokens tokens and its deep prompts (hosted blocks, up to one row's length, H) in
        float32, its attention mask in int64, and a header; at most the wire's MAX_FRAME_BYTES. Checked before the
        frame is read, so what one call can make the server hold follows the pass limit."""
        tokens, prompt_positions = self.max_pass_tokens, min(self.max_session_length, self.max_pass_tokens)
        floats = ((2 if backward else 1) * tokens + (self.end - self.start) * prompt_positions) * self.hidden_size * 4
        return min(MAX_FRAME_BYTES, floats + tokens * 8 + HEADER_LEN_BYTES + MAX_HEADER_BYTES)

    # ------------------------------------------------------------------ tensors
    def sequence(self, hidden: Tensor) -> Tensor:
        """Hidden states of a forward or backward pass, (B, T, H) with T at most the server's session limit (its
        attention costs T x T, so one longer request would hold the compute thread for minutes) and B x T at most
        its pass limit (the compute and memory of one call). Sizes are checked before the values are."""
        if hidden.ndim == 3:
            batch, length = hidden.shape[0], hidden.shape[1]
            if length > self.max_session_length:
                raise RequestError(
                    ErrorCode.BAD_REQUEST,
                    f"a pass over {length} tokens exceeds this server's limit of {self.max_session_length} tokens",
                )
            if batch * length > self.max_pass_tokens:
                raise RequestError(
                    ErrorCode.BAD_REQUEST,
                    f"a pass over {batch} x {length} = {batch * length} tokens exceeds this server's limit of "
                    f"{self.max_pass_tokens} tokens (batch x length) per forward or backward; send fewer rows per call",
                )
        return self.hidden(hidden)

    def hidden(self, hidden: Tensor, batch_size: int | None = None) -> Tensor:
        """Hidden states (B, T, hidden_size), finite float, non-empty; B = batch_size if given."""
        if hidden.dtype not in FLOAT_DTYPES:
            raise RequestError(
                ErrorCode.BAD_REQUEST, f"hidden states must be float32/bfloat16/float16, got {hidden.dtype}"
            )
        if hidden.ndim != 3 or hidden.shape[2] != self.hidden_size:
            raise RequestError(
                ErrorCode.BAD_REQUEST,
                f"hidden states must have shape (batch, length, {self.hidden_size}), got {tuple(hidden.shape)}",
            )
        if hidden.shape[1] == 0 or hidden.shape[0] == 0:
            raise RequestError(ErrorCode.BAD_REQUEST, f"empty hidden states {tuple(hidden.shape)}")
        if batch_size is not None and hidden.shape[0] != batch_size:
            raise RequestError(
                ErrorCode.BAD_REQUEST, f"batch size {hidden.shape[0]} differs from the session's {batch_size}"
            )
        if not torch.isfinite(hidden).all():
            raise RequestError(ErrorCode.BAD_REQUEST, "hidden states contain NaN or inf")
        return hidden

    def mask_and_prompts(
        self,
        tensors: Mapping[str, Tensor],
        hidden: Tensor,
        num_blocks: int,
        mask_length: int,
        max_positions: int | None = None,
    ) -> tuple[Tensor | None, Tensor | None]:
        """The optional `attention_mask` (batch, mask_length), as bool on the CPU, and deep `prompts`
        (num_blocks, P, H) with P <= max_positions (default: hidden's length); with both, the first P slots of
        every row must be real."""
        mask = tensors.get("attention_mask")
        if mask is not None:
            bad_request(check_mask(mask, hidden.shape[0], mask_length))
            mask = mask.to(torch.bool)
        prompts = tensors.get("prompts")
        if prompts is None:
            return mask, None
        try:
            check_prompts(prompts, hidden, num_blocks, max_positions)
        except ValueError as e:
            raise RequestError(ErrorCode.BAD_REQUEST, str(e)) from None
        if mask is not None:
            bad_request(check_prompt_slots(mask, prompts.shape[1]))
        return mask, prompts

    # ------------------------------------------------------------------ whole requests
    def step(
        self,
        message: InferenceStep,
        tensors: Mapping[str, Tensor],
        *,
        batch_size: int,
        held: int,
        max_length: int,
        num_blocks: int,
    ) -> Step:
        """An inference step of a session of `batch_size` rows over `num_blocks` blocks that holds `held` tokens
        and may hold `max_length`."""
        hidden = self.hidden(tensors["hidden"], batch_size)
        if message.position > held:
            raise RequestError(
                ErrorCode.BAD_REQUEST, f"step at position {message.position}, but the session holds only {held} tokens"
            )
        end = message.position + hidden.shape[1]
        mask, prompts = self.mask_and_prompts(tensors, hidden, num_blocks, end, max_length)
        if prompts is not None and message.position >= prompts.shape[1]:
            prompts = None  # the step holds no prompt position: the ordinary (batched) paths apply
        hypo_ids = None
        if message.hypo_ids is not None:
            bad_request(check_hypo_ids(message.hypo_ids, batch_size))
            hypo_ids = tuple(message.hypo_ids)
        if end > max_length:
            raise RequestError(
                ErrorCode.SESSION_FULL, f"step would reach {end} tokens, past the session's max_length={max_length}"
            )
        return Step(message.step_id, hidden, message.position, mask, prompts, hypo_ids)

    def forward(
        self, request: ForwardRequest, tensors: Mapping[str, Tensor]
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """(hidden (B, T, H), attention_mask (B, T) or None, prompts (n_blocks, P, H) or None) of a forward."""
        hidden = self.sequence(tensors["hidden"])
        blocks = request.blocks
        mask, prompts = self.mask_and_prompts(tensors, hidden, blocks.end - blocks.start, hidden.shape[1])
        return hidden, mask, prompts

    def backward(
        self, request: BackwardRequest, tensors: Mapping[str, Tensor]
    ) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
        """(hidden, grad_output, attention_mask or None, prompts or None) of a backward, as `forward` takes them."""
        hidden = self.sequence(tensors["hidden"])
        try:
            grad_output = check_grad_output(tensors["grad_output"], hidden)
        except ValueError as e:
            raise RequestError(ErrorCode.BAD_REQUEST, str(e)) from None
        blocks = request.blocks
        mask, prompts = self.mask_and_prompts(tensors, hidden, blocks.end - blocks.start, hidden.shape[1])
        return hidden, grad_output, mask, prompts
