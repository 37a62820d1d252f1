"""torchrun, with its rendezvous store listening where it is told to, and ranks that die with it.

torchrun's own rendezvous store (a ``TCPStore``, ``--standalone`` or static alike) listens on
every interface of the host whatever address it is given (checked on torch 2.13 with
``/proc/net/tcp``: ``[::]:PORT``). Anyone who reaches the host could then write keys into a
running group's store. This entry point runs torchrun unchanged except for that: for a job on
one host (``--nnodes=1``, static rendezvous) it binds a socket to ``--master-addr``'s address
(127.0.0.1 as flower-shard starts it) itself and hands it over to a store in this process
(``master_listen_fd``); torchrun's static rendezvous asks for a multi-tenant store on that
port and gets this one. The ranks connect to it as before (``TORCHELASTIC_USE_AGENT_STORE``).
``--master-port=0`` takes a free port. A job over several hosts keeps torchrun's store, which
the other hosts must reach (see SECURITY.md).

It also exports its pid as ``FLOWER_SHARD_AGENT_PID``: the ranks (flower-shard's modules) call
:func:`flower_shard.launch.guard.die_with_agent` first thing, so they die with the agent even
when it is killed outright.

    python -m flower_shard.launch.agent [torchrun arguments, with --master-addr=HOST and
        --master-port=PORT written with "="]

On failure: an address it cannot listen on ends it at once with one line (exit 2); anything
else is torchrun's own behaviour and exit status.
"""

from __future__ import annotations

import os
import socket
import sys
from datetime import timedelta

from flower_shard.launch.guard import AGENT_ENV

AGENT_MODULE = "flower_shard.launch.agent"  # what the launchers start (python -m)
MASTER_ADDR, MASTER_PORT, NNODES = "--master-addr=", "--master-port=", "--nnodes="
LOOPBACK = "127.0.0.1"  # where a one-host job's store listens
LOOPBACK_INTERFACE = "lo"  # and its ranks' gloo / NCCL sockets
SOCKET_IFNAME_ENVS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
STORE_TIMEOUT = timedelta(minutes=30)  # torchrun's own default for the static rendezvous


def _option(argv: list[str], prefix: str) -> str | None:
    return next((a[len(prefix) :] for a in argv if a.startswith(prefix)), None)


def host_store(host: str, port: int):
    """A multi-tenant TCPStore server on ``host:port`` only (port 0: a free one); returns the
    store (keep it alive) and the port."""
    import torch.distributed as dist

    listener = socket.create_server((host, port))
    port = listener.getsockname()[1]
    store = dist.TCPStore(
        host,
        port,
        is_master=True,
        wait_for_workers=False,
        multi_tenant=True,  # torchrun's static rendezvous asks for one: it gets this server
        master_listen_fd=listener.detach(),
        timeout=STORE_TIMEOUT,
    )
    return store, port


def _first_signal_only() -> None:
    """torchrun turns SIGTERM/SIGINT into an exception wherever the agent is, then shuts its
    ranks down. A second signal during that shutdown (a launcher stopping the whole tree) was
    raised again at any point, once inside the logging of the first, which printed a
    traceback: later signals are ignored while the first one's shutdown runs."""
    from torch.distributed.elastic.multiprocessing import api

    handler, fired = api._terminate_process_handler, []

    def first_only(signum, frame):
        if not fired:
            fired.append(signum)
            handler(signum, frame)

    # looked up by name when torchrun installs its handlers (PContext.start)
    api._terminate_process_handler = first_only


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    host, port = _option(argv, MASTER_ADDR), _option(argv, MASTER_PORT)
    store = None
    if host and port is not None and port.isdigit() and _option(argv, NNODES) == "1":
        try:
            store, bound = host_store(host, int(port))
        except OSError as exc:
            print(
                f"flower-shard: error: cannot listen on {host}:{port} for the rendezvous "
                f"({exc}); give an address of this host and a free port",
                file=sys.stderr,
            )
            return 2
        argv = [f"{MASTER_PORT}{bound}" if a.startswith(MASTER_PORT) else a for a in argv]
    os.environ[AGENT_ENV] = str(os.getpid())
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun

    _first_signal_only()

    try:
        torchrun(argv)
    except SignalException as exc:  # stopped (Ctrl-C, a launcher's stop): it has stopped the
        # ranks; say so in one line, not torchrun's traceback
        print(f"flower-shard: torchrun stopped by {exc.sigval.name}", file=sys.stderr)
        return 128 + int(exc.sigval)
    finally:
        del store  # the ranks are gone: close the store and its socket
    return 0


if __name__ == "__main__":
    sys.exit(main())
