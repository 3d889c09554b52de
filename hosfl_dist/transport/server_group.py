"""The server ranks as a transport for a data-parallel server step: rank 0 of the group leads.

The algorithm says what moves (each rank's rows out, λ rows and losses back, the step decision out); this class moves
it over the server group's process group with ``torch.distributed``'s object collectives, in the group's own rank
numbering. The torchrun runtime injects it (``server.group``) when ``server.ranks`` > 1.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


class ServerGroup:
    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)

    @property
    def leads(self) -> bool:
        return self.rank == 0

    def scatter(self, items: list[Any] | None) -> Any:
        """Rank 0 gives item k to rank k (``items`` is None on the other ranks); returns this rank's item."""
        out: list[Any] = [None]
        dist.scatter_object_list(out, items if self.leads else None, group=self.group, group_src=0)
        return out[0]

    def gather(self, item: Any) -> list[Any] | None:
        """Every rank's ``item``, in rank order, on rank 0 (None elsewhere)."""
        out: list[Any] | None = [None] * self.size if self.leads else None
        dist.gather_object(item, out, group=self.group, group_dst=0)
        return out

    def broadcast(self, item: Any) -> Any:
        """Rank 0's ``item`` on every rank."""
        box = [item]
        dist.broadcast_object_list(box, group=self.group, group_src=0)
        return box[0]
