"""How the gateway parses tokq.v1 requests and writes Embed responses as bytes.

Request inputs are read as bytes so the byte caps run before any UTF-8 decoding (docs/internals.md).
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable, Mapping, Sequence

import grpc
import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError

from tokq.gateway.errors import refuse
from tokq.v1 import embedder_pb2 as pb


def _inputs_as_bytes(published: type) -> type:
    """``published`` (a request message with ``repeated string inputs``) with ``inputs`` read as bytes."""
    file = descriptor_pb2.FileDescriptorProto()
    pb.DESCRIPTOR.CopyToProto(file)
    [message] = [m for m in file.message_type if m.name == published.DESCRIPTOR.name]
    [inputs] = [f for f in message.field if f.name == "inputs"]
    inputs.type = descriptor_pb2.FieldDescriptorProto.TYPE_BYTES
    pool = descriptor_pool.DescriptorPool()  # its own pool: the same names as the real file
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(published.DESCRIPTOR.full_name))


EmbedRequestUtf8 = _inputs_as_bytes(pb.EmbedRequest)
TokenizeRequestUtf8 = _inputs_as_bytes(pb.TokenizeRequest)

# Per method: the request type the gateway parses, where it is not the published one.
_READ_AS = {"Embed": EmbedRequestUtf8, "Tokenize": TokenizeRequestUtf8}
# Methods whose handlers return their response's wire bytes.
_WRITTEN_AS_BYTES = {"Embed"}


class Malformed:
    """A request that does not parse; its handler refuses it INVALID_ARGUMENT (``_refusing_malformed``)
    where a raising deserializer would make gRPC answer UNKNOWN and log a traceback."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _parse_or_malformed(parse: Callable[[bytes], object]) -> Callable[[bytes], object]:
    def read(data: bytes) -> object:
        try:
            return parse(data)
        except DecodeError as exc:
            return Malformed(str(exc))
    return read


def _refusing_malformed(handler: Callable, full_name: str,
                        count: Callable[[str, str], None] | None) -> Callable:
    """``handler``, refusing a Malformed request (and counting it: ``count(rpc, code)``)."""
    rpc = full_name.rsplit(".", 1)[-1].removesuffix("Request")

    async def handle(request, context: grpc.aio.ServicerContext):
        if type(request) is Malformed:
            refuse(context, grpc.StatusCode.INVALID_ARGUMENT,
                   f"the request is not a valid {full_name} ({request.reason}): string fields must be UTF-8")
            if count:
                count(rpc, grpc.StatusCode.INVALID_ARGUMENT.name)
            return None
        return await handler(request, context)
    return handle


# What a gateway sends in one message at most (gRPC's max_send_message_length; tokq.Client
# receives as much): an Embed response larger fails only once every vector is computed.
MAX_SEND_MESSAGE_BYTES = 64 * 1024 * 1024
_REPLY_OVERHEAD_BYTES = 4096  # model name, usage, timing: well under this


def embed_response_max_bytes(num_vectors: int, dims: int) -> int:
    """At least ``embed_response``'s size for that many vectors of ``dims`` floats: each vector is
    two length-delimited headers (a tag and a length of at most 3 bytes each) and its float32s."""
    return num_vectors * (dims * 4 + 8) + _REPLY_OVERHEAD_BYTES


# Timing's fields in field-number order: (tag byte, name); each a double (wire type 1).
_TIMING = tuple((f.number << 3 | 1, f.name) for f in sorted(pb.Timing.DESCRIPTOR.fields, key=lambda f: f.number)
                if f.type == f.TYPE_DOUBLE)
assert len(_TIMING) == len(pb.Timing.DESCRIPTOR.fields), "Timing holds doubles only"
_DOUBLE = struct.Struct("<d")
_ZERO_DOUBLE = bytes(8)


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(tag: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2): tag byte, length, payload."""
    return bytes((tag,)) + _varint(len(payload)) + payload


# Timing with no field at its default, written in one pack: 4 doubles, each after its tag byte.
_ALL_TIMING = struct.Struct("<" + "Bd" * len(_TIMING))
_ALL_TIMING_HEAD = _field(0x22, bytes(_ALL_TIMING.size))[:-_ALL_TIMING.size]
_TIMING_TAGS = [tag for tag, _ in _TIMING]
_vector_heads: dict[int, bytes] = {}  # by a vector's byte size: its Embedding's and values' headers


def _vector_head(size: int) -> bytes:
    head = _vector_heads.get(size)
    if head is None:
        inner = b"\x0a" + _varint(size)
        head = _vector_heads[size] = b"\x0a" + _varint(len(inner) + size) + inner
    return head


def embed_response(vectors: Sequence[np.ndarray], model: str, num_tokens: int,
                   timing: Mapping[str, float]) -> bytes:
    """tokq.v1.EmbedResponse's wire bytes, as protobuf writes them: packed little-endian float32s,
    model, usage (prompt and total tokens alike) and timing. Fields at their default are left out;
    usage and timing are always present."""
    parts = []
    for v in vectors:
        data = v.astype("<f4", copy=False).tobytes()
        parts += (_vector_head(len(data)), data) if data else (b"\x0a\x00",)
    if model:
        parts.append(_model_field(model))
    usage = b"\x08" + _varint(num_tokens) + b"\x10" + _varint(num_tokens) if num_tokens else b""
    parts.append(_field(0x1A, usage))
    values = [timing[name] for _, name in _TIMING]
    if 0.0 in values:  # a field at its default (+0.0) is left out; -0.0 is not
        doubles = []
        for (tag, _), value in zip(_TIMING, values):
            raw = _DOUBLE.pack(value)
            if raw != _ZERO_DOUBLE:
                doubles.append(bytes((tag,)) + raw)
        parts.append(_field(0x22, b"".join(doubles)))
    else:
        fields = [0] * (2 * len(_TIMING))
        fields[::2], fields[1::2] = _TIMING_TAGS, values
        parts += (_ALL_TIMING_HEAD, _ALL_TIMING.pack(*fields))
    return b"".join(parts)


@functools.lru_cache(maxsize=64)
def _model_field(model: str) -> bytes:
    return _field(0x12, model.encode())


def add_embedder_service(servicer, server: grpc.aio.Server) -> None:
    """What the generated ``add_EmbedderServicer_to_server`` does, with ``_READ_AS`` applied and
    requests that do not parse refused (counted by the servicer's ``count_refused``, if any)."""
    count = getattr(servicer, "count_refused", None)
    service = pb.DESCRIPTOR.services_by_name["Embedder"]
    handlers = {}
    for method in service.methods:
        if method.client_streaming or method.server_streaming:
            raise TypeError(f"{method.full_name} streams: only unary methods are registered here")
        request = _READ_AS.get(method.name) or message_factory.GetMessageClass(method.input_type)
        response = message_factory.GetMessageClass(method.output_type)
        handlers[method.name] = grpc.unary_unary_rpc_method_handler(
            _refusing_malformed(getattr(servicer, method.name), method.input_type.full_name, count),
            request_deserializer=_parse_or_malformed(request.FromString),
            response_serializer=None if method.name in _WRITTEN_AS_BYTES else response.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)
