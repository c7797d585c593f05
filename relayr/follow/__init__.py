"""The inbound half of the bridge: artifactr's events become reflexr events, once each (ADR-0065).

An application imports :mod:`relayr.follow.events` for the event types its rules match and
:mod:`relayr.follow.config` to declare what it follows; the dispatcher runs
:mod:`relayr.follow.follower` at the start of every pass, ``relayr follow`` alone. Importing this
package imports nothing.
"""
