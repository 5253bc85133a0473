"""OpenAI request/response shapes for /v1/completions and /v1/chat/completions: prompt and
parameter mapping onto SamplingParams names, and the JSON of responses and stream chunks."""

from __future__ import annotations

from sglang.srt.entrypoints.chat_output import ChatOutputParser, ChatOutputSpec
from sglang.srt.managers.io_struct import MAX_TOP_LOGPROBS, visible_output_ids
from sglang.srt.parsers.dsml_tool_calls import BLOCK_START, INVOKE_START
from sglang.srt.tokenizer import encode_messages
from sglang.srt.tokenizer.chat_template import THINK_START

# OpenAI parameters this server cannot honour: accepted only at their neutral values, so a
# client that relies on them gets a 400 instead of silently different output.
_NEUTRAL = {
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "logit_bias": (None, {}),
    "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0),
}
# Passed through unchanged under the same name (OpenAI's and SGLang's extras).
_PASSTHROUGH = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "n")


class APIError(Exception):
    def __init__(self, message: str, status: int = 400, type_: str = "invalid_request_error", code=None):
        super().__init__(message)
        self.message, self.status, self.type, self.code = message, status, type_, code


def get_bool(body: dict, key: str, default: bool) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise APIError(f"{key} must be true or false, got {value!r}")
    return value


def check_model(body: dict, manager) -> str:
    model = body.get("model")
    if model is None:
        return manager.served_model_name
    if not isinstance(model, str):
        raise APIError(f"model must be a string, got {model!r}")
    if model not in (manager.served_model_name, manager.server_args.model_path):
        raise APIError(f"The model `{model}` does not exist.", status=404, code="model_not_found")
    return model


def _is_int_list(value) -> bool:
    return isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in value)


def completion_prompt_ids(body: dict, manager) -> list[int]:
    """`prompt`: a string, a list of token ids, or a one-element list of either."""
    prompt = body.get("prompt")
    if prompt is None:
        raise APIError("prompt is required")
    if isinstance(prompt, list) and prompt and not _is_int_list(prompt):
        if len(prompt) != 1:
            raise APIError("only one prompt per request is supported")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise APIError("prompt is empty: it needs at least one token")
        return manager.tokenize(prompt)
    if prompt == []:
        raise APIError("prompt is empty: it needs at least one token")
    if _is_int_list(prompt):
        return prompt
    raise APIError("prompt must be a string or a list of token ids")


def chat_tools_of(body: dict, parse_tools: bool) -> tuple[list | None, object]:
    """(tools, tool_choice) of a chat body, validated. tool_choice defaults to "auto" with
    tools and "none" without; a named choice is {"type": "function", "function": {"name"}}."""
    for key in ("functions", "function_call"):
        if body.get(key) is not None:
            raise APIError(f"{key} is deprecated and not supported: use tools and tool_choice",
                           code="unsupported_parameter")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise APIError("tools must be a list of function tools")
    for tool in tools or []:
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise APIError(f"each tool must be {{\"type\": \"function\", \"function\": {{...}}}}, got {tool!r}")
        function = tool.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise APIError(f"each tool needs function.name, a non-empty string: {tool!r}")
    tools = tools or None
    if tools and not parse_tools:
        raise APIError("tools need a tool-call parser: this server runs with --tool-call-parser none",
                       code="unsupported_parameter")
    choice = body.get("tool_choice")
    if choice is None:
        return tools, "auto" if tools else "none"
    if not tools and choice != "none":
        raise APIError(f"tool_choice {choice!r} needs tools")
    names = [t["function"]["name"] for t in tools or []]
    if isinstance(choice, dict):
        function = choice.get("function") if choice.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise APIError(f'tool_choice must be "none", "auto", "required" or {{"type": "function", '
                           f'"function": {{"name": ...}}}}, got {choice!r}')
        if name not in names:
            raise APIError(f"tool_choice names {name!r}, which is not among the tools")
        return tools, choice
    if choice not in ("none", "auto", "required"):
        raise APIError(f'tool_choice must be "none", "auto", "required" or a named function, got {choice!r}')
    return tools, choice


def chat_prompt_ids(body: dict, manager) -> tuple[list[int], ChatOutputSpec]:
    """Prompt ids of a chat body and how its output is to be read."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError("messages is required and must be a non-empty list")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError("each message must be an object with a string role")
    args = manager.server_args
    parse_tools = args.tool_call_parser != "none"
    tools, tool_choice = chat_tools_of(body, parse_tools)
    get_bool(body, "parallel_tool_calls", True)  # the model decides how many calls it makes
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise APIError("chat_template_kwargs must be an object")
    thinking = kwargs.get("thinking", kwargs.get("enable_thinking"))
    if thinking is not None and not isinstance(thinking, bool):
        raise APIError("chat_template_kwargs.thinking must be true or false")
    response_format = body.get("response_format")
    if response_format not in (None, {"type": "text"}):
        raise APIError("response_format is not supported")
    offered = tools if tool_choice != "none" else None
    try:
        prompt = encode_messages(messages, offered, thinking)
    except (ValueError, NotImplementedError, TypeError, KeyError) as e:
        raise APIError(f"cannot encode messages: {e}") from None
    in_thinking = prompt.endswith(THINK_START)
    forced = ""
    if tool_choice == "required" or isinstance(tool_choice, dict):
        # No grammar engine: the call is started in the prompt, and the model completes it.
        if in_thinking:
            raise APIError("tool_choice required or a named function needs thinking off "
                           "(chat_template_kwargs.thinking: false): the call would skip the reasoning")
        forced = f"\n\n{BLOCK_START}\n{INVOKE_START} name=\""
        if isinstance(tool_choice, dict):
            forced += f'{tool_choice["function"]["name"]}">\n'
    spec = ChatOutputSpec(thinking=in_thinking, parse_reasoning=args.reasoning_parser != "none",
                          parse_tools=parse_tools and offered is not None, forced_prefix=forced)
    return manager.tokenizer.encode(prompt + forced, add_special_tokens=False), spec


def sampling_params_of(body: dict, chat: bool) -> tuple[dict, bool]:
    """SamplingParams fields (as a dict, validated later) and skip_special_tokens."""
    for key, neutral in _NEUTRAL.items():
        if key in body and not any(body[key] == v and type(body[key]) is type(v) for v in neutral):
            raise APIError(f"{key} is not supported")
    max_tokens = body.get("max_completion_tokens") if chat else None
    if max_tokens is None:
        max_tokens = body.get("max_tokens", None if chat else 16)  # OpenAI's completions default
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool)):
        raise APIError(f"{key} must be an integer, got {max_tokens!r}")
    if max_tokens is not None and max_tokens < 0:
        raise APIError(f"{key} must be >= 0, got {max_tokens}")
    params = {k: body[k] for k in _PASSTHROUGH if body.get(k) is not None}
    if max_tokens is not None:
        params["max_new_tokens"] = max_tokens
    return params, get_bool(body, "skip_special_tokens", True)


def _int_in_range(body: dict, key: str) -> int:
    value = body.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOP_LOGPROBS:
        raise APIError(f"{key} must be an integer from 0 to {MAX_TOP_LOGPROBS}, got {value!r}")
    return value


def logprobs_of(body: dict, chat: bool) -> tuple[bool, int]:
    """(return_logprob, top_logprobs_num) of OpenAI's parameters. Completions: `logprobs` is
    the number of alternatives (0 to 20). Chat: `logprobs` true/false and `top_logprobs`
    (0 to 20, only with logprobs)."""
    if not chat:
        if body.get("logprobs") is None:
            return False, 0
        return True, _int_in_range(body, "logprobs")
    want = get_bool(body, "logprobs", False)
    if body.get("top_logprobs") is None:
        return want, 0
    top = _int_in_range(body, "top_logprobs")
    if top and not want:
        raise APIError("top_logprobs needs logprobs: true")
    return want, top


def stream_include_usage(body: dict) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise APIError("stream_options must be an object")
    return get_bool(options, "include_usage", False)


def finish_reason_str(reason: dict | None) -> str | None:
    return None if reason is None else reason.get("type")


class ResponseFormatter:
    """Builds one request's response (or its stream chunks) in OpenAI's shapes. With logprobs
    (`token_text`: id -> the token's text), each choice carries them for its visible tokens (a
    matched stop token is not text, so it has none): chat's `content` entries, or completions'
    tokens / token_logprobs / top_logprobs / text_offset (offsets into the completion text,
    from the tokens' own texts)."""

    def __init__(self, chat: bool, model: str, rid: str, created: int, token_text=None, top_logprobs: int = 0,
                 output: ChatOutputSpec | None = None):
        self.chat, self.model, self.created = chat, model, created
        self.output = ChatOutputParser(output or ChatOutputSpec()) if chat else None
        self.id = ("chatcmpl-" if chat else "cmpl-") + rid
        self._role_sent = False
        self.token_text, self.top_n = token_text, top_logprobs
        self._offset = 0  # completions' text_offset across stream chunks

    def logprobs(self, ids, logprobs, top_logprobs, finish_reason) -> dict | None:
        """The choice's `logprobs` for these output tokens (None without logprobs)."""
        if self.token_text is None:
            return None
        ids = visible_output_ids(ids, finish_reason)
        top_logprobs = top_logprobs or [[] for _ in ids]
        texts = [self.token_text(i) for i in ids]
        if self.chat:
            entry = lambda text, lp: {"token": text, "logprob": lp, "bytes": list(text.encode())}  # noqa: E731
            return {"content": [dict(entry(t, lp), top_logprobs=[entry(self.token_text(i), v) for v, i in top])
                                for t, lp, top in zip(texts, logprobs, top_logprobs)], "refusal": None}
        offsets = []
        for t in texts:
            offsets.append(self._offset)
            self._offset += len(t)
        top = [{self.token_text(i): v for v, i in step} for step in top_logprobs[:len(ids)]] if self.top_n else None
        return {"tokens": texts, "token_logprobs": list(logprobs[:len(ids)]), "top_logprobs": top,
                "text_offset": offsets}

    @staticmethod
    def usage(out) -> dict:
        return {
            "prompt_tokens": out.prompt_tokens,
            "completion_tokens": out.completion_tokens,
            "total_tokens": out.prompt_tokens + out.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": out.cached_tokens},
        }

    def _finish_reason(self, out) -> str | None:
        reason = finish_reason_str(out.finish_reason)
        return self.output.finish_reason(reason) if self.chat else reason

    def response(self, text: str, out, logprobs: dict | None = None) -> dict:
        choice = {"index": 0, "logprobs": logprobs}
        if self.chat:
            choice["message"] = self.output.message(text)
        else:
            choice["text"] = text
        choice["finish_reason"] = self._finish_reason(out)
        return {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": self.usage(out),
        }

    def _chunk(self, piece, finish_reason=None, usage=None, logprobs=None) -> dict:
        choices = []
        if piece is not None:
            choice = {"index": 0, "logprobs": logprobs, "finish_reason": finish_reason}
            choice["delta" if self.chat else "text"] = piece
            choices.append(choice)
        chunk = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage is not None:
            chunk["usage"] = usage
        return chunk

    def stream_events(self, out, include_usage: bool) -> list[dict]:
        events = []
        if self.chat and not self._role_sent:
            events.append(self._chunk({"role": "assistant", "content": ""}))
            self._role_sent = True
        logprobs = None
        reason = out.finish_reason if out.finished else None
        if self.token_text is not None and visible_output_ids(out.output_ids, reason):
            logprobs = self.logprobs(out.output_ids, out.output_logprobs, out.output_top_logprobs, reason)
        if self.chat:
            deltas = self.output.feed(out.text) if out.text else []
            if out.finished:
                deltas += self.output.finish()
            if logprobs and not deltas:
                deltas = [{"content": ""}]  # the tokens' text is held back; their logprobs are not
            for i, delta in enumerate(deltas):
                events.append(self._chunk(delta, logprobs=logprobs if i == 0 else None))
        elif out.text or logprobs:
            events.append(self._chunk(out.text, logprobs=logprobs))
        if out.finished:
            events.append(self._chunk({} if self.chat else "", self._finish_reason(out)))
            if include_usage:
                events.append(self._chunk(None, usage=self.usage(out)))
        return events
