from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Priority(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PRIORITY_UNSPECIFIED: _ClassVar[Priority]
    INTERACTIVE: _ClassVar[Priority]
    BATCH: _ClassVar[Priority]
PRIORITY_UNSPECIFIED: Priority
INTERACTIVE: Priority
BATCH: Priority

class EmbedRequest(_message.Message):
    __slots__ = ("inputs", "model", "truncate", "normalize", "dimensions", "prompt_name", "token_inputs", "priority")
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_NAME_FIELD_NUMBER: _ClassVar[int]
    TOKEN_INPUTS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    inputs: _containers.RepeatedScalarFieldContainer[str]
    model: str
    truncate: bool
    normalize: bool
    dimensions: int
    prompt_name: str
    token_inputs: _containers.RepeatedCompositeFieldContainer[TokenIds]
    priority: Priority
    def __init__(self, inputs: _Optional[_Iterable[str]] = ..., model: _Optional[str] = ..., truncate: _Optional[bool] = ..., normalize: _Optional[bool] = ..., dimensions: _Optional[int] = ..., prompt_name: _Optional[str] = ..., token_inputs: _Optional[_Iterable[_Union[TokenIds, _Mapping]]] = ..., priority: _Optional[_Union[Priority, str]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Embedding(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, values: _Optional[_Iterable[float]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "total_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    total_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., total_tokens: _Optional[int] = ...) -> None: ...

class Timing(_message.Message):
    __slots__ = ("tokenize_ms", "queue_ms", "inference_ms", "total_ms")
    TOKENIZE_MS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    INFERENCE_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    tokenize_ms: float
    queue_ms: float
    inference_ms: float
    total_ms: float
    def __init__(self, tokenize_ms: _Optional[float] = ..., queue_ms: _Optional[float] = ..., inference_ms: _Optional[float] = ..., total_ms: _Optional[float] = ...) -> None: ...

class EmbedResponse(_message.Message):
    __slots__ = ("embeddings", "model", "usage", "timing")
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    embeddings: _containers.RepeatedCompositeFieldContainer[Embedding]
    model: str
    usage: Usage
    timing: Timing
    def __init__(self, embeddings: _Optional[_Iterable[_Union[Embedding, _Mapping]]] = ..., model: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timing: _Optional[_Union[Timing, _Mapping]] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("model", "dimensions", "max_input_length", "token_budget", "max_inputs", "prompt_names", "default_prompt_name", "pooling", "version", "models", "task", "tasks")
    class TasksEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_INPUT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BUDGET_FIELD_NUMBER: _ClassVar[int]
    MAX_INPUTS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_NAMES_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_PROMPT_NAME_FIELD_NUMBER: _ClassVar[int]
    POOLING_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    model: str
    dimensions: int
    max_input_length: int
    token_budget: int
    max_inputs: int
    prompt_names: _containers.RepeatedScalarFieldContainer[str]
    default_prompt_name: str
    pooling: str
    version: str
    models: _containers.RepeatedScalarFieldContainer[str]
    task: str
    tasks: _containers.ScalarMap[str, str]
    def __init__(self, model: _Optional[str] = ..., dimensions: _Optional[int] = ..., max_input_length: _Optional[int] = ..., token_budget: _Optional[int] = ..., max_inputs: _Optional[int] = ..., prompt_names: _Optional[_Iterable[str]] = ..., default_prompt_name: _Optional[str] = ..., pooling: _Optional[str] = ..., version: _Optional[str] = ..., models: _Optional[_Iterable[str]] = ..., task: _Optional[str] = ..., tasks: _Optional[_Mapping[str, str]] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("inputs", "model", "truncate", "prompt_name")
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_NAME_FIELD_NUMBER: _ClassVar[int]
    inputs: _containers.RepeatedScalarFieldContainer[str]
    model: str
    truncate: bool
    prompt_name: str
    def __init__(self, inputs: _Optional[_Iterable[str]] = ..., model: _Optional[str] = ..., truncate: _Optional[bool] = ..., prompt_name: _Optional[str] = ...) -> None: ...

class TokenizedInput(_message.Message):
    __slots__ = ("ids", "tokens")
    IDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    tokens: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, ids: _Optional[_Iterable[int]] = ..., tokens: _Optional[_Iterable[str]] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("inputs", "model")
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    inputs: _containers.RepeatedCompositeFieldContainer[TokenizedInput]
    model: str
    def __init__(self, inputs: _Optional[_Iterable[_Union[TokenizedInput, _Mapping]]] = ..., model: _Optional[str] = ...) -> None: ...

class RerankRequest(_message.Message):
    __slots__ = ("query", "documents", "top_n", "raw_scores", "return_documents", "truncate", "model", "priority")
    QUERY_FIELD_NUMBER: _ClassVar[int]
    DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    TOP_N_FIELD_NUMBER: _ClassVar[int]
    RAW_SCORES_FIELD_NUMBER: _ClassVar[int]
    RETURN_DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    query: str
    documents: _containers.RepeatedScalarFieldContainer[str]
    top_n: int
    raw_scores: bool
    return_documents: bool
    truncate: bool
    model: str
    priority: Priority
    def __init__(self, query: _Optional[str] = ..., documents: _Optional[_Iterable[str]] = ..., top_n: _Optional[int] = ..., raw_scores: _Optional[bool] = ..., return_documents: _Optional[bool] = ..., truncate: _Optional[bool] = ..., model: _Optional[str] = ..., priority: _Optional[_Union[Priority, str]] = ...) -> None: ...

class RerankResult(_message.Message):
    __slots__ = ("index", "score", "document")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    DOCUMENT_FIELD_NUMBER: _ClassVar[int]
    index: int
    score: float
    document: str
    def __init__(self, index: _Optional[int] = ..., score: _Optional[float] = ..., document: _Optional[str] = ...) -> None: ...

class RerankResponse(_message.Message):
    __slots__ = ("results", "model", "usage", "timing")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[RerankResult]
    model: str
    usage: Usage
    timing: Timing
    def __init__(self, results: _Optional[_Iterable[_Union[RerankResult, _Mapping]]] = ..., model: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timing: _Optional[_Union[Timing, _Mapping]] = ...) -> None: ...
