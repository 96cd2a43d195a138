"""Export the JSON Schema of every contract into ``proto/schemas/`` (``pbsd schemas export``).

The files are committed so that non-Python consumers can validate messages, and a
test fails when they no longer match the models.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel

from proto.handback import HandedBack
from proto.runs import RunSpec
from proto.streams import ALL_STREAMS

SCHEMA_DIR = Path(__file__).parent / "schemas"
# the run specification, every stream's message model once, in the streams' order, then what a
# leaving rollout worker keeps under a name (proto.handback)
EXPORTED: tuple[type[BaseModel], ...] = (RunSpec, *dict.fromkeys(s.model for s in ALL_STREAMS), HandedBack)


def render_schemas() -> dict[str, str]:
    """File name -> JSON text of each exported model's schema (serialisation mode, JSON form)."""
    out = {}
    for model in EXPORTED:
        schema = model.model_json_schema(mode="serialization")
        schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
        out[f"{model.__name__}.json"] = json.dumps(schema, indent=2, sort_keys=True) + "\n"
    return out


def export(directory: Path = SCHEMA_DIR) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in render_schemas().items():
        path = directory / name
        path.write_text(text)
        written.append(path)
    return written
