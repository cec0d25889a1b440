"""``querator worker MODULE:FUNCTION --queue NAME``: run a handler of your code as a worker.

``querator worker MODULE:SETTINGS`` runs a :class:`~querator.WorkerSettings` instead
(queue, handlers and tasks, options); the flags given override it. The handler or
settings are imported by path (the current directory first on ``sys.path``, as
``python -m`` does), then a :class:`~querator.Worker` runs it until SIGTERM or SIGINT
(graceful: running handlers finish within ``--shutdown-timeout``, the rest is given
back), or with ``--burst`` until the queue is empty. Logs go to standard error.
The runner lives with the other commands: the Worker knows nothing of the CLI.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import signal
import sys
import threading
from dataclasses import asdict, replace
from typing import TYPE_CHECKING, Any

from .._worker.dispatch import Handler
from .._worker.options import WorkerOptions
from .._worker.settings import WorkerSettings
from .._worker.workers import Worker
from ._common import Commands, parse_duration

if TYPE_CHECKING:
    from .._client import Client

HELP = (
    "run a handler (MODULE:FUNCTION) or worker settings (MODULE:SETTINGS) on a queue's items "
    "until SIGTERM/SIGINT, or until empty with --burst"
)

# Flags that override a WorkerOptions field of the same name when given.
_OPTION_FLAGS = (
    "concurrency",
    "batch_size",
    "handler_timeout",
    "max_lease_duration",
    "shutdown_timeout",
    "lease_wait",
    "metrics_port",
    "metrics_host",
    "faulty_timeout",
)

log = logging.getLogger("querator.worker")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``querator worker`` options, added to ``parser``."""
    parser.add_argument(
        "handler",
        nargs="?",
        metavar="MODULE:FUNCTION",
        help="the handler of every item (of kinds without --kind), or a querator.WorkerSettings; flags override it",
    )
    parser.add_argument("-Q", "--queue", help="the queue to work on (default: the settings')")
    parser.add_argument(
        "--kind",
        action="append",
        default=[],
        metavar="KIND=MODULE:FUNCTION",
        help="the handler of items of KIND (repeatable); items of other kinds go to HANDLER, "
        "or to the dead-letter queue without one",
    )
    parser.add_argument("-c", "--concurrency", type=int, help="handlers at once (default 10)")
    parser.add_argument("--batch-size", type=int, help="items per Lease call (default: --concurrency, at most 1000)")
    parser.add_argument(
        "--burst",
        action="store_true",
        help="exit 0 once the queue has nothing ready, leased or scheduled (waiting while any partition is faulty)",
    )
    parser.add_argument(
        "--faulty-timeout",
        type=parse_duration,
        help="with --burst: fail (exit non-zero) when partitions stay faulty this long once the rest is empty "
        "(default: wait until they are back)",
    )
    parser.add_argument("--handler-timeout", type=parse_duration, help="give up a handler after this long; its item is retried")
    parser.add_argument("--max-lease-duration", type=parse_duration, help="stop extending a lease this long after leasing")
    parser.add_argument(
        "--shutdown-timeout", type=parse_duration,
        help="at SIGTERM/SIGINT, how long running handlers may finish (default 30s)",
    )  # fmt: skip
    parser.add_argument("--lease-wait", type=parse_duration, help="long-poll time (default 30s)")
    parser.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port (the metrics extra)")
    parser.add_argument("--metrics-host", help="the address the metrics port binds (default 127.0.0.1: this machine only)")
    parser.add_argument(
        "--log-level", default="INFO", type=str.upper, choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="default info"
    )


def load(path: str) -> Any:
    """The object named by ``module:attribute`` (the attribute may be dotted): a
    callable, or worker settings."""
    module_name, sep, attribute = path.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(f"not MODULE:FUNCTION: {path!r} (e.g. myapp.tasks:handle)")
    if "" not in sys.path:
        sys.path.insert(0, "")  # the current directory, as `python -m` has it
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise ValueError(f"cannot import {module_name!r}: no module named {exc.name!r}") from None
        raise  # the module itself failed to import something: show its traceback
    for name in attribute.split("."):
        try:
            obj = getattr(obj, name)
        except AttributeError:
            raise ValueError(f"{module_name!r} has no attribute {attribute!r}") from None
    several = isinstance(obj, (list, tuple)) and bool(obj) and all(isinstance(s, WorkerSettings) for s in obj)
    if not callable(obj) and not isinstance(obj, WorkerSettings) and not several:
        raise ValueError(f"{path} is neither callable nor a querator.WorkerSettings (or a list of them)")
    return obj


def run(args: argparse.Namespace, client: Client) -> int:
    """Run the worker the parsed ``args`` describe; 0 once it stopped gracefully."""
    several = settings_of(args)
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=args.log_level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
    workers = [settings.worker(client) for settings in several]
    until = ", until empty" if args.burst else ""
    for settings in several:
        names = [*settings.handlers, *(t.kind for tasks in settings.registries() for t in tasks)]
        if settings.handler is not None:
            names.append(f"(default: {getattr(settings.handler, '__qualname__', settings.handler)!r})")
        names += [f"periodic:{job.name}" for job in settings.periodic]
        log.info(
            "worker on queue %s: %s, concurrency %d%s", settings.queue, " ".join(names), settings.options.concurrency, until
        )
    if len(workers) == 1:
        workers[0].run(until_empty=args.burst)
    else:
        _run_together(workers, args.burst)
    # asdict() would rebuild the failures Counter from (name, count) pairs, counting
    # the pairs: the names are the keys.
    reports = [{**asdict(w.stats), "failures": dict(w.stats.failures)} for w in workers]
    if args.json:
        print(json.dumps(reports[0] if len(workers) == 1 else [{"queue": w.queue_name, **r} for w, r in zip(workers, reports)]), flush=True)
    for worker in workers:
        stats = worker.stats
        log.info(
            "worker stopped: %d completed, %d retried, %d dead, %d given back, %d failed (queue %s)",
            stats.completed, stats.retried, stats.dead, stats.released, stats.failed, worker.queue_name,
        )  # fmt: skip
    stuck = sum(w._engine.threads.running for w in workers if w._engine is not None and w._engine.threads is not None)
    if stuck:
        # Given up (handler_timeout, shutdown_timeout) but still running: Python waits
        # for them before the process ends, and nothing can stop them but a kill.
        log.warning("%d sync handler(s) still running; the process ends when they return", stuck)
    return 0


def _run_together(workers: list[Worker], burst: bool) -> None:
    """Several workers (one per queue) in this process, each on its thread with its own
    event loop; SIGTERM/SIGINT stop them all gracefully (a worker handles signals only
    on the main thread, which here waits for them)."""
    errors: list[BaseException] = []

    def work(worker: Worker) -> None:
        try:
            worker.run(until_empty=burst)
        except BaseException as exc:  # raised below, in the main thread
            errors.append(exc)
            for other in workers:
                other.stop(wait=False)

    def stop(signum: int, frame: object) -> None:
        for worker in workers:
            worker.stop(wait=False)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    threads = [threading.Thread(target=work, args=(w,), name=f"querator-worker-{w.queue_name}") for w in workers]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            while thread.is_alive():
                thread.join(0.2)  # in slices: the signal handler runs in this thread
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if errors:
        raise errors[0]


def settings_of(args: argparse.Namespace) -> list[WorkerSettings]:
    """The settings the command line describes: MODULE:SETTINGS (one, or a list of them:
    one worker per queue), or MODULE:FUNCTION and --kind; the flags given override the
    settings' options."""
    if args.handler is None and not args.kind:
        raise ValueError("give a handler (MODULE:FUNCTION), worker settings (MODULE:SETTINGS), --kind, or both")
    loaded = load(args.handler) if args.handler else None
    if isinstance(loaded, (list, tuple)):
        if args.queue or args.kind:
            raise ValueError("--queue and --kind take one worker's settings, not a list of them")
        overrides = {name: getattr(args, name) for name in _OPTION_FLAGS if getattr(args, name) is not None}
        queues = [s.queue for s in loaded]
        if len(set(queues)) != len(queues):
            raise ValueError(f"one worker settings per queue: {queues}")
        return [s.with_options(**overrides) for s in loaded]
    base = loaded if isinstance(loaded, WorkerSettings) else None
    kinds: dict[str, Handler] = {}
    for spec in args.kind:
        kind, sep, path = spec.partition("=")
        if not sep:
            raise ValueError(f"--kind takes KIND=MODULE:FUNCTION, not {spec!r}")
        handler = load(path)
        if isinstance(handler, WorkerSettings):
            raise ValueError(f"--kind takes a handler, and {path} is worker settings")
        kinds[kind] = handler
    overrides = {name: getattr(args, name) for name in _OPTION_FLAGS if getattr(args, name) is not None}
    if base is None:
        if not args.queue:
            raise ValueError("--queue is needed with a handler (worker settings may name their queue)")
        return [WorkerSettings(queue=args.queue, handler=loaded, handlers=kinds, options=WorkerOptions(**overrides))]
    settings = base.with_options(**overrides)
    if args.queue and args.queue != settings.queue:
        if settings.registries():
            raise ValueError(f"--queue {args.queue}: the settings' tasks are for queue {settings.queue!r}")
        settings = replace(settings, queue=args.queue)
    if kinds:
        settings = replace(settings, handlers={**settings.handlers, **kinds})
    return [settings]


def register(commands: Commands) -> None:
    add_arguments(commands.leaf("worker", run, HELP))
