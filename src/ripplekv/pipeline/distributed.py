"""Run units of work on Ray actors: each worker loads the model once and pulls the next unit when free.

A unit is whatever the caller makes independent (for `eval`: one sample with all its variants, so the
one-prefill design is kept; for `profile`: one calibration sample). Results come back in the order they
finish; the caller (the driver) is the only one that writes them. Units are handed out one at a time to
whichever worker is free, so a long sample never holds back the others.

Faults: when a worker process dies mid-unit (killed, out of memory), Ray restarts the actor (it loads
the model again) and the driver puts the unit back at the front of the queue, so the next free worker
runs it. A unit is retried a few times at most, and a result is only ever taken once. Errors raised by
the work itself (a bug, bad input) stop the run at once: retrying would fail the same way.

Local clusters bind to 127.0.0.1 only and send no usage statistics; `address` joins a cluster started
with `ray start --head` (and `ray start --address` on the other hosts).
"""

from __future__ import annotations

import logging
import os
import socket
import tempfile
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ripplekv.errors import UserError

INSTALL_HINT = "pip install 'ripplekv[ray]' (or `make install`)"
ATTEMPTS = 3  # tries per unit when workers die under it; an actor may restart as often


@dataclass(frozen=True)
class Workers:
    """How to scale out: how many workers, which cluster, CPU threads per worker (None: split the cores)."""

    count: int = 1
    address: str | None = None
    threads: int | None = None

    @property
    def uses_ray(self) -> bool:
        return self.count > 1 or self.address is not None

    def check(self) -> None:
        if self.count < 1:
            raise UserError(f"--workers must be at least 1, got {self.count}")
        if self.threads is not None and self.threads < 1:
            raise UserError(f"threads per worker must be at least 1, got {self.threads}")


def import_ray(local: bool):
    """Ray, or one line saying how to install it. A local cluster is kept on the loopback address."""
    if local:
        # Read by Ray at import: node address = loopback, and nothing is reported to Ray's usage server.
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    try:
        import ray
    except ImportError:
        raise UserError(f"--workers and --ray-address need Ray, which is not installed: {INSTALL_HINT}") from None
    return ray


def resolve_address(address: str) -> str:
    """The `host:port` a --ray-address names: `auto` is the cluster `ray start` left on this host
    (RAY_ADDRESS, else Ray's current-cluster file); anything but auto, host:port or ray://host:port is refused."""
    address = address.strip()
    if address == "auto":
        found = os.environ.get("RAY_ADDRESS", "").strip()
        current = Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"
        if not found and current.is_file():
            found = current.read_text(encoding="utf-8", errors="replace").strip()
        if not found or found == "auto":
            raise UserError("--ray-address auto: no Ray cluster runs on this host; start one with `ray start --head`, "
                            "or leave out --ray-address for a local one")
        address = found
    plain = address.split("://", 1)[1] if address.startswith("ray://") else address
    host, _, port = plain.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536 or "/" in plain:
        raise UserError(f"--ray-address {address!r} is not a cluster address; write host:port (e.g. 10.0.0.5:6379), "
                        "ray://host:port or auto")
    return plain


# An HTTP/2 client's opening (the preface and an empty SETTINGS frame): a gRPC server, as Ray's GCS and
# its client server are, answers with a SETTINGS frame of its own; anything else is not Ray.
_HTTP2_HELLO = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
_SETTINGS = 4


def check_reachable(address: str, timeout: float = 5.0) -> None:
    """A cluster address must resolve and answer as Ray (gRPC) now: Ray itself would retry for minutes
    before failing, also where another kind of server (a web server) listens."""
    plain = resolve_address(address)
    host, _, port = plain.rpartition(":")
    try:
        conn = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
    except OSError as err:
        raise UserError(f"no Ray cluster answers at {address} ({err.strerror or err}); start one there with "
                        "`ray start --head`, or leave out --ray-address for a local one") from None
    reply = b""
    with conn:
        try:
            conn.sendall(_HTTP2_HELLO)
            while len(reply) < 9:
                chunk = conn.recv(9 - len(reply))
                if not chunk:
                    break
                reply += chunk
        except TimeoutError:
            reply = None
        except OSError:  # reset by a server that does not speak HTTP/2
            pass
    if reply is None or len(reply) < 9 or reply[3] != _SETTINGS:
        what = f"nothing answered within {timeout:g} s" if reply is None else "it answers, but not as Ray (gRPC)"
        raise UserError(f"{address} is not a Ray cluster ({what}); pass the address `ray start --head` printed "
                        "(its port is 6379 unless set), or leave out --ray-address for a local one")


class UnitWorker:
    """A Ray actor: sets its torch threads, builds its context once (the model), then runs units."""

    def __init__(self, setup: Callable[[], object], work: Callable[[object, object], object], threads: int):
        import torch

        torch.set_num_threads(threads)
        self.work, self.error = work, None
        try:
            self.context = setup()
        except Exception as err:  # reported by `ready`, so the driver can show it as it is
            self.error = err

    def ready(self) -> int:
        if self.error is not None:
            raise self.error
        return os.getpid()

    def run(self, unit):
        return self.work(self.context, unit)


def _plan_resources(ray, workers: Workers, gpu: bool) -> int:
    """Threads per CPU worker; checks that the cluster can hold every worker (else they would wait forever)."""
    total = ray.cluster_resources()
    cpus = int(total.get("CPU", 0))
    if gpu:
        gpus = int(total.get("GPU", 0))
        if gpus < workers.count:
            raise UserError(f"--workers {workers.count} needs one GPU each, but the Ray cluster has {gpus}; "
                            f"use --workers {max(gpus, 1)} or --device cpu")
        return workers.threads or 1
    threads = workers.threads or max(1, cpus // workers.count)
    if cpus < workers.count * threads:
        raise UserError(f"{workers.count} workers x {threads} threads need {workers.count * threads} CPUs, "
                        f"but the Ray cluster has {cpus}; use fewer --workers")
    return threads


def _connect(ray, workers: Workers, gpu: bool) -> bool:
    """Join `workers.address`, or start a local cluster; False when this process was already connected."""
    if ray.is_initialized():
        return False
    quiet = {"include_dashboard": False, "log_to_driver": False, "logging_level": logging.ERROR}
    if workers.address is not None:
        try:
            ray.init(address=workers.address, **quiet)
        except (OSError, ValueError, RuntimeError) as err:
            raise UserError(f"cannot join the Ray cluster at {workers.address} ({err}); start one there with "
                            "`ray start --head`, or leave out --ray-address for a local one") from None
        return True
    import torch

    cores = os.cpu_count() or 1
    threads = workers.threads or max(1, cores // workers.count)
    ray.init(num_cpus=max(cores, workers.count * threads), num_gpus=torch.cuda.device_count() if gpu else 0,
             object_store_memory=256 * 2**20, **quiet)
    return True


def run_units(
    units: list,
    setup: Callable[[], object],
    work: Callable[[object, object], object],
    workers: Workers,
    device: str = "cpu",
    on_retry: Callable[[object, str], None] | None = None,
    label: Callable[[object], str] = str,
) -> Iterator[tuple[object, object]]:
    """Yield `(unit, work(context, unit))` for every unit exactly once, in the order they finish.

    `setup()` runs once in every worker (e.g. loads the model); GPU workers (device cuda or cuda:N) get one
    GPU each, CPU workers split the cores. Closing the iteration (or Ctrl-C) stops the workers, and the
    cluster when it was started here; wrap it in `contextlib.closing` when the consumer may fail.
    """
    workers.check()
    if not units:
        return
    gpu = device.startswith("cuda")
    ray = import_ray(local=workers.address is None)
    started = _connect(ray, workers, gpu)
    actors = []
    try:
        threads = _plan_resources(ray, workers, gpu)
        remote = ray.remote(UnitWorker).options(
            num_cpus=1 if gpu else threads, num_gpus=1 if gpu else 0, max_restarts=ATTEMPTS, max_task_retries=0,
        )
        actors = [remote.remote(setup, work, threads) for _ in range(workers.count)]
        yield from _schedule(ray, actors, units, on_retry, label)
    finally:
        for actor in actors:
            ray.kill(actor, no_restart=True)
        if started:
            ray.shutdown()


def _schedule(ray, actors: list, units: list, on_retry, label) -> Iterator[tuple[object, object]]:
    """Pull-based dispatch: a free actor takes the next queued unit; a unit whose worker died is requeued first."""
    from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError, WorkerCrashedError

    queue = deque(range(len(units)))
    tries = [0] * len(units)
    finished: set[int] = set()
    idle: deque = deque()  # live actors with nothing to do
    pending = {actor.ready.remote(): (actor, None) for actor in actors}  # ref -> (actor, unit index or None)
    while len(finished) < len(units):
        if not pending:
            raise UserError("every Ray worker died; see the Ray logs (/tmp/ray/session_latest/logs) for why")
        (ref,), _ = ray.wait(list(pending), num_returns=1)
        actor, index = pending.pop(ref)
        try:
            result = ray.get(ref)
        except RayTaskError as err:  # the work (or the model loading) raised: rerunning would fail alike
            cause = err.cause if isinstance(err.cause, BaseException) else err
            if isinstance(cause, UserError):
                raise UserError(*cause.args) from None  # its named settings kept, for the CLI to phrase
            raise cause from err
        except (RayActorError, WorkerCrashedError) as err:  # the worker process died (or is restarting)
            if index is not None:
                tries[index] += 1
                reason = str(err).strip().splitlines()[0]
                if tries[index] >= ATTEMPTS:
                    raise UserError(f"workers died {ATTEMPTS} times running {label(units[index])}: {reason}; "
                                    "see the Ray logs (/tmp/ray/session_latest/logs)") from None
                if on_retry is not None:
                    on_retry(units[index], reason)
                queue.appendleft(index)
            if index is not None or isinstance(err, ActorUnavailableError):
                pending[actor.ready.remote()] = (actor, None)  # answers once Ray has restarted it
            # else: an actor gone for good (restarts used up) takes no more work
        else:
            idle.append(actor)
            if index is not None and index not in finished:
                finished.add(index)
                yield units[index], result
        while queue and idle:
            nxt, free = queue.popleft(), idle.popleft()
            pending[free.run.remote(units[nxt])] = (free, nxt)


def load_model_on_worker(spec: str | None, device: str, dtype: str):
    """(model, tokenizer) in a worker; a GPU worker sees only the GPU Ray gave it, as `cuda`.

    The first worker on a host dequantizes a GGUF into the shared cache while the others wait for it
    (`engine.models` locks the cache), instead of all of them writing the same folder at once.
    """
    from ripplekv.engine.models import load_model

    model, tokenizer, _ = load_model(spec, device="cuda" if device.startswith("cuda") else device, dtype=dtype)
    return model, tokenizer
