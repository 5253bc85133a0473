"""Parsers of DeepSeek-V4's generated text: reasoning (`<think>`) and DSML tool calls."""

from sglang.srt.parsers.dsml_tool_calls import ToolCall, ToolCallParser, parse_block
from sglang.srt.parsers.reasoning import ReasoningParser

__all__ = ["ReasoningParser", "ToolCall", "ToolCallParser", "parse_block"]
