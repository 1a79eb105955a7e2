"""What the scheduler side tells the workers each step, and what the workers tell it back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata


@dataclass
class LoadJob:
    """Blocks of one request to copy from the pool into the paged KV cache, this step."""

    job: int
    req_id: str
    # Chain position of each block and its hash.
    positions: list[int]
    hashes: list[str]
    block_ids: list[int]
    # Loaded between steps (vLLM's asynchronous load): the request waits for it alone, and the
    # workers report it finished through ``get_finished``.
    asynchronous: bool = False


@dataclass
class SaveJob:
    """Full blocks of one request to store. The scheduler holds a reference on each block until
    every worker reported the job done, so no other request can overwrite them meanwhile, even
    when this one is preempted or finished."""

    job: int
    req_id: str
    # Chain position of each block, its hash, the hash before it (None at the root).
    positions: list[int]
    hashes: list[str]
    parents: list[Optional[str]]
    block_ids: list[int]


@dataclass
class KVPoolConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)
    # Requests preempted since the last step, and whether this step's saves could not be
    # referenced (no block pool bound): then the workers wait for a preempted request's saves
    # before its blocks are reused.
    preempted: set[str] = field(default_factory=set)
    unreferenced: bool = False
    # Synchronous load jobs every worker has reported since the last step: whether any block
    # failed on any worker. A step with synchronous loads saves only once it knows its loads
    # all arrived (with tensor parallelism, one rank's failed load poisons every rank's KV).
    load_verdicts: dict[int, bool] = field(default_factory=dict)


@dataclass
class KVPoolWorkerMetadata(KVConnectorWorkerMetadata):
    """Jobs each worker finished since its last report: ``done[job]`` counts workers (summed by
    ``aggregate``); ``failed[job]`` holds the chain positions of blocks some worker could not
    store or load."""

    done: dict[int, int] = field(default_factory=dict)
    failed: dict[int, set[int]] = field(default_factory=dict)
    # Save jobs a worker dropped because their step read blocks whose load failed: the chain
    # position from which the request's blocks must be saved again once computed.
    rewind: dict[int, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> "KVPoolWorkerMetadata":
        assert isinstance(other, KVPoolWorkerMetadata)
        for job, n in other.done.items():
            self.done[job] = self.done.get(job, 0) + n
        for job, positions in other.failed.items():
            self.failed.setdefault(job, set()).update(positions)
        for job, pos in other.rewind.items():
            self.rewind[job] = min(pos, self.rewind.get(job, pos))
        return self
