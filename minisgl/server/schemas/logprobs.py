"""The logprobs payloads of the answers: chat's, legacy completions' and vLLM's prompt_logprobs, and their
builders from the detokenizer's entries."""

from __future__ import annotations

import math

from pydantic import BaseModel

from minisgl.messages import Alternative, LogprobEntry


def _lp(value: float) -> float:
    # JSON has no -inf (Starlette refuses to encode it); a masked-out alternative gets a floor instead.
    return value if math.isfinite(value) else -9999.0


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]  # None: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


def by_id(token: LogprobEntry | Alternative) -> str:
    """A token spelled by its id, as vLLM's return_tokens_as_token_ids has it (a token that is not text on
    its own, such as part of a UTF-8 character, stays exact)."""
    return f"token_id:{token.token_id}"


def chat_logprobs(entries: list[LogprobEntry], spell_by_id: bool = False) -> ChatLogprobs:
    """The chat `logprobs` object: per token its logprob, UTF-8 bytes and top alternatives."""

    def item(token: LogprobEntry | Alternative) -> dict:
        text = by_id(token) if spell_by_id else token.text
        return {"token": text, "logprob": _lp(token.logprob), "bytes": list(text.encode("utf-8"))}

    return ChatLogprobs(content=[TokenLogprob(**item(e), top_logprobs=[TopLogprob(**item(alt)) for alt in e.top])
                                 for e in entries])


def completion_logprobs(entries: list[LogprobEntry], text_offset_start: int = 0,
                        spell_by_id: bool = False) -> CompletionLogprobs:
    """The legacy completions `logprobs` object; `text_offset` counts characters into the returned text.
    An entry whose logprob is None (an echoed prompt's first token) has None for its top alternatives too."""
    offsets, pos = [], text_offset_start
    for e in entries:
        offsets.append(pos)
        pos += len(e.text)
    return CompletionLogprobs(
        tokens=[by_id(e) if spell_by_id else e.text for e in entries],
        token_logprobs=[None if e.logprob is None else _lp(e.logprob) for e in entries],
        top_logprobs=[None if e.logprob is None else completion_top(e, spell_by_id) for e in entries],
        text_offset=offsets)


class VllmLogprob(BaseModel):
    logprob: float
    rank: int | None  # among the top N (1 the best); null for a prompt token outside them
    decoded_token: str


PromptLogprobs = list[dict[str, VllmLogprob] | None]


def vllm_prompt_logprobs(entries: list[LogprobEntry] | None, count: int | None) -> PromptLogprobs | None:
    """vLLM's `prompt_logprobs` when asked for (`count` not None): null for the first prompt token, then per
    position the token itself and the `count` best, keyed by token id (the engine may have scored more:
    completions' echo asks for its own count)."""
    if count is None:
        return None
    positions: PromptLogprobs = [None]
    for e in entries or []:
        ranked = {alt.token_id: (rank, alt) for rank, alt in enumerate(e.top[:count], 1)}
        position = {str(e.token_id): VllmLogprob(logprob=_lp(e.logprob), rank=ranked.get(e.token_id, (None,))[0],
                                                 decoded_token=e.text)}
        for token_id, (rank, alt) in ranked.items():
            position.setdefault(str(token_id), VllmLogprob(logprob=_lp(alt.logprob), rank=rank, decoded_token=alt.text))
        positions.append(position)
    return positions


def completion_top(entry: LogprobEntry, spell_by_id: bool = False) -> dict[str, float]:
    """A position's `top_logprobs`, as vLLM gives it: the token itself, then the top alternatives (N + 1 keys
    when it is not among them). Keys are texts (or ids, `spell_by_id`), so a second token of an already-listed
    text is keyed by its id (`token_id:N`, vLLM's spelling) instead of overwriting the first."""
    top = {by_id(entry) if spell_by_id else entry.text: _lp(entry.logprob)}
    for alt in entry.top:
        if alt.token_id != entry.token_id:
            top[alt.text if alt.text not in top and not spell_by_id else by_id(alt)] = _lp(alt.logprob)
    return top
