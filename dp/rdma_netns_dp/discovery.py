"""Old home of the device plugin's sysfs reader: it is rdma_netns.kernel.rdma_devices now (one
reader for the CNI plugin and the device plugin). Kept as a re-export for scripts and tests that
still import it from here."""

from __future__ import annotations

from rdma_netns.kernel.rdma_devices import CharDevice, PortInfo, RdmaDevice
from rdma_netns.kernel.rdma_devices import DeviceSysfs as Sysfs

__all__ = ["CharDevice", "PortInfo", "RdmaDevice", "Sysfs"]
