"""Python client for search backends.

    from tokq import Client
    vectors = Client("localhost:50051").embed(["red shoes", "blue shoes"])   # float32 [2, dim]
    best = Client("localhost:50051").rerank("red shoes", ["a red shoe", "a blue hat"])[0]  # .index, .score

Errors raise ``TokqError`` (gRPC status code and message). TLS: ``credentials=``; API keys:
``api_key=``. ``timeout=None`` or ``math.inf`` leaves the gateway's default deadline.
``priority="batch"`` queues bulk work behind live queries (None: the API key's default, else
interactive). Calls are spread over the gateway processes behind a few connections (docs/internals.md).
"""

from __future__ import annotations

import asyncio
import json
import math
import numbers
import operator
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc
import numpy as np

from tokq.queue.priority import PRIORITIES
from tokq.v1 import embedder_pb2 as pb
from tokq.v1 import embedder_pb2_grpc as pb_grpc


class TokqError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


@dataclass(frozen=True)
class Embeddings:
    """Everything an Embed call returns; ``embed`` returns just ``vectors``."""

    vectors: np.ndarray  # float32 [n, dim]
    model: str
    prompt_tokens: int
    timing: dict[str, float]


@dataclass(frozen=True)
class RerankResult:
    index: int  # the document's position in the request
    score: float
    document: str | None = None  # with return_documents=True


@dataclass(frozen=True)
class Reranking:
    """Everything a Rerank call returns; ``rerank`` returns just ``results`` (best first)."""

    results: list[RerankResult]
    model: str
    prompt_tokens: int
    timing: dict[str, float]


def _text_list(texts: Sequence[str], method: str) -> list[str]:
    # else each character (each byte, as an int) would go as an input of its own
    if isinstance(texts, (str, bytes, bytearray)):
        raise TypeError(f"{method}() takes a list of strings; wrap a single text in a list")
    items = list(texts)
    for i, text in enumerate(items):
        if not isinstance(text, str):
            raise TypeError(f"{method}() takes a list of strings; input {i} is {type(text).__name__}")
        if not text.isascii():  # ASCII is UTF-8: the common case costs one check
            try:
                text.encode()
            except UnicodeEncodeError as exc:  # a lone surrogate: protobuf would raise it raw
                raise ValueError(f"input {i} is not valid UTF-8 (a lone surrogate, "
                                 f"{text[exc.start]!r}, at character {exc.start:,}): text inputs "
                                 "must be UTF-8") from None
    return items


UINT32_MAX = 2**32 - 1  # EmbedRequest.dimensions is a uint32


def _check_dimensions(dimensions) -> int:
    if isinstance(dimensions, bool):
        raise TypeError(f"dimensions must be an integer, got {dimensions!r}")
    try:
        dims = operator.index(dimensions)  # ints and numpy integers, not 1.5
    except TypeError:
        raise TypeError(f"dimensions must be an integer, got {dimensions!r}") from None
    if not 0 <= dims <= UINT32_MAX:  # 0 is the gateway's to refuse, naming the model's range
        raise ValueError(f"dimensions={dims} is out of range: it must be a positive integer")
    return dims


def check_priority(priority: str | None) -> str | None:
    """``priority`` if it is a class name or None (the API key's default), else ValueError."""
    if priority is not None and (not isinstance(priority, str) or priority not in PRIORITIES):
        raise ValueError(f"priority must be one of {', '.join(map(repr, PRIORITIES))} or None (the API "
                         f"key's default, else interactive), got {priority!r:.60}")
    return priority


def _priority(priority: str | None) -> int:
    """A priority class as tokq.v1.Priority: None is PRIORITY_UNSPECIFIED."""
    if check_priority(priority) is None:
        return pb.PRIORITY_UNSPECIFIED
    return pb.Priority.Value(priority.upper())


def _request(texts: Sequence[str], truncate: bool, normalize: bool, dimensions: int | None,
             prompt_name: str | None, model: str, priority: str | None = None) -> pb.EmbedRequest:
    req = pb.EmbedRequest(inputs=_text_list(texts, "embed"), truncate=truncate, normalize=normalize,
                          model=model, priority=_priority(priority))
    if dimensions is not None:
        req.dimensions = _check_dimensions(dimensions)
    if prompt_name is not None:
        req.prompt_name = prompt_name
    return req


def _rerank_request(query: str, documents: Sequence[str], top_n: int | None, raw_scores: bool,
                    return_documents: bool, truncate: bool, model: str,
                    priority: str | None = None) -> pb.RerankRequest:
    if not isinstance(query, str):
        raise TypeError(f"rerank() takes the query as a string, got {type(query).__name__}")
    _text_list([query], "rerank")
    req = pb.RerankRequest(query=query, documents=_text_list(documents, "rerank"), raw_scores=raw_scores,
                           return_documents=return_documents, truncate=truncate, model=model,
                           priority=_priority(priority))
    if top_n is not None:
        if isinstance(top_n, bool):
            raise TypeError(f"top_n must be an integer, got {top_n!r}")
        try:
            n = operator.index(top_n)
        except TypeError:
            raise TypeError(f"top_n must be an integer, got {top_n!r}") from None
        if not 0 <= n <= UINT32_MAX:  # 0 is the gateway's to refuse
            raise ValueError(f"top_n={n} is out of range: it must be a positive integer")
        req.top_n = n
    return req


def _unpack_rerank(resp: pb.RerankResponse) -> Reranking:
    results = [RerankResult(r.index, r.score, r.document if r.HasField("document") else None)
               for r in resp.results]
    t = resp.timing
    return Reranking(results, resp.model, resp.usage.prompt_tokens,
                     {"tokenize_ms": t.tokenize_ms, "queue_ms": t.queue_ms,
                      "inference_ms": t.inference_ms, "total_ms": t.total_ms})


def _unpack(resp: pb.EmbedResponse) -> Embeddings:
    dim = len(resp.embeddings[0].values) if resp.embeddings else 0
    vectors = np.empty((len(resp.embeddings), dim), dtype=np.float32)
    for i, emb in enumerate(resp.embeddings):
        vectors[i] = emb.values
    t = resp.timing
    return Embeddings(vectors, resp.model, resp.usage.prompt_tokens,
                      {"tokenize_ms": t.tokenize_ms, "queue_ms": t.queue_ms,
                       "inference_ms": t.inference_ms, "total_ms": t.total_ms})


def _error(exc: grpc.RpcError) -> TokqError:
    return TokqError(exc.code(), exc.details() or "")


# The gateway's --max-timeout-ms default and highest value: it cuts longer deadlines to this
# anyway, and grpc overflows one past ~1e10 s (the call fails at once: DEADLINE_EXCEEDED).
MAX_TIMEOUT_S = 86_400.0


def _deadline(timeout: float | None) -> float | None:
    """``timeout`` as grpc takes it: None or inf for none (the gateway's --default-timeout-ms
    then applies), at most MAX_TIMEOUT_S; NaN, 0 and negatives refused (grpc fails them at once
    with DEADLINE_EXCEEDED, as if the gateway were slow)."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise TypeError(f"timeout must be a number of seconds or None, got {timeout!r}")
    if math.isnan(timeout) or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds (or None/inf for no "
                         f"deadline), got {timeout!r}")
    return None if math.isinf(timeout) else min(float(timeout), MAX_TIMEOUT_S)


GATEWAY_ID_METADATA = "tokq-gateway"  # trailing metadata: the answering gateway process's id
DEFAULT_CONNECTIONS = 4
# Reopen connections that reach an already-reached process until this many in a row found no
# new one: with 2 processes and 4 connections, the chance one process is never reached is 2^-19.
DISCOVERY_MISSES = 16
# A new client's first burst waits at most this long while its connections and that many more,
# opened at once, are probed (Info): its calls then spread over every process found.
FIRST_SEARCH_WAIT_S = 0.5
PROBE_TIMEOUT_S = 5.0
# Then one doubled-up connection is reopened at most this often, the wait doubling up to the max.
REDISCOVER_FIRST_S = 5.0
REDISCOVER_MAX_S = 300.0
# A process that answered one of these is passed over this long while another can take the call.
# Not RESOURCE_EXHAUSTED: the queue's token cap it stands for is shared by every process.
BACKOFF_CODES = frozenset({grpc.StatusCode.UNAVAILABLE})
BACKOFF_S = 1.0
# While calls are in flight, a connection silent this long is pinged and closed if no answer
# comes within the timeout, so a call to a frozen gateway fails UNAVAILABLE instead of hanging.
KEEPALIVE_TIME_MS = 30_000
KEEPALIVE_TIMEOUT_MS = 10_000


def _channel_options() -> list[tuple[str, object]]:
    return [("grpc.max_receive_message_length", 64 * 1024 * 1024),
            ("grpc.max_send_message_length", 64 * 1024 * 1024),
            # Each channel its own connection: grpc-python otherwise shares one between all
            # channels to the same target.
            ("grpc.use_local_subchannel_pool", 1),
            # A name with several addresses (a headless Service): each connection takes a random
            # one instead of all taking the first.
            ("grpc.service_config", json.dumps(
                {"loadBalancingConfig": [{"pick_first": {"shuffleAddressList": True}}]})),
            ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
            ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
            # The timer that closes a connection on an unanswered ping (grpc core's default: 1 min).
            ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
            # Pings only while calls are in flight: more would draw GOAWAY too_many_pings from a
            # gateway on grpc's default ping policy.
            ("grpc.keepalive_permit_without_calls", 0)]


def read_pem(path: str) -> bytes:
    """A PEM file's bytes for grpc's TLS credentials; ValueError if unreadable or not PEM (gRPC would
    take such bytes and fail every call with "Failed to create security handshaker")."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise ValueError(f"{path!r}: {exc.strerror}") from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"{path!r} is not a PEM file")
    return data

class _Connection:
    __slots__ = ("channel", "stub", "outstanding", "process", "retired")

    def __init__(self, channel) -> None:
        self.channel = channel
        self.stub = pb_grpc.EmbedderStub(channel)
        self.outstanding = 0  # calls in flight, a probe included
        self.process: str | None = None  # the gateway process it reaches, once a reply said
        self.retired = False  # replaced: closed once its calls in flight finish


class _Pool:
    """Which connection the next call takes (no I/O: shared by Client and AsyncClient): the least
    busy gateway process's least busy connection (docs/internals.md)."""

    def __init__(self, open_channel: Callable[[], object], size: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._open = open_channel
        self._clock = clock
        self._lock = threading.Lock()
        self._turn = 0
        self._misses_left = DISCOVERY_MISSES
        self._rediscover_s = REDISCOVER_FIRST_S
        self._next_rediscovery = clock() + REDISCOVER_FIRST_S
        self._seen: set[str] = set()
        self._backoff_until: dict[str, float] = {}  # process -> passed over until (clock)
        self._search_until: float | None = None  # when a burst's calls stop waiting for the search
        self.searching = False  # the first search's probes are out
        self._scouts: list[_Connection] = []  # its extra connections
        self._probes: list[_Connection] = []  # probes to send
        self._probing = 0  # probes to send or in flight
        self._searched = threading.Condition(self._lock)
        self.closed = False
        self.connections = [_Connection(open_channel()) for _ in range(size)]
        self.retired: list[_Connection] = []

    @staticmethod
    def _least_busy(items: list, load, turn: int):
        n = len(items)
        return min((items[(turn + i) % n] for i in range(n)), key=load)

    def acquire(self, wait: bool = False) -> _Connection | None:
        """The connection for a call; None (only with ``wait``) while the call should wait for
        the first search: ``take_probes`` then says which probes to send."""
        with self._lock:
            if self.closed:
                raise ValueError("this tokq client is closed")
            if wait and self._hold(self._clock()):
                return None
            self._turn += 1
            identified = any(c.process for c in self.connections)
            now = self._clock()
            groups: dict[object, list[_Connection]] = {}
            passed_over: dict[object, list[_Connection]] = {}
            for conn in self.connections:
                if conn.process is None and identified and conn.outstanding:
                    continue  # not identified yet: one call at a time, to find out
                backing_off = conn.process is not None and self._backoff_until.get(conn.process, 0.0) > now
                (passed_over if backing_off else groups).setdefault(conn.process or id(conn), []).append(conn)
            group = self._least_busy(list((groups or passed_over).values()),
                                     lambda g: sum(c.outstanding for c in g), self._turn)
            conn = self._least_busy(group, lambda c: c.outstanding, self._turn)
            conn.outstanding += 1
            return conn

    def _hold(self, now: float) -> bool:
        """Whether a call waits for the first search. A call that comes while another is in flight
        begins it (a lone call goes at once), unless calls already spent the search or every
        connection reaches a process of its own."""
        if self._search_until is None:
            found = [c.process for c in self.connections]
            if (not any(c.outstanding for c in self.connections) or not self._misses_left
                    or (None not in found and len(set(found)) == len(found))):
                return False
            self._search_until = now + FIRST_SEARCH_WAIT_S
            self.searching = True
            self._scouts = [_Connection(self._open()) for _ in range(DISCOVERY_MISSES)]
            for conn in [c for c in self.connections if c.process is None] + self._scouts:
                self._queue_probe(conn)
        return self.searching and now < self._search_until

    def _queue_probe(self, conn: _Connection) -> None:
        conn.outstanding += 1
        self._probing += 1
        self._probes.append(conn)

    def take_probes(self) -> list[_Connection]:
        """Connections to send an Info probe on, each once; the caller sends them and passes each
        answer to ``probe_done``."""
        with self._lock:
            probes, self._probes = self._probes, []
            return [] if self.closed else probes

    def search_left(self) -> float:
        """Seconds a held call may still wait for the first search."""
        with self._lock:
            return 0.0 if self._search_until is None else max(0.0, self._search_until - self._clock())

    def wait_for_search(self) -> None:
        """Block until the first search ends or its time is up (threads only)."""
        with self._searched:
            if self.searching and self._search_until is not None:
                self._searched.wait(max(0.0, self._search_until - self._clock()))

    def probe_done(self, conn: _Connection, process: str | None) -> list:
        """Record a probe's answer (``process``: None when it named none); returns the channels
        the caller must close. The last answer ends the search."""
        with self._lock:
            conn.outstanding -= 1
            self._probing -= 1
            if self.closed:
                return []
            if process and not conn.retired:
                conn.process = process
            closing = []
            if conn.retired and conn.outstanding == 0 and conn in self.retired:
                self.retired.remove(conn)
                closing.append(conn.channel)
            if self.searching and not self._probing:
                self._searched.notify_all()
                closing += self._settle()
            return closing

    def _settle(self) -> list:
        """The first search's end: keep as many connections as before, over every process found
        in turn (one each, then a second each, ...); close the others once idle."""
        size = len(self.connections)
        found: dict[str, list[_Connection]] = {}
        for conn in self.connections + self._scouts:
            if conn.process:
                found.setdefault(conn.process, []).append(conn)
        keep = [conns[depth] for depth in range(size) for conns in found.values() if depth < len(conns)][:size]
        keep += [c for c in self.connections if c.process is None][:size - len(keep)]
        closing = []
        for conn in self.connections + self._scouts:
            if any(conn is k for k in keep):
                continue
            conn.retired = True
            if conn.outstanding:
                self.retired.append(conn)
            else:
                closing.append(conn.channel)
        self.connections, self._scouts = keep, []
        self._seen.update(found)
        self._misses_left = 0  # searched: from now on, now and again only
        self._next_rediscovery = self._clock() + self._rediscover_s
        self.searching = False
        return closing

    def release(self, conn: _Connection, process: str | None,
                code: grpc.StatusCode | None = None) -> object | None:
        """Record a finished call, the process that answered and any failure code; returns a
        channel the caller must close (a replaced connection with nothing left in flight), or None."""
        with self._lock:
            conn.outstanding -= 1
            now = self._clock()
            if process and code in BACKOFF_CODES:
                if len(self._backoff_until) > 64:  # ids of processes gone (restarts): forgotten
                    self._backoff_until = {p: t for p, t in self._backoff_until.items() if t > now}
                self._backoff_until[process] = now + BACKOFF_S
            if process and not conn.retired and not self.closed:
                changed, conn.process = process != conn.process, process
                if changed and process not in self._seen:  # a new process: search from the start
                    self._seen.add(process)
                    self._misses_left = DISCOVERY_MISSES
                    self._rediscover_s = REDISCOVER_FIRST_S
                    self._next_rediscovery = now + REDISCOVER_FIRST_S
                elif any(c is not conn and c.process == process for c in self.connections):
                    if changed and self._misses_left > 0:  # the first search: at once
                        self._misses_left -= 1
                        self._next_rediscovery = now + self._rediscover_s
                        self._reopen(conn)
                    elif now >= self._next_rediscovery:  # then now and again
                        self._rediscover_s = min(2 * self._rediscover_s, REDISCOVER_MAX_S)
                        self._next_rediscovery = now + self._rediscover_s
                        self._reopen(conn)
            if self.closed:
                return None  # close() took every channel, this one too
            if conn.retired and conn.outstanding == 0 and conn in self.retired:
                self.retired.remove(conn)
                return conn.channel
            return None

    def _reopen(self, conn: _Connection) -> None:
        """Replace ``conn`` by a new connection; it is closed once its calls in flight finish."""
        conn.retired = True
        self.retired.append(conn)
        self.connections[self.connections.index(conn)] = _Connection(self._open())

    def processes(self) -> dict[str | None, int]:
        """How many connections reach each gateway process (None: not identified yet)."""
        with self._lock:
            out: dict[str | None, int] = {}
            for conn in self.connections:
                out[conn.process] = out.get(conn.process, 0) + 1
            return out

    def close(self) -> list:
        """Every channel, to close; no call starts and no connection opens after this."""
        with self._lock:
            self.closed = True
            self._searched.notify_all()  # calls held for the search fail now: closed
            return [c.channel for c in self.connections + self.retired + self._scouts]


def _process_of(metadata) -> str | None:
    for key, value in metadata or ():
        if key == GATEWAY_ID_METADATA:
            return value
    return None


def _check_connections(connections: int) -> int:
    if isinstance(connections, bool) or not isinstance(connections, int) or connections < 1:
        raise ValueError(f"connections must be a positive integer, got {connections!r}")
    return connections


def _auth_metadata(api_key: str | None) -> tuple | None:
    """The call metadata carrying ``api_key``, stripped as the gateway strips keys (a key read
    from a file or variable often ends in a newline); None for no key or a blank one."""
    if api_key is None:
        return None
    if not isinstance(api_key, str):
        raise TypeError(f"api_key must be a string, got {type(api_key).__name__}")
    key = api_key.strip()
    if not key:
        return None
    if not (key.isascii() and key.isprintable()):  # else grpc fails each call: INTERNAL, no why
        raise ValueError("api_key must be printable ASCII (it goes in gRPC metadata); it holds "
                         "a control or non-ASCII character")
    return (("authorization", f"Bearer {key}"),)


class _ClientBase:
    """What both clients share: ``connections`` channels to ``target``, the model asked for,
    and the call metadata. ``grpc_module`` is ``grpc`` or ``grpc.aio``."""

    def __init__(self, grpc_module, target: str, credentials: grpc.ChannelCredentials | None,
                 model: str, connections: int, api_key: str | None) -> None:
        def open_channel():
            return (grpc_module.secure_channel(target, credentials, _channel_options()) if credentials
                    else grpc_module.insecure_channel(target, _channel_options()))

        # a gateway started with --api-key checks this on every call
        self._metadata = _auth_metadata(api_key)
        self._pool = _Pool(open_channel, _check_connections(connections))
        self.model = model

    def _tokenize_request(self, texts: Sequence[str], truncate: bool, prompt_name: str | None):
        req = pb.TokenizeRequest(inputs=_text_list(texts, "tokenize"), truncate=truncate, model=self.model)
        if prompt_name is not None:
            req.prompt_name = prompt_name
        return req

    def processes(self) -> dict[str | None, int]:
        """Connections per gateway process reached (None: not identified yet)."""
        return self._pool.processes()


class Client(_ClientBase):
    """A blocking client, safe to share between threads; ``connections`` connections to
    ``target``, calls spread over the gateway processes they reach."""

    def __init__(self, target: str = "localhost:50051", *, credentials: grpc.ChannelCredentials | None = None,
                 model: str = "", connections: int = DEFAULT_CONNECTIONS, api_key: str | None = None) -> None:
        super().__init__(grpc, target, credentials, model, connections, api_key)

    def _acquire(self) -> _Connection:
        while (conn := self._pool.acquire(wait=True)) is None:  # a new client's burst: search first
            self._send_probes()
            self._pool.wait_for_search()
        return conn

    def _send_probes(self) -> None:
        for conn in self._pool.take_probes():
            threading.Thread(target=self._probe, args=(conn,), name="tokq-client-probe", daemon=True).start()

    def _probe(self, conn: _Connection) -> None:
        process = None
        try:
            _, call = conn.stub.Info.with_call(pb.InfoRequest(), timeout=PROBE_TIMEOUT_S, metadata=self._metadata)
            process = _process_of(call.trailing_metadata())
        except grpc.RpcError as exc:
            process = _process_of(exc.trailing_metadata())
        except ValueError:  # the client was closed meanwhile
            pass
        finally:
            for channel in self._pool.probe_done(conn, process):
                channel.close()

    def _call(self, method: str, request, timeout: float | None):
        timeout = _deadline(timeout)
        conn = self._acquire()
        process = code = None
        try:
            response, call = getattr(conn.stub, method).with_call(request, timeout=timeout, metadata=self._metadata)
            process = _process_of(call.trailing_metadata())
            return response
        except grpc.RpcError as exc:
            process, code = _process_of(exc.trailing_metadata()), exc.code()
            raise _error(exc) from None
        finally:
            idle = self._pool.release(conn, process, code)
            if idle is not None:
                idle.close()

    def embed(self, texts: Sequence[str], *, truncate: bool = False, normalize: bool = True,
              dimensions: int | None = None, prompt_name: str | None = None,
              timeout: float | None = None, priority: str | None = None) -> np.ndarray:
        """``priority``: "interactive" or "batch"; None: the API key's default, else interactive."""
        return self.embed_full(texts, truncate=truncate, normalize=normalize, dimensions=dimensions,
                               prompt_name=prompt_name, timeout=timeout, priority=priority).vectors

    def embed_full(self, texts: Sequence[str], *, truncate: bool = False, normalize: bool = True,
                   dimensions: int | None = None, prompt_name: str | None = None,
                   timeout: float | None = None, priority: str | None = None) -> Embeddings:
        req = _request(texts, truncate, normalize, dimensions, prompt_name, self.model, priority)
        return _unpack(self._call("Embed", req, timeout))

    def rerank(self, query: str, documents: Sequence[str], *, top_n: int | None = None,
               raw_scores: bool = False, return_documents: bool = False, truncate: bool = False,
               timeout: float | None = None, priority: str | None = None) -> list[RerankResult]:
        """``documents`` scored against ``query`` by a reranker, best first (``top_n`` of them)."""
        return self.rerank_full(query, documents, top_n=top_n, raw_scores=raw_scores,
                                return_documents=return_documents, truncate=truncate,
                                timeout=timeout, priority=priority).results

    def rerank_full(self, query: str, documents: Sequence[str], *, top_n: int | None = None,
                    raw_scores: bool = False, return_documents: bool = False, truncate: bool = False,
                    timeout: float | None = None, priority: str | None = None) -> Reranking:
        req = _rerank_request(query, documents, top_n, raw_scores, return_documents, truncate, self.model,
                              priority)
        return _unpack_rerank(self._call("Rerank", req, timeout))

    def info(self, timeout: float | None = None) -> pb.InfoResponse:
        return self._call("Info", pb.InfoRequest(model=self.model), timeout)

    def tokenize(self, texts: Sequence[str], *, truncate: bool = False, prompt_name: str | None = None,
                 timeout: float | None = None) -> list[list[int]]:
        req = self._tokenize_request(texts, truncate, prompt_name)
        return [list(t.ids) for t in self._call("Tokenize", req, timeout).inputs]

    def close(self) -> None:
        for channel in self._pool.close():
            channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient(_ClientBase):
    """The asyncio variant (grpc.aio); create it inside a running event loop."""

    def __init__(self, target: str = "localhost:50051", *, credentials: grpc.ChannelCredentials | None = None,
                 model: str = "", connections: int = DEFAULT_CONNECTIONS, api_key: str | None = None) -> None:
        try:  # its channels bind to the loop running now; made outside one, the first call fails
            asyncio.get_running_loop()
        except RuntimeError:
            raise RuntimeError("create tokq.AsyncClient inside a coroutine (a running event loop): "
                               "its gRPC channels belong to the loop that creates them") from None
        super().__init__(grpc.aio, target, credentials, model, connections, api_key)
        self._searched = asyncio.Event()  # set when the first search ends
        self._probe_tasks: set[asyncio.Task] = set()

    async def _acquire(self) -> _Connection:
        while (conn := self._pool.acquire(wait=True)) is None:  # a new client's burst: search first
            self._send_probes()
            try:
                await asyncio.wait_for(self._searched.wait(), self._pool.search_left())
            except asyncio.TimeoutError:
                pass
        return conn

    def _send_probes(self) -> None:
        for conn in self._pool.take_probes():
            task = asyncio.ensure_future(self._probe(conn))
            self._probe_tasks.add(task)  # held: the loop keeps only weak references to tasks
            task.add_done_callback(self._probe_tasks.discard)

    async def _probe(self, conn: _Connection) -> None:
        process = None
        try:
            call = conn.stub.Info(pb.InfoRequest(), timeout=PROBE_TIMEOUT_S, metadata=self._metadata)
            await call
            process = _process_of(await call.trailing_metadata())
        except grpc.RpcError as exc:
            process = _process_of(exc.trailing_metadata())
        except grpc.aio.UsageError:  # the client was closed meanwhile
            pass
        finally:
            closing = self._pool.probe_done(conn, process)
            if not self._pool.searching:
                self._searched.set()
            for channel in closing:
                await asyncio.shield(channel.close())

    async def _call(self, method: str, request, timeout: float | None):
        timeout = _deadline(timeout)
        conn = await self._acquire()
        process = code = None
        try:
            call = getattr(conn.stub, method)(request, timeout=timeout, metadata=self._metadata)
            response = await call
            process = _process_of(await call.trailing_metadata())
            return response
        except grpc.RpcError as exc:
            process, code = _process_of(exc.trailing_metadata()), exc.code()
            raise _error(exc) from None
        finally:
            idle = self._pool.release(conn, process, code)
            if idle is not None:
                await asyncio.shield(idle.close())  # closed even if this call is cancelled now

    async def embed(self, texts: Sequence[str], *, truncate: bool = False, normalize: bool = True,
                    dimensions: int | None = None, prompt_name: str | None = None,
                    timeout: float | None = None, priority: str | None = None) -> np.ndarray:
        return (await self.embed_full(texts, truncate=truncate, normalize=normalize,
                                      dimensions=dimensions, prompt_name=prompt_name,
                                      timeout=timeout, priority=priority)).vectors

    async def embed_full(self, texts: Sequence[str], *, truncate: bool = False, normalize: bool = True,
                         dimensions: int | None = None, prompt_name: str | None = None,
                         timeout: float | None = None, priority: str | None = None) -> Embeddings:
        req = _request(texts, truncate, normalize, dimensions, prompt_name, self.model, priority)
        return _unpack(await self._call("Embed", req, timeout))

    async def rerank(self, query: str, documents: Sequence[str], *, top_n: int | None = None,
                     raw_scores: bool = False, return_documents: bool = False, truncate: bool = False,
                     timeout: float | None = None, priority: str | None = None) -> list[RerankResult]:
        return (await self.rerank_full(query, documents, top_n=top_n, raw_scores=raw_scores,
                                       return_documents=return_documents, truncate=truncate,
                                       timeout=timeout, priority=priority)).results

    async def rerank_full(self, query: str, documents: Sequence[str], *, top_n: int | None = None,
                          raw_scores: bool = False, return_documents: bool = False, truncate: bool = False,
                          timeout: float | None = None, priority: str | None = None) -> Reranking:
        req = _rerank_request(query, documents, top_n, raw_scores, return_documents, truncate, self.model,
                              priority)
        return _unpack_rerank(await self._call("Rerank", req, timeout))

    async def info(self, timeout: float | None = None) -> pb.InfoResponse:
        return await self._call("Info", pb.InfoRequest(model=self.model), timeout)

    async def tokenize(self, texts: Sequence[str], *, truncate: bool = False, prompt_name: str | None = None,
                       timeout: float | None = None) -> list[list[int]]:
        req = self._tokenize_request(texts, truncate, prompt_name)
        return [list(t.ids) for t in (await self._call("Tokenize", req, timeout)).inputs]

    async def close(self) -> None:
        channels = self._pool.close()
        self._searched.set()  # calls held for the search fail now: closed
        for channel in channels:
            await channel.close()
        await asyncio.gather(*self._probe_tasks, return_exceptions=True)  # ended by the close

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
