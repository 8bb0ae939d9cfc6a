"""`ChatKinfer`: kinfer as a LangChain chat model, with no server to run.

    from kinfer_rpc.integrations.langchain import ChatKinfer

    chat = ChatKinfer(model="qwen3:0.6b", temperature=0, max_tokens=200)
    chat.invoke("Name three colours.").content

It speaks the protocol through the Python client to a `kinfer-rpc` of this process's own, or to
the daemon (`kinfer serve`) when one runs or `attach=True` (kinfer_rpc.integrations.connection);
every ChatKinfer of the process with the same command shares one server. invoke, stream (a chunk
per token), batch and their async forms; `bind_tools` with `tool_choice` ("auto", "none",
"any"/"required", a tool's name) and `parallel_tool_calls`; `with_structured_output` by kinfer's
`format` (`method="json_schema"`, the default), by a forced tool call (`"function_calling"`) or
as any JSON object (`"json_mode"`). Forced calls and `format` are held to their schema by
constrained decoding: the arguments and answers are valid by construction, never repaired.

Schemas: LangChain's schemas come from types whose fields are the whole of them (pydantic models,
TypedDicts, functions), so an object schema that names its properties and says nothing of others
is closed (`additionalProperties: false`) before it is sent: the model cannot invent arguments a
tool would drop. `strict=False` (bind_tools, with_structured_output) sends schemas as given.

With tools on offer a reply's text may be call markup: a streamed reply then gives each call as it
completes and its text once the reply is whole, as kinfer's OpenAI face does. Usage metadata
carries the prompt tokens the prefix cache served as `cache_read`.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from operator import itemgetter
from typing import Any, Literal

import attrs
from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LangSmithParams, LanguageModelInput
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.messages.tool import tool_call, tool_call_chunk
from langchain_core.output_parsers import JsonOutputKeyToolsParser, JsonOutputParser, PydanticOutputParser
from langchain_core.output_parsers.openai_tools import PydanticToolsParser
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_json_schema
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from kinfer_rpc.client import Client, Result, Stream, Thought
from kinfer_rpc.integrations import connection
from kinfer_rpc.integrations.langchain_shapes import (
    FINISH,
    kinfer_messages,
    kinfer_tool,
    kinfer_tool_choice,
    response_metadata,
    usage_metadata,
)
from kinfer_rpc.integrations.schemas import closed

# LangChain's option names -> kinfer's GenerateOptions
OPTIONS = {
    "temperature": "temperature",
    "max_tokens": "maxTokens",
    "top_p": "topP",
    "top_k": "topK",
    "min_p": "minP",
    "repeat_penalty": "repeatPenalty",
    "seed": "seed",
}
# the arguments a call may take besides the options (bound by bind_tools, with_structured_output)
CALL_ARGUMENTS = {"model", "tools", "tool_choice", "parallel_tool_calls", "format", "reasoning"}


class ChatKinfer(BaseChatModel):
    """A kinfer model as a LangChain chat model (see the module's docstring)."""

    model_config = ConfigDict(populate_by_name=True)

    model: str | None = None
    """A kinfer model: a name (`qwen3:0.6b`, `smollm2-135m-instruct`) or a file's path; None is
    kinfer's default model."""
    attach: bool | None = None
    """True: the daemon (started when none runs); False: a kinfer-rpc of this process's own;
    None: the daemon when one answers on its socket, else one's own."""
    socket: str | None = None
    """The daemon's socket, where it is not the default one."""
    command: list[str] | None = None
    """The whole server command, instead of what `attach` and `socket` make."""
    env: dict[str, str] | None = None
    """Environment added to the server's (a spawned kinfer-rpc: KINFER_MODELS, OLLAMA_MODELS...)."""
    temperature: float | None = None
    max_tokens: int | None = Field(default=None, alias="num_predict")
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    seed: int | None = None
    stop: list[str] | None = None
    timeout: float | None = None
    """Seconds an invoke waits for its reply before it cancels it and raises TimeoutError."""
    model_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Other GenerateOptions, by the protocol's camelCase names (`repeatLastN`, `logprobs`...)."""
    streaming: bool = False
    # A thinking model: whether it reasons first (True, False, or "low", "medium", "high"; None: as
    # its template does), as ChatOllama's `reasoning`; its reasoning goes to the message's
    # additional_kwargs["reasoning_content"], apart from the content
    reasoning: bool | str | None = None
    """invoke streams (a callback sees each token)."""
    _argv: list[str] | None = PrivateAttr(default=None)  # the server command, chosen on first use

    @property
    def _llm_type(self) -> str:
        return "kinfer"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model": self.model, **self._options({})}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(
            ls_provider="kinfer",
            ls_model_name=kwargs.get("model") or self.model or _default_model(),
            ls_model_type="chat",
        )
        if (temperature := kwargs.get("temperature", self.temperature)) is not None:
            params["ls_temperature"] = temperature
        if (max_tokens := kwargs.get("max_tokens", self.max_tokens)) is not None:
            params["ls_max_tokens"] = max_tokens
        if ls_stop := stop or self.stop:
            params["ls_stop"] = ls_stop
        return params

    # -- tools and structured output -------------------------------------------------------
    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable[..., Any] | BaseTool],
        *,
        tool_choice: dict[str, Any] | str | bool | None = None,
        parallel_tool_calls: bool | None = None,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """Offer `tools` to the model. `tool_choice`: "auto" (the default), "none", "any" or
        "required" (one call or more, held to the tools' schemas), a tool's name (calls of it);
        `parallel_tool_calls=False`: at most one call; `strict=False`: schemas as given."""
        bound: dict[str, Any] = {"tools": [kinfer_tool(t, strict) for t in tools], **kwargs}
        if tool_choice is not None:
            bound["tool_choice"] = kinfer_tool_choice(tool_choice)
        if parallel_tool_calls is not None:
            bound["parallel_tool_calls"] = parallel_tool_calls
        return super().bind(**bound)

    def with_structured_output(
        self,
        schema: dict[str, Any] | type,
        *,
        method: Literal["json_schema", "function_calling", "json_mode"] = "json_schema",
        include_raw: bool = False,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, dict[str, Any] | BaseModel]:
        """Answers that are instances of `schema` (a pydantic model, a TypedDict, a JSON schema or
        OpenAI's tool dict): by kinfer's `format` ("json_schema"), a forced call of one tool of
        that schema ("function_calling", for models trained to call tools) or any JSON object
        ("json_mode": the prompt must ask for the shape). A pydantic model gives instances of
        it, the others dicts. `include_raw=True`: {"raw", "parsed", "parsing_error"}."""
        if kwargs:
            raise ValueError(f"with_structured_output takes no {', '.join(sorted(kwargs))}")
        pydantic = isinstance(schema, type) and is_basemodel_subclass(schema)
        trace = {"kwargs": {"method": method, "strict": strict}, "schema": schema}
        parser: Runnable[Any, Any]
        if method == "function_calling":
            tool = kinfer_tool(schema, strict)
            name = tool["function"]["name"]
            llm = self.bind_tools(
                [tool], tool_choice=name, parallel_tool_calls=False, strict=False, ls_structured_output_format=trace
            )
            parser = (
                PydanticToolsParser(tools=[schema], first_tool_only=True)  # type: ignore[list-item]
                if pydantic
                else JsonOutputKeyToolsParser(key_name=name, first_tool_only=True)
            )
        elif method in ("json_schema", "json_mode"):
            if method == "json_mode":
                fmt: str | dict[str, Any] = "json"
            else:
                fmt = convert_to_json_schema(schema)
                if "function" in fmt and "parameters" in fmt.get("function", {}):  # OpenAI's tool dict
                    fmt = fmt["function"]["parameters"]
                fmt = closed(fmt) if strict is not False else fmt
            llm = self.bind(format=fmt, ls_structured_output_format=trace)
            parser = PydanticOutputParser(pydantic_object=schema) if pydantic else JsonOutputParser()  # type: ignore[arg-type]
        else:
            raise ValueError(f"method: {method!r} is not 'json_schema', 'function_calling' or 'json_mode'")
        if not include_raw:
            return llm | parser
        parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
        none = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | parsed.with_fallbacks([none], exception_key="parsing_error")

    # -- calls -----------------------------------------------------------------------------
    def _client(self) -> Client:
        if self._argv is None:
            self._argv = self.command or connection.command(self.attach, self.socket)
        return connection.shared(self._argv, self.env)

    def _options(self, kwargs: dict[str, Any], stop: list[str] | None = None) -> dict[str, Any]:
        options = dict(self.model_kwargs)
        for name, key in OPTIONS.items():
            value = kwargs[name] if name in kwargs else getattr(self, name)
            if value is not None:
                options[key] = value
        if stops := stop if stop is not None else self.stop:
            options["stop"] = list(stops)
        return options

    def _start(self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]) -> _Call:
        """The request, as a stream (one can be waited for, read or cancelled from any thread)."""
        unknown = set(kwargs) - CALL_ARGUMENTS - set(OPTIONS)
        if unknown:
            raise ValueError(f"ChatKinfer takes no {', '.join(sorted(unknown))}")
        options = self._options(kwargs, stop)
        if kwargs.get("format") is not None:
            options["format"] = kwargs["format"]
        tools = kwargs.get("tools") or None
        choice = kwargs.get("tool_choice")
        parallel = kwargs.get("parallel_tool_calls")
        stream = self._client().stream_chat(
            kinfer_messages(messages),
            kwargs.get("model") or self.model,
            tools=tools,
            tool_choice=choice,
            parallel_tool_calls=parallel,
            think=kwargs["reasoning"] if kwargs.get("reasoning") is not None else self.reasoning,
            **options,
        )
        return _Call(stream, bool(tools) and choice != "none", parallel is False)

    @staticmethod
    def _message(result: Result, one: bool) -> AIMessage:
        calls = result.tool_calls[:1] if one else result.tool_calls
        return AIMessage(
            content=result.text,
            additional_kwargs={"reasoning_content": result.reasoning} if result.reasoning is not None else {},
            tool_calls=[tool_call(name=c.name, args=c.arguments, id=c.id) for c in calls],
            usage_metadata=usage_metadata(result),
            response_metadata=response_metadata(result),
        )

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        call = self._start(messages, stop, kwargs)
        with call.stream:
            try:
                call.stream.response.result(self.timeout)
            except TimeoutError:
                raise TimeoutError(
                    f"kinfer did not answer within {self.timeout} s (the request is cancelled)"
                ) from None
            result = call.stream.wait()
        return ChatResult(generations=[ChatGeneration(message=self._message(result, call.one))])

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        call = self._start(messages, stop, kwargs)
        result = await connection.finished(call.stream, self.timeout)  # cancelled with the task
        return ChatResult(generations=[ChatGeneration(message=self._message(result, call.one))])

    @staticmethod
    def _chunks(call: _Call, piece: str | None, sent: int) -> Iterator[ChatGenerationChunk]:
        """The chunks a streamed piece (None: the end) gives: its text, unless tools are on offer;
        the calls completed since the last piece (`sent` given so far)."""
        if isinstance(piece, Thought):  # a thinking model's reasoning, apart from the content
            yield ChatGenerationChunk(
                message=AIMessageChunk(content="", additional_kwargs={"reasoning_content": str(piece)})
            )
        elif piece and not call.calling:
            yield ChatGenerationChunk(message=AIMessageChunk(content=piece))
        calls = call.stream.tool_calls[: 1 if call.one else None]
        for index, c in enumerate(calls[sent:], start=sent):
            chunk = tool_call_chunk(name=c.name, args=json.dumps(c.arguments), id=c.id, index=index)
            yield ChatGenerationChunk(message=AIMessageChunk(content="", tool_call_chunks=[chunk]))
        if piece is None:
            result = call.stream.result or call.stream.wait()
            if call.calling and result.text:
                yield ChatGenerationChunk(message=AIMessageChunk(content=result.text))
            last = AIMessageChunk(
                content="",
                usage_metadata=usage_metadata(result),
                response_metadata=response_metadata(result),
                chunk_position="last",
            )
            yield ChatGenerationChunk(message=last, generation_info={"finish_reason": FINISH.get(result.stop_reason)})

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        call = self._start(messages, stop, kwargs)
        sent = 0
        with call.stream:  # leaving early (the consumer stops reading) cancels the request
            for piece in itertools.chain(call.stream, [None]):
                for chunk in self._chunks(call, piece, sent):
                    sent += len(chunk.message.tool_call_chunks)  # type: ignore[attr-defined]
                    if run_manager and chunk.text:
                        run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                    yield chunk

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        call = self._start(messages, stop, kwargs)
        sent = 0
        pieces = connection.pieces(call.stream)  # leaving early or being cancelled cancels the request
        try:
            async for piece in _then_none(pieces):
                for chunk in self._chunks(call, piece, sent):
                    sent += len(chunk.message.tool_call_chunks)  # type: ignore[attr-defined]
                    if run_manager and chunk.text:
                        await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                    yield chunk
        finally:
            await pieces.aclose()


@attrs.frozen
class _Call:
    """A request on its way: its stream, whether tools are on offer (then its text is sent once
    whole) and whether at most one call is kept."""

    stream: Stream
    calling: bool
    one: bool


async def _then_none(pieces: AsyncIterator[str]) -> AsyncIterator[str | None]:
    async for piece in pieces:
        yield piece
    yield None


def _default_model() -> str:
    from kinfer_rpc.host.store import DEFAULT_MODEL

    return DEFAULT_MODEL
