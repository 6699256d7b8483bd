"""How kubelet learns about a resource: the classic Register call on kubelet.sock, or the
plugin watcher (a socket in plugins_registry that kubelet finds and asks GetInfo)."""

from __future__ import annotations

import logging
import os
from concurrent import futures

import grpc

from rdma_netns.util import fsutil
from rdma_netns_dp.api.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from rdma_netns_dp.api.pluginregistration.v1 import api_pb2 as reg_pb2
from rdma_netns_dp.api.pluginregistration.v1 import api_pb2_grpc as reg_pb2_grpc

API_VERSION = "v1beta1"
# kubelet's Register handler dials the plugin back and allows itself 10 s for that before it
# answers; waiting less would call a slow but successful registration a failure and start over.
KUBELET_DIAL_BACK_TIMEOUT = 10.0
# Connecting to kubelet.sock itself: a socket that exists but accepts nothing is a kubelet not
# (yet) serving, retried with back-off.
CONNECT_TIMEOUT = 3.0
log = logging.getLogger("rdma_netns_dp.registration")


class RegistrationFailed(RuntimeError):
    pass


def register(kubelet_socket: str, endpoint: str, resource_name: str,
             options: api_pb2.DevicePluginOptions, timeout: float = CONNECT_TIMEOUT,
             dial_back_timeout: float = KUBELET_DIAL_BACK_TIMEOUT) -> None:
    """Call kubelet's Registration.Register; our server must already be serving `endpoint`.

    timeout: to connect to kubelet.sock; dial_back_timeout: for the Register answer, which kubelet
    gives after dialling us back (its own limit is 10 s, plus a second for the answer)."""
    if not os.path.exists(kubelet_socket):
        raise RegistrationFailed(f"{kubelet_socket} does not exist (kubelet not running?)")
    with grpc.insecure_channel(f"unix://{kubelet_socket}") as channel:
        try:
            grpc.channel_ready_future(channel).result(timeout=timeout)
            api_pb2_grpc.RegistrationStub(channel).Register(
                api_pb2.RegisterRequest(version=API_VERSION, endpoint=endpoint, resource_name=resource_name,
                                        options=options), timeout=dial_back_timeout + 1.0)
        except grpc.FutureTimeoutError:
            raise RegistrationFailed(f"kubelet does not answer on {kubelet_socket}") from None
        except grpc.RpcError as exc:
            raise RegistrationFailed(f"kubelet refused the registration: {exc.code().name}: {exc.details()}") from None


class WatcherRegistration(reg_pb2_grpc.RegistrationServicer):
    """pluginregistration.Registration for kubelet's plugin watcher."""

    def __init__(self, resource_name: str, endpoint_path: str, plugin_type: str = "DevicePlugin",
                 versions: list[str] | None = None) -> None:
        """resource_name: the resource (DevicePlugin) or the driver name (DRAPlugin)."""
        self.resource_name = resource_name
        self.endpoint_path = endpoint_path
        self.plugin_type = plugin_type
        self.versions = versions or [API_VERSION]
        self.registered = False

    def GetInfo(self, request, context):
        return reg_pb2.PluginInfo(type=self.plugin_type, name=self.resource_name, endpoint=self.endpoint_path,
                                  supported_versions=self.versions)

    def NotifyRegistrationStatus(self, request, context):
        self.registered = request.plugin_registered
        if request.plugin_registered:
            log.info("registered through the plugin watcher", extra={"resource": self.resource_name})
        else:
            log.error("kubelet's plugin watcher refused the registration: %s", request.error,
                      extra={"resource": self.resource_name})
        return reg_pb2.RegistrationStatusResponse()


def serve_watcher(servicer: WatcherRegistration, socket_path: str) -> grpc.Server:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    reg_pb2_grpc.add_RegistrationServicer_to_server(servicer, server)
    fsutil.remove(socket_path)
    server.add_insecure_port(f"unix://{socket_path}")
    server.start()
    return server
