from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ListLoadersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListLoadersResponse(_message.Message):
    __slots__ = ("names",)
    NAMES_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, names: _Optional[_Iterable[str]] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ("loader", "consumer", "epoch", "seed", "reshard")
    LOADER_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    RESHARD_FIELD_NUMBER: _ClassVar[int]
    loader: str
    consumer: Consumer
    epoch: int
    seed: int
    reshard: Reshard
    def __init__(self, loader: _Optional[str] = ..., consumer: _Optional[_Union[Consumer, _Mapping]] = ..., epoch: _Optional[int] = ..., seed: _Optional[int] = ..., reshard: _Optional[_Union[Reshard, _Mapping]] = ...) -> None: ...

class Consumer(_message.Message):
    __slots__ = ("sharing", "job", "rank", "world_size")
    SHARING_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    sharing: str
    job: str
    rank: int
    world_size: int
    def __init__(self, sharing: _Optional[str] = ..., job: _Optional[str] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ...) -> None: ...

class LoaderInfo(_message.Message):
    __slots__ = ("name", "length", "has_length", "batch_size", "dataset_kind", "options", "seed", "fingerprint", "dataset_length", "sharing", "epoch_length", "pool", "warnings")
    class OptionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    HAS_LENGTH_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    DATASET_KIND_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DATASET_LENGTH_FIELD_NUMBER: _ClassVar[int]
    SHARING_FIELD_NUMBER: _ClassVar[int]
    EPOCH_LENGTH_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    WARNINGS_FIELD_NUMBER: _ClassVar[int]
    name: str
    length: int
    has_length: bool
    batch_size: int
    dataset_kind: str
    options: _containers.ScalarMap[str, str]
    seed: int
    fingerprint: str
    dataset_length: int
    sharing: _containers.RepeatedScalarFieldContainer[str]
    epoch_length: int
    pool: PoolInfo
    warnings: _containers.RepeatedCompositeFieldContainer[LoaderWarning]
    def __init__(self, name: _Optional[str] = ..., length: _Optional[int] = ..., has_length: _Optional[bool] = ..., batch_size: _Optional[int] = ..., dataset_kind: _Optional[str] = ..., options: _Optional[_Mapping[str, str]] = ..., seed: _Optional[int] = ..., fingerprint: _Optional[str] = ..., dataset_length: _Optional[int] = ..., sharing: _Optional[_Iterable[str]] = ..., epoch_length: _Optional[int] = ..., pool: _Optional[_Union[PoolInfo, _Mapping]] = ..., warnings: _Optional[_Iterable[_Union[LoaderWarning, _Mapping]]] = ...) -> None: ...

class LoaderWarning(_message.Message):
    __slots__ = ("category", "message")
    CATEGORY_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    category: str
    message: str
    def __init__(self, category: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class PoolInfo(_message.Message):
    __slots__ = ("backend", "nodes", "workers")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    backend: str
    nodes: int
    workers: int
    def __init__(self, backend: _Optional[str] = ..., nodes: _Optional[int] = ..., workers: _Optional[int] = ...) -> None: ...

class StreamRequest(_message.Message):
    __slots__ = ("loader", "epoch", "seed", "consumer", "start", "fingerprint", "shm", "tcp", "reshard", "compression", "data_connections", "node_fetch")
    LOADER_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    TCP_FIELD_NUMBER: _ClassVar[int]
    RESHARD_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    DATA_CONNECTIONS_FIELD_NUMBER: _ClassVar[int]
    NODE_FETCH_FIELD_NUMBER: _ClassVar[int]
    loader: str
    epoch: int
    seed: int
    consumer: Consumer
    start: int
    fingerprint: str
    shm: ShmOffer
    tcp: bool
    reshard: Reshard
    compression: str
    data_connections: int
    node_fetch: bool
    def __init__(self, loader: _Optional[str] = ..., epoch: _Optional[int] = ..., seed: _Optional[int] = ..., consumer: _Optional[_Union[Consumer, _Mapping]] = ..., start: _Optional[int] = ..., fingerprint: _Optional[str] = ..., shm: _Optional[_Union[ShmOffer, _Mapping]] = ..., tcp: _Optional[bool] = ..., reshard: _Optional[_Union[Reshard, _Mapping]] = ..., compression: _Optional[str] = ..., data_connections: _Optional[int] = ..., node_fetch: _Optional[bool] = ...) -> None: ...

class Reshard(_message.Message):
    __slots__ = ("world_size", "consumed", "origin")
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    CONSUMED_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    world_size: int
    consumed: _containers.RepeatedScalarFieldContainer[int]
    origin: Reshard
    def __init__(self, world_size: _Optional[int] = ..., consumed: _Optional[_Iterable[int]] = ..., origin: _Optional[_Union[Reshard, _Mapping]] = ...) -> None: ...

class ShmOffer(_message.Message):
    __slots__ = ("probe", "nonce", "pid", "probe_fd")
    PROBE_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    PROBE_FD_FIELD_NUMBER: _ClassVar[int]
    probe: str
    nonce: bytes
    pid: int
    probe_fd: int
    def __init__(self, probe: _Optional[str] = ..., nonce: _Optional[bytes] = ..., pid: _Optional[int] = ..., probe_fd: _Optional[int] = ...) -> None: ...

class NodeChannel(_message.Message):
    __slots__ = ("host", "port", "ticket", "connections")
    HOST_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    CONNECTIONS_FIELD_NUMBER: _ClassVar[int]
    host: str
    port: int
    ticket: bytes
    connections: int
    def __init__(self, host: _Optional[str] = ..., port: _Optional[int] = ..., ticket: _Optional[bytes] = ..., connections: _Optional[int] = ...) -> None: ...

class NodeBatch(_message.Message):
    __slots__ = ("host", "port", "slot", "generation", "offset")
    HOST_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    host: str
    port: int
    slot: int
    generation: int
    offset: int
    def __init__(self, host: _Optional[str] = ..., port: _Optional[int] = ..., slot: _Optional[int] = ..., generation: _Optional[int] = ..., offset: _Optional[int] = ...) -> None: ...

class TcpChannel(_message.Message):
    __slots__ = ("port", "ticket", "more_tickets")
    PORT_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    MORE_TICKETS_FIELD_NUMBER: _ClassVar[int]
    port: int
    ticket: bytes
    more_tickets: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, port: _Optional[int] = ..., ticket: _Optional[bytes] = ..., more_tickets: _Optional[_Iterable[bytes]] = ...) -> None: ...

class ShmBatch(_message.Message):
    __slots__ = ("ring", "ring_bytes", "offset", "release", "slot")
    RING_FIELD_NUMBER: _ClassVar[int]
    RING_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    ring: str
    ring_bytes: int
    offset: int
    release: int
    slot: ShmSlot
    def __init__(self, ring: _Optional[str] = ..., ring_bytes: _Optional[int] = ..., offset: _Optional[int] = ..., release: _Optional[int] = ..., slot: _Optional[_Union[ShmSlot, _Mapping]] = ...) -> None: ...

class ShmSlot(_message.Message):
    __slots__ = ("pid", "fd", "inode", "size", "generation")
    PID_FIELD_NUMBER: _ClassVar[int]
    FD_FIELD_NUMBER: _ClassVar[int]
    INODE_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    pid: int
    fd: int
    inode: int
    size: int
    generation: int
    def __init__(self, pid: _Optional[int] = ..., fd: _Optional[int] = ..., inode: _Optional[int] = ..., size: _Optional[int] = ..., generation: _Optional[int] = ...) -> None: ...

class CapturedError(_message.Message):
    __slots__ = ("where", "type", "message", "traceback", "module", "qualname")
    WHERE_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TRACEBACK_FIELD_NUMBER: _ClassVar[int]
    MODULE_FIELD_NUMBER: _ClassVar[int]
    QUALNAME_FIELD_NUMBER: _ClassVar[int]
    where: str
    type: str
    message: str
    traceback: str
    module: str
    qualname: str
    def __init__(self, where: _Optional[str] = ..., type: _Optional[str] = ..., message: _Optional[str] = ..., traceback: _Optional[str] = ..., module: _Optional[str] = ..., qualname: _Optional[str] = ...) -> None: ...

class StreamEnd(_message.Message):
    __slots__ = ("batches",)
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    batches: int
    def __init__(self, batches: _Optional[int] = ...) -> None: ...

class Frame(_message.Message):
    __slots__ = ("batch", "part", "parts", "total_bytes", "header_bytes", "error", "end", "shm", "tcp_channel", "on_tcp", "node_channel", "node", "waited_us", "data")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    HEADER_BYTES_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    TCP_CHANNEL_FIELD_NUMBER: _ClassVar[int]
    ON_TCP_FIELD_NUMBER: _ClassVar[int]
    NODE_CHANNEL_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    WAITED_US_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    batch: int
    part: int
    parts: int
    total_bytes: int
    header_bytes: int
    error: CapturedError
    end: StreamEnd
    shm: ShmBatch
    tcp_channel: TcpChannel
    on_tcp: bool
    node_channel: NodeChannel
    node: NodeBatch
    waited_us: int
    data: bytes
    def __init__(self, batch: _Optional[int] = ..., part: _Optional[int] = ..., parts: _Optional[int] = ..., total_bytes: _Optional[int] = ..., header_bytes: _Optional[int] = ..., error: _Optional[_Union[CapturedError, _Mapping]] = ..., end: _Optional[_Union[StreamEnd, _Mapping]] = ..., shm: _Optional[_Union[ShmBatch, _Mapping]] = ..., tcp_channel: _Optional[_Union[TcpChannel, _Mapping]] = ..., on_tcp: _Optional[bool] = ..., node_channel: _Optional[_Union[NodeChannel, _Mapping]] = ..., node: _Optional[_Union[NodeBatch, _Mapping]] = ..., waited_us: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class Node(_message.Message):
    __slots__ = ("tensor", "ndarray", "int", "float", "bool", "str", "bytes", "none", "list", "tuple", "dict")
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    NDARRAY_FIELD_NUMBER: _ClassVar[int]
    INT_FIELD_NUMBER: _ClassVar[int]
    FLOAT_FIELD_NUMBER: _ClassVar[int]
    BOOL_FIELD_NUMBER: _ClassVar[int]
    STR_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    NONE_FIELD_NUMBER: _ClassVar[int]
    LIST_FIELD_NUMBER: _ClassVar[int]
    TUPLE_FIELD_NUMBER: _ClassVar[int]
    DICT_FIELD_NUMBER: _ClassVar[int]
    tensor: Tensor
    ndarray: Tensor
    int: int
    float: float
    bool: bool
    str: str
    bytes: Tensor
    none: bool
    list: Sequence
    tuple: Sequence
    dict: Mapping
    def __init__(self, tensor: _Optional[_Union[Tensor, _Mapping]] = ..., ndarray: _Optional[_Union[Tensor, _Mapping]] = ..., int: _Optional[int] = ..., float: _Optional[float] = ..., bool: _Optional[bool] = ..., str: _Optional[str] = ..., bytes: _Optional[_Union[Tensor, _Mapping]] = ..., none: _Optional[bool] = ..., list: _Optional[_Union[Sequence, _Mapping]] = ..., tuple: _Optional[_Union[Sequence, _Mapping]] = ..., dict: _Optional[_Union[Mapping, _Mapping]] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "offset", "nbytes", "compression", "raw_nbytes")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    RAW_NBYTES_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    nbytes: int
    compression: str
    raw_nbytes: int
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ..., compression: _Optional[str] = ..., raw_nbytes: _Optional[int] = ...) -> None: ...

class Sequence(_message.Message):
    __slots__ = ("items", "type", "fields")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[Node]
    type: str
    fields: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, items: _Optional[_Iterable[_Union[Node, _Mapping]]] = ..., type: _Optional[str] = ..., fields: _Optional[_Iterable[str]] = ...) -> None: ...

class Mapping(_message.Message):
    __slots__ = ("keys", "values", "type")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedCompositeFieldContainer[Node]
    values: _containers.RepeatedCompositeFieldContainer[Node]
    type: str
    def __init__(self, keys: _Optional[_Iterable[_Union[Node, _Mapping]]] = ..., values: _Optional[_Iterable[_Union[Node, _Mapping]]] = ..., type: _Optional[str] = ...) -> None: ...

class StallReport(_message.Message):
    __slots__ = ("loader", "consumer", "reporter", "epoch", "window_seconds", "wait_fraction", "workers", "in_flight", "copy", "stage", "batches_per_second", "recent_wait_fraction", "recent_stage")
    LOADER_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_FIELD_NUMBER: _ClassVar[int]
    REPORTER_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    WINDOW_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WAIT_FRACTION_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    COPY_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    BATCHES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    RECENT_WAIT_FRACTION_FIELD_NUMBER: _ClassVar[int]
    RECENT_STAGE_FIELD_NUMBER: _ClassVar[int]
    loader: str
    consumer: Consumer
    reporter: int
    epoch: int
    window_seconds: float
    wait_fraction: float
    workers: float
    in_flight: float
    copy: float
    stage: str
    batches_per_second: float
    recent_wait_fraction: float
    recent_stage: str
    def __init__(self, loader: _Optional[str] = ..., consumer: _Optional[_Union[Consumer, _Mapping]] = ..., reporter: _Optional[int] = ..., epoch: _Optional[int] = ..., window_seconds: _Optional[float] = ..., wait_fraction: _Optional[float] = ..., workers: _Optional[float] = ..., in_flight: _Optional[float] = ..., copy: _Optional[float] = ..., stage: _Optional[str] = ..., batches_per_second: _Optional[float] = ..., recent_wait_fraction: _Optional[float] = ..., recent_stage: _Optional[str] = ...) -> None: ...

class ReportReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerStatus(_message.Message):
    __slots__ = ("loaders", "history_interval")
    LOADERS_FIELD_NUMBER: _ClassVar[int]
    HISTORY_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    loaders: _containers.RepeatedCompositeFieldContainer[LoaderStatus]
    history_interval: float
    def __init__(self, loaders: _Optional[_Iterable[_Union[LoaderStatus, _Mapping]]] = ..., history_interval: _Optional[float] = ...) -> None: ...

class LoaderStatus(_message.Message):
    __slots__ = ("name", "backend", "workers", "busy", "batches_per_second", "bytes_per_second", "cpu_cores_used", "cores", "make_seconds", "stream_wait_seconds", "send_seconds", "consumers", "busy_history", "rate_history")
    NAME_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    BUSY_FIELD_NUMBER: _ClassVar[int]
    BATCHES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    CPU_CORES_USED_FIELD_NUMBER: _ClassVar[int]
    CORES_FIELD_NUMBER: _ClassVar[int]
    MAKE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STREAM_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SEND_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CONSUMERS_FIELD_NUMBER: _ClassVar[int]
    BUSY_HISTORY_FIELD_NUMBER: _ClassVar[int]
    RATE_HISTORY_FIELD_NUMBER: _ClassVar[int]
    name: str
    backend: str
    workers: int
    busy: float
    batches_per_second: float
    bytes_per_second: float
    cpu_cores_used: float
    cores: int
    make_seconds: float
    stream_wait_seconds: float
    send_seconds: float
    consumers: _containers.RepeatedCompositeFieldContainer[ConsumerStatus]
    busy_history: _containers.RepeatedScalarFieldContainer[float]
    rate_history: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, name: _Optional[str] = ..., backend: _Optional[str] = ..., workers: _Optional[int] = ..., busy: _Optional[float] = ..., batches_per_second: _Optional[float] = ..., bytes_per_second: _Optional[float] = ..., cpu_cores_used: _Optional[float] = ..., cores: _Optional[int] = ..., make_seconds: _Optional[float] = ..., stream_wait_seconds: _Optional[float] = ..., send_seconds: _Optional[float] = ..., consumers: _Optional[_Iterable[_Union[ConsumerStatus, _Mapping]]] = ..., busy_history: _Optional[_Iterable[float]] = ..., rate_history: _Optional[_Iterable[float]] = ...) -> None: ...

class ConsumerStatus(_message.Message):
    __slots__ = ("consumer", "epoch", "attached", "lag", "ready", "reported", "wait_fraction", "workers", "in_flight", "copy", "stage", "batches_per_second", "report_age", "wait_history", "rate_history", "reporter")
    CONSUMER_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ATTACHED_FIELD_NUMBER: _ClassVar[int]
    LAG_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    REPORTED_FIELD_NUMBER: _ClassVar[int]
    WAIT_FRACTION_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    COPY_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    BATCHES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    REPORT_AGE_FIELD_NUMBER: _ClassVar[int]
    WAIT_HISTORY_FIELD_NUMBER: _ClassVar[int]
    RATE_HISTORY_FIELD_NUMBER: _ClassVar[int]
    REPORTER_FIELD_NUMBER: _ClassVar[int]
    consumer: Consumer
    epoch: int
    attached: bool
    lag: int
    ready: int
    reported: bool
    wait_fraction: float
    workers: float
    in_flight: float
    copy: float
    stage: str
    batches_per_second: float
    report_age: float
    wait_history: _containers.RepeatedScalarFieldContainer[float]
    rate_history: _containers.RepeatedScalarFieldContainer[float]
    reporter: int
    def __init__(self, consumer: _Optional[_Union[Consumer, _Mapping]] = ..., epoch: _Optional[int] = ..., attached: _Optional[bool] = ..., lag: _Optional[int] = ..., ready: _Optional[int] = ..., reported: _Optional[bool] = ..., wait_fraction: _Optional[float] = ..., workers: _Optional[float] = ..., in_flight: _Optional[float] = ..., copy: _Optional[float] = ..., stage: _Optional[str] = ..., batches_per_second: _Optional[float] = ..., report_age: _Optional[float] = ..., wait_history: _Optional[_Iterable[float]] = ..., rate_history: _Optional[_Iterable[float]] = ..., reporter: _Optional[int] = ...) -> None: ...
