"""The Loader service's methods by name, each with its (de)serializers: what create_server
registers under remote_loader.v1.Loader."""

from __future__ import annotations

from typing import Any

import grpc

from remote_loader.protos import loader_pb2 as pb
from remote_loader.server.api.report import Reports
from remote_loader.server.api.service import LoaderService
from remote_loader.server.api.snapshot import Snapshots
from remote_loader.server.api.validation import decoder


def method_handlers(
    service: LoaderService, reports: Reports, snapshots: Snapshots
) -> dict[str, grpc.RpcMethodHandler[Any, Any]]:
    """Requests are decoded by `decoder` (an undecodable one is refused with one log line)."""
    return {
        "ListLoaders": grpc.unary_unary_rpc_method_handler(
            service.ListLoaders,
            request_deserializer=decoder(pb.ListLoadersRequest.FromString),
            response_serializer=pb.ListLoadersResponse.SerializeToString,
        ),
        "Describe": grpc.unary_unary_rpc_method_handler(
            service.Describe,
            request_deserializer=decoder(pb.DescribeRequest.FromString),
            response_serializer=pb.LoaderInfo.SerializeToString,
        ),
        # No response serializer: the handler yields Frames it serialized itself (see wire.py).
        "Stream": grpc.unary_stream_rpc_method_handler(
            service.Stream, request_deserializer=decoder(pb.StreamRequest.FromString)
        ),
        # NOTE [ Stall stages ] in protos/stall.py: trainers' reports, and what top shows.
        "Report": grpc.unary_unary_rpc_method_handler(
            reports.Report,
            request_deserializer=decoder(pb.StallReport.FromString),
            response_serializer=pb.ReportReply.SerializeToString,
        ),
        "Status": grpc.unary_unary_rpc_method_handler(
            snapshots.Status,
            request_deserializer=decoder(pb.StatusRequest.FromString),
            response_serializer=pb.ServerStatus.SerializeToString,
        ),
    }
