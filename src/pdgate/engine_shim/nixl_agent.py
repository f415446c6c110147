"""The only module that imports nixl: a thin, typed wrapper over one `nixl_agent`.

NIXL agents are not thread-safe: the caller must make every call on one agent from ONE
thread (the connector uses `AgentThread`). This wrapper adds no locking.

Progress: nixl's Python `nixl_agent` hard-codes the progress thread's delay to 0 µs, so an
agent created with its default config spins a whole core even when idle (measured: two idle
agents burn ~2 s of CPU per second). We create the agent with the progress thread OFF;
the UCX backend then makes progress inside our own calls (`state`, `get_notifs`, `post`),
which the owner's poll loop issues at an adaptive interval. An idle agent costs no CPU.

Errors from nixl are re-raised as `NixlAgentError` naming the call, so callers never see
nixl's exception types. The nixl import is lazy (in the constructor), so importing this
module works on machines without nixl.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from pdgate.engine_shim.logs import fold_library_loggers
from pdgate.engine_shim.transfer_errors import NixlAgentError

XferOp = Literal["READ", "WRITE"]
XferState = Literal["DONE", "PROC", "ERR"]
MemType = Literal["DRAM", "VRAM"]
Regions = Sequence[tuple[int, int]] | npt.NDArray[np.uint64]
"""(address, length in bytes) pairs, or an Nx2 uint64 array of them."""

T = TypeVar("T")


class PreppedList:
    """A descriptor list prepared once (`prep_local` / `prep_remote`); transfers pick
    descriptors from it by index. `size` is the number of descriptors."""

    __slots__ = ("handle", "size", "agent_name")

    def __init__(self, handle: Any, size: int, agent_name: str) -> None:
        self.handle = handle
        self.size = size
        self.agent_name = agent_name


class Xfer:
    """One transfer request; `release()` it (via `NixlAgent.release`) when done."""

    __slots__ = ("handle", "remote_agent", "nbytes")

    def __init__(self, handle: Any, remote_agent: str, nbytes: int) -> None:
        self.handle = handle
        self.remote_agent = remote_agent
        self.nbytes = nbytes


class TransferAgent(Protocol):
    """What the connector and its block transfers use of an agent: `NixlAgent`, or a fake in
    unit tests (the connector takes an `AgentFactory`). Semantics as in `NixlAgent`."""

    name: str

    def register(self, addr: int, length: int, mem_type: MemType, device_id: int) -> None: ...
    def deregister(self) -> None: ...
    def metadata(self) -> bytes: ...
    def add_remote(self, metadata: bytes) -> str: ...
    def remove_remote(self, agent_name: str) -> None: ...
    def prep_local(self, regions: Regions, mem_type: MemType,
                   device_id: int) -> PreppedList: ...
    def prep_remote(self, agent_name: str, regions: Regions, mem_type: MemType,
                    device_id: int) -> PreppedList: ...
    def release_list(self, prepped: PreppedList) -> None: ...
    def make_xfer(self, op: XferOp, local: PreppedList, local_idx: npt.NDArray[np.int32],
                  remote: PreppedList, remote_idx: npt.NDArray[np.int32], notif: bytes,
                  nbytes: int, *, merge: bool = True) -> Xfer: ...
    def make_xfer_regions(self, op: XferOp, local: Regions, local_mem: MemType,
                          local_dev: int, remote_agent: str, remote: Regions,
                          remote_mem: MemType, remote_dev: int, notif: bytes) -> Xfer: ...
    def post(self, xfer: Xfer) -> XferState: ...
    def state(self, xfer: Xfer) -> XferState: ...
    def release(self, xfer: Xfer) -> None: ...
    def get_notifs(self) -> dict[str, list[bytes]]: ...
    def send_notif(self, agent_name: str, message: bytes) -> None: ...


AgentFactory = Callable[[str, bool], TransferAgent]
"""Builds the agent named `name` (`vram`: it will register GPU memory); called once, on the
connector's agent thread."""


def nixl_agent_factory(name: str, vram: bool) -> TransferAgent:
    """The production `AgentFactory`: a real NIXL agent."""
    return NixlAgent(name, vram=vram)


def _call(what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    try:
        return fn(*args, **kwargs)
    except NixlAgentError:
        raise
    except Exception as e:  # nixl raises its own pybind types and plain RuntimeErrors
        raise NixlAgentError(f"nixl {what} failed: {type(e).__name__}: {e}") from e


def _descs(regions: Regions, device_id: int) -> npt.NDArray[np.uint64]:
    """Nx3 (addr, len, device_id) array, the form nixl takes without per-item Python work."""
    arr = np.asarray(regions, dtype=np.uint64).reshape(-1, 2)
    out = np.empty((arr.shape[0], 3), dtype=np.uint64)
    out[:, :2] = arr
    out[:, 2] = device_id
    return out


def _nixl_api() -> tuple[Any, Any]:
    """nixl's agent API: from the `nixl` meta package, else from NIXL's CUDA 13 build
    alone (what the shim extra installs: `nixl-cu13`, which the meta package only wraps)."""
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError:
        from nixl_cu13._api import nixl_agent, nixl_agent_config
    return nixl_agent, nixl_agent_config


class NixlAgent:
    """One NIXL agent with the UCX backend and no progress thread (see module doc).

    `name` must be unique among the agents that will ever talk to each other; the connector
    appends a random suffix per process so a restarted engine is a new agent to its peers.
    `telemetry=True` makes `telemetry()` available (used by the benchmark); `vram=True`
    when the agent will register GPU memory (it configures UCX for CUDA IPC)."""

    def __init__(self, name: str, *, telemetry: bool = False, vram: bool = False) -> None:
        if vram:
            # UCX reads its config when the backend starts. Without this a VRAM<-VRAM READ
            # silently takes an emulated path (~0.5 GB/s on an H200) instead of CUDA IPC
            # (~1 TB/s); an operator's explicit setting still wins. Only for VRAM agents:
            # on a host without CUDA, UCX warns about the unused variable at every start.
            os.environ.setdefault("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "on")
        try:
            nixl_agent, nixl_agent_config = _nixl_api()
        except ImportError as e:
            raise NixlAgentError(f"nixl is not installed: {e}") from e
        fold_library_loggers()  # the import gave `nixl` a stdout handler of its own
        config = nixl_agent_config(
            enable_prog_thread=False, enable_listen_thread=False,
            capture_telemetry=telemetry, backends=["UCX"],
        )
        self.name = name
        self._agent: Any = _call("create agent", nixl_agent, name, config)
        self._registered: Any = None

    # -- memory ---------------------------------------------------------------------------
    def register(self, addr: int, length: int, mem_type: MemType, device_id: int) -> None:
        """Register [addr, addr+length) once; every transfer's local/remote regions must lie
        inside a registered range."""
        if self._registered is not None:
            raise NixlAgentError("memory is already registered with this agent")
        descs = [(addr, length, device_id, "")]
        self._registered = _call(
            "register_memory", self._agent.register_memory, descs, mem_type
        )

    def deregister(self) -> None:
        if self._registered is not None:
            reg, self._registered = self._registered, None
            _call("deregister_memory", self._agent.deregister_memory, reg)

    # -- metadata and peers ---------------------------------------------------------------
    def metadata(self) -> bytes:
        """This agent's metadata (connection info + registered memory) for a peer's
        `add_remote`. Call after `register`."""
        md: bytes = _call("get_agent_metadata", self._agent.get_agent_metadata)
        return md

    def add_remote(self, metadata: bytes) -> str:
        """Load a peer's metadata; returns the peer agent's name."""
        name: str | bytes = _call("add_remote_agent", self._agent.add_remote_agent, metadata)
        return name.decode() if isinstance(name, bytes) else name  # nixl returns bytes

    def remove_remote(self, agent_name: str) -> None:
        """Forget a peer (and disconnect). Its prepared lists must be released first."""
        _call("remove_remote_agent", self._agent.remove_remote_agent, agent_name)

    # -- descriptor lists -----------------------------------------------------------------
    def prep_local(self, regions: Regions, mem_type: MemType, device_id: int) -> PreppedList:
        """Prepare a list of this agent's regions, reusable by index in `make_xfer`."""
        descs = _descs(regions, device_id)
        h = _call("prep_xfer_dlist(local)", self._agent.prep_xfer_dlist,
                  "NIXL_INIT_AGENT", descs, mem_type)
        return PreppedList(h, len(descs), "")

    def prep_remote(
        self, agent_name: str, regions: Regions, mem_type: MemType, device_id: int
    ) -> PreppedList:
        """Prepare a list of peer `agent_name`'s regions (addresses in the peer's space)."""
        descs = _descs(regions, device_id)
        h = _call("prep_xfer_dlist(remote)", self._agent.prep_xfer_dlist,
                  agent_name, descs, mem_type)
        return PreppedList(h, len(descs), agent_name)

    def release_list(self, prepped: PreppedList) -> None:
        _call("release_dlist_handle", self._agent.release_dlist_handle, prepped.handle)

    # -- transfers ------------------------------------------------------------------------
    def make_xfer(
        self, op: XferOp, local: PreppedList, local_idx: npt.NDArray[np.int32],
        remote: PreppedList, remote_idx: npt.NDArray[np.int32], notif: bytes, nbytes: int,
        *, merge: bool = True,
    ) -> Xfer:
        """A transfer of local[local_idx[i]] <-> remote[remote_idx[i]] for every i. With
        `merge` NIXL merges descriptors adjacent on both sides (False only to measure the
        cost of not coalescing). `notif` reaches the peer after the data. `nbytes` is
        recorded on the Xfer for the caller's accounting."""
        h = _call("make_prepped_xfer", self._agent.make_prepped_xfer,
                  op, local.handle, local_idx, remote.handle, remote_idx, notif,
                  skip_desc_merge=not merge)
        return Xfer(h, remote.agent_name, nbytes)

    def make_xfer_regions(
        self, op: XferOp, local: Regions, local_mem: MemType, local_dev: int,
        remote_agent: str, remote: Regions, remote_mem: MemType, remote_dev: int, notif: bytes,
    ) -> Xfer:
        """A one-off transfer between two explicit region lists (prepared per request)."""
        ld, rd = _descs(local, local_dev), _descs(remote, remote_dev)
        if ld.shape[0] != rd.shape[0] or not np.array_equal(ld[:, 1], rd[:, 1]):
            raise NixlAgentError("local and remote region lists differ in shape")
        lx = _call("get_xfer_descs", self._agent.get_xfer_descs, ld, local_mem)
        rx = _call("get_xfer_descs", self._agent.get_xfer_descs, rd, remote_mem)
        h = _call("initialize_xfer", self._agent.initialize_xfer,
                  op, lx, rx, remote_agent, notif)
        return Xfer(h, remote_agent, int(ld[:, 1].sum()))

    def post(self, xfer: Xfer) -> XferState:
        """Start the transfer; small (or shared-memory) transfers may already be DONE."""
        state: XferState = _call("transfer", self._agent.transfer, xfer.handle)
        return state

    def state(self, xfer: Xfer) -> XferState:
        """Poll the transfer (this also drives UCX progress)."""
        state: XferState = _call("check_xfer_state", self._agent.check_xfer_state, xfer.handle)
        return state

    def release(self, xfer: Xfer) -> None:
        """Free the request; an active transfer is cancelled if the backend can."""
        _call("release_xfer_handle", self._agent.release_xfer_handle, xfer.handle)

    def telemetry(self, xfer: Xfer) -> tuple[int, int, int]:
        """(post duration µs, transfer duration µs, descriptors after merging) of a finished
        transfer; needs `telemetry=True`."""
        t = _call("get_xfer_telemetry", self._agent.get_xfer_telemetry, xfer.handle)
        return int(t.postDuration), int(t.xferDuration), int(t.descCount)

    # -- notifications --------------------------------------------------------------------
    def get_notifs(self) -> dict[str, list[bytes]]:
        """Notifications received since the last call, by sender agent name (drives progress)."""
        notifs: dict[str, list[bytes]] = _call("get_new_notifs", self._agent.get_new_notifs)
        return notifs

    def send_notif(self, agent_name: str, message: bytes) -> None:
        _call("send_notif", self._agent.send_notif, agent_name, message)
