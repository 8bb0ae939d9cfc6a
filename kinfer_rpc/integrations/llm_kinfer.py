"""The plugin of Simon Willison's `llm`: kinfer's models as `kinfer/NAME`.

    llm models                                   # kinfer/smollm2-135m-instruct, kinfer/qwen3:0.6b...
    llm -m kinfer/qwen3:0.6b "Name three colours." -o temperature 0 -o max_tokens 100
    llm -m kinfer/qwen3:0.6b --schema "name, age int" "Make up a person."
    llm -m kinfer/qwen3:0.6b -T llm_time "What time is it?" -o tool_choice required --td

Registered through llm's entry point group (`[project.entry-points.llm]` of kinfer-rpc's
pyproject.toml): installing kinfer-rpc is all. NAME is a kinfer model name: every model of
kinfer's stores (the embedded default, ~/.kinfer/models, Ollama's store) is listed.

Each prompt goes through the Python client to the daemon when one runs (`kinfer serve`: the model
stays loaded between `llm` commands), else to a kinfer-rpc of the process's own
(kinfer_rpc.integrations.connection). Streaming, conversations (`llm chat`, `-c`), async models,
options (`llm models --options -m kinfer/NAME`), schemas held by kinfer's `format` and tools by
its tool calls: a schema's answer and a forced call's arguments are valid by construction.
llm has no tool choice of its own: `-o tool_choice required` (or a tool's name) makes the model
call a tool in the prompt's first response; once tool results are in, it answers freely.
`-o parallel_tool_calls false` holds a response to one call.
"""

from __future__ import annotations

import base64
import json
import logging
import os
from collections.abc import AsyncGenerator, Iterator
from typing import Any, Literal

import llm
from llm.parts import AttachmentPart, Message, ReasoningPart, StreamEvent, TextPart, ToolCallPart, ToolResultPart
from pydantic import Field

from kinfer_rpc.client import Client, Result, Stream, Thought
from kinfer_rpc.integrations import connection
from kinfer_rpc.integrations.schemas import closed

PREFIX = "kinfer/"
log = logging.getLogger(__name__)


@llm.hookimpl
def register_models(register: Any) -> None:
    """Every model of kinfer's stores, as `kinfer/NAME`, sync and async."""
    for name in model_names():
        register(KinferModel(name), AsyncKinferModel(name))


def model_names() -> list[str]:
    """The names of kinfer's models, read from its stores here (no server is started for it)."""
    from kinfer_rpc.host.store import DEFAULT_MODEL, ModelStore

    try:
        names = [ref.name for ref in ModelStore().list()]
    except Exception as exc:  # a broken store must not break llm's other models
        log.warning("kinfer's model stores could not be read: %s", exc)
        names = [DEFAULT_MODEL]
    return list(dict.fromkeys(names))


class Options(llm.Model.Options):
    """kinfer's sampling and stopping options, by llm's names."""

    temperature: float | None = Field(None, description="0..100, default 0.8; 0 is greedy", ge=0, le=100)
    max_tokens: int | None = Field(None, description="The most tokens the reply may have", ge=0)
    top_p: float | None = Field(None, description="Nucleus sampling, 0..1 (default 0.95)", ge=0, le=1)
    top_k: int | None = Field(None, description="Sample among the k likeliest tokens (default 40; 0: all)", ge=0)
    min_p: float | None = Field(None, description="Drop tokens less likely than this share of the best (0.05)")
    repeat_penalty: float | None = Field(None, description="Penalty of repeated tokens (default 1.0: off)", gt=0)
    seed: int | None = Field(None, description="The same seed, the same reply", ge=0)
    stop: str | list[str] | None = Field(None, description="Stop before this string")
    json_object: bool | None = Field(None, description="Reply with a JSON object")
    tool_choice: str | None = Field(
        None, description="auto, none, required or a tool's name: whether the first response must call a tool"
    )
    parallel_tool_calls: bool | None = Field(None, description="false: at most one tool call a response")
    think: bool | Literal["low", "medium", "high"] | None = Field(
        None, description="A thinking model: reason first (true, or low, medium, high) or not (false)"
    )
    max_reasoning_tokens: int | None = Field(
        None, description="A thinking model: the most tokens its reasoning takes before it must answer", ge=0
    )


OPTIONS = {
    "max_tokens": "maxTokens",
    "top_p": "topP",
    "top_k": "topK",
    "min_p": "minP",
    "repeat_penalty": "repeatPenalty",
    "max_reasoning_tokens": "maxReasoningTokens",
}


def kinfer_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """llm's messages (the whole conversation) as the protocol's: a tool result is a `tool`
    message naming its call; an image attachment (`llm -a shot.png`) is the message's image, for
    a model loaded with a vision projector (its path, or its bytes as base64; kinfer fetches no
    URL); other attachments are refused."""
    out: list[dict[str, Any]] = []
    for m in messages:
        texts, calls, thoughts, images = [], [], [], []
        for part in m.parts:
            if isinstance(part, TextPart):
                texts.append(part.text)
            elif isinstance(part, ReasoningPart):
                thoughts.append(part.text)
            elif isinstance(part, ToolCallPart):
                call = {"type": "function", "function": {"name": part.name, "arguments": part.arguments}}
                calls.append({"id": part.tool_call_id, **call} if part.tool_call_id else call)
            elif isinstance(part, ToolResultPart):
                result = {"role": "tool", "name": part.name, "content": part.output}
                out.append({**result, "toolCallId": part.tool_call_id} if part.tool_call_id else result)
            elif isinstance(part, AttachmentPart) and part.attachment is not None:
                images.append(_image(part.attachment))
            else:
                raise ValueError(f"kinfer reads text: a {type(part).__name__} cannot be sent")
        if m.role == "tool":
            continue
        message: dict[str, Any] = {"role": m.role, "content": "".join(texts)}
        if calls:
            message["toolCalls"] = calls
        if m.role == "assistant" and "".join(thoughts):  # the template keeps or drops it
            message["reasoning"] = "".join(thoughts)
        if images:
            message["images"] = images
        if texts or calls or images:
            out.append(message)
    return out


def _image(attachment: llm.Attachment) -> str:
    """An image attachment as the protocol takes it: a file's absolute path, or base64."""
    if attachment.path:
        return os.path.abspath(attachment.path)
    if attachment.content is not None:
        return base64.b64encode(attachment.content).decode("ascii")
    raise ValueError("kinfer reads an image from a file or its bytes, not from a URL (it fetches nothing)")


class _Kinfer:
    """What the sync and async models share: the request a prompt makes, and what a Result
    tells the response."""

    can_stream = True
    supports_schema = True
    # images, for a model loaded with a vision projector (others refuse them: -31006)
    attachment_types: set[str] | frozenset[str] = frozenset({"image/png", "image/jpeg", "image/gif", "image/bmp"})
    supports_tools = True
    Options = Options

    def __init__(self, name: str):
        self.model_id = PREFIX + name
        self.name = name

    def _client(self) -> Client:
        return connection.shared(connection.command())

    def _start(self, prompt: llm.Prompt) -> tuple[Stream, bool]:
        """The prompt's request, as a stream; whether tools are on offer (then the reply's text
        may be call markup, and comes once whole)."""
        opts: Options = prompt.options  # type: ignore[assignment]
        options: dict[str, Any] = {}
        for name, value in opts.model_dump(exclude_none=True).items():
            if name in ("json_object", "tool_choice", "parallel_tool_calls", "think"):
                continue
            options[OPTIONS.get(name, name)] = value
        if prompt.schema:
            schema = prompt.schema if isinstance(prompt.schema, dict) else prompt.schema.model_json_schema()
            options["format"] = closed(schema)
        elif opts.json_object:
            options["format"] = "json"
        tools = [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    "description": t.description or "",
                    "parameters": closed(t.input_schema or {"type": "object", "properties": {}}),
                },
            }
            for t in prompt.tools
            if isinstance(t, llm.Tool)
        ]
        messages = prompt.messages
        choice = opts.tool_choice if tools and not (messages and messages[-1].role == "tool") else None
        stream = self._client().stream_chat(
            kinfer_messages(messages),
            self.name,
            tools=tools or None,
            tool_choice=choice,
            parallel_tool_calls=opts.parallel_tool_calls if tools else None,
            think=opts.think,
            **options,
        )
        return stream, bool(tools) and choice != "none"

    def _finish(self, result: Result, response: llm.Response | llm.AsyncResponse) -> Iterator[StreamEvent]:
        """The calls of a finished reply, as llm records them, and its usage."""
        for call in result.tool_calls:
            response.add_tool_call(llm.ToolCall(name=call.name, arguments=call.arguments, tool_call_id=call.id))
            yield StreamEvent(type="tool_call_name", chunk=call.name, tool_call_id=call.id)
            yield StreamEvent(type="tool_call_args", chunk=json.dumps(call.arguments), tool_call_id=call.id)
        usage = result.usage
        counts = {"cached_tokens": usage.cached_tokens, "reasoning_tokens": usage.reasoning_tokens}
        details = {k: v for k, v in counts.items() if v} or None
        response.set_usage(input=usage.prompt_tokens, output=usage.completion_tokens, details=details)
        response.response_json = {"model": result.model, "stopReason": result.stop_reason, "seed": result.seed}


class KinferModel(_Kinfer, llm.Model):
    """A kinfer model in llm."""

    def execute(
        self, prompt: llm.Prompt, stream: bool, response: llm.Response, conversation: llm.Conversation | None
    ) -> Iterator[str | StreamEvent]:
        request, calling = self._start(prompt)
        with request:  # leaving early (Ctrl-C, a consumer that stops) cancels the request
            for piece in request:
                if stream and isinstance(piece, Thought):  # a thinking model's reasoning, as it comes
                    yield StreamEvent(type="reasoning", chunk=str(piece))
                elif stream and not calling:
                    yield piece
            result = request.result or request.wait()
        if result.reasoning and not stream:
            yield StreamEvent(type="reasoning", chunk=result.reasoning)
        if result.text and (calling or not stream):
            yield result.text
        yield from self._finish(result, response)


class AsyncKinferModel(_Kinfer, llm.AsyncModel):
    """A kinfer model in llm's async API."""

    async def execute(
        self,
        prompt: llm.Prompt,
        stream: bool,
        response: llm.AsyncResponse,
        conversation: llm.AsyncConversation | None,
    ) -> AsyncGenerator[str | StreamEvent, None]:
        request, calling = self._start(prompt)
        if stream:
            async for piece in connection.pieces(request):
                if isinstance(piece, Thought):
                    yield StreamEvent(type="reasoning", chunk=str(piece))
                elif not calling:
                    yield piece
            result = request.result or request.wait()
            if calling and result.text:
                yield result.text
        else:
            result = await connection.finished(request)
            if result.reasoning:
                yield StreamEvent(type="reasoning", chunk=result.reasoning)
            if result.text:
                yield result.text
        for event in self._finish(result, response):
            yield event
