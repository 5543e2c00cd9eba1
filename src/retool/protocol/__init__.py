"""retool.protocol: the code_interpreter tool, system prompts, tool-call formats, strict parsing, and
exact token continuity across tool turns (docs/spec.md §2, chapter 8.4.2-8.4.3)."""

from retool.protocol.chat import ChatProtocol, TemplateNotAppendOnlyError
from retool.protocol.formats import (
    FORMATS,
    HermesJsonFormat,
    MarkdownFormat,
    ParsedAssistant,
    QwenXmlFormat,
    ToolFormat,
    detect_format,
    get_format,
    parse_assistant,
)
from retool.protocol.prompts import (
    CODE_TOOL,
    MARKDOWN_TOOL_INSTRUCTIONS,
    TEXT_SYSTEM_PROMPT,
    TOOL_NAME,
    TOOL_SYSTEM_PROMPT,
)
from retool.protocol.sanitize import sanitize_tool_content, special_token_strings

__all__ = [
    "CODE_TOOL",
    "FORMATS",
    "MARKDOWN_TOOL_INSTRUCTIONS",
    "TEXT_SYSTEM_PROMPT",
    "TOOL_NAME",
    "TOOL_SYSTEM_PROMPT",
    "ChatProtocol",
    "HermesJsonFormat",
    "MarkdownFormat",
    "ParsedAssistant",
    "QwenXmlFormat",
    "TemplateNotAppendOnlyError",
    "ToolFormat",
    "detect_format",
    "get_format",
    "parse_assistant",
    "sanitize_tool_content",
    "special_token_strings",
]
