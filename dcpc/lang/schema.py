"""The language's JSON Schema, generated from the pydantic models.

Editors' YAML language servers (e.g. redhat.vscode-yaml) validate and complete
schedules with it: see docs/language.md, "Editor support".
"""

from __future__ import annotations

from typing import Any

from dcpc.lang.model import Schedule

SCHEMA_ID = "https://dcpc.invalid/schema/schedule.json"


def json_schema() -> dict[str, Any]:
    schema = Schedule.model_json_schema(mode="validation")
    schema["$schema"] = "http://json-schema.org/draft-07/schema#"
    schema["title"] = "dcpc schedule"
    schema["$id"] = SCHEMA_ID
    # a step is a one-key mapping {name: op}; say so for editors
    schema["properties"]["steps"]["items"]["maxProperties"] = 1
    schema["properties"]["steps"]["items"]["minProperties"] = 1
    _accept_int_base(schema)
    return schema


def _accept_int_base(node: Any) -> None:
    """YAML reads ``lse_base: 2`` as an integer; the parser accepts it, so must the schema."""
    if isinstance(node, dict):
        if node.get("enum") == ["e", "2"]:
            node["enum"] = ["e", "2", 2]
            node.pop("type", None)
        for value in node.values():
            _accept_int_base(value)
    elif isinstance(node, list):
        for value in node:
            _accept_int_base(value)
