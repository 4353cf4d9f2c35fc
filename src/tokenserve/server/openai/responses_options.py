"""The Responses API's request options checked and mapped onto chat's: refused fields,
`include`, text.format's constraint, and function tools in chat completions' shape."""

from __future__ import annotations

import json

from tokenserve.engine.guided import check_structured
from tokenserve.sampling import GuideKind, StructuredOutput

from .params import JSON_OBJECT_SCHEMA, bad_request
from .responses_schemas import FunctionToolChoice, ResponseCreateRequest
from .schemas import FunctionDefinition, NamedFunction, NamedToolChoice, Tool

LOGPROBS_INCLUDE = "message.output_text.logprobs"
# include values served: the logprobs, and those that only add what a served response holds
# anyway or name tools that run on OpenAI's side (so there is nothing of theirs to include)
_SERVED_INCLUDES = {LOGPROBS_INCLUDE, "reasoning.encrypted_content", "file_search_call.results",
                    "web_search_call.results", "web_search_call.action.sources",
                    "message.input_image.image_url", "computer_call_output.output.image_url",
                    "code_interpreter_call.outputs"}


def check_unsupported(body: ResponseCreateRequest) -> None:
    """Refuses fields that would change the answer and are not served here.

    Raises:
        InvalidRequestError: naming the first such field (code unsupported_parameter).
    """
    refused = [("conversation", body.conversation is not None,
                "Conversations are not served; continue with previous_response_id."),
               ("prompt", body.prompt is not None, "Stored prompt templates are not served."),
               ("background", bool(body.background), "Background mode is not served."),
               ("max_tool_calls", body.max_tool_calls is not None,
                "max_tool_calls is not served; parallel_tool_calls: false allows one call.")]
    for name, is_set, why in refused:
        if is_set:
            raise bad_request(f"'{name}' is not supported by this server. {why}", name,
                              "unsupported_parameter")
    for i, value in enumerate(body.include or ()):
        if value not in _SERVED_INCLUDES:
            raise bad_request(f"include.{i}: '{value}' is not supported by this server.",
                              f"include.{i}", "unsupported_parameter")


def text_format(body: ResponseCreateRequest) -> StructuredOutput | None:
    """The output constraint of text.format (json_object or json_schema), checked.

    Raises:
        InvalidRequestError: a json_schema format without a name or a schema, or a schema
            the guide cannot take.
    """
    spec = body.text.format if body.text is not None else None
    if spec is None or spec.type == "text":
        return None
    if spec.type == "json_object":
        structured, param = StructuredOutput(GuideKind.JSON_SCHEMA, JSON_OBJECT_SCHEMA), \
            "text.format"
    else:
        for field, value in (("name", spec.name), ("schema", spec.schema_)):
            if value is None:
                raise bad_request(f"text.format.{field}: a format of type 'json_schema' needs "
                                  f"a '{field}'.", f"text.format.{field}", "invalid_type")
        structured, param = StructuredOutput(GuideKind.JSON_SCHEMA,
                                             json.dumps(spec.schema_)), "text.format.schema"
    check_structured(structured, param)
    return structured


def chat_tools(body: ResponseCreateRequest) -> tuple[list[Tool] | None, object]:
    """The request's function tools and tool_choice in chat completions' shape (tools.py
    takes that one)."""
    tools = None if body.tools is None else [
        Tool(type="function", function=FunctionDefinition(
            name=t.name, description=t.description, parameters=t.parameters, strict=t.strict))
        for t in body.tools]
    choice = body.tool_choice
    if isinstance(choice, FunctionToolChoice):
        choice = NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
    return tools, choice
