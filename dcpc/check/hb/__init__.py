"""The happens-before checker: races on symmetric buffers and deadlocks, with proofs.

    check(schedule, worlds) -> HbReport       (.findings, .diagnostics(), .as_json(), .stats)
    hb_dot(schedule, world, finding=None) -> str   (Graphviz DOT of the unrolled graph)

The stages, one module each: ``events`` lowers a schedule to the coarse events of
one call on one rank, exactly as the codegen lowers the ops; ``clocks`` unrolls
calls, matches signals to waits, finds what can run and computes vector clocks
for rank 0 (rotation symmetry gives every other rank's); ``races`` and
``deadlock`` read the findings off the clocks; ``report`` and ``timeline`` turn
them into diagnostics with counterexamples; ``hints`` proves fixes; ``draw``
draws the graph.

Happens-before is program order within a stream (one per slot and rank with
``streams: per_slot``, one per rank with ``single``) plus every signal before the
wait it satisfies, closed transitively.

Why calls 0 .. 2*slots-1 per rank are enough (the unroll bound)
-----------------------------------------------------------------
1. HB never goes back in calls: program order moves forward, and the signal of
   call c only satisfies waits of call c (epochs are per (step, slot) and
   monotonic). So an HB path from call a to call b only visits calls in [a, b],
   and the calls in [a + slots, b + slots] look exactly like those in [a, b]
   (same slots, same stream order): the HB relation is invariant under shifting
   every call by ``slots``. Deadlocks therefore show in the first call of each
   stream, and a race between calls (a, b) shows as one between
   (a mod slots, b - a + a mod slots).
2. Accesses of calls of the same slot are the same, and a later call's copy of
   an access follows an earlier one in program order. Take accesses x (call a)
   and y (call b = a + d, d > slots) to one instance. Let y' be y's copy in call
   b - slots * k with a < b - slots*k <= a + slots. If x and y' are ordered, then
   x -> y' (y' cannot reach back to the earlier call a) and y' -> y, so x -> y.
   Hence every unordered pair has an unordered partner at distance <= slots.
3. A per-slot instance is touched only by calls of its slot (distance 0 or
   slots); a ``shared`` instance by every call, so partners at distance
   1 .. slots cover every other slot. With first calls 0 .. slots-1 and
   distances 0 .. slots, calls 0 .. 2*slots-1 contain every case.
tests/check/test_hb_unroll.py checks this empirically: unrolling more calls finds
nothing new on the corpus and on random schedules.
"""

from dcpc.check.hb.checker import check
from dcpc.check.hb.draw import hb_dot
from dcpc.check.hb.report import Finding, HbReport, Location

__all__ = ["Finding", "HbReport", "Location", "check", "hb_dot"]
