"""Elastic training and Horovod's ``join`` on the ring, TF-free (``psclient.horovod.elastic`` builds on it).

- :class:`ElasticRing`: the ring ``psclient.horovod`` runs on: the ring's collectives with a control
  round that lets ranks ``join`` (Horovod's uneven-data support), and, in a psrun elastic job,
  generations that fail fast and are replaced when ranks are lost or added.
- :class:`ElasticSession`: a worker's membership in a ``psrun --min-np/--max-np`` job.
- :class:`State`, :class:`ObjectState`, :func:`run_fn`: Horovod's elastic state objects and run loop.
- The exceptions: :class:`HorovodInternalError` (the ring broke: restore and re-form),
  :class:`HostsUpdatedInterrupt` (ranks wait to join: re-form at this commit), :class:`RendezvousError`.
"""

from psclient.elastic._errors import HorovodInternalError, HostsUpdatedInterrupt, RendezvousError
from psclient.elastic._ring import ElasticRing, allgather_object, broadcast_object
from psclient.elastic._session import ElasticSession
from psclient.elastic._state import ObjectState, State, run_fn
from psclient.elastic.rendezvous import Assignment, RendezvousClient

__all__ = [
    "Assignment",
    "ElasticRing",
    "ElasticSession",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "ObjectState",
    "RendezvousClient",
    "RendezvousError",
    "State",
    "allgather_object",
    "broadcast_object",
    "run_fn",
]
