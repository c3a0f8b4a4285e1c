"""Tool parameter schemas closed for decoding (capsulert/chat/schemas.py)."""
from __future__ import annotations

from capsulert.chat.schemas import closed

OPEN = {"type": "object", "required": ["city"], "properties": {
    "city": {"type": "string"},
    "where": {"type": "object", "properties": {"lat": {"type": "number"}}},
    "stops": {"type": "array", "items": {"properties": {"name": {"type": "string"}}}},
    "unit": {"anyOf": [{"$ref": "#/$defs/Unit"}, {"type": "null"}]},
    "extra": {"type": "object", "additionalProperties": {"type": "object", "properties": {"k": {"type": "string"}}}},
    "free": {"type": "object", "additionalProperties": True}},
    "$defs": {"Unit": {"type": "object", "properties": {"name": {"type": "string"}}}}}


def test_every_object_that_says_nothing_is_closed():
    c = closed(OPEN)
    assert c["additionalProperties"] is False
    props = c["properties"]
    assert props["where"]["additionalProperties"] is False
    assert props["stops"]["items"]["additionalProperties"] is False
    assert c["$defs"]["Unit"]["additionalProperties"] is False
    assert props["extra"]["additionalProperties"]["additionalProperties"] is False  # its values' schema closed
    assert props["free"]["additionalProperties"] is True  # said: kept
    assert props["city"] == {"type": "string"} and props["unit"]["anyOf"][1] == {"type": "null"}
    assert "additionalProperties" not in OPEN  # the argument is not changed

