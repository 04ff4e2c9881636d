"""Compile a schedule, run it across W processes, and gather one report.

The parent compiles (parse -> check -> lower -> emit) and writes the module into a
temporary directory; every child imports it from there (``dcpc.harness.worker``).
"""

from __future__ import annotations

import os
import re
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from dcpc.diagnostics import Diagnostic, DiagnosticError, printable
from dcpc.harness.launch import LaunchResult, RankOutcome, launch
from dcpc.harness.replay import Replay
from dcpc.harness.worker import OutputStats, RankReport
from dcpc.lang.mesh import MeshWorld, worlds_text
from dcpc.run_limits import RunConfigError, check_compiled, check_config, default_calls


@dataclass
class RunConfig:
    schedule: str  # path of the YAML file
    world: int = 2
    backend: str | dict[str, str] = "host"  # or one kind per mesh axis
    calls: int | None = 50  # None: default_calls(the schedule's slots)
    seed: int = 0
    jitter_s: float = 0.002  # longest random delay before/after a step
    jitter_p: float = 0.3  # chance of a delay
    poison: bool = True
    order: str = "sequential"  # or "interleaved" (two slots in flight)
    lse_base: str | None = None  # "2": rewrite every LSE buffer of the schedule to base 2
    wait_timeout_s: float | None = None  # how long a module's wait lasts (None: its default)
    epoch_start: int | None = None
    fault: dict[str, Any] | None = None  # adversary.Fault fields
    programs: int | None = 1  # programs per kernel (None: the module's own tuning)
    timeout_s: float | None = None  # default: grows with calls and world
    grace_s: float = 15.0  # after one rank fails, how long the others get
    hb: bool = False  # run the happens-before checker while compiling
    handshake: bool = True  # False: the modules' torch handshake off (races can show)
    module_patch: tuple[tuple[str, str], ...] = ()  # (old, new) text edits: mutation tests
    sizes: dict[str, int] | None = None  # constructor sizes (maxima) instead of the small ones
    device: str = "cpu"  # or "cuda": the compiled kernels (gpu_plan says how ranks map)
    program_order: str = "natural"  # CPU: the interpreter's order of a launch's programs
    module: str | None = None  # a module `dcpc compile` wrote for the schedule: run, not compiled
    replay: Replay | None = None  # a checker's race to make happen (replay.plan)

    def worker_args(self, schedule_path: str, module_path: str) -> dict[str, Any]:
        return {
            "schedule_path": schedule_path, "module_path": module_path,
            "backend": self.backend, "calls": self.calls, "seed": self.seed,
            "jitter_s": self.jitter_s, "jitter_p": self.jitter_p, "poison": self.poison,
            "order": self.order, "timeout_s": self.wait_timeout_s,
            "epoch_start": self.epoch_start, "fault": self.fault, "programs": self.programs,
            **({"mesh": list(self.world.shape)} if isinstance(self.world, MeshWorld) else {}),
            "sizes": self.sizes, "program_order": self.program_order,
            "handshake": self.handshake,
        }


class RunDeviceError(ValueError):
    """``--device cuda`` where it cannot run (no GPU, a backend that runs on the CPU)."""


GPU_ENV = {  # set before CUDA starts in a GPU run's process (dcpc.runtime.local)
    "CUDA_MODULE_LOADING": "EAGER",  # a lazy module load while a peer's kernel spins hangs
    "CUDA_DEVICE_MAX_CONNECTIONS": "32",  # a hardware queue per stream (W ranks x slots)
    "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",  # multicast stays off
    "NVSHMEM_DISABLE_NVLS": "1",
}


def gpu_plan(config: RunConfig) -> str:
    """How a ``--device cuda`` run places its ranks: ``"gpus"`` (one process per GPU, W
    GPUs, the backend given or symm_mem) or ``"local"`` (W threads of one process on one
    GPU, backend local); RunDeviceError when this machine cannot run it."""
    import torch

    if not torch.cuda.is_available():
        raise RunDeviceError(
            "--device cuda: no CUDA GPU is visible to torch here (torch "
            f"{torch.__version__}, torch.cuda.is_available() is False); run on a machine "
            "with a GPU, or drop --device to run the same kernels on CPU")
    kinds = _kinds(config.backend)
    if kinds == {"local"}:
        return "local"
    if kinds & {"host"}:
        raise RunDeviceError(
            "--device cuda: backend host runs the kernels under the CPU interpreter; use "
            "--backend local (ranks as threads on one GPU), symm_mem or torch")
    ranks = int(config.world)
    if torch.cuda.device_count() >= ranks:
        return "gpus"
    if kinds == {"symm_mem"} and config.backend == "symm_mem":
        return "local"  # the default: fewer GPUs than ranks, every rank on GPU 0
    raise RunDeviceError(
        f"--device cuda --backend {show_backend(config.backend)}: {ranks} ranks need "
        f"{ranks} GPUs, this machine has {torch.cuda.device_count()}; --backend local runs "
        "every rank as a thread on one GPU")


@dataclass
class RunReport:
    config: RunConfig
    schedule_name: str
    launch: LaunchResult
    outputs: dict[str, OutputStats] = field(default_factory=dict)  # merged over ranks
    ranks: list[RankReport] = field(default_factory=list)
    compile_s: float = 0.0
    sizes: dict[str, int] = field(default_factory=dict)  # the constructor sizes bound
    gpu_plan: str = ""  # --device cuda: "local" (one GPU) or "gpus" (one per rank)

    @property
    def mismatches(self) -> int:
        return sum(s.mismatches for s in self.outputs.values())

    @property
    def ok(self) -> bool:
        compared = sum(s.compared for s in self.outputs.values())
        return self.launch.ok and self.mismatches == 0 and compared > 0

    @property
    def ms_per_call(self) -> float:
        """Mean over ranks of the time spent in the module's methods per call."""
        if not self.ranks:
            return float("nan")
        return 1000 * sum(r.module_s for r in self.ranks) / len(self.ranks) / self.config.calls

    @property
    def replay_outcome(self) -> str:
        """How the held rank's hold ended ("" without a replay, or when it never held)."""
        return next((r.replay for r in self.ranks if r.replay), "")

    def errors(self) -> list[str]:
        return [f"rank {o.rank} {o.status}: {o.error}" for o in self.launch.outcomes
                if o.status != "ok"]


ELEMENTS_REF = 65_536  # about the elements of kimi_k3_dcp's buffers at the harness's sizes


def default_timeout_s(calls: int, world: int, wait_s: float, steps: int = 4,
                      elements: int = ELEMENTS_REF) -> float:
    """The whole run's bound when none is given: four times what an idle 2-core machine
    needs, 60 s plus 0.15 s per step, call and rank under the interpreter (0.6 s per call
    for kimi_k3_dcp's four steps), scaled by the elements of the schedule's buffers at the
    run's sizes over ``ELEMENTS_REF`` when there are more. A generous bound costs nothing:
    a hang is caught much earlier, by the ranks' progress (``launch``'s ``stall_s``)."""
    per_call = 0.15 * steps * max(1.0, elements / ELEMENTS_REF)
    return 4 * max(60.0 + per_call * calls * world, wait_s + 30)


def run_elements(schedule_path: str, world: int, sizes: dict[str, int]) -> tuple[int, int]:
    """(steps, elements of every buffer at ``sizes`` on one rank) of a schedule."""
    from dcpc.harness.simulate import buffer_shape
    from dcpc.lang.parse import parse_file

    schedule = parse_file(schedule_path, world=world)  # a loop may name W
    env = {**{k: v for k, v in schedule.sizes.items() if isinstance(v, int)}, **sizes,
           "W": int(world)}
    elements = 0
    for name in schedule.buffers:
        n = 1
        for d in buffer_shape(schedule, name, env):
            n *= d
        elements += n
    return len(schedule.step_list()), elements


def variant_text(text: str, lse_base: str | None) -> str:
    """The schedule text with every ``lse_base`` set to ``lse_base`` (a base-2 variant)."""
    if lse_base is None:
        return text
    return re.sub(r"lse_base:\s*['\"]?(e|2)['\"]?", f"lse_base: {lse_base}", text)


def compile_to(schedule_path: str, out_dir: Path, world: int, *, lse_base: str | None = None,
               hb: bool = False, patch: tuple[tuple[str, str], ...] = ()
               ) -> tuple[str, str, str, float]:
    """Compile into ``out_dir``: (schedule file used, module file, schedule name, seconds)."""
    from dcpc.pipeline import Options
    from dcpc.pipeline import run as compile_stages

    source = Path(schedule_path)
    used = source
    if lse_base is not None:
        used = out_dir / source.name
        used.write_text(variant_text(source.read_text(), lse_base))
    c = compile_stages(used, Options(worlds=[world], hb=hb), until="emit")
    assert c.schedule is not None and c.module_text is not None
    text = c.module_text
    if patch:  # one self-contained module: a patch may edit the device library's code too
        from dcpc.codegen.emit import inline_device

        text = inline_device(text)
    for old, new in patch:
        if old not in text:
            raise ValueError(f"module patch: {old!r} is not in the generated module")
        text = text.replace(old, new)
    module = out_dir / f"{c.schedule.schedule}.py"
    module.write_text(text)
    try:  # the ranks import it: a module that does not compile is reported here, once
        compile(text, str(module), "exec")
    except SyntaxError as exc:
        raise DiagnosticError([Diagnostic(
            c.schedule.mark("schedule"), "internal",
            f"the module generated for '{c.schedule.schedule}' is not valid Python "
            f"(line {exc.lineno}: {exc.msg}); this is a dcpc bug",
            hint="report it with the schedule; rename the schedule meanwhile")]) from None
    return str(used), str(module), c.schedule.schedule, sum(c.seconds.values())


def given_module(config: RunConfig) -> tuple[str, str, str, float]:
    """``compile_to``'s answer for ``config.module``, a module ``dcpc compile`` wrote (one
    may serve several W): RunConfigError when it is not this schedule file's (its source
    hash) or serves no group of ``config.world``."""
    from dcpc.files import read_capped
    from dcpc.harness.worker import load_module_class
    from dcpc.lang.parse import MAX_FILE_BYTES, parse_file, sha256
    from dcpc.run_limits import RunConfigError

    path = config.module
    if config.lse_base is not None or config.module_patch:
        raise RunConfigError(f"--module {printable(str(path))}: runs the module as compiled; "
                             "--lse-base (a variant of the schedule) needs a compile")
    schedule = parse_file(config.schedule, world=config.world)  # its errors: the file's
    try:
        cls = load_module_class(str(path), schedule.schedule)
    except (ImportError, OSError, SyntaxError) as exc:
        raise RunConfigError(f"--module {printable(str(path))}: {exc}") from None
    digest = sha256(read_capped(Path(config.schedule), MAX_FILE_BYTES).decode("utf-8"))
    if getattr(cls, "SOURCE_SHA256", None) != digest:
        raise RunConfigError(
            f"--module {printable(str(path))} was compiled from another text of schedule "
            f"'{schedule.schedule}' (source sha256 {getattr(cls, 'SOURCE_SHA256', '?')[:12]}, "
            f"{printable(config.schedule)}'s {digest[:12]}); compile it again")
    try:
        variant = cls.for_world(config.world)
    except ValueError as exc:
        raise RunConfigError(f"--module {printable(str(path))}: {exc}") from None
    proved = tuple(getattr(variant, "WORLDS", ()))
    want = tuple(config.world.shape) if isinstance(config.world, MeshWorld) else \
        int(config.world)
    if want not in proved:  # a run outside the proof (and its checks: a root past W)
        shown = worlds_text([MeshWorld(w) if isinstance(w, tuple) else w for w in proved])
        raise RunConfigError(
            f"--module {printable(str(path))} was proved and compiled for W {shown}, not "
            f"--world {config.world}; compile it with --world {config.world} (or a range "
            "that holds it)")
    return str(config.schedule), str(path), schedule.schedule, 0.0


class RunSizesError(ValueError):
    """``--sizes`` the generated constructor refuses (its message names size and range)."""


def bound_sizes(config: RunConfig, schedule_path: str, module_path: str,
                name: str) -> dict[str, int]:
    """The constructor sizes every rank uses: ``config.sizes`` over the harness's small
    defaults, validated by the generated class's own rules (``check_sizes``, then its
    ``_bind_sizes`` for constants, multiples and maxima) before any rank starts."""
    from dcpc.harness import synth
    from dcpc.harness.worker import load_module_class
    from dcpc.lang.parse import parse_file
    from dcpc.runtime import DcpcArgumentError
    from dcpc.runtime.validate import check_sizes

    cls = load_module_class(module_path, name).for_world(config.world)
    try:
        given = check_sizes(cls.__name__, config.sizes, cls.SIZES)
        schedule = parse_file(schedule_path, world=config.world)  # a loop may name W
        sizes = synth.constructor_sizes(schedule, config.world, given)
        probe = cls.__new__(cls)  # the constructor's size rules, without its allocation
        probe.world = config.world
        probe._bind_sizes({**given, **sizes})
    except DcpcArgumentError as exc:
        raise RunSizesError(str(exc)) from None
    return sizes


def sizes_line(sizes: dict[str, int], world: int) -> str:
    """What a run binds, printed at its start: W, then each size (maxima: per call, call 0
    runs at the maxima, call 1 at 1, the others at random values in between)."""
    bound = ", ".join(f"{k}={v}" for k, v in sizes.items())
    return (f"sizes      W={world}" + (f", {bound}" if bound else "")
            + " (a size with a max: call 0 at it, call 1 at 1, later calls random)")


def run_calls(config: RunConfig, schedule_path: str) -> int:
    """The calls a run makes: ``config.calls``, or ``default_calls`` of the schedule's
    slots; a replay needs its later call (RunConfigError when ``config.calls`` is less)."""
    from dcpc.lang.parse import parse_file

    calls = config.calls
    if calls is None:
        calls = default_calls(parse_file(schedule_path, world=config.world).slots)
        if config.replay is not None:
            calls = max(calls, config.replay.calls)
    elif config.replay is not None and calls < config.replay.calls:
        raise RunConfigError(f"--calls {calls}: the replayed race is in call "
                             f"{config.replay.calls - 1}; give at least {config.replay.calls} "
                             "calls, or leave --calls out")
    return calls


def run_schedule(config: RunConfig, announce: Any = None) -> RunReport:
    """Compile and run ``config``; ``announce(line)``, when given, hears the bound sizes
    before any rank starts."""
    from dcpc.lang.parse import parse_file

    check_config(config)  # calls, delays, timeouts: refused before anything runs
    if config.replay is not None and config.device != "cpu":
        raise RunConfigError("--replay runs on CPU (--device cpu) only, for now")
    plan = gpu_plan(config) if config.device != "cpu" else ""  # refused before any work
    if _kinds(config.backend) & {"host"}:
        from dcpc.runtime.host import remove_orphan_segments

        remove_orphan_segments()  # segments of ranks killed in earlier runs
    with tempfile.TemporaryDirectory(prefix="dcpc-run-") as tmp:
        if config.module is not None:
            used, module, name, compile_s = given_module(config)
        else:
            used, module, name, compile_s = compile_to(
                config.schedule, Path(tmp), config.world, lse_base=config.lse_base,
                hb=config.hb, patch=config.module_patch)
        check_compiled(config, used, module, name)  # what every rank would refuse
        config = replace(config, calls=run_calls(config, used))
        if config.replay is not None and config.replay.in_flight(
                parse_file(used, world=config.world)):  # two calls at once: interleave them
            config = replace(config, order="interleaved")
        sizes = bound_sizes(config, used, module, name)
        if announce is not None:
            announce(sizes_line(sizes, config.world))
        from dcpc.runtime.module import DEFAULT_TIMEOUT_S

        # a survivor of a dead rank must outlive its own wait, to say what it waited for
        wait = config.wait_timeout_s or DEFAULT_TIMEOUT_S
        args = config.worker_args(used, module)
        if config.replay is not None:  # held at most half a wait: no peer times out on it
            args["replay"] = config.replay.worker_args(str(Path(tmp) / "replay-released"),
                                                       wait / 2)
        timeout = config.timeout_s or default_timeout_s(
            config.calls, config.world, wait, *run_elements(used, config.world, sizes))
        grace = max(config.grace_s, wait + 10)
        # a hang is no progress (no step started or finished on any rank) for longer than
        # a module's own wait lasts; a slow machine only makes the run longer
        stall = wait + 30
        if plan == "gpus":  # one process per GPU
            env = {**os.environ, **GPU_ENV}
            result = launch("dcpc.harness.worker:run_gpus", int(config.world),
                            args, timeout_s=timeout,
                            grace_s=grace, stall_s=stall, env=env, interpret=False)
        elif plan == "local" or _kinds(config.backend) == {"local"}:  # W threads, 1 process
            args = {**args, "ranks": int(config.world), "group_timeout_s": timeout,
                    "group_stall_s": stall}  # the group tells its threads' hang from slow
            if plan:
                args.update(backend="local", device="cuda")
            result = _per_rank(launch("dcpc.harness.worker:run_local", 1, args,
                                      timeout_s=timeout + 30, grace_s=grace,
                                      env={**os.environ, **GPU_ENV} if plan else None,
                                      interpret=not plan), int(config.world))
        else:
            # one process per rank: each call's float64 simulation made once, shared
            args = {**args, "sims_dir": tmp, "sims_users": int(config.world)}
            result = launch("dcpc.harness.worker:run_rank", int(config.world),
                            args, timeout_s=timeout, grace_s=grace,
                            stall_s=stall)
    report = RunReport(config, name, result, compile_s=compile_s, sizes=sizes, gpu_plan=plan)
    for outcome in result.outcomes:
        if outcome.status != "ok":
            continue
        rank_report: RankReport = outcome.value
        report.ranks.append(rank_report)
        for out, stats in rank_report.outputs.items():
            merged = report.outputs.setdefault(out, OutputStats())
            merged.compared += stats.compared
            merged.kept += stats.kept
            merged.mismatches += stats.mismatches
            merged.max_abs_err = max(merged.max_abs_err, stats.max_abs_err)
            merged.first_mismatch = merged.first_mismatch or stats.first_mismatch
    return report


def _kinds(backend: str | dict[str, str]) -> set[str]:
    """The backend kinds of ``--backend``: one, or one per mesh axis."""
    return {backend} if isinstance(backend, str) else set(backend.values())


def show_backend(backend: str | dict[str, str]) -> str:
    return backend if isinstance(backend, str) else ",".join(
        f"{a}={k}" for a, k in backend.items())


def _per_rank(result: LaunchResult, world: int) -> LaunchResult:
    """The one process of a ``local`` run as W rank outcomes (its threads' reports); a
    group that stopped on its ranks' progress (dcpc.runtime.local) as the launcher names
    processes: ``hung`` (nothing new for the stall bound), ``timeout`` (still
    progressing at the deadline), the status its exception carries (``launch_status``,
    dcpc.harness.launch)."""
    (only,) = result.outcomes
    if only.status != "ok":
        return LaunchResult(world, [RankOutcome(r, only.status, None, only.error,
                                                only.traceback)
                                    for r in range(world)], result.wall_s, result.notes)
    return LaunchResult(world, [RankOutcome(r, "ok", value, reported_s=only.reported_s)
                                for r, value in enumerate(only.value)], result.wall_s,
                        result.notes)


def _count(n: int, what: str) -> str:
    return f"{n} {what}" if n == 1 else f"{n} {what}s"


def format_report(report: RunReport) -> str:
    c = report.config
    on_gpu = c.device != "cpu"
    where = "on the GPU" if on_gpu else "on CPU"
    placed = (f"{c.world} threads of one process" if c.backend == "local" or report.gpu_plan
              == "local" else f"{c.world} processes")
    if on_gpu:
        placed += ", one GPU" if report.gpu_plan == "local" else ", one GPU each"
    backend = "local" if report.gpu_plan == "local" else show_backend(c.backend)
    lines = [
        f"schedule   {report.schedule_name} ({printable(c.schedule)})"
        + (f", LSE base {c.lse_base}" if c.lse_base else ""),
        f"world      W={c.world} ({placed}), backend {backend}, "
        f"{_count(c.calls, 'call')}, "
        f"slot order {c.order}, seed {c.seed}",
        sizes_line(report.sizes, c.world),
        f"adversary  poisoned memory: {'yes' if c.poison else 'no'}, delays up to "
        f"{1000 * c.jitter_s:.1f} ms (p={c.jitter_p})"
        + ("" if c.handshake else ", torch handshake off"),
    ]
    if c.replay is not None:
        (hr, hc, hs), (rr, rc, rs) = c.replay.hold, c.replay.release
        lines += [f"replay     {c.replay.text}",
                  f"           {hs} on rank {hr} (call {hc}) held "
                  f"{'after its return' if c.replay.at == 'after' else 'before it'} until "
                  f"{rs} on rank {rr} "
                  f"(call {rc}) ran: {report.replay_outcome or 'never reached'}"]
        if c.replay.unforced:
            lines.append(f"           NOT FORCED at the race's own read: {c.replay.unforced}")
    lines.append("output        compared  mismatches  max abs err vs float64")
    for name, s in report.outputs.items():
        lines.append(f"  {name:<12}{s.compared:>8}  {s.mismatches:>10}  {s.max_abs_err:.3g}")
        if s.first_mismatch:
            lines.append(f"    first: {s.first_mismatch}")
        if s.kept:
            lines.append(f"    and {s.kept} returned where nothing in the call wrote it (a "
                         "shift without wrap, on a rank with no source; a step whose when: "
                         "fails on that rank): not compared")
    cpu = sum(r.cpu_s for r in report.ranks)  # local: every thread reads the process's
    if c.backend == "local" and report.ranks:
        cpu = max(r.cpu_s for r in report.ranks)
    lines.append(f"time       {report.ms_per_call:.1f} ms per call in the module "
                 f"({backend} backend {where}), {report.launch.wall_s:.1f} s "
                 f"wall, {cpu:.1f} s CPU over all ranks, compile {report.compile_s:.2f} s")
    lines += [f"error      {e}" for e in report.errors()]
    unforced = c.replay is not None and (not report.replay_outcome.startswith("released")
                                         or bool(c.replay.unforced) and report.ok)
    lines.append(f"result     {'OK: every output matches' if report.ok else 'FAILED'}"
                 f" ({report.mismatches} mismatches)" + (
                     "; the replay's order was not forced, so this run does not show its race"
                     if unforced else ""))
    return "\n".join(lines)


def report_record(report: RunReport) -> dict[str, Any]:
    """One run as plain data (``dcpc run --json``, the GPU conformance suite)."""
    c = report.config
    return {
        "schedule": report.schedule_name, "file": str(c.schedule), "world": str(c.world),
        "device": c.device, "placement": report.gpu_plan or (
            "threads" if c.backend == "local" else "processes"),
        "backend": "local" if report.gpu_plan == "local" else show_backend(c.backend),
        "calls": c.calls, "seed": c.seed, "order": c.order, "programs": c.programs,
        "handshake": c.handshake,
        **({"replay": {"race": c.replay.text, "hold": list(c.replay.hold), "at": c.replay.at,
                       "until": list(c.replay.release), "outcome": report.replay_outcome,
                       **({"unforced": c.replay.unforced} if c.replay.unforced else {})}}
           if c.replay is not None else {}),
        "sizes": report.sizes, "ok": report.ok, "mismatches": report.mismatches,
        "status": "ok" if report.ok else ("mismatch" if report.launch.ok else
                                          ",".join(sorted({o.status for o in
                                                           report.launch.outcomes
                                                           if o.status != "ok"}))),
        "outputs": {name: {"compared": s.compared, "mismatches": s.mismatches,
                           "max_abs_err": s.max_abs_err, "first": s.first_mismatch}
                    for name, s in report.outputs.items()},
        "errors": report.errors()[:8], "wall_s": round(report.launch.wall_s, 2),
    }
