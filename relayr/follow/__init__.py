"""The inbound half of the bridge: artifactr's events become reflexr events, once each.

- :mod:`relayr.follow.events`: the bridged event types (``artifactr:message_posted``, ...), for
  an application's rules to match;
- :mod:`relayr.follow.projections`: how an artifactr envelope becomes one of them;
- :mod:`relayr.follow.config`: what an application says (``Application.inbound``);
- :mod:`relayr.follow.store`: cursors, leases and dead letters;
- :mod:`relayr.follow.chains`: which run's chain each bridged envelope continues;
- :mod:`relayr.follow.batches`: a batch of envelopes made into reflexr entries, published in
  one transaction;
- :mod:`relayr.follow.reports`: what following reports (counts, status, replays, dead
  letters' reasons);
- :mod:`relayr.follow.follower`: the followers themselves, which the dispatcher runs at the
  start of every pass and ``relayr follow`` runs alone (ADR-0065).

Importing this package imports nothing: an application imports the module it needs
(the events module loads reflexr only).
"""
