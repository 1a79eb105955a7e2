"""Type stubs of the Rust extension ``kvpool._native`` (see ``python/src/lib.rs``)."""

from typing import Any, Optional, Sequence, Union

Key = Union[str, bytes]
__version__: str

class KvpoolError(Exception):
    """A kvpool call failed; ``args == (message, code)``."""

    code: str

class EventSubscription:
    """KV events of the pool, batch by batch (from ``Client.subscribe``)."""

    def next(self, timeout: Optional[float] = None) -> Optional[dict[str, Any]]: ...
    @property
    def resume_from(self) -> int: ...
    @property
    def log_id(self) -> int: ...
    def close(self) -> None: ...

class SharedBuffer:
    """Memory shared with a same-host server; supports the writable buffer protocol."""

    @property
    def address(self) -> int: ...
    @property
    def size(self) -> int: ...
    def __len__(self) -> int: ...
    def __buffer__(self, flags: int) -> memoryview: ...

class Client:
    def __init__(
        self,
        server: Optional[str] = None,
        api_key: Optional[str] = None,
        *,
        fingerprint: Optional[str] = None,
        ca_file: Optional[str] = None,
        data_dir: Optional[str] = None,
        server_name: Optional[str] = None,
        transport: str = "auto",
        timeout: float = 30.0,
        client_name: Optional[str] = None,
        verify_shm_gets: bool = False,
        dead_after: Optional[float] = None,
        etcd: Optional[str] = None,
        etcd_prefix: str = "/kvpool/",
        node_answer_within: Optional[float] = None,
        bulk: str = "auto",
        trusted_networks: Optional[list[str]] = None,
        device_chunk: Optional[int] = None,
    ) -> None: ...
    @property
    def last_device_error(self) -> Optional[str]: ...
    @property
    def cluster(self) -> bool: ...
    @property
    def transport(self) -> str: ...
    @property
    def control(self) -> str: ...
    @property
    def tenant(self) -> str: ...
    @property
    def limits(self) -> dict[str, int]: ...
    def ping(self) -> float: ...
    def close(self) -> None: ...
    def put_batch(
        self,
        keys: Sequence[Key],
        values: Sequence[Any],
        upsert: bool = False,
        parents: Optional[Sequence[Optional[Key]]] = None,
        tokens: Optional[Sequence[int]] = None,
        seq_tokens: Optional[Sequence[int]] = None,
        pin: Optional[str] = None,
    ) -> list[str]: ...
    def get_batch(self, keys: Sequence[Key]) -> list[tuple[str, Optional[bytes]]]: ...
    def get_size(self, keys: Sequence[Key]) -> list[tuple[str, int]]: ...
    def exists(self, keys: Sequence[Key]) -> list[bool]: ...
    def lookup(self, chain: Sequence[Key]) -> int: ...
    def lookup_lease(self, chain: Sequence[Key], ttl: Optional[float] = None) -> tuple[int, list[int]]: ...
    def release(self, lease: int) -> None: ...
    def remove_matching(
        self, prefix: Optional[Key] = None, pattern: Optional[str] = None, force: bool = False
    ) -> tuple[int, int]: ...
    def remove(self, keys: Sequence[Key], force: bool = False) -> list[str]: ...
    def remove_all(self, force: bool = False) -> tuple[int, int]: ...
    def stats(self) -> dict[str, Any]: ...
    def subscribe(
        self,
        from_seq: Optional[int] = None,
        all_tenants: bool = False,
        max_batch: int = 0,
        log_id: Optional[int] = None,
    ) -> EventSubscription: ...
    def alloc_buffer(self, size: int) -> SharedBuffer: ...
    def register(self, ptr: int, size: int) -> bool: ...
    def unregister(self, ptr: int) -> None: ...
    def registered(self, memory: bool = False) -> list[tuple[Any, ...]]: ...
    def put_from(
        self,
        keys: Sequence[Key],
        ptrs: Sequence[int],
        sizes: Sequence[int],
        upsert: bool = False,
        parents: Optional[Sequence[Optional[Key]]] = None,
        tokens: Optional[Sequence[int]] = None,
        seq_tokens: Optional[Sequence[int]] = None,
        pin: Optional[str] = None,
    ) -> list[str]: ...
    def put_from_multi(
        self,
        keys: Sequence[Key],
        ptrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        upsert: bool = False,
        parents: Optional[Sequence[Optional[Key]]] = None,
        tokens: Optional[Sequence[int]] = None,
        seq_tokens: Optional[Sequence[int]] = None,
        pin: Optional[str] = None,
    ) -> list[str]: ...
    def get_into(self, keys: Sequence[Key], ptrs: Sequence[int], sizes: Sequence[int]) -> list[tuple[str, int]]: ...
    def get_into_multi(
        self, keys: Sequence[Key], ptrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]
    ) -> list[tuple[str, int]]: ...
