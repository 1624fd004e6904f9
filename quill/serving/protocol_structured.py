"""The request fields that constrain an answer, and ``logit_bias``, read into the engine's parameters.

Structured outputs come under several names; at most one may be given:

* OpenAI's ``response_format``: ``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema":
  {"name", "schema", "strict"}}`` (chat completions);
* vLLM's ``structured_outputs``: ``{"json" | "regex" | "choice" | "grammar" | "json_object"}``, and its older
  ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` (accepted with a warning);
* llama-server's ``json_schema`` (a schema) and ``grammar`` (read as xgrammar's EBNF, which is close to
  but not GBNF).

Each becomes a ``quill.engine.structured.StructuredOutputs`` whose ``source`` names the field, so an
invalid schema is a 400 naming it (the engine parses it when the request is checked, before queuing).
"""

from __future__ import annotations

import logging
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr

from quill.engine.sampling import LOGIT_BIAS
from quill.engine.structured import StructuredOutputError, StructuredOutputs

log = logging.getLogger("quill.serving")

RESPONSE_FORMATS = ("text", "json_object", "json_schema")
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_TOKEN_ID = re.compile(r"^[0-9]{1,10}$")


class StructuredOutputsIn(BaseModel):
    """vLLM's ``structured_outputs`` object."""

    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)

    json_: dict[str, Any] | StrictStr | None = Field(None, alias="json")
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = None
    grammar: StrictStr | None = None
    json_object: StrictBool | None = None
    disable_any_whitespace: StrictBool = False


Schema = dict[str, Any] | StrictStr


class StructuredFields(BaseModel):
    """The constraint fields both endpoints take (``response_format`` is the chat endpoint's own)."""

    structured_outputs: StructuredOutputsIn | None = None
    guided_json: Schema | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None
    json_schema: dict[str, Any] | None = None  # llama-server
    grammar: StrictStr | None = None  # llama-server (xgrammar's EBNF)

    def structured(self) -> StructuredOutputs | None:
        """The one constraint the request asks for (None: free text); a 400 naming the field if it is
        malformed or if several are given."""
        found = [(name, spec) for name, spec in self._constraints() if spec is not None]
        if len(found) > 1:
            raise _bad(f"only one of {', '.join(n for n, _ in found)} may be given", found[1][0])
        return found[0][1] if found else None

    def _constraints(self):
        yield "response_format", _response_format(getattr(self, "response_format", None))
        so = self.structured_outputs
        if so is not None:
            yield "structured_outputs", _spec("structured_outputs", json=so.json_, regex=so.regex, choice=so.choice,
                                              grammar=so.grammar, json_object=so.json_object,
                                              disable_any_whitespace=so.disable_any_whitespace)
        for name, kind in GUIDED.items():
            value = getattr(self, name)
            if value is not None:
                log.warning("%s is deprecated (vLLM's older name); send structured_outputs.%s", name, kind)
                yield name, _spec(name, **{kind: value})
        if self.json_schema is not None:
            yield "json_schema", _spec("json_schema", json=self.json_schema)
        if self.grammar is not None:
            yield "grammar", _spec("grammar", grammar=self.grammar)


def _bad(message: str, param: str, code: str = "invalid_value"):
    from quill.serving.protocol import bad_request  # protocol's request models import this module
    return bad_request(message, param, code)


def _spec(source: str, **fields) -> StructuredOutputs:
    try:
        return StructuredOutputs(**fields, source=source)
    except StructuredOutputError as e:
        raise _bad(str(e), e.source) from None


def _response_format(fmt: dict[str, Any] | None) -> StructuredOutputs | None:
    if fmt is None:
        return None
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return _spec("response_format", json_object=True)
    if kind != "json_schema":
        raise _bad(f"response_format.type '{kind}' is not supported; supported: {', '.join(RESPONSE_FORMATS)}",
                          "response_format.type", "unsupported_parameter")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise _bad("response_format.json_schema: expected an object with name and schema, found "
                          f"{type(spec).__name__}", "response_format.json_schema")
    schema = spec.get("schema")
    if schema is None:  # OpenAI's schema is optional: then any JSON object
        return _spec("response_format.json_schema", json_object=True)
    if not isinstance(schema, dict):
        raise _bad(f"response_format.json_schema.schema: expected a JSON schema object, found "
                          f"{type(schema).__name__}", "response_format.json_schema.schema")
    return _spec("response_format.json_schema.schema", json=schema)


def logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's ``logit_bias`` (token-id strings -> [-100, 100]) as the engine's {id: bias}; a 400 naming the
    key if it is no token id or its value is out of range (ids beyond the vocabulary: the engine's check)."""
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        if not _TOKEN_ID.match(key):
            raise _bad(f"logit_bias: key '{key}' is not a token id (a non-negative integer as a string)",
                              "logit_bias")
        if not LOGIT_BIAS[0] <= value <= LOGIT_BIAS[1]:
            raise _bad(f"logit_bias['{key}']: {value} is outside [{LOGIT_BIAS[0]:g}, {LOGIT_BIAS[1]:g}]",
                              "logit_bias")
        out[int(key)] = value
    return out

