"""Run generated modules for real on CPU across processes, and check every output.

    launch.py     W spawned processes in a gloo group, deadlines, hung/died ranks
    forkwarm.py   what launch's fork server does once for every rank it forks
    simulate.py   float64 simulator of a schedule's op semantics over all W ranks
    synth.py      seeded call inputs (empty shards, padding rows) and external steps
    adversary.py  random delays, slot orders, injected faults (dead or stalled rank)
    worker.py     one rank: drive the generated module, compare every output
    run.py        compile, launch, merge the ranks' reports; format_report
    probe.py      a small push-and-signal Triton kernel that tests HostHeap alone
"""

from dcpc.harness.run import RunConfig, RunReport, format_report, run_schedule

__all__ = ["RunConfig", "RunReport", "format_report", "run_schedule"]
