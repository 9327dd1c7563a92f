"""A private torch name, in every Ray worker process: rank 0's rendezvous store listens on
MASTER_ADDR (see the package's table)."""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import socket
import sys

#: ``worker_process_setup_hook`` of a Ray this process starts (a dotted name: Ray imports it
#: in every worker process).
STORE_ON_MASTER_ADDR_HOOK = f"{__name__}.store_on_master_addr"

_STORE_MODULE = "torch.distributed.rendezvous"


def store_on_master_addr() -> None:
    """``worker_process_setup_hook`` of a local Ray (:data:`STORE_ON_MASTER_ADDR_HOOK`): rank 0's TCPStore (the rendezvous that
    ``init_process_group`` starts) listens on MASTER_ADDR, here loopback, instead of on
    every interface, which is torch's default and has no setting.

    Runs in every worker process Ray starts, most of which never train: torch is not
    imported for them; the patch is applied when a process imports torch's rendezvous.
    """
    if _STORE_MODULE in sys.modules:
        _patch_store(sys.modules[_STORE_MODULE])
    elif not any(isinstance(finder, _PatchOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds torch's rendezvous module with the other finders, then patches it once loaded."""

    def find_spec(self, name, path, target=None):
        if name != _STORE_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _patch_store(module)

        spec.loader.exec_module = exec_and_patch
        return spec


def _patch_store(rendezvous) -> None:
    # torch 2.14: init_process_group(init_method="env://"/"tcp://") builds rank 0's store with
    # the private _create_c10d_store, which binds every interface and takes no address.
    create = rendezvous._create_c10d_store
    if getattr(create, "_on_master_addr", False):
        return

    def create_c10d_store(hostname, port, rank, world_size, timeout, *args, **kwargs):
        if rank != 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            return create(hostname, port, rank, world_size, timeout, *args, **kwargs)
        from torch.distributed import TCPStore

        family = socket.AF_INET6 if ":" in hostname else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((hostname, port))
            listener.listen(socket.SOMAXCONN)
        except OSError:  # not an address of this machine after all: torch's own way
            listener.close()
            return create(hostname, port, rank, world_size, timeout, *args, **kwargs)
        use_libuv = args[0] if args else kwargs.get("use_libuv", True)
        return TCPStore(
            host_name=hostname,
            port=port,
            world_size=world_size,
            is_master=True,
            timeout=timeout,
            multi_tenant=True,
            master_listen_fd=listener.detach(),
            use_libuv=use_libuv,
        )

    create_c10d_store._on_master_addr = True
    rendezvous._create_c10d_store = create_c10d_store
