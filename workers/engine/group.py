"""How an engine's ranks reach each other's tensors: the process group (NCCL when every rank holds
a GPU of its own, else gloo through host memory) on its store, the `Wire` that says how a rank's
tensors travel, and the TP all-reduce. The control plane (commands, the handshake) is
`workers.engine.ctrl`, `workers.engine.rank` and `workers.engine.dist`."""

from __future__ import annotations

import datetime
import os
import socket
from typing import Any, Callable

import torch
import torch.distributed as dist

TIMEOUT = datetime.timedelta(seconds=60)
# NCCL on these hosts: NVLink multicast off (NVLS needs a fabric manager setup the lent machines
# lack). Set at a process's start, before any group (`process_env`), never by a library call.
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


def process_env() -> None:
    """At a worker, stage or rank process's start: the NCCL defaults, where the operator set none."""
    for k, v in NCCL_ENV.items():
        os.environ.setdefault(k, v)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def group_backend(devices: list[str]) -> str:
    """`nccl` when every rank holds a GPU of its own (cuda:N, all different); else `gloo`, with
    device tensors going through host memory (ranks sharing one GPU, or CPU ranks)."""
    if len(devices) > 1 and all(d.startswith("cuda:") for d in devices) and len(set(devices)) == len(devices):
        return "nccl"
    return "gloo"


class Wire:
    """How one rank's tensors travel to the others: as they are (NCCL, on the GPU) or through
    host memory (gloo)."""

    def __init__(self, backend: str, device: str) -> None:
        self.direct = backend == "nccl"
        self.device = device

    def out(self, t: torch.Tensor) -> torch.Tensor:
        return t.contiguous() if self.direct else t.contiguous().cpu()

    def buffer(self, *shape: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(*shape, dtype=dtype, device=self.device if self.direct else "cpu")

    def into(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device)


def bound_listener(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port only (for a TCPStore's server: `master_listen_fd`)."""
    fam = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    s = socket.socket(fam, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host.strip("[]"), port))
        s.listen(512)
    except OSError:
        s.close()
        raise
    return s


def make_group(rank: int, world: int, port: int, host: str = "127.0.0.1", backend: str = "gloo",
               device: str = "cpu", store_path: str = "") -> tuple[Any, socket.socket | None]:
    """A process group on a store: a FileStore at `store_path` for ranks spawned on this host (no
    listener at all), else a TCPStore at host:port (rank 0 serves it on a socket bound to `host`
    only: remote stages). NCCL when the ranks hold distinct GPUs
    (NVLink multicast off: NCCL_NVLS_ENABLE=0 unless set); gloo otherwise, binding the address the
    host name resolves to, or the interface named by GLOO_SOCKET_IFNAME.
    Returns the group and, on rank 0 of a TCPStore, the listening socket its store serves on
    (keep it as long as the group)."""
    # torch's stubs do not list its c10d store and gloo option classes among torch.distributed's
    # exports (they are re-exported from the C extension at import): the attributes exist at run time
    store: Any
    lsock = None
    if store_path:
        # (type: ignore below) torch's stubs omit the c10d stores (see above)
        store = dist.FileStore(store_path, world)  # type: ignore[attr-defined]
    elif rank == 0:   # the store's server on a socket of our own, bound to `host` (torch's binds every interface)
        lsock = bound_listener(host, port)
        # (type: ignore below) torch's stubs omit the c10d stores (see above)
        store = dist.TCPStore(host, port, world, is_master=True, timeout=TIMEOUT,  # type: ignore[attr-defined]
                              master_listen_fd=lsock.fileno())
    else:
        # (type: ignore below) torch's stubs omit the c10d stores (see above)
        store = dist.TCPStore(host, port, world, is_master=False, timeout=TIMEOUT)  # type: ignore[attr-defined]
    if backend == "nccl":
        torch.cuda.set_device(device)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = TIMEOUT
        return dist.ProcessGroupNCCL(store, rank, world, opts), lsock
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    if ifname:
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # (see the stores above)
        opts._timeout = TIMEOUT
        opts._devices = [dist.ProcessGroupGloo.create_device(interface=ifname)]
        return dist.ProcessGroupGloo(store, rank, world, opts), lsock
    return dist.ProcessGroupGloo(store, rank, world, TIMEOUT), lsock


def all_reduce_fn(group: Any, direct: bool = False) -> Callable[[torch.Tensor], torch.Tensor]:
    """Sum over the TP ranks: in place with NCCL (`direct`) or for host tensors; device tensors
    under gloo go through host memory (ranks may share one GPU, where NCCL needs distinct devices)."""
    def reduce(t: torch.Tensor) -> torch.Tensor:
        if direct or t.device.type == "cpu":
            t = t.contiguous()
            group.allreduce([t]).wait()
            return t
        h = t.cpu()
        group.allreduce([h]).wait()
        return h.to(t.device)
    return reduce
