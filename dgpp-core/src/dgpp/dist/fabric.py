"""Fabric preflight: find RDMA (RoCE v2) lanes with pyverbs and point NCCL at them.

pyverbs is optional. Without it, or without an active RoCE port, the report says so and NCCL stays on
TCP sockets. Devices and ports come from pyverbs; a GID's type (RoCE v1/v2) and its network interface
come from sysfs (``/sys/class/infiniband/<dev>/ports/<port>/gid_attrs``), which is where the kernel
publishes them. Per port the routable RoCE v2 GID (not link-local ``fe80::``) with the lowest index
is preferred.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from dgpp.extras import install_hint
from dgpp.log import get_logger

log = get_logger("dgpp.dist")
SYSFS = Path("/sys/class/infiniband")
PORT_ACTIVE = 4
LINK_ETHERNET = 2


@dataclass(frozen=True)
class Lane:
    """One usable RDMA port: device, port number, the chosen GID and its network interface."""

    device: str
    port: int
    gid_index: int
    gid: str
    netdev: str
    mtu: int = 0


@dataclass
class FabricReport:
    """What the preflight found; ``env`` is the NCCL environment it recommends (empty: TCP)."""

    lanes: list[Lane] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)

    def lines(self) -> list[str]:
        if not self.lanes:
            return [f"fabric: {'; '.join(self.notes) or 'no RDMA lanes'}; collectives use TCP"]
        out = [f"fabric: {len(self.lanes)} RoCE v2 lane(s)"]
        out += [f"  {ln.device} port {ln.port}: gid[{ln.gid_index}] {ln.gid} on {ln.netdev or '?'} mtu {ln.mtu}"
                for ln in self.lanes]
        out += [f"  {k}={v}" for k, v in sorted(self.env.items())]
        return out


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _pick_gid(ctx: Any, device: str, port: int, table_len: int, sysfs: Path) -> tuple[int, str, str] | None:
    attrs = sysfs / device / "ports" / str(port) / "gid_attrs"
    best: tuple[int, int, str, str] | None = None  # (link-local?, index, gid, netdev)
    for index in range(table_len):
        if "v2" not in _read(attrs / "types" / str(index)).lower():
            continue
        gid = str(ctx.query_gid(port, index))
        if not gid or set(gid.replace(":", "")) <= {"0"}:
            continue
        rank = (1 if gid.lower().startswith("fe80") else 0, index, gid, _read(attrs / "ndevs" / str(index)))
        best = rank if best is None or rank < best else best
    return None if best is None else best[1:]


def _env_list(name: str) -> list[str]:
    return [v.strip() for v in os.environ.get(name, "").split(",") if v.strip()]


def probe(pyverbs_device: Any = None, sysfs: Path = SYSFS) -> FabricReport:
    """List RDMA devices and active Ethernet ports, pick a RoCE v2 GID per port, derive the NCCL env.

    ``DGPP_ROCE_DEVICES`` (comma-separated names, from the template's ``node_env``) limits the devices and
    orders the lanes; ``DGPP_ROCE_GID_INDICES`` (one per lane) overrides the chosen GID indices."""
    report = FabricReport()
    wanted = _env_list("DGPP_ROCE_DEVICES")
    if pyverbs_device is None:
        try:
            import pyverbs.device as pyverbs_device  # type: ignore[import-not-found,no-redef]
        except ImportError:
            report.notes.append(install_hint("pyverbs", "fabric"))
            return report
    try:
        devices = pyverbs_device.get_device_list()
    except Exception as e:  # no rdma-core userspace, no permissions
        report.notes.append(f"RDMA device list unavailable ({e})")
        return report
    if not devices:
        report.notes.append("no RDMA devices")
        return report
    for dev in devices:
        name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
        ctx = pyverbs_device.Context(name=name)
        try:
            for port in range(1, ctx.query_device().phys_port_cnt + 1):
                attr = ctx.query_port(port)
                if attr.state != PORT_ACTIVE or attr.link_layer != LINK_ETHERNET:
                    report.notes.append(f"{name} port {port} is not an active RoCE port")
                    continue
                picked = _pick_gid(ctx, name, port, attr.gid_tbl_len, sysfs)
                if picked is None:
                    report.notes.append(f"{name} port {port} has no RoCE v2 GID")
                    continue
                index, gid, netdev = picked
                report.lanes.append(Lane(name, port, index, gid, netdev, 128 << int(attr.active_mtu)))
        finally:
            ctx.close()
    if wanted:
        report.lanes = sorted((ln for ln in report.lanes if ln.device in wanted), key=lambda ln: wanted.index(ln.device))
        missing = [d for d in wanted if d not in {ln.device for ln in report.lanes}]
        if missing:
            report.notes.append(f"DGPP_ROCE_DEVICES names {', '.join(missing)}, which has no usable port")
    indices = _env_list("DGPP_ROCE_GID_INDICES")
    if indices:
        report.lanes = [replace(ln, gid_index=int(i)) for ln, i in zip(report.lanes, indices, strict=False)] + \
            report.lanes[len(indices):]
    report.env = nccl_env(report.lanes)
    return report


def nccl_env(lanes: list[Lane]) -> dict[str, str]:
    """NCCL_IB_HCA over every lane; GID index and socket interface from the first lane (NCCL takes one)."""
    if not lanes:
        return {}
    env = {"NCCL_IB_HCA": ",".join(f"{ln.device}:{ln.port}" for ln in lanes),
           "NCCL_IB_GID_INDEX": str(lanes[0].gid_index)}
    netdevs = list(dict.fromkeys(ln.netdev for ln in lanes if ln.netdev))
    if netdevs:
        env["NCCL_SOCKET_IFNAME"] = ",".join(netdevs)
    return env


def apply_fabric_env(log_result: bool = False, report: FabricReport | None = None) -> FabricReport:
    """Probe and export the NCCL variables; values the operator already set win."""
    report = report or probe()
    for key, value in report.env.items():
        os.environ.setdefault(key, value)
    if log_result:
        for line in report.lines():
            log.info(line.strip())
    return report
