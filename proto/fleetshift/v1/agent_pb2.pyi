from fleetshift.v1 import fleet_pb2 as _fleet_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetAgentInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AgentInfo(_message.Message):
    __slots__ = ("node_name", "gpus", "versions", "inventory_source", "daemon_address", "registered")
    NODE_NAME_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    INVENTORY_SOURCE_FIELD_NUMBER: _ClassVar[int]
    DAEMON_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    node_name: str
    gpus: _containers.RepeatedCompositeFieldContainer[_fleet_pb2.Gpu]
    versions: _fleet_pb2.NodeVersions
    inventory_source: _fleet_pb2.InventorySource
    daemon_address: str
    registered: bool
    def __init__(self, node_name: _Optional[str] = ..., gpus: _Optional[_Iterable[_Union[_fleet_pb2.Gpu, _Mapping]]] = ..., versions: _Optional[_Union[_fleet_pb2.NodeVersions, _Mapping]] = ..., inventory_source: _Optional[_Union[_fleet_pb2.InventorySource, str]] = ..., daemon_address: _Optional[str] = ..., registered: _Optional[bool] = ...) -> None: ...
