"""The host backend's shared float64 simulations (worker.CallSims ``store``): a call's
reference made by one process and loaded by the others, bit for bit; a holder killed
mid-simulation leaves nothing and the others go on; a simulation that raises is raised
by every process without simulating again; each call's file is gone once every process
read it (a run of many calls keeps only the calls in flight on disk)."""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from dcpc.harness import synth
from dcpc.harness import worker as w
from dcpc.harness.simulate import step_rounding
from dcpc.lang.parse import parse_file

ROOT = Path(__file__).resolve().parents[2]
SCHEDULE = str(ROOT / "tests" / "harness" / "all_reduce_rs_ag.yaml")
PERSIST = str(ROOT / "schedules" / "ops" / "persist.yaml")  # a buffer carried over


def _sims(path: str, store: str | None, users: int = 1, keep: bool = True,
          world: int = 2) -> w.CallSims:
    s = parse_file(path, world=world)
    return w.CallSims(s, world, synth.constructor_sizes(s, world, None), 1,
                      step_rounding(s, "host", "cpu"), keep=keep, store=store,
                      store_users=users)


def _flat(x: object) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        return [t for k in sorted(x) for t in _flat(x[k])]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _flat(v)]
    return []


def _bits_equal(a: object, b: object) -> bool:
    fa, fb = _flat(a), _flat(b)
    return len(fa) == len(fb) and all(
        x.dtype == y.dtype and x.shape == y.shape
        and torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8))
        for x, y in zip(fa, fb, strict=True))


@pytest.mark.parametrize("path", [SCHEDULE, PERSIST])
def test_loaded_reference_equals_a_fresh_simulation_bit_for_bit(tmp_path, path):
    made = _sims(path, str(tmp_path), users=2)   # simulates and saves
    loaded = _sims(path, str(tmp_path), users=2)  # loads
    fresh = _sims(path, None)                     # no store: its own simulation
    for k in range(3):
        got = [cs.get(k) for cs in (made, loaded, fresh)]
        ends = [cs.sims[k][4] for cs in (made, loaded, fresh)]
        assert _flat(got[0][1]) and _flat(got[0][3])  # inputs and trace hold tensors
        for other, end in zip(got[1:], ends[1:], strict=True):
            assert _bits_equal(got[0], other)
            assert _bits_equal(ends[0], end)
        # both processes read the call: its files are gone
        assert os.listdir(tmp_path) == []


def _three(target: Any, tmp_path: Any, *args: Any, barrier: bool = False,
           ) -> tuple[list[int | None], list[Any]]:
    """Fork three processes running ``target(i, folder, *args, [a 3-party barrier,] q)``
    and wait for them: their exit codes and, sorted, what they put on ``q`` (one item each
    that exits cleanly)."""
    ctx = mp.get_context("fork")
    q: mp.Queue = ctx.Queue()
    extra = (ctx.Barrier(3),) if barrier else ()
    ps = [ctx.Process(target=target, args=(i, str(tmp_path), *args, *extra, q))
          for i in range(3)]
    for p in ps:
        p.start()
    for p in ps:
        p.join(240)
    codes = [p.exitcode for p in ps]
    return codes, sorted(q.get(timeout=5) for c in codes if c == 0)


def _reader(i: int, d: str, calls: int, step: Any, q: mp.Queue) -> None:
    cs = _sims(SCHEDULE, d, users=3, keep=False)
    left = []
    for k in range(calls):
        cs.get(k)
        cs.finish(k)
        step.wait()  # the ranks meet (a collective) ...
        # ... and every process read call k: none of its files is on disk any more
        left += [n for n in os.listdir(d) if n.startswith(f"call{k}.")]
        step.wait()
    q.put((i, left))


def test_call_files_are_deleted_once_every_process_read_them(tmp_path):
    """Three processes (meeting after each call, as ranks do) read 8 calls through one
    store: once all three read a call its files are gone, before the run's end."""
    codes, got = _three(_reader, tmp_path, 8, barrier=True)
    assert codes == [0, 0, 0]
    assert got == [(i, []) for i in range(3)]
    assert os.listdir(tmp_path) == []


def _dier(i: int, d: str, q: mp.Queue) -> None:
    orig = w.simulate_call

    def sim(*a, **k):
        if i == 0:  # dies holding the lock, mid-simulation
            open(os.path.join(d, "holding"), "w").close()
            time.sleep(0.5)
            os.kill(os.getpid(), 9)
        return orig(*a, **k)

    w.simulate_call = sim
    if i:  # process 0 takes the lock first: it says so from inside its simulation
        while not os.path.exists(os.path.join(d, "holding")):
            time.sleep(0.01)
    cs = _sims(SCHEDULE, d, users=3)
    got = cs.get(0)
    q.put((i, _bits_equal(got, _sims(SCHEDULE, None).get(0)), sorted(os.listdir(d))))


def test_a_holder_killed_mid_simulation_leaves_no_file_and_the_others_go_on(tmp_path):
    codes, got = _three(_dier, tmp_path)
    assert codes == [-9, 0, 0]
    assert [(i, same) for i, same, _ in got] == [(1, True), (2, True)]
    # no partial file (``call0.pt.<pid>``) at any time a survivor looked, nor after
    for _, _, names in got:
        assert not [n for n in names if n.startswith("call0.pt.") and n != "call0.pt.lock"]
    assert not [n for n in os.listdir(tmp_path) if n.startswith("call0.pt.")
                and n != "call0.pt.lock"]


def _failer(i: int, d: str, q: mp.Queue) -> None:
    def boom(*a, **k):
        with open(os.path.join(d, "simulated"), "a") as f:
            f.write(f"{i}\n")
        time.sleep(0.5)
        raise ValueError("the reference refused call 0's inputs")

    w.simulate_call = boom
    cs = _sims(SCHEDULE, d, users=3)
    try:
        cs.get(0)
    except ValueError as e:
        q.put((i, str(e)))
    else:
        q.put((i, "no error"))


def test_a_simulation_that_raises_is_raised_by_all_without_simulating_again(tmp_path):
    codes, got = _three(_failer, tmp_path)
    assert codes == [0, 0, 0]
    assert got == [(i, "the reference refused call 0's inputs") for i in range(3)]
    assert len((tmp_path / "simulated").read_text().split()) == 1  # simulated once
    assert (tmp_path / "call0.err").exists()


def test_a_waiter_says_how_long_it_waited(tmp_path):
    """A process blocked on another's simulation of the call tells its progress each
    second (the launcher reads a rank that moves as progressing, not hung)."""
    import fcntl

    cs = _sims(SCHEDULE, str(tmp_path), users=2)
    heard: list[str] = []
    lock = open(tmp_path / "call0.pt.lock", "a")
    fcntl.flock(lock, fcntl.LOCK_EX)  # another rank's process holds the call

    def say(msg: str) -> None:
        heard.append(msg)
        if len([h for h in heard if "waiting" in h]) == 2:
            lock.close()  # the holder is done (died: nothing saved, so this one simulates)

    cs.get(0, say)
    waits = [h for h in heard if "waiting" in h]
    # each message new (the launcher counts only new text as progress), one a second (a
    # loaded machine may skip a second: the count, not the wording, may jump)
    said = [re.fullmatch(r"call 0: waiting (\d+) s for another rank's float64 reference", h)
            for h in waits]
    assert len(said) >= 2 and all(said), waits
    seconds = [int(m.group(1)) for m in said]
    assert seconds[0] >= 1 and seconds == sorted(set(seconds)), waits
    assert _bits_equal(cs.get(0), _sims(SCHEDULE, None).get(0))
