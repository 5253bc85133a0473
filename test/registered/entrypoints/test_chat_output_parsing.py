"""Reasoning and DSML tool-call parsing of generated chat text (srt/parsers, chat_output): on
the assistant turns DeepSeek's own chat encoding renders (the shared chat-encoding cases),
and on hand-made edge cases, whole and streamed in every split."""

import json
import re
from types import SimpleNamespace

import pytest

from sglang.srt.entrypoints.chat_output import ChatOutputParser, ChatOutputSpec
from sglang.srt.entrypoints.openai_api import APIError, chat_prompt_ids, chat_tools_of
from sglang.srt.parsers import ReasoningParser, ToolCall, ToolCallParser, parse_block
from sglang.srt.server_args import ServerArgs
from sglang.srt.tokenizer import ByteTokenizer, encode_messages

D = "｜DSML｜"
EOS = "<｜end▁of▁sentence｜>"
ASSISTANT = "<｜Assistant｜>"


def block(*invokes: str) -> str:
    return f"<{D}tool_calls>\n" + "\n".join(invokes) + f"\n</{D}tool_calls>"


def invoke(name: str, **params) -> str:
    lines = [f'<{D}invoke name="{name}">']
    for key, (value, is_string) in params.items():
        lines.append(f'<{D}parameter name="{key}" string="{"true" if is_string else "false"}">{value}</{D}parameter>')
    return "\n".join(lines + [f"</{D}invoke>"])


def parse(text: str, spec: ChatOutputSpec, pieces=None) -> tuple[dict, list[dict]]:
    """(message folded from the stream deltas, the deltas) for `text` fed as `pieces`."""
    p = ChatOutputParser(spec)
    deltas = []
    for piece in pieces if pieces is not None else [text]:
        deltas += p.feed(piece)
    deltas += p.finish()
    return fold(deltas), deltas


def fold(deltas: list[dict]) -> dict:
    """What a client rebuilds from stream deltas (the OpenAI SDK's accumulation rule)."""
    msg = {"reasoning_content": "", "content": "", "tool_calls": []}
    for d in deltas:
        msg["reasoning_content"] += d.get("reasoning_content", "")
        msg["content"] += d.get("content", "")
        for tc in d.get("tool_calls", []):
            if tc["index"] == len(msg["tool_calls"]):
                msg["tool_calls"].append({"id": tc["id"], "type": tc["type"],
                                          "function": {"name": tc["function"]["name"], "arguments": ""}})
            msg["tool_calls"][tc["index"]]["function"]["arguments"] += tc["function"]["arguments"]
    return msg


TOOLS = ChatOutputSpec(thinking=False, parse_reasoning=True, parse_tools=True)
THINK_TOOLS = ChatOutputSpec(thinking=True, parse_reasoning=True, parse_tools=True)


# ---- DeepSeek's rendered assistant turns parse back into the messages they came from ----------


def _generated_turns(case_dir, n: int):
    """(assistant message, thinking, the text the model generated for it) of a chat-encoding
    case: the rendered prompt's text after each assistant's generation prompt, up to its EOS."""
    data = json.loads((case_dir / f"messages_{n}.json").read_text())
    messages = data["messages"] if isinstance(data, dict) else data
    prompt = (case_dir / f"prompt_{n}.txt").read_text()
    turns = [m for m in messages if m["role"] == "assistant"]
    generated = []
    for piece in prompt.split(ASSISTANT)[1:]:
        text = piece.split(EOS)[0]
        thinking = text.startswith("<think>")
        generated.append((thinking, text.removeprefix("<think>").removeprefix("</think>")))
    return [(m, t, g) for m, (t, g) in zip(turns, generated[-len(turns):])]


@pytest.mark.parametrize("case", [1, 3])
def test_rendered_tool_call_turns_parse_back(dsv4_reference_dir, case):
    turns = _generated_turns(dsv4_reference_dir / "chat-encoding", case)
    assert any(m.get("tool_calls") for m, _, _ in turns), "the case has an assistant turn with tool calls"
    for msg, thinking, generated in turns:
        p = ChatOutputParser(ChatOutputSpec(thinking=thinking, parse_reasoning=True, parse_tools=True))
        got = p.message(generated)
        want_calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg.get("tool_calls", [])]
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got.get("tool_calls", [])] == want_calls
        assert (got["content"] or "") == (msg.get("content") or "")
        assert (got["reasoning_content"] or "") == (msg.get("reasoning_content") or "" if thinking else "")
        assert p.finish_reason("stop") == ("tool_calls" if want_calls else "stop")


def test_template_render_then_parse_round_trips_typed_arguments():
    """Arguments of every JSON type go through the template's DSML (string="true|false") and
    come back equal."""
    args = {"city": "Zürich 🌧", "days": 3, "ratio": 0.5, "metric": True, "tags": ["a", "b"],
            "filter": {"min": {"temp": -3}, "names": ["x\"y"]}, "empty": None}
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": json.dumps(args)}}]}]
    rendered = encode_messages(messages, thinking=False)
    generated = rendered.split(ASSISTANT)[-1].removeprefix("</think>").split(EOS)[0]
    msg = ChatOutputParser(TOOLS).message(generated)
    assert msg["content"] is None
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["f"]
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == args


# ---- edge cases ------------------------------------------------------------------------------

SEVERAL = "Let me check both.\n\n" + block(
    invoke("get_weather", location=("Beijing", True), unit=("celsius", True)),
    invoke("search", query=('他说 "hi" & <b>', True), num_results=("5", False), opts=('{"a": [1, {"b": null}]}', False)),
)


def test_several_calls_with_text_before_them():
    msg, _ = parse(SEVERAL, TOOLS)
    assert msg["content"] == "Let me check both."
    calls = msg["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather", "search"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"location": "Beijing", "unit": "celsius"}
    assert json.loads(calls[1]["function"]["arguments"]) == {"query": '他说 "hi" & <b>', "num_results": 5,
                                                             "opts": {"a": [1, {"b": None}]}}
    assert len({c["id"] for c in calls}) == 2 and all(re.fullmatch(r"call_[0-9a-f]{24}", c["id"]) for c in calls)


@pytest.mark.parametrize("text", [SEVERAL, "<think>ignored</think>" + SEVERAL])
def test_every_split_of_the_stream_gives_the_whole_message(text):
    spec = TOOLS if text is SEVERAL else ChatOutputSpec(thinking=True, parse_reasoning=True, parse_tools=True)
    whole = ChatOutputParser(spec).message(text)
    for i in range(len(text) + 1):
        msg, deltas = parse(text, spec, [text[:i], text[i:]])
        assert msg["content"] == (whole["content"] or "")
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]] == \
            [(c["function"]["name"], c["function"]["arguments"]) for c in whole["tool_calls"]]
    msg, deltas = parse(text, spec, list(text))  # one character per delta
    assert [c["function"]["arguments"] for c in msg["tool_calls"]] == [c["function"]["arguments"] for c in whole["tool_calls"]]
    # OpenAI's streaming shape: the name (with id and type) first, then argument fragments.
    first = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert first[0]["function"] == {"name": "get_weather", "arguments": ""} and first[0]["type"] == "function"
    assert all("name" not in tc["function"] and "id" not in tc for tc in first[1:4])


def test_reasoning_split_across_deltas_at_every_byte():
    text = "I should call it.</think>\n\n" + block(invoke("f", x=("1", False)))
    for i in range(len(text) + 1):
        msg, _ = parse(text, THINK_TOOLS, [text[:i], text[i:]])
        assert msg["reasoning_content"] == "I should call it."
        assert msg["content"] == ""
        assert [c["function"]["arguments"] for c in msg["tool_calls"]] == ['{"x": 1}']


@pytest.mark.parametrize("text", [
    f"<{D}tool_calls>not a call</{D}tool_calls>",  # only looks like a block
    f"<{D}tool_calls>\n<{D}invoke name=\"f\">\n<{D}parameter name=\"x\" string=\"maybe\">1</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>",
    f"<{D}tool_calls></{D}tool_calls>",  # no invoke
    "Answer.\n\n" + block(invoke("f", x=("1", False)))[:-5],  # cut off by max_tokens
    "Answer.\n\n" + f"<{D}tool_calls>\n<{D}invoke name=\"f\">",
    "Look: <｜DSML｜tool",  # a marker's prefix at the very end
    "plain text  \n\n",  # trailing whitespace is content when no block follows
])
def test_text_that_is_not_a_complete_block_comes_back_verbatim(text):
    for pieces in ([text], list(text)):
        msg, deltas = parse(text, TOOLS, pieces)
        assert msg["content"] == text
        assert msg["tool_calls"] == []
    p = ChatOutputParser(TOOLS)
    assert p.message(text)["content"] == text and "tool_calls" not in p.message("")
    assert p.finish_reason("length") == "length" and p.finish_reason("stop") == "stop"


def test_a_value_that_is_not_json_stays_a_string_and_text_after_a_block_is_content():
    text = block(invoke("f", n=("not json", False))) + "\nDone."
    msg, _ = parse(text, TOOLS)
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"n": "not json"}
    assert msg["content"] == "\nDone."


def test_argument_fragments_concatenate_to_the_arguments():
    for args in ({}, {"a": 1}, {"a": "x", "b": [1, 2], "c": {"d": "é"}}):
        call = ToolCall("f", args)
        assert "".join(call.argument_fragments()) == call.arguments_json()
        assert json.loads(call.arguments_json()) == args


def test_parse_block_refuses_anything_but_invokes():
    ok = "\n" + invoke("f", a=("1", True)) + "\n"
    assert parse_block(ok) == [ToolCall("f", {"a": "1"})]
    assert parse_block(ok + "stray") is None
    assert parse_block("") is None
    assert parse_block(f'<{D}invoke name="">\n</{D}invoke>') is None


def test_reasoning_parser():
    p = ReasoningParser(thinking=True)
    assert p.feed("abc</thi") == ("abc", "")
    assert p.feed("nk>answer") == ("", "answer")
    assert p.feed(" more") == ("", " more")
    cut = ReasoningParser(thinking=True)
    assert cut.feed("still thinking </th") == ("still thinking ", "")
    assert cut.finish() == ("</th", "")  # max_tokens cut it: all of it was reasoning
    off = ReasoningParser(thinking=False)
    assert off.feed("x</think>y") == ("", "x</think>y")
    msg, _ = parse("never closed", THINK_TOOLS)
    assert msg == {"reasoning_content": "never closed", "content": "", "tool_calls": []}
    assert ChatOutputParser(THINK_TOOLS).message("never closed") == {
        "role": "assistant", "content": None, "reasoning_content": "never closed"}


def test_a_forced_prefix_is_part_of_the_call():
    prefix = f'\n\n<{D}tool_calls>\n<{D}invoke name="'
    p = ToolCallParser(prefix)
    content, calls = p.feed(f'f">\n<{D}parameter name="a" string="true">x</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>')
    assert (content, calls) == ("", [ToolCall("f", {"a": "x"})])
    cut = ToolCallParser(prefix)
    assert cut.feed('f">\n<') == ("", [])
    assert cut.finish() == prefix + 'f">\n<'  # never closed: the whole call attempt is content
    with pytest.raises(ValueError):
        ToolCallParser("text first")


# ---- request validation and the prompt ---------------------------------------------------------

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("body, message", [
    ({"tools": {"a": 1}}, "tools must be a list"),
    ({"tools": [{"type": "retrieval"}]}, "each tool must be"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "function.name"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice must be"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "not among the tools"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"tool_choice": "auto"}, "needs tools"),
    ({"functions": [{"name": "f"}]}, "deprecated"),
])
def test_bad_tool_requests_get_a_clear_400(body, message):
    with pytest.raises(APIError, match=message) as e:
        chat_tools_of(body, parse_tools=True)
    assert e.value.status == 400


def _manager(**kw):
    args = ServerArgs(**kw)
    return SimpleNamespace(server_args=args, tokenizer=ByteTokenizer(512))


def test_the_prompt_offers_tools_and_starts_forced_calls():
    tok = ByteTokenizer(512)
    user = [{"role": "user", "content": "weather?"}]
    ids, spec = chat_prompt_ids({"messages": user, "tools": [WEATHER]}, _manager())
    assert "get_weather" in tok.decode(ids, skip_special_tokens=False)
    assert spec == ChatOutputSpec(thinking=False, parse_reasoning=True, parse_tools=True, forced_prefix="")
    ids, spec = chat_prompt_ids({"messages": user, "tools": [WEATHER], "tool_choice": "none"}, _manager())
    assert "get_weather" not in tok.decode(ids) and not spec.parse_tools
    ids, spec = chat_prompt_ids({"messages": user, "tools": [WEATHER],
                                 "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, _manager())
    assert tok.decode(ids, skip_special_tokens=False).endswith(f'</think>\n\n<{D}tool_calls>\n<{D}invoke name="get_weather">\n')
    assert spec.forced_prefix.endswith('name="get_weather">\n')
    ids, spec = chat_prompt_ids({"messages": user, "chat_template_kwargs": {"thinking": True}}, _manager())
    assert spec.thinking and tok.decode(ids, skip_special_tokens=False).endswith("<｜Assistant｜><think>")
    with pytest.raises(APIError, match="thinking off"):
        chat_prompt_ids({"messages": user, "tools": [WEATHER], "tool_choice": "required",
                         "chat_template_kwargs": {"thinking": True}}, _manager())
    with pytest.raises(APIError, match="--tool-call-parser none"):
        chat_prompt_ids({"messages": user, "tools": [WEATHER]}, _manager(tool_call_parser="none"))
    _, spec = chat_prompt_ids({"messages": user}, _manager(reasoning_parser="none"))
    assert not spec.parse_reasoning
