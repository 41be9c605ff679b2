"""One verify step's drafts: how many each request has (on the host, since they shape the verify batch) and the
tokens themselves, on the device where an MTP drafter picked them (the host never reads them before the judge's
one copy, which brings back the accepted ones as emitted tokens) or on the host where a lookup found them."""

from __future__ import annotations

import torch


class Proposal:
    """Each request's drafts, in request order: ``counts`` and either ``device`` (flat ``[sum(counts)]`` int64) or
    ``host`` (one list per request)."""

    def __init__(
        self, counts: list[int], *, device: torch.Tensor | None = None, host: list[list[int]] | None = None
    ) -> None:
        if (device is None) == (host is None):
            raise ValueError("a proposal holds its tokens on the device or on the host")
        self.counts, self._device, self._host = counts, device, host

    @classmethod
    def of(cls, drafts: list[list[int]]) -> Proposal:
        return cls([len(d) for d in drafts], host=drafts)

    def lists(self) -> list[list[int]]:
        """The drafts on the host (a device->host copy when they are on the device)."""
        if self._host is None:
            assert self._device is not None
            flat, self._host, at = self._device.tolist(), [], 0
            for n in self.counts:
                self._host.append(flat[at : at + n])
                at += n
        return self._host

    def flat(self, device: torch.device) -> torch.Tensor:
        """Every draft in order, ``[sum(counts)]`` int64 on ``device``."""
        if self._device is None:
            assert self._host is not None
            tokens = [t for d in self._host for t in d]
            self._device = torch.tensor(tokens, dtype=torch.int64).to(device, non_blocking=True)
        return self._device

    def verify_rows(self, last: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The verify's input ids (each request's ``last`` token, then its drafts) and each row's draft to judge
        (the one fed on the row after it; -1 on a request's last row), ``[sum(1 + counts)]`` on ``device``."""
        starts: list[int] = []
        fed_at: list[int] = []
        judged_at: list[int] = []
        at = 0
        for n in self.counts:
            starts.append(at)
            fed_at.extend(range(at + 1, at + 1 + n))
            judged_at.extend(range(at, at + n))
            at += n + 1
        requests, drafted = len(starts), len(fed_at)
        # one host->device copy for the places and the last tokens
        host = torch.tensor(starts + fed_at + judged_at + last, dtype=torch.int64).to(
            device, non_blocking=True
        )
        first, fed = host[:requests], host[requests : requests + drafted]
        judged, last_ids = host[requests + drafted : requests + 2 * drafted], host[requests + 2 * drafted :]
        flat = self.flat(device)
        ids = torch.empty(at, dtype=torch.int64, device=device)
        ids[first] = last_ids
        ids[fed] = flat
        drafts = torch.full((at,), -1, dtype=torch.int64, device=device)
        drafts[judged] = flat
        return ids, drafts
