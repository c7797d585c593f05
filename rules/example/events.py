"""The example's events: ``deploy:finished`` and ``incident:opened``, one namespace each.

reflexr registers an event type when its class is defined; this module imports reflexr only,
so a command that publishes events loads no more than that (ADR-0050).
"""

from typing import Final

from reflexr import Event


class DeployEvent(Event, abstract=True, event_namespace="deploy"):
    """Events about deploys."""


class DeployFinished(DeployEvent, name="finished"):
    """``deploy:finished``: a deploy of a service ended, with its status."""

    service: str
    status: str
    thread_id: str


class IncidentEvent(Event, abstract=True, event_namespace="incident"):
    """Events about incidents."""


class IncidentOpened(IncidentEvent, name="opened"):
    """``incident:opened``: someone opened an incident, discussed in a thread."""

    title: str
    thread_id: str


EVENTS: Final = (DeployFinished, IncidentOpened)
"""What clients may publish into the example's workspaces."""
