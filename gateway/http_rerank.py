"""Rerank over HTTP in the two shapes clients already speak, over the shared rerank path
(gateway/rerank.py):

  POST /v1/rerank, /v2/rerank  Cohere's and Jina's: {model, query, documents, top_n,
                               return_documents} -> {id, model, results: [{index, relevance_score,
                               document?: {text}}], meta, usage}. Documents may be strings or
                               {"text": ...} objects. Long pairs are cut (truncate defaults to true,
                               as Cohere cuts long documents).
  POST /rerank                 TEI's: {query, texts, raw_scores, return_text, truncate} ->
                               [{index, score, text?}], best first; truncate defaults to false.

Both take tokq's "priority" ("interactive" or "batch"); Cohere's integer priority (0 first, the
default) maps 0 to interactive and a higher number to batch.
"""

from __future__ import annotations

import uuid

import orjson

from tokq.gateway.errors import InvalidArgument
from tokq.gateway.priority import from_json, resolve
from tokq.gateway.rerank import RerankInput, RerankOutput
from tokq.queue.priority import PRIORITIES

# Body fields per shape. Known fields tokq cannot honour are refused when set, never ignored.
COHERE_FIELDS = {"model", "query", "documents", "top_n", "return_documents", "truncate", "raw_scores",
                 "max_tokens_per_doc", "rank_fields", "max_chunks_per_doc", "relevant_spans", "priority"}
_COHERE_UNSUPPORTED = {
    "max_tokens_per_doc": "tokq cuts a pair at the model's max length (truncate); send shorter documents",
    "rank_fields": "send each document as a string or as {\"text\": ...}",
    "max_chunks_per_doc": "tokq scores each document as one pair, cut at the model's max length",
    "relevant_spans": "tokq returns one score per document",
}
TEI_FIELDS = {"query", "texts", "raw_scores", "return_text", "truncate", "truncation_direction", "model",
              "priority"}


def _object(raw: bytes) -> dict:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidArgument(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidArgument("request body must be a JSON object")
    return body


def _known(body: dict, fields: set[str]) -> None:
    unknown = sorted(set(body) - fields)
    if unknown:
        raise InvalidArgument(f"unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(fields))}",
                              param=unknown[0])


def _typed(body: dict, name: str, types: tuple[type, ...], what: str, default=None):
    value = body.get(name)
    if value is None:
        return default
    # bool is an int in Python; JSON true is not a count
    if not isinstance(value, types) or (bool not in types and isinstance(value, bool)):
        raise InvalidArgument(f"{name} must be {what}, got {value!r}", param=name)
    return value


def _query(body: dict) -> str:
    if "query" not in body:
        raise InvalidArgument("query is required", param="query")
    return _typed(body, "query", (str,), "a string", "")


def _texts(body: dict, name: str, objects: bool) -> list[str]:
    """A list of strings (and, for Cohere and Jina, {"text": ...} objects) named ``name``."""
    if name not in body:
        raise InvalidArgument(f"{name} is required", param=name)
    value = body[name]
    if not isinstance(value, list):
        raise InvalidArgument(f"{name} must be a list of strings", param=name)
    out = []
    for i, item in enumerate(value):
        if objects and isinstance(item, dict) and set(item) == {"text"}:
            item = item["text"]
        if not isinstance(item, str):
            want = 'a string or {"text": "..."}' if objects else "a string"
            raise InvalidArgument(f"{name} item {i} must be {want}, got {item!r:.60}", param=name)
        out.append(item)
    return out


def _cohere_priority(value) -> str | None:
    """tokq's class names, or Cohere's integer priority: 0 (its default, handled first) is
    interactive, a higher number batch."""
    if type(value) is int and value >= 0:  # JSON true is no priority
        return "interactive" if value == 0 else "batch"
    if value is None or (isinstance(value, str) and value in PRIORITIES):
        return value
    raise InvalidArgument(f'priority must be "interactive", "batch" or an integer >= 0 (Cohere\'s: 0 is '
                          f"interactive, higher is batch), got {value!r:.60}", param="priority")


def parse_cohere(raw: bytes, key_priority: str | None = None) -> RerankInput:
    """A POST /v1/rerank or /v2/rerank body (Cohere's and Jina's shape); ``key_priority``: the
    caller's API key's default class, for a body that names none."""
    body = _object(raw)
    _known(body, COHERE_FIELDS)
    for name, why in _COHERE_UNSUPPORTED.items():
        if body.get(name) is not None:
            raise InvalidArgument(f"{name} is not supported: {why}", param=name)
    priority = resolve(_cohere_priority(body.get("priority")), key_priority)
    return RerankInput(
        query=_query(body), documents=_texts(body, "documents", objects=True),
        model=_typed(body, "model", (str,), "a string", ""),
        top_n=_typed(body, "top_n", (int,), "an integer >= 1"),
        raw_scores=_typed(body, "raw_scores", (bool,), "a boolean", False),
        return_documents=_typed(body, "return_documents", (bool,), "a boolean", False),
        truncate=_typed(body, "truncate", (bool,), "a boolean", True), priority=priority)


def parse_tei(raw: bytes, key_priority: str | None = None) -> RerankInput:
    """A POST /rerank body (TEI's shape); ``key_priority`` as parse_cohere's."""
    body = _object(raw)
    _known(body, TEI_FIELDS)
    direction = _typed(body, "truncation_direction", (str,), '"right"', "right")
    if direction.lower() != "right":
        raise InvalidArgument(f"truncation_direction {direction!r} is not supported: pairs are cut as "
                              "the model's tokenizer cuts them", param="truncation_direction")
    return RerankInput(
        query=_query(body), documents=_texts(body, "texts", objects=False),
        model=_typed(body, "model", (str,), "a string", ""),
        raw_scores=_typed(body, "raw_scores", (bool,), "a boolean", False),
        return_documents=_typed(body, "return_text", (bool,), "a boolean", False),
        truncate=_typed(body, "truncate", (bool,), "a boolean", False),
        priority=resolve(from_json(body.get("priority")), key_priority))


def cohere_reply(out: RerankOutput, params: RerankInput, version: str) -> dict:
    results = []
    for index, score in out.results:
        item = {"index": index, "relevance_score": score}
        if params.return_documents:
            item["document"] = {"text": out.documents[index]}
        results.append(item)
    return {"id": str(uuid.uuid4()), "model": out.model, "results": results,
            "meta": {"api_version": {"version": version}, "billed_units": {"input_tokens": out.num_tokens}},
            "usage": {"prompt_tokens": out.num_tokens, "total_tokens": out.num_tokens}}


def tei_reply(out: RerankOutput, params: RerankInput) -> list[dict]:
    return [{"index": index, "score": score} | ({"text": out.documents[index]} if params.return_documents else {})
            for index, score in out.results]
