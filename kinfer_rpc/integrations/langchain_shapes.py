"""LangChain's values in the protocol's shapes, and kinfer's replies in LangChain's: messages
(tool calls and their results with their ids), tools, tool choices, usage and metadata. For
`ChatKinfer` (kinfer_rpc.integrations.langchain)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage, ChatMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.messages.ai import InputTokenDetails, OutputTokenDetails, UsageMetadata
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_openai_tool

from kinfer_rpc.client import Result
from kinfer_rpc.integrations.schemas import closed

FINISH = {"stop": "stop", "length": "length", "toolCalls": "tool_calls", "cancelled": "cancelled"}
# content blocks that an assistant message's tool_calls (or nothing kinfer reads) already carry
SKIPPED_BLOCKS = {"tool_use", "tool_call", "tool_call_chunk", "reasoning", "thinking"}


def kinfer_tool(
    tool: dict[str, Any] | type | Callable[..., Any] | BaseTool, strict: bool | None = None
) -> dict[str, Any]:
    """A LangChain tool (a BaseTool, a function, a pydantic model, a TypedDict, OpenAI's dict) in
    the protocol's shape, its parameters closed unless `strict` is False."""
    spec = convert_to_openai_tool(tool)
    function = dict(spec["function"])
    function.setdefault("parameters", {"type": "object", "properties": {}})
    if strict is not False:
        function["parameters"] = closed(function["parameters"])
    return {"type": "function", "function": function}


def kinfer_tool_choice(choice: Any) -> str | dict[str, Any] | None:
    """LangChain's tool_choice as the protocol's toolChoice: "any" and True are "required"."""
    if choice is None or isinstance(choice, dict):
        return choice
    if choice is True or choice == "any":
        return "required"
    if choice is False:
        return "none"
    if isinstance(choice, str):
        return choice
    raise ValueError(f"tool_choice: {choice!r} is not 'auto', 'none', 'any', 'required', a tool's name or a dict")


def _text(content: str | list[Any], role: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for block in content:
        if isinstance(block, str):
            texts.append(block)
        elif isinstance(block, dict) and block.get("type") == "text":
            texts.append(str(block.get("text", "")))
        elif not (isinstance(block, dict) and block.get("type") in SKIPPED_BLOCKS):
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise ValueError(f"kinfer reads text: a {kind!r} block of a {role} message cannot be sent")
    return "".join(texts)


def _user(content: str | list[Any]) -> dict[str, Any]:
    """A user's message: its text, and its images (`image_url` blocks with a base64 data: URL,
    or `image` blocks of base64 data) for a model loaded with a vision projector."""
    if isinstance(content, str):
        return {"role": "user", "content": content}
    images: list[str] = []
    rest: list[Any] = []
    for block in content:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "image_url":
            value = block.get("image_url")
            url = value.get("url") if isinstance(value, dict) else value
            if not isinstance(url, str) or not url.startswith("data:") or ";base64," not in url:
                raise ValueError("kinfer reads an image_url block's image from a base64 data: URL only")
            images.append(url)
        elif kind == "image" and isinstance(block.get("base64") or block.get("data"), str):
            images.append(block.get("base64") or block["data"])
        else:
            rest.append(block)
    message: dict[str, Any] = {"role": "user", "content": _text(rest, "user")}
    if images:
        message["images"] = images
    return message


def kinfer_messages(messages: Sequence[BaseMessage]) -> list[dict[str, Any]]:
    """LangChain's messages as the protocol's: tool calls and their results with their ids."""
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # a call's id -> its function's name, for tool messages without one
    for m in messages:
        if isinstance(m, SystemMessage):
            out.append({"role": "system", "content": _text(m.content, "system")})
        elif isinstance(m, HumanMessage):
            out.append(_user(m.content))
        elif isinstance(m, AIMessage):
            message: dict[str, Any] = {"role": "assistant", "content": _text(m.content, "assistant")}
            thought = m.additional_kwargs.get("reasoning_content")
            if isinstance(thought, str) and thought:  # a thinking model's: the template keeps or drops it
                message["reasoning"] = thought
            if m.tool_calls:
                message["toolCalls"] = [
                    {
                        "id": c["id"] or f"call_{i}",
                        "type": "function",
                        "function": {"name": c["name"], "arguments": c["args"]},
                    }
                    for i, c in enumerate(m.tool_calls)
                ]
                names.update({c["id"]: c["function"]["name"] for c in message["toolCalls"]})
            out.append(message)
        elif isinstance(m, ToolMessage):
            message = {"role": "tool", "toolCallId": m.tool_call_id, "content": _text(m.content, "tool")}
            name = m.name or names.get(m.tool_call_id)
            if name:
                message["name"] = name
            out.append(message)
        elif isinstance(m, ChatMessage):
            out.append({"role": m.role, "content": _text(m.content, m.role)})
        else:
            raise ValueError(f"kinfer takes system, user, assistant, tool and chat messages, not {type(m).__name__}")
    return out


def usage_metadata(result: Result) -> UsageMetadata:
    u = result.usage
    return UsageMetadata(
        input_tokens=u.prompt_tokens,
        output_tokens=u.completion_tokens,
        total_tokens=u.prompt_tokens + u.completion_tokens,
        input_token_details=InputTokenDetails(cache_read=u.cached_tokens),
        output_token_details=OutputTokenDetails(reasoning=u.reasoning_tokens),
    )


def response_metadata(result: Result) -> dict[str, Any]:
    return {
        "model_name": result.model or "",
        "model_provider": "kinfer",
        "finish_reason": FINISH.get(result.stop_reason, result.stop_reason),
        "seed": result.seed,
    }
