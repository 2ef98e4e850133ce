"""How tools are described to the policy: a signature when the parameters are a flat object
of plainly typed properties, the JSON Schema itself when it says more than a signature can."""

from __future__ import annotations

import json

from libs.chat.tool_calls import describe_tool, describe_tools
from libs.domains.calc.env import TOOLS as CALC_TOOLS
from libs.domains.coding.tools import TOOLS as CODING_TOOLS
from proto.messages import ToolSpec


def tool(parameters: dict[str, object]) -> ToolSpec:
    return ToolSpec(name="act", description="Acts.", parameters=parameters)


def flat(properties: dict[str, object], required: list[str]) -> dict[str, object]:
    return {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }


def test_flat_parameters_read_as_a_signature() -> None:
    assert describe_tool(CALC_TOOLS[0]) == "add(a: integer, b: integer): Returns a + b."
    both = flat(
        {"path": {"type": "string"}, "args": {"type": "array", "items": {"type": "string"}}},
        ["path"],
    )
    assert describe_tool(tool(both)) == "act(path: string, args?: string[]): Acts."
    assert describe_tool(tool(flat({}, []))) == "act(): Acts."
    assert describe_tool(tool({})) == "act(): Acts."
    # Most hand-written schemas leave additionalProperties out: they mean the listed ones.
    plain = {"type": "object", "properties": {"x": {"type": "integer"}}}
    assert describe_tool(tool(plain)) == "act(x?: integer): Acts."


def test_a_property_description_follows_the_signature() -> None:
    described = flat({"path": {"type": "string", "description": "relative path"}}, [])
    assert describe_tool(tool(described)) == "act(path?: string): Acts. path: relative path."
    read_file = next(spec for spec in CODING_TOOLS if spec.name == "read_file")
    assert describe_tool(read_file) == (
        "read_file(path: string): Read a text file. path: path relative to the working folder."
    )


def test_a_schema_a_signature_cannot_say_is_shown_whole() -> None:
    richer = [
        flat({"mode": {"type": "string", "enum": ["r", "w"]}}, []),  # a choice of values
        flat({"where": flat({"x": {"type": "integer"}}, ["x"])}, []),  # a nested object
        {"type": "object", "properties": {}, "additionalProperties": True},  # any arguments
        flat({"x": {"type": "integer", "default": 3}}, []),
        flat({"x": {"type": "integer"}}, ["x", "y"]),  # requires what it does not define
    ]
    for parameters in richer:
        text = describe_tool(tool(parameters))
        assert text == f"act: Acts. Arguments: {json.dumps(parameters, separators=(',', ':'))}"


def test_the_listing_names_the_call_format_and_every_tool() -> None:
    listing = describe_tools(list(CALC_TOOLS))
    assert '<tool_call>{"name": "<tool>", "arguments": {...}}</tool_call>' in listing
    assert [line.split("(")[0] for line in listing.splitlines() if line.startswith("- ")] == [
        "- add",
        "- subtract",
        "- multiply",
        "- divide",
    ]
    assert describe_tools([]) == ""
