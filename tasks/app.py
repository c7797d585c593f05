"""relayr's Celery app: how run messages are carried, acknowledged and redelivered.

The broker only delivers; reflexr's store is the truth about a run, so the settings favour
delivering again over losing, and bound the loops that could make (ADR-0001, ADR-0011,
ADR-0012 lists each setting and why). JSON only, late acks, prefetch 1, no result backend, and
time limits below the broker's visibility timeout. ``celery -A tasks.app worker`` finds
:data:`app`, built lazily from the environment; ``relayr worker`` calls :func:`create_celery`
with settings it has already read.
"""

from typing import Any, Final

from celery import Celery, Task

from relayr import broker
from relayr.observe.health import heartbeat_path, heartbeat_step
from relayr.settings import Settings
from tasks.runs import task_names
from tasks.worker import process

PROC_ALIVE_TIMEOUT_S: Final = 30.0
"""How long a new pool process may take to report ready. Its runtime starts in the background,
so this only covers imports and the fork itself; Celery's default (4 s) is tight on a busy host."""

PUBLISH_RETRY_POLICY: Final = {
    "max_retries": 3,
    "interval_start": 0.05,
    "interval_step": 0.25,
    "interval_max": 0.5,
}
"""How a publish that meets a broker connection error is retried (Celery's own mechanism): three
times within about a second, as storage steps are (relayr.runtime.transient), so a broker that
blinks costs nothing and one that is down fails the publish fast; the dispatcher's next pass, or the
operator, tries again."""

_current: Celery | None = None


def transport_options(settings: Settings) -> dict[str, Any]:
    """The broker's transport options (:func:`relayr.broker.transport_options`)."""
    return broker.transport_options(settings)


def broker_url(settings: Settings) -> str:
    """The broker's URL for kombu (:func:`relayr.broker.url`)."""
    return broker.url(settings)


def celery_config(settings: Settings) -> dict[str, Any]:
    """Celery's configuration for ``settings`` (see the module docstring for the why)."""
    return {
        "broker_url": broker_url(settings),
        # relayr's transports for the embedded broker and Redis (ADR-0013)
        "broker_transport": broker.transport(settings),
        "broker_transport_options": transport_options(settings),
        "broker_connection_retry_on_startup": True,
        "task_serializer": "json",
        "result_serializer": "json",
        "event_serializer": "json",
        "accept_content": ["json"],
        "result_accept_content": ["json"],
        "task_ignore_result": True,
        "result_backend": None,
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "task_retry_on_worker_lost": True,
        "task_soft_time_limit": settings.soft_time_limit_s,
        "task_time_limit": settings.time_limit_s,
        "task_default_queue": settings.queue,
        "task_routes": {name: {"queue": settings.queue} for name in task_names()},
        "task_annotations": {
            name: {
                # one more than allowed, so the task body sees the delivery past the bound
                # and fails the run itself (tasks.runs)
                "max_retries": settings.max_redeliveries + 1,
                # after the lost attempt's lease lapsed, so the redelivery can claim the run
                "default_retry_delay": int(settings.lease_ttl_s) + 1,
            }
            for name in task_names()
        },
        "task_publish_retry": True,
        "task_publish_retry_policy": PUBLISH_RETRY_POLICY,
        "worker_prefetch_multiplier": 1,
        "worker_send_task_events": True,
        "task_send_sent_event": True,
        "worker_cancel_long_running_tasks_on_connection_loss": True,
        "worker_soft_shutdown_timeout": settings.turn_grace_s,
        "worker_enable_soft_shutdown_on_idle": True,
        "worker_hijack_root_logger": False,
        "worker_proc_alive_timeout": PROC_ALIVE_TIMEOUT_S,
    }


def create_celery(settings: Settings) -> Celery:
    """Build relayr's Celery app for ``settings``; it becomes this process's current app.

    Raises:
        RuntimeError: On a Celery without ``task_retry_on_worker_lost`` (before 5.7), where a
            task that kills its worker would be redelivered forever (ADR-0011).
    """
    global _current
    if not hasattr(Task, "retry_on_worker_lost"):
        raise RuntimeError(
            "relayr needs Celery 5.7 or newer: bounded redelivery uses task_retry_on_worker_lost"
        )
    app = Celery("relayr", set_as_current=True, include=["tasks.runs"])
    app.conf.update(celery_config(settings))
    # liveness for `relayr health --liveness`: the main process beats while its pool is busy
    app.steps["worker"].add(heartbeat_step(heartbeat_path(settings.home, "worker")))
    process.configure(settings)
    if settings.tracing:
        from relayr.observe.otel import instrument_celery  # the SDK: only when tracing is on

        instrument_celery()
    _current = app
    return app


def current() -> Celery:
    """The app this process built, or one built now from the environment's settings."""
    if _current is None:
        return create_celery(Settings.from_env())
    return _current


def __getattr__(name: str) -> Celery:
    # `celery -A tasks.app` looks for `app`, then `celery`: built when first asked for, so
    # importing this module reads no environment.
    if name in ("app", "celery"):
        return current()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
