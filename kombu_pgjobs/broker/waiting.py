"""The queues a consumer that LISTENs waits on, as registered in ``pgjobs_waiter``.

A publish wakes one registered consumer per message and deletes its registration
(``0017_wake_one.sql``); a consumer that is not registered is woken by nobody. So a consumer
may sleep on a queue only when its registration is in place and it has proved the queue empty
after every publisher that could have missed the registration committed. Per queue:

absent
    Not registered (at start, after a reconnect, after a wake-up deleted the registration).
    A claim that drains registers the queue and tries its wake lock (the *barrier*).
``unquiet``
    Registered, but a publish to the queue was in flight at the barrier (it may not have seen
    the registration): claim again shortly, trying the barrier again.
``confirming``
    Registered and the barrier was quiet: every publisher that missed the registration has
    committed. One more claim sees their rows; if it drains, the queue is ``armed``.
``armed``
    Registered and proved empty: the consumer sleeps until a wake-up (or another reason to
    claim). A claim that drains leaves it armed and sends nothing extra.

A wake-up on the consumer's own channel means the registration is gone: the queue is absent
again. A wake-up may name a message the publish claimed for this consumer (a *hand-off*,
``0018_hand_off.sql``, ``0021_trust_boundary.sql``; :func:`handed_ids` reads its ids): the
consumer takes it with one fenced statement instead of a claim, delivers it, or hands it back
when it can no longer take it. A notification is never trusted: any role that can connect may
LISTEN and NOTIFY, so a wake-up only ever causes a statement, never a delivery by itself.

A wake-up read while a claim was in flight must not be overwritten by that claim's result,
hence the per-queue wake count a :class:`Ticket` remembers. A wake-up the consumer cannot act
on (its prefetch window is closed, or it stops consuming the queue) is passed on to every
consumer of the queue, never kept: its registration is already gone, so nobody else would be
woken for that message.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from ..store.core import ClaimResult, Handed, WaitPlan

__all__ = ["ARMED", "CONFIRMING", "HAND_OFF", "UNQUIET", "Handed", "Ticket", "Waits",
           "handed_ids"]

UNQUIET = "unquiet"
CONFIRMING = "confirming"
ARMED = "armed"

#: Looking again after an unquiet barrier: first wait, and the most it grows to (a publisher
#: inside a long transaction keeps the barrier unquiet until it commits).
RECHECK_FIRST = 0.002
RECHECK_MAX = 0.5

_random = random.SystemRandom()

#: First character of a hand-off's payload (a plain wake-up's payload is the queue's name).
HAND_OFF = "\x1e"

#: A hand-off's payload (0021_trust_boundary.sql): ids and the queue, never the message.
_HANDED = re.compile(r"\x1e([1-9][0-9]{0,18}) ([0-9]{1,10}):(.+)", re.DOTALL)


def handed_ids(payload: str, waiter: int) -> Handed | None:
    """The ids a hand-off names, or None: a plain wake-up (the payload is a queue), or a
    payload in no format this version sends (an older hand-off that carried the message,
    something made up). Format: ``\\x1e<id> <claim>:<queue>``."""
    m = _HANDED.fullmatch(payload)
    if m is None:
        return None
    claim = int(m.group(2))
    if claim > 2**31 - 1:
        return None
    return Handed(waiter, int(m.group(1)), claim, m.group(3))


@dataclass(frozen=True, slots=True)
class Ticket:
    """A claim's wait plan and the wake counts of its queues when it was made."""

    plan: WaitPlan
    wakes: dict[str, int]


#: seconds a dropped registration's queue is still expected on the wake channel
DROPPED_FOR = 60.0


class Waits:
    """Registration states of one claim connection's queues (see the module docstring)."""

    def __init__(self) -> None:
        self.waiter: int | None = None
        self.state: dict[str, str] = {}
        self._wakes: dict[str, int] = {}
        self._backoff = 0.0
        #: wake-ups to pass on to every consumer of their queues (the schema's channel): for
        #: queues this connection no longer consumes, or will not claim now (:meth:`gated`)
        self.pass_on: set[str] = set()
        #: queues woken on this consumer's channel and not claimed since
        self.unserved: set[str] = set()
        #: queues handed a message and not claimed since: the consumer claims them again
        #: (and so registers again) even below its refill mark, as a woken consumer would
        self.rearm: set[str] = set()
        #: registrations dropped (queues no longer consumed) whose wake-up may still come: a
        #: publish that took one before the drop woke this consumer for it. By queue, the
        #: monotonic time of the drop: kept DROPPED_FOR seconds (a wake-up sent before the
        #: drop committed arrives within moments), so a connection that consumed many
        #: short-lived queues (Celery's reply queues) does not keep them all
        self.dropped: dict[str, float] = {}

    @property
    def channel(self) -> str:
        """The wake channel of the current wake id."""
        return f"pgjobs.w.{self.waiter}"

    def start(self) -> int:
        """A new wake id (a new connection LISTENs): nothing registered under it yet. Ids
        start above 2**32, out of the range of a one-int advisory lock key."""
        self.waiter = _random.randrange(2**32, 2**62)
        self.state.clear()
        self.dropped.clear()
        return self.waiter

    def stop(self) -> set[str]:
        """The connection stopped listening or is gone (its registrations go with it).
        Returns the wake-ups it still had to pass on."""
        self.waiter = None
        self.state.clear()
        passed = self.pass_on | self.unserved
        self.pass_on, self.unserved, self.rearm = set(), set(), set()
        self.dropped.clear()
        return passed

    def expects(self, queue: str, consumed: Collection[str]) -> bool:
        """Whether a wake-up on this consumer's own channel for ``queue`` can be real: it is
        registered on the queue, consumes it, or dropped its registration lately. Anything
        else came from a role that merely sent a NOTIFY: ignored, so that made-up queue names
        cost nothing, not even memory."""
        return queue in self.state or queue in consumed or queue in self.dropped

    def woken(self, queue: str, consumed: Collection[str]) -> None:
        """A wake-up on this consumer's channel: its registration on ``queue`` was deleted."""
        self.state.pop(queue, None)
        self.dropped.pop(queue, None)
        self._wakes[queue] = self._wakes.get(queue, 0) + 1
        if queue not in consumed:
            self.pass_on.add(queue)
        else:
            self.unserved.add(queue)

    def handed(self, queue: str) -> None:
        """A hand-off on this consumer's channel: its registration on ``queue`` was deleted,
        and the message it announced came with it (nothing to pass on)."""
        self.state.pop(queue, None)
        self._wakes[queue] = self._wakes.get(queue, 0) + 1
        self.rearm.add(queue)

    def gated(self, queues: Collection[str]) -> None:
        """The consumer will not claim ``queues`` now (its prefetch window is closed): a
        wake-up it had for them is passed on to the others, which may be idle."""
        held = self.unserved.intersection(queues)
        self.unserved.difference_update(held)
        self.pass_on.update(held)

    def ticket(self, queues: Sequence[str], consumed: Collection[str]) -> Ticket | None:
        """What a claim of ``queues`` registers and tries if it drains (None: polling)."""
        if self.waiter is None:
            return None
        mine = [q for q in queues if q in consumed]
        self.unserved.difference_update(mine)
        self.rearm.difference_update(mine)
        register = [q for q in mine if q not in self.state]
        barrier = [q for q in mine if self.state.get(q, UNQUIET) == UNQUIET]
        return Ticket(WaitPlan(self.waiter, register, barrier),
                      {q: self._wakes.get(q, 0) for q in mine})

    def settle(self, ticket: Ticket | None, result: ClaimResult) -> float | None:
        """Account for a drained claim. Returns 0.0 to claim again at once, a delay to look
        again after, or None when every queue of the claim is armed."""
        if ticket is None or not result.drained or self.waiter != ticket.plan.waiter:
            return None
        again: float | None = None
        for q, count in ticket.wakes.items():
            if self._wakes.get(q, 0) != count:
                continue  # woken meanwhile: absent, and already marked to claim
            if q in ticket.plan.barrier:
                if result.quiet:
                    self.state[q] = CONFIRMING
                    again = 0.0
                else:
                    self.state[q] = UNQUIET
                    self._backoff = min(RECHECK_MAX, max(RECHECK_FIRST, self._backoff * 2))
                    again = self._backoff if again is None else min(again, self._backoff)
            elif self.state.get(q) == CONFIRMING:
                self.state[q] = ARMED
        if result.quiet:
            self._backoff = 0.0
        return again

    def stale(self, consumed: Collection[str]) -> list[str]:
        """Registered queues no longer consumed (their registrations are to be dropped). Also
        forgets what is kept of queues gone from this connection: wake-up counts of queues
        neither consumed nor registered (only consumed queues' counts are read), drops older
        than :data:`DROPPED_FOR`."""
        gone = [q for q in self.state if q not in consumed]
        now = time.monotonic()
        for q in gone:
            del self.state[q]
            self.dropped[q] = now
        for q in [q for q, at in self.dropped.items() if now - at > DROPPED_FOR]:
            del self.dropped[q]
        if len(self._wakes) > len(consumed) + len(self.state):
            for q in [q for q in self._wakes if q not in consumed and q not in self.state
                      and q not in self.dropped]:
                del self._wakes[q]
        return gone
