"""World formation: the journal star and settings handshake first, then the
torch.distributed process group (NCCL on GPUs, gloo on CPUs) on ``ports.fabric``.

A world whose ranks disagree on version, model or any effective config value refuses to form, and
every rank's error names what differs.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dgpp.config import DeployConfig
from dgpp.dist.channel import JournalHub, LineSocket, WorldError, connect_journal
from dgpp.dist.records import Formed, Hello, Refuse
from dgpp.family import World
from dgpp.log import get_logger

log = get_logger("dgpp.dist")


@dataclass(frozen=True)
class WorldSpec:
    """Where this rank sits and how to reach rank 0, from the deployment template."""

    rank: int
    size: int
    master_addr: str
    fabric_port: int
    journal_port: int
    timeout_s: float

    @classmethod
    def from_config(cls, cfg: DeployConfig, rank: int) -> WorldSpec:
        size = cfg.world
        if not 0 <= rank < size:
            raise WorldError(f"--rank {rank} is outside the world of {size} (nodes / world_size)")
        # nodes entries may be "user@host"; rank 0's host is the rendezvous point
        master = cfg.nodes[0].rsplit("@", 1)[-1] if cfg.nodes else "127.0.0.1"
        return cls(rank, size, master, cfg.ports.fabric, cfg.ports.journal,
                   cfg.engine.rendezvous_timeout_ms / 1000.0)


def settings_of(cfg: DeployConfig) -> dict[str, Any]:
    """What every rank must agree on before anything loads."""
    from dgpp import __version__

    return {"version": __version__, "model": cfg.model, "world": cfg.world, "config_digest": cfg.digest(),
            "config": _flatten(cfg.to_dict())}


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(data, dict):
        return {prefix: data}
    out: dict[str, Any] = {}
    for key, value in data.items():
        out.update(_flatten(value, f"{prefix}.{key}" if prefix else key))
    return out


def settings_difference(ours: dict[str, Any], theirs: dict[str, Any], their_rank: int) -> str | None:
    """None when the settings agree, else one sentence naming every differing item."""
    diffs = [f"{key} {ours.get(key)!r} on rank 0 vs {theirs.get(key)!r} on rank {their_rank}"
             for key in ("version", "model", "world") if ours.get(key) != theirs.get(key)]
    if ours.get("config_digest") != theirs.get("config_digest"):
        a, b = ours.get("config", {}), theirs.get("config", {})
        keys = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        named = ", ".join(f"{k} ({a.get(k)!r} vs {b.get(k)!r})" for k in keys[:6])
        diffs.append(f"config digest {ours.get('config_digest')} on rank 0 vs {theirs.get('config_digest')} "
                     f"on rank {their_rank}" + (f": {named}" if named else ""))
    return "; ".join(diffs) or None


@dataclass
class DistWorld:
    """A formed world: this rank's ``World``, the TP process group and its journal end."""

    world: World
    group: Any
    hub: JournalHub | None = None  # rank 0
    link: LineSocket | None = None  # peers
    device: str = "cpu"

    def close(self, orderly: bool = True) -> None:
        """Leave the world. ``orderly``: every rank is closing too, so wait for all of them first (a rank
        that tears its gloo pairs down while another still uses them can abort the process)."""
        if orderly and dist.is_initialized():
            try:
                dist.barrier()
            except Exception as e:  # a rank is already gone: nothing left to wait for
                log.warning("closing barrier failed", error=str(e))
        if self.hub is not None:
            self.hub.close()
        if self.link is not None:
            self.link.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def handshake(spec: WorldSpec, settings: dict[str, Any]) -> tuple[JournalHub | None, LineSocket | None]:
    """The journal star plus the settings check; raises ``WorldError`` naming any difference."""
    if spec.rank == 0:
        hub = JournalHub("0.0.0.0", spec.journal_port)
        try:
            hub.accept(spec.size, spec.timeout_s)
            problems = [d for r, h in sorted(hub.hellos.items()) if (d := settings_difference(settings, h.settings, r))]
            if problems:
                reason = "world refused: " + "; ".join(problems)
                hub.broadcast(Refuse(reason))
                raise WorldError(reason)
            hub.broadcast(Formed())
        except BaseException:
            hub.close()
            raise
        return hub, None
    link = connect_journal(spec.master_addr, spec.journal_port, spec.timeout_s)
    link.send(Hello(spec.rank, settings))
    answer = link.recv(timeout=spec.timeout_s)
    if isinstance(answer, Refuse):
        link.close()
        raise WorldError(answer.reason)
    if not isinstance(answer, Formed):
        link.close()
        raise WorldError(f"rank 0 closed the journal during formation (got {answer!r})")
    return None, link


def form_world(spec: WorldSpec, settings: dict[str, Any], device: str | None = None) -> DistWorld:
    """Handshake, then ``init_process_group`` (NCCL when ``device`` is CUDA, else gloo)."""
    hub, link = handshake(spec, settings)
    if device is None:
        device = f"cuda:{spec.rank % torch.cuda.device_count()}" if torch.cuda.is_available() else "cpu"
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    try:
        dist.init_process_group(
            backend, init_method=f"tcp://{spec.master_addr}:{spec.fabric_port}", rank=spec.rank,
            world_size=spec.size, timeout=datetime.timedelta(seconds=spec.timeout_s),
        )
    except Exception as e:
        for end in (hub, link):
            if end is not None:
                end.close()
        raise WorldError(f"process group ({backend}) on {spec.master_addr}:{spec.fabric_port} did not form: {e}") from e
    log.info("world formed", rank=spec.rank, size=spec.size, backend=backend, device=device)
    return DistWorld(World(spec.rank, spec.size), dist.group.WORLD, hub, link, device)
