"""Fabric preflight with a stand-in pyverbs (no RDMA here): lanes, RoCE v2 GIDs, the NCCL env."""

from __future__ import annotations

import types
from pathlib import Path

from dgpp.dist import fabric


class _Ctx:
    def __init__(self, name: str, ports: dict[int, tuple[int, int, list[str]]]) -> None:
        self.name, self.ports = name, ports

    def query_device(self):
        return types.SimpleNamespace(phys_port_cnt=len(self.ports))

    def query_port(self, port: int):
        state, link, gids = self.ports[port]
        return types.SimpleNamespace(state=state, link_layer=link, gid_tbl_len=len(gids), active_mtu=5)

    def query_gid(self, port: int, index: int) -> str:
        return self.ports[port][2][index]

    def close(self) -> None:
        pass


def _fake_pyverbs(devices: dict[str, dict]) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        get_device_list=lambda: [types.SimpleNamespace(name=n.encode()) for n in devices],
        Context=lambda name: _Ctx(name, devices[name]),
    )


def _sysfs(root: Path, device: str, port: int, types_: list[str], ndev: str) -> None:
    attrs = root / device / "ports" / str(port) / "gid_attrs"
    (attrs / "types").mkdir(parents=True)
    (attrs / "ndevs").mkdir()
    for i, t in enumerate(types_):
        (attrs / "types" / str(i)).write_text(t + "\n")
        (attrs / "ndevs" / str(i)).write_text(ndev + "\n")


LINK_LOCAL = "fe80:0000:0000:0000:0000:0000:0000:0001"
ROUTABLE = "0000:0000:0000:0000:0000:ffff:0a00:0001"


def test_two_lanes_pick_routable_roce_v2_gids_and_set_nccl_env(tmp_path):
    devices = {
        "rocep1s0f0": {1: (4, 2, [LINK_LOCAL, LINK_LOCAL, ROUTABLE, ROUTABLE])},
        "roceP2p1s0f0": {1: (4, 2, [LINK_LOCAL, LINK_LOCAL, ROUTABLE, ROUTABLE])},
        "mlx5_down": {1: (1, 2, [ROUTABLE])},  # port down: listed as a note, not a lane
    }
    for dev, ndev in (("rocep1s0f0", "enp1s0f0np0"), ("roceP2p1s0f0", "enP2p1s0f0np0")):
        _sysfs(tmp_path, dev, 1, ["IB/RoCE v1", "RoCE v2", "IB/RoCE v1", "RoCE v2"], ndev)
    report = fabric.probe(_fake_pyverbs(devices), sysfs=tmp_path)
    assert [(ln.device, ln.port, ln.gid_index, ln.mtu) for ln in report.lanes] == [
        ("rocep1s0f0", 1, 3, 4096), ("roceP2p1s0f0", 1, 3, 4096)]
    assert report.env == {"NCCL_IB_HCA": "rocep1s0f0:1,roceP2p1s0f0:1", "NCCL_IB_GID_INDEX": "3",
                          "NCCL_SOCKET_IFNAME": "enp1s0f0np0,enP2p1s0f0np0"}
    assert any("mlx5_down port 1 is not an active RoCE port" in n for n in report.notes)
    assert report.lines()[0] == "fabric: 2 RoCE v2 lane(s)"


def test_without_pyverbs_or_devices_it_says_so_and_stays_on_tcp(monkeypatch):
    empty = fabric.probe(_fake_pyverbs({}))
    assert empty.lines() == ["fabric: no RDMA devices; collectives use TCP"] and empty.env == {}
    monkeypatch.setitem(__import__("sys").modules, "pyverbs", None)  # import fails as if not installed
    monkeypatch.setitem(__import__("sys").modules, "pyverbs.device", None)
    missing = fabric.probe()
    assert missing.lines() == ["fabric: pyverbs is not installed: pip install 'dgpp-core[fabric]'; collectives use TCP"]


def test_operator_env_wins(monkeypatch):
    monkeypatch.setenv("NCCL_IB_GID_INDEX", "1")
    monkeypatch.delenv("NCCL_IB_HCA", raising=False)
    report = fabric.FabricReport(env={"NCCL_IB_GID_INDEX": "3", "NCCL_IB_HCA": "x:1"})
    fabric.apply_fabric_env(report=report)
    import os

    assert os.environ["NCCL_IB_GID_INDEX"] == "1" and os.environ["NCCL_IB_HCA"] == "x:1"


def test_node_env_picks_and_orders_devices_and_gid_indices(tmp_path, monkeypatch):
    devices = {name: {1: (4, 2, [LINK_LOCAL, ROUTABLE, ROUTABLE])} for name in ("mlx5_0", "mlx5_1", "mlx5_2")}
    for name in devices:
        _sysfs(tmp_path, name, 1, ["RoCE v2", "RoCE v2", "RoCE v2"], f"eth_{name}")
    monkeypatch.setenv("DGPP_ROCE_DEVICES", "mlx5_2,mlx5_0,mlx5_9")
    monkeypatch.setenv("DGPP_ROCE_GID_INDICES", "2")
    report = fabric.probe(_fake_pyverbs(devices), sysfs=tmp_path)
    assert [(ln.device, ln.gid_index) for ln in report.lanes] == [("mlx5_2", 2), ("mlx5_0", 1)]
    assert report.env["NCCL_IB_HCA"] == "mlx5_2:1,mlx5_0:1" and report.env["NCCL_IB_GID_INDEX"] == "2"
    assert any("mlx5_9" in n for n in report.notes)
