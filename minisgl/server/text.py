"""The api process's tokenizer, used only off the event loop.

Tokenizing a 20 MB prompt takes tens of seconds of CPU; on the loop it would stall every request and
/health with it. Here encoding, chat templating and decoding run in a small thread pool, through the
Rust tokenizer's batch calls: those release the GIL (`encode`/`decode` keep it, which stalls the loop
as surely as running on it). A prompt's ids become a Python list only when they can fit the context:
a prompt too long is answered with its token count, never millions of ids built under the GIL.

Only the backend tokenizer is called from the threads: transformers' `__call__` reconfigures truncation
and padding on every call, which fails ("Already borrowed") when threads share a tokenizer.
"""

from __future__ import annotations

import asyncio
import inspect
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from minisgl.server.errors import ApiError

TEXT_THREADS = 4

NO_TOKENIZER = "this server runs with --skip-tokenizer-init and has no tokenizer"


@dataclass
class Conversation:
    """A chat prompt: the messages and tools as the chat template takes them, and the client's extra
    template variables (`enable_thinking`...); `tools_needed`: the output may call the tools, so a template
    that cannot show them to the model is refused. `add_generation_prompt` opens the assistant's turn;
    `continue_final_message` leaves the last message open (no end-of-turn) for the model to go on with."""

    messages: list[dict]
    tools: list[dict] | None = None
    tools_needed: bool = False
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    add_generation_prompt: bool = True
    continue_final_message: bool = False


# Names a client's template variables may not take: apply_chat_template's own parameters, and `messages`.
RESERVED_TEMPLATE_NAMES = frozenset(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters) - {
    "self", "kwargs"} | {"messages"}


class TextCodec:
    """Text <-> token ids for the api; `tokenizer` None (--skip-tokenizer-init) answers every call with 400."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        if tokenizer is not None:
            self.backend = tokenizer.backend_tokenizer
            self.backend.no_truncation()  # tokenizer.json may ask for truncation; a prompt is never cut silently
            self.backend.no_padding()
        self.pool = ThreadPoolExecutor(TEXT_THREADS, thread_name_prefix="tokenizer")
        self.closed = False
        self.waiting: set[asyncio.Future] = set()  # callers waiting for a thread's result

    def require(self, param: str | None, what: str) -> None:
        if self.tokenizer is None:
            raise ApiError(400, f"{NO_TOKENIZER}: {what}", param=param)

    async def encode(self, text: str, limit: int, add_special_tokens: bool = False) -> tuple[int, list[int]]:
        """(token count, ids); the ids are left out (empty) when the count passes `limit`. The tokenizer's
        special tokens (a BOS) are added only when asked for."""
        return await self.run(self._encode, text, limit, add_special_tokens)

    async def encode_chat(self, conversation: Conversation, limit: int,
                          add_special_tokens: bool = False) -> tuple[int, list[int], str]:
        """The conversation through the model's chat template, encoded; and the template's text."""
        return await self.run(self._encode_chat, conversation, limit, add_special_tokens)

    async def decode(self, ids: list[int]) -> str:
        return (await self.run(self.backend.decode_batch, [ids], skip_special_tokens=False))[0]

    def close(self) -> None:
        """Shutdown: whoever still waits for the tokenizer gets a 503 now (the thread's work is abandoned)."""
        self.closed = True
        for waiter in self.waiting:
            if not waiter.done():
                waiter.set_exception(ApiError(503, "the server is shutting down", retry_after=5))

    async def run(self, fn, *args, **kwargs):
        """fn(*args, **kwargs) in the pool: CPU-heavy work on a request (tokenizing, parsing a grammar)."""
        if self.closed:
            raise ApiError(503, "the server is shutting down", retry_after=5)
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()

        def settle(work: Future) -> None:  # on the loop, once the thread is done
            if not waiter.done():
                error = work.exception()
                waiter.set_exception(error) if error is not None else waiter.set_result(work.result())

        self.pool.submit(fn, *args, **kwargs).add_done_callback(lambda work: loop.call_soon_threadsafe(settle, work))
        self.waiting.add(waiter)
        try:
            return await waiter
        finally:
            self.waiting.discard(waiter)

    def _encode(self, text: str, limit: int, add_special_tokens: bool = False) -> tuple[int, list[int]]:
        [encoding] = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)
        count = len(encoding)
        return count, (encoding.ids if count <= limit else [])

    def _encode_chat(self, conversation: Conversation, limit: int,
                     add_special_tokens: bool = False) -> tuple[int, list[int], str]:
        tools, kwargs = conversation.tools, conversation.template_kwargs
        reserved = sorted(RESERVED_TEMPLATE_NAMES & set(kwargs))
        if reserved:
            raise ApiError(400, f"chat_template_kwargs may not set {reserved[0]!r}", param="chat_template_kwargs")
        try:
            if conversation.tools_needed and "tools" not in self.tokenizer.get_chat_template(tools=tools):
                raise ApiError(400, "this model's chat template does not show tools to the model", param="tools")
            text = self.tokenizer.apply_chat_template(
                conversation.messages, tools=tools, add_generation_prompt=conversation.add_generation_prompt,
                continue_final_message=conversation.continue_final_message, tokenize=False, **kwargs)
        except ApiError:
            raise
        except Exception as exc:  # the template is a program run on the client's messages; it refused them
            raise ApiError(400, f"the model's chat template refused these messages: {exc}", param="messages") from None
        return *self._encode(text, limit, add_special_tokens), text
