"""A SuperExec that runs every ClientApp task in one warm process instead of a fresh one.

Flower 1.42's SuperExec starts a new ``flwr-clientapp`` process for every message a SuperNode
receives. That process imports flwr (about 2 s of CPU here), installs the FAB, loads the
ClientApp, and only then pulls its message: seconds of start-up per round that no polling
setting removes, and on a busy node the start-up competes with training for the cores.

This entry point runs the stock SuperExec loop (``flower-superexec``: same arguments, same
Runtime API, same task tokens) with one change: a ClientApp task runs on a thread of this
long-lived process. The flwr imports, the installed FAB and the loaded ClientApp are kept from
one message to the next (per FAB hash), so a round pays only the Runtime API calls. Each task
still does what ``flwr-clientapp`` does, in the same order: pull its Context, Run, FAB and
Message with its own token, call the ClientApp, push the reply (an Error reply if the app
raised), then push the Context and the final status. Other task types fall back to Flower's
subprocess executor.

What is given up is process isolation between messages: a ClientApp that keeps global state
keeps it across messages. flower-shard's ClientApp is stateless (it converts Messages for the
long-lived group), so nothing changes for it. Tasks pull their input concurrently and call the
ClientApp one at a time, as Flower's per-task globals (``TaskIdentity``) assume. The process
exits with its SuperNode (``--parent-pid``).

Flower ends a ``flwr-clientapp`` whose task token is refused (the task expired, its run
stopped) by sending SIGINT to its own process: from its retry invoker on an HTTP 401 and from
its task heartbeat. Here that would take down every later task with it (a ServerApp killed
mid-round left a node that never trained again), so a task's client gives up on 401/403 and its
heartbeat marks the task abandoned instead: the task fails, the process serves the next one.
A queued task's heartbeat starts at once, so its token stays valid while it waits its turn.

    python -m flower_shard.flower.node.warm_superexec [flower-superexec arguments]
"""

from __future__ import annotations

import fcntl
import logging
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import httpx
from flwr.app import Message
from flwr.app.error import Error
from flwr.cli.install import install_from_fab
from flwr.clientapp.client_app import ClientApp, LoadClientAppError
from flwr.clientapp.utils import get_load_client_app_fn
from flwr.common.constant import ErrorCode, SubStatus
from flwr.proto.runtime_pb2 import SendTaskHeartbeatRequest
from flwr.supercore import log
from flwr.supercore.constant import TaskType
from flwr.supercore.heartbeat import HeartbeatSender
from flwr.supercore.interceptors import (
    RuntimeTokenHttpInterceptor,
    RuntimeVersionHttpInterceptor,
)
from flwr.supercore.retry import RetryInvoker, make_simple_http_retry_invoker
from flwr.supercore.runtime import RuntimeHttpClient
from flwr.supercore.superexec.executor.subprocess_executor import SubprocessExecutor
from flwr.supercore.superexec.executor.types import ExecutionSpec, LaunchResult
from flwr.supercore.task_identity import TaskIdentity
from flwr.supercore.utils import get_flwr_home
from flwr.supernode.runtime.run_clientapp import (
    pull_task_input,
    push_message,
    push_task_output,
)

# A refused task token: the task expired or its run stopped. Only this task is over.
_TASK_REFUSED = (httpx.codes.UNAUTHORIZED, httpx.codes.FORBIDDEN)

FAB_LOCK = ".fab-install.lock"
"""In the Flower home: held while a FAB is installed and its ClientApp loaded."""


def task_retry_invoker() -> RetryInvoker:
    """Flower's Runtime API retry policy, except that a refused token ends the call with its
    HTTP error instead of SIGINT to this (shared) process."""
    invoker = make_simple_http_retry_invoker()
    flower_giveup = invoker.should_giveup

    def should_giveup(exc: Exception) -> bool:
        if isinstance(exc, httpx.HTTPStatusError) and exc.response.status_code in _TASK_REFUSED:
            return True
        return flower_giveup(exc) if flower_giveup else False

    invoker.should_giveup = should_giveup
    return invoker


def task_heartbeat_fn(client: RuntimeHttpClient, abandoned: threading.Event) -> Callable[[], bool]:
    """Flower's task heartbeat, except that a heartbeat the SuperNode refuses sets
    ``abandoned`` (and stops retrying) instead of sending SIGINT to this process."""
    request = SendTaskHeartbeatRequest()

    def beat() -> bool:
        try:
            ok = client.SendTaskHeartbeat(request).success
        except httpx.TransportError:
            return False  # retried
        except httpx.HTTPStatusError as err:
            if err.response.status_code not in _TASK_REFUSED:
                return False  # 5xx: retried
            ok = False
        if not ok:
            abandoned.set()
        return True

    return beat


class TaskAbandoned(RuntimeError):
    """The SuperNode no longer knows this task (it expired, or its run stopped)."""


class WarmClientAppExecutor(SubprocessExecutor):
    """Runs ClientApp tasks on threads of this process (the app one at a time); the rest as
    subprocesses.

    On failure: an exception in the ClientApp becomes an Error reply to its message (as in
    ``flwr-clientapp``) and the task is reported FAILED; an error talking to the SuperNode is
    logged and the task expires on the SuperNode's side. Either way this process goes on
    serving the next task.
    """

    def __init__(self) -> None:
        self._apps: dict[str, ClientApp] = {}
        self._one_at_a_time = threading.Lock()

    def launch(self, spec: ExecutionSpec) -> LaunchResult:
        if spec.task_type != TaskType.CLIENT_APP:
            return super().launch(spec)
        threading.Thread(
            target=self._run_task, args=(spec,), name=f"clientapp-{spec.task_id}", daemon=True
        ).start()
        return LaunchResult.accepted()

    def _client_app(self, run, fab) -> ClientApp:
        """The ClientApp of this FAB, installed and loaded on first use."""
        if fab.hash_str not in self._apps:
            # Several nodes on one host may share a Flower home. install_from_fab makes the
            # app's directory first and copies into it after, and one that finds the directory
            # returns at once: a second SuperExec would load a half-copied app
            # (LoadClientAppError, seen as a group missing from a run's first round). Install
            # and load under one lock of the home.
            home = get_flwr_home()
            home.mkdir(parents=True, exist_ok=True)
            with open(home / FAB_LOCK, "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                install_from_fab(fab.content, skip_prompt=True)
                load = get_load_client_app_fn(default_app_ref="", app_path=None, multi_app=True)
                self._apps[fab.hash_str] = load(run.fab_id, run.fab_version, fab.hash_str)
        return self._apps[fab.hash_str]

    def _run_task(self, spec: ExecutionSpec) -> None:
        certificates = (
            Path(spec.root_certificates_path).read_bytes() if spec.root_certificates_path else None
        )
        client = RuntimeHttpClient.from_server_address(
            server_address=spec.runtime_api_address,
            insecure=spec.insecure,
            root_certificates=certificates,
            interceptors=[
                RuntimeVersionHttpInterceptor(component_name="flwr-clientapp"),
                RuntimeTokenHttpInterceptor(spec.token),
            ],
            retry_invoker=task_retry_invoker(),
        )
        abandoned = threading.Event()
        heartbeat = HeartbeatSender(task_heartbeat_fn(client, abandoned))
        message = reply = context = None
        status, details = SubStatus.FAILED, "ClientApp task failed due to unknown reason"
        try:
            heartbeat.start()
            # Pulled outside the lock: a dead run's task can wait minutes for objects that
            # never come, and must not hold up the live run's tasks meanwhile.
            message, context, run, fab = pull_task_input(client)
            with self._one_at_a_time:
                if abandoned.is_set():
                    raise TaskAbandoned(f"task {spec.task_id} expired before its turn")
                # pull_task_input set these globals; another task's pull may have since.
                TaskIdentity.task_id = spec.task_id
                TaskIdentity.run_id = context.run_id
                TaskIdentity.node_id = context.node_id
                reply = self._client_app(run, fab)(message=message, context=context)
                status, details = SubStatus.COMPLETED, ""
        except Exception as ex:  # the app's or the Runtime API's: this process lives on
            log(logging.ERROR, "ClientApp task %d failed: %s", spec.task_id, ex)
            code = ErrorCode.CLIENT_APP_RAISED_EXCEPTION
            details = f"{type(ex)}:<'{ex}'>"
            if isinstance(ex, LoadClientAppError):
                code = ErrorCode.LOAD_CLIENT_APP_EXCEPTION
                details = "An exception was raised when attempting to load `ClientApp`"
            if message is not None:
                reply = Message(Error(code=code, reason=details), reply_to=message)
        finally:
            try:
                if not abandoned.is_set():  # else the SuperNode refuses this task's token
                    if reply is not None and context is not None:
                        push_message(client, reply, context)
                    push_task_output(client, context, status, details)
            except Exception as ex:  # noqa: BLE001 - logged; the task expires upstream
                log(logging.ERROR, "Could not push task %d's reply: %s", spec.task_id, ex)
            finally:
                if heartbeat.is_running:
                    heartbeat.stop()
                client.close()


def main() -> int:
    import flwr.supercore.superexec.run_superexec as superexec
    from flwr.supercore.cli.flower_superexec import flower_superexec

    from flower_shard.flower.node.fast_supernode import fast_object_pulls

    fast_object_pulls()  # the ClientApp's pulls from the SuperNode
    executor = WarmClientAppExecutor()
    # run_superexec looks its executor up through this module-level name.
    superexec.get_executor = lambda *args, **kwargs: executor
    sys.argv[0] = "flower-superexec"
    flower_superexec()
    return 0


if __name__ == "__main__":
    sys.exit(main())
