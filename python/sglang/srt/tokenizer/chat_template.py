"""The DeepSeek-V4 release's chat encoding (messages -> prompt text), used for checkpoints and
presets alike (the byte tokenizer maps the markers to special ids).

Inferred from the release's reference prompts (test/data/dsv4-reference/chat-encoding):
    BOS  system text  [<｜latest_reminder｜>text]
    <｜User｜>user text<｜Assistant｜>M        M = <think> in thinking mode for the last user
                                              turn and every turn after it, else </think>
    [reasoning</think>]answer[\\n\\n<｜DSML｜tool_calls>...]<｜end▁of▁sentence｜>
Reasoning is kept only after the last user turn (earlier turns drop it); a tool result is a
user turn `<tool_result>...</tool_result>`; a `developer` message renders as a user turn;
tool schemas follow the system (or developer) text. Anything the references do not show
raises NotImplementedError instead of guessing a prompt the model was not trained on.
"""

from __future__ import annotations

import json
from typing import Any

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
LATEST_REMINDER = "<｜latest_reminder｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"
TASK_TOKENS = {"action": "<｜action｜>"}  # the only task the references show

TOOLS_HEADER = (
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user's question. You can invoke "
    f'tools by writing a "<{DSML}tool_calls>" block like the following:\n\n'
    f"<{DSML}tool_calls>\n"
    f'<{DSML}invoke name="$TOOL_NAME">\n'
    f'<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE'
    f"</{DSML}parameter>\n"
    "...\n"
    f"</{DSML}invoke>\n"
    f'<{DSML}invoke name="$TOOL_NAME2">\n'
    "...\n"
    f"</{DSML}invoke>\n"
    f"</{DSML}tool_calls>\n\n"
    'String parameters should be specified as is and set `string="true"`. For all other types '
    "(numbers, booleans, arrays, objects), pass the value in JSON format and set "
    '`string="false"`.\n\n'
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete "
    "reasoning inside <think>...</think> BEFORE any tool calls or final response.\n\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
)
TOOLS_FOOTER = (
    "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke "
    "tool calls.\n"
)

_USER_LIKE = ("user", "developer")
_KNOWN_ROLES = ("system", "latest_reminder", "user", "developer", "assistant", "tool")


def encode_messages(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    thinking: bool | None = None,
    add_bos: bool = True,
) -> str:
    """The prompt text for `messages`. `tools` are OpenAI-style request tools; `thinking`
    None means thinking mode iff some assistant message carries `reasoning_content`.
    A conversation ending in a user or tool turn ends with the generation prompt
    (`<｜Assistant｜><think>` or `<｜Assistant｜></think>`)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in _KNOWN_ROLES:
            role = m.get("role") if isinstance(m, dict) else m
            raise NotImplementedError(f"chat role {role!r} is not supported by the DSV4 encoding")
    if thinking is None:
        thinking = any(m["role"] == "assistant" and m.get("reasoning_content") for m in messages)
    messages = _attach_request_tools(messages, tools)
    last_user = max((i for i, m in enumerate(messages) if m["role"] in _USER_LIKE), default=-1)

    def turn_end(i: int) -> str:
        return ASSISTANT + (THINK_START if thinking and i >= last_user else THINK_END)

    parts = [BOS] if add_bos else []
    for i, msg in enumerate(messages):
        role, prev = msg["role"], messages[i - 1]["role"] if i > 0 else None
        if role == "system":
            parts.append(_text(msg) + _tools_block(msg.get("tools")))
        elif role == "latest_reminder":
            parts.append(LATEST_REMINDER + _text(msg))
        elif role in _USER_LIKE:
            parts.append(USER + _text(msg) + _tools_block(msg.get("tools")) + turn_end(i))
            parts.append(_task_token(msg, thinking))
        elif role == "tool":
            if prev == "tool":
                raise NotImplementedError(
                    "consecutive tool messages (parallel tool results) are not supported by "
                    "the DSV4 encoding here"
                )
            parts.append(f"{USER}<tool_result>{_text(msg)}</tool_result>" + turn_end(i))
        else:  # assistant
            if prev not in ("user", "developer", "tool"):
                raise NotImplementedError(
                    "an assistant message must follow a user, developer or tool message"
                )
            reasoning = ""
            if thinking and i > last_user:
                reasoning = (msg.get("reasoning_content") or "") + THINK_END
            calls = msg.get("tool_calls") or []
            calls_text = "\n\n" + _tool_calls_block(calls) if calls else ""
            parts.append(reasoning + _text(msg) + calls_text + EOS)
    return "".join(parts)


def apply_chat_template(
    tokenizer,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    thinking: bool | None = None,
) -> list[int]:
    """Prompt token ids: the encoded text already starts with BOS, so none is added."""
    return tokenizer.encode(encode_messages(messages, tools, thinking), add_special_tokens=False)


# ---- pieces -------------------------------------------------------------------------------


def _attach_request_tools(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    # Request-level tools go after the system text (reference case 1); with no system message
    # an empty one is added, as DeepSeek's serving code does for V3.2.
    if not tools:
        return messages
    if any(m.get("tools") for m in messages):
        raise NotImplementedError("tools both on the request and on a message")
    messages = [dict(m) for m in messages]
    first = messages[0]
    if first["role"] != "system":
        first = {"role": "system", "content": ""}
        messages.insert(0, first)
    first["tools"] = tools
    return messages


def _text(msg: dict) -> str:
    content = msg.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise NotImplementedError(f"content part of type {kind!r} is not supported")
            texts.append(str(part.get("text", "")))
        return "".join(texts)
    raise ValueError(f"message content must be a string or a list of parts, got {content!r}")


def _task_token(msg: dict, thinking: bool) -> str:
    task = msg.get("task")
    if task is None:
        return ""
    if task not in TASK_TOKENS:
        raise NotImplementedError(f"user task {task!r} is not supported (known: action)")
    if thinking:
        raise NotImplementedError("a user task in thinking mode is not supported")
    return TASK_TOKENS[task]


def _tools_block(tools: list[dict] | None) -> str:
    if not tools:
        return ""
    schemas = []
    for tool in tools:
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise NotImplementedError(f"tool {tool!r} is not a function tool")
        function = tool.get("function", tool)
        schemas.append(json.dumps(function, ensure_ascii=False))
    return "\n\n" + TOOLS_HEADER + "\n".join(schemas) + TOOLS_FOOTER


def _tool_calls_block(calls: list[dict]) -> str:
    lines = [f"<{DSML}tool_calls>"]
    for call in calls:
        function = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(function, dict) or "name" not in function:
            raise ValueError(f"malformed tool call {call!r}")
        args = function.get("arguments") or {}
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError as e:
                raise ValueError(f"tool call arguments are not valid JSON: {e}") from None
        if not isinstance(args, dict):
            raise ValueError(f"tool call arguments must be a JSON object, got {args!r}")
        lines.append(f'<{DSML}invoke name="{function["name"]}">')
        for key, value in args.items():
            is_str = isinstance(value, str)
            text = value if is_str else json.dumps(value, ensure_ascii=False)
            lines.append(
                f'<{DSML}parameter name="{key}" string="{"true" if is_str else "false"}">'
                f"{text}</{DSML}parameter>"
            )
        lines.append(f"</{DSML}invoke>")
    lines.append(f"</{DSML}tool_calls>")
    return "\n".join(lines)
