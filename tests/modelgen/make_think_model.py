"""Copy SmolLM2-135M-Instruct's GGUF as a thinking model: Qwen3's chat template and `<think>` /
`</think>` as tokens of its vocabulary.

    python tests/modelgen/make_think_model.py OUT.gguf [--source SmolLM2.gguf]

or, from a test, `make_think_model(dst_path)` (returns dst_path).

Qwen3 marks its reasoning with `<think>` ... `</think>`, two added tokens of its vocabulary, and
its template reads `enable_thinking`: false closes an empty block in the generation prompt. It
takes `reasoning_content` on an assistant's message and keeps it only for the turns after the
last user message (earlier reasoning is dropped), and writes tools as Qwen 2.5 does (hermes).
THINK_TEMPLATE is that template, cut to what kinfer exercises (no multi-step tool bookkeeping).

SmolLM2's vocabulary has control tokens that chats never use: `<filename>` and
`<issue_comment>` (ids 6 and 9) become `<think>` and `</think>`, user-defined tokens as Qwen3's
GGUFs have them (after `<filename>` the model writes on, where after most others it ends its
turn at once). The weights are SmolLM2's: the model never writes `</think>` by itself, so its
replies reach the answer through a reasoning budget (maxReasoningTokens), which forces the end,
or through its own end of turn inside the block, which closes the block when a format waits.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from make_tool_model import CHAT_TEMPLATE_KEY, DROP, copy_gguf

THINK_TOKENS = {6: "<think>", 9: "</think>"}
USER_DEFINED = 4  # gguf.TokenType.USER_DEFINED

THINK_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n" }}
    {{- "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments" }}
    {{- " within <tool_call></tool_call> XML tags:\\n<tool_call>\\n" }}
    {{- '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_query_index=-1) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {%- set ns.last_query_index = loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and reasoning_content %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' }}
            {{- content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if tool_call.function is defined %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
                {{- tool_call.arguments | tojson }}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""


def make_think_model(
    dst_path: str | os.PathLike[str], source: str | None = None, template: str = THINK_TEMPLATE
) -> str:
    """Write the thinking copy of `source` (default: the embedded SmolLM2 GGUF) to `dst_path`."""

    def edit(name: str, value: Any) -> Any:
        if name == CHAT_TEMPLATE_KEY:
            return DROP
        if name == "tokenizer.ggml.tokens":
            return [THINK_TOKENS.get(i, t) for i, t in enumerate(value)]
        if name == "tokenizer.ggml.token_type":
            return [USER_DEFINED if i in THINK_TOKENS else t for i, t in enumerate(value)]
        return value

    return copy_gguf(dst_path, source, edit=edit, add=lambda w: w.add_string(CHAT_TEMPLATE_KEY, template))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--source", default=None, help="the GGUF to copy (default: the embedded SmolLM2)")
    args = ap.parse_args()
    make_think_model(args.out, args.source)


if __name__ == "__main__":
    main()
