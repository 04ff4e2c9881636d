"""A dumped plan is loaded and emitted: ``dcpc compile FILE --dump lower`` writes the
plan as lossless JSON, ``dcpc compile FILE --plan PLAN`` emits it without lowering
again, byte for byte the module a plain compile writes, and only after the proof:
the file's hash, the checks at the plan's worlds, the plan's facts of the schedule
and the happens-before checker on the loaded plan."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from dcpc.cli import main
from dcpc.codegen.plan import MAX_PLAN_BYTES, PLAN_VERSION

ROOT = Path(__file__).resolve().parents[2]
KIMI = ROOT / "schedules" / "kimi_k3_dcp.yaml"

# (file, its --world arguments): the file's own default worlds, a mesh at 2x2, a loop
# whose trip count names W at one W, an fp8 payload, an int payload, steps with
# ``when:`` and slot chunks (views of the module's memory) in the contract, a persistent
# buffer in the contract, a grouped ragged step's slot arithmetic, a perm's peer set, a
# 0-d view of a 1-d slot
ROUND_TRIPS = [
    ("kimi_k3_dcp.yaml", []),
    ("gallery/helix.yaml", ["--world", "2x2"]),
    ("gallery/ring_attention.yaml", ["--world", "3"]),
    ("ops/lse_combine_fp8.yaml", ["--world", "2..8"]),
    ("ops/ragged_all_to_all_int.yaml", ["--world", "2"]),
    ("ops/all_gather_int.yaml", ["--world", "3"]),
    ("gallery/zigzag_ring_attention.yaml", ["--world", "3"]),
    ("gallery/pipeline_clock_cycles.yaml", ["--world", "3"]),
    ("gallery/moe_dispatch_combine.yaml", ["--world", "2"]),
    ("ops/shift_perm.yaml", ["--world", "3"]),
    # a 1-d slot's chunk: a 0-d view (BUFFERS shape (), its contract line)
    ("../tests/lang/slot_chunk_axis0_counts.yaml", ["--world", "3"]),
]


def invoke(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def dump(schedule: Path, tmp_path: Path, *worlds: str) -> dict:
    result = invoke("compile", str(schedule), "-o", str(tmp_path / "unused"),
                    "--dump", "lower", *worlds)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def from_plan(schedule: Path, plan: dict | str, tmp_path: Path):
    """``dcpc compile schedule --plan`` of ``plan`` (a dict is written as JSON)."""
    path = tmp_path / "plan.json"
    path.write_text(plan if isinstance(plan, str) else json.dumps(plan))
    return invoke("compile", str(schedule), "-o", str(tmp_path / "from_plan"),
                  "--plan", str(path))


def refused(result, code: str) -> str:
    assert result.exit_code == 1, result.output
    assert f"[{code}]" in result.output, result.output
    assert "Traceback" not in result.output
    return result.output


def steps(plan: dict) -> list[dict]:
    return [s["StepPlan"] for s in plan["plan"]["Plan"]["steps"]]


@pytest.mark.parametrize("name, worlds", ROUND_TRIPS, ids=[n for n, _ in ROUND_TRIPS])
def test_dumped_plan_emits_the_same_module(name: str, worlds: list[str], tmp_path: Path):
    schedule = ROOT / "schedules" / name
    plain = invoke("compile", str(schedule), "-o", str(tmp_path / "plain"), *worlds)
    assert plain.exit_code == 0, plain.output
    plan = dump(schedule, tmp_path, *worlds)
    assert plan["format"] == "dcpc-plan" and plan["version"] == PLAN_VERSION
    loaded = from_plan(schedule, plan, tmp_path)
    assert loaded.exit_code == 0, loaded.output
    (module,) = (tmp_path / "plain").glob("*.py")
    again = tmp_path / "from_plan" / module.name
    assert again.read_bytes() == module.read_bytes()


@pytest.fixture(scope="module")
def kimi_plan(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return dump(KIMI, tmp_path_factory.mktemp("kimi"))


@pytest.mark.parametrize("index, field, value", [
    (0, "signal", None),  # the gather's peers would wait forever
    (2, "wait", None),  # the exchange would stop waiting
    (0, "signal", "next"),  # a peers spec the lowering did not make
    (0, "polls", 2),
    (0, "axes", {"tuple": [0]}),
])
def test_a_sync_edit_is_refused(kimi_plan: dict, tmp_path: Path, index: int, field: str,
                                value) -> None:
    """A step's Sync is the lowering's: the kernels signal and wait as the op and its
    attrs say, not as the plan's Sync does, so an edited Sync would be proved by the hb
    stage while the module ran the lowering's (a race the checker found, emitted)."""
    plan = copy.deepcopy(kimi_plan)
    steps(plan)[index]["sync"]["Sync"][field] = value
    out = refused(from_plan(KIMI, plan, tmp_path), "plan-mismatch")
    assert f"plan.Plan.steps[{index}].StepPlan.sync.Sync.{field} is not what" in out
    assert not (tmp_path / "from_plan").exists()


def test_the_missing_barrier_of_a_wrong_twin_cannot_be_added_through_sync(
        tmp_path: Path) -> None:
    """The review's reproducer: custom_all_reduce's twin without its end barrier is a
    race; a plan that adds the barrier to the reduce's Sync alone (no kernel would wait)
    is refused before the hb stage could prove it."""
    twin = ROOT / "tests" / "gallery_twins" / "custom_all_reduce.no_end_barrier.yaml"
    plain = invoke("compile", str(twin), "-o", str(tmp_path / "plain"), "--world", "3")
    refused(plain, "race")
    result = invoke("compile", str(twin), "-o", str(tmp_path / "unused"), "--world", "3",
                    "--dump", "lower")
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    (reduce,) = [s for s in steps(plan) if s["op"] == "sum"]
    reduce["sync"]["Sync"].update(signal="all", wait="all", polls=reduce["index"])
    out = refused(from_plan(twin, plan, tmp_path), "plan-mismatch")
    assert ".sync.Sync.signal is not what" in out
    assert not (tmp_path / "from_plan").exists()


@pytest.mark.parametrize("edit, what", [
    (lambda p: p["plan"]["Plan"]["buffers"][0]["BufferPlan"]["shape"].__setitem__(
        0, {"tuple": ["num", 7]}), "buffers"),
    (lambda p: p["plan"]["Plan"].update(slots=1), "slots"),
    (lambda p: steps(p)[2]["effects"].pop(), "effects"),  # an access the proof would miss
    (lambda p: steps(p)[1].update(writes=["o_part"]), "contract"),
    (lambda p: p["plan"]["Plan"].update(version="0.0.1"), "version"),
])
def test_a_plan_unlike_its_schedule_is_refused(kimi_plan: dict, tmp_path: Path, edit, what):
    plan = copy.deepcopy(kimi_plan)
    edit(plan)
    out = refused(from_plan(KIMI, plan, tmp_path), "plan-mismatch")
    assert f"the plan's {what} is not what" in out


def test_a_schedule_edited_after_the_dump_is_refused(kimi_plan: dict, tmp_path: Path):
    edited = tmp_path / KIMI.name
    edited.write_text(KIMI.read_text() + "\n# edited after the dump\n")
    out = refused(from_plan(edited, kimi_plan, tmp_path), "plan-stale")
    assert "changed since the plan was dumped" in out


V = str(PLAN_VERSION)  # the version this dcpc reads, so that each text fails where it says


@pytest.fixture(scope="module")
def zigzag_plan(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return dump(ROOT / "schedules" / "gallery" / "zigzag_ring_attention.yaml",
                tmp_path_factory.mktemp("zigzag"), "--world", "3")


def _when_of(plan: dict, name: str) -> dict:
    (step,) = [s for s in steps(plan) if s["name"] == name]
    return step["attrs"]["dict"][0][1]


def _view(plan: dict, name: str) -> dict:
    (buffer,) = [b["BufferPlan"] for b in plan["plan"]["Plan"]["buffers"]
                 if b["BufferPlan"]["name"] == name]
    return buffer


@pytest.mark.parametrize("edit, what", [
    # the branch of the later ranks run where the earlier ones' does (h + 1 <= rank)
    (lambda p: _when_of(p, "attend_upper_h0")["tuple"].__setitem__(0, "<="), "when"),
    # the same with the contract's text made to agree: the when fact still differs
    (lambda p: (_when_of(p, "attend_upper_h0")["tuple"].__setitem__(0, "<="),
                p["plan"]["Plan"].__setitem__("contract", [
                    line.replace("only where 1 > rank", "only where 1 <= rank")
                    for line in p["plan"]["Plan"]["contract"]])), "when"),
    # the engine's view of chunk 0 of recv_k's slot 0 taken along axis 0
    (lambda p: _view(p, "recv_k_0_0").update(view_axis=0), "buffers"),
    (lambda p: _view(p, "recv_k_0_0").update(view_index=1), "buffers"),
])
def test_a_plan_with_another_branch_or_view_is_refused(zigzag_plan: dict, tmp_path: Path,
                                                        edit, what):
    plan = copy.deepcopy(zigzag_plan)
    edit(plan)
    out = refused(from_plan(ROOT / "schedules" / "gallery" / "zigzag_ring_attention.yaml",
                            plan, tmp_path), "plan-mismatch")
    assert f"the plan's {what} is not what" in out


@pytest.mark.parametrize("text, where", [
    ("{", "not JSON"),
    ("[]", "expected an object"),
    ('{"format": "dcpc-plan", "version": 99, "plan": null}', "at version: unknown version 99"),
    ('{"format": "other", "version": ' + V + ', "plan": null}', "at format:"),
    ('{"format": "dcpc-plan", "version": ' + V + ', "plan": NaN}', "NaN is no JSON number"),
    ('{"format": "dcpc-plan", "version": ' + V + ', "plan": {"Plan": []}}',
     "at plan: unknown kind"),
    ('{"format": "dcpc-plan", "version": ' + V + ', "plan": ' + "[" * 100_000 + "]" * 100_000 + "}",
     "not JSON"),
])
def test_a_file_that_is_no_plan_is_refused(text: str, where: str, tmp_path: Path):
    out = refused(from_plan(KIMI, text, tmp_path), "bad-plan")
    assert where in out


@pytest.mark.parametrize("edit, where", [
    (lambda p: steps(p)[0].update(bogus=1),
     "at plan.Plan.steps[0].StepPlan: unknown field 'bogus'"),
    (lambda p: p["plan"]["Plan"].pop("slots"), "at plan.Plan: missing field 'slots'"),
    (lambda p: p["plan"]["Plan"].update(slots="2"), "at plan.Plan.slots: not a value"),
    (lambda p: steps(p)[0]["sync"].update(Bogus={}), "at plan.Plan.steps[0].StepPlan.sync"),
    (lambda p: steps(p)[0].update(template="../../etc/passwd"), "not a template of an op"),
    # a name that would be code in the module
    (lambda p: steps(p)[0]["params"].__setitem__(0, 'q"); import os; ("'),
     "at plan.Plan.steps[0].StepPlan.params: the string"),
    (lambda p: p["plan"]["Plan"].update(slots=10**40), "at plan.Plan.slots: an integer of"),
    (lambda p: p["plan"]["Plan"].update(worlds=[]), "names no worlds (at plan.Plan.worlds)"),
    (lambda p: p["plan"]["Plan"].update(worlds=[1]), "group size 1: group sizes must lie in"),
    (lambda p: p["plan"]["Plan"].update(worlds=[10**6]), "group size 1000000: group sizes"),
    (lambda p: p["plan"]["Plan"].update(worlds=[{"MeshWorld": [1, 1]}]), "mesh shape"),
])
def test_a_malformed_plan_is_refused_where_it_breaks(kimi_plan: dict, tmp_path: Path,
                                                     edit, where):
    plan = copy.deepcopy(kimi_plan)
    edit(plan)
    assert where in refused(from_plan(KIMI, plan, tmp_path), "bad-plan")


def test_a_huge_plan_file_is_refused_unread(tmp_path: Path):
    path = tmp_path / "huge.json"
    with path.open("wb") as f:  # sparse: no disk, no memory
        f.truncate(MAX_PLAN_BYTES + 1)
    result = invoke("compile", str(KIMI), "-o", str(tmp_path / "out"), "--plan", str(path))
    assert f"larger than {MAX_PLAN_BYTES} bytes" in refused(result, "too-large")


def test_plan_takes_one_schedule_and_no_world(kimi_plan: dict, tmp_path: Path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(kimi_plan))
    for extra in ([str(KIMI)], ["--world", "2"], ["--dump", "hb"]):
        result = invoke("compile", str(KIMI), *extra, "-o", str(tmp_path), "--plan", str(path))
        assert result.exit_code == 2 and "--plan takes" in result.output


# --- nothing from the plan file is put into code (review of session 30) ---------------
#
# The reviewer's payload: made of names, subscripts, a comprehension and arithmetic only
# (every character in the plan's string set), it runs torch.os.system when the module's
# kernel call evaluates it. Its string here is never executed: the tests only check that
# --plan refuses it and writes no module.
PAYLOAD = ("[[0]for[self.__class__.__class_getitem__]in[[torch.os.system]]][0][0]"
           "+self.__class__[torch.os.__doc__[0]+torch.os.__doc__[1]]*0+1")
PEER = ROOT / "schedules" / "ops" / "ragged_all_to_all_peer.yaml"
GROUPS = ROOT / "schedules" / "ops" / "ragged_all_to_all_groups.yaml"
ALL_REDUCE = ROOT / "schedules" / "ops" / "all_reduce.yaml"


def _attrs(step: dict) -> list:
    return step["attrs"]["dict"]


def _set_attr(plan: dict, index: int, key: str, value) -> None:
    (pair,) = [p for p in _attrs(steps(plan)[index]) if p[0] == key]
    pair[1] = value


@pytest.mark.parametrize("schedule, index, key, payload", [
    (PEER, 4, "peer_k", PAYLOAD),  # put_h0's peer offset (an int spliced as code)
    (GROUPS, 0, "src_slot", "peer * groups + g + " + PAYLOAD),  # slot arithmetic (text)
    (GROUPS, 0, "src_slot", "g * WORLD + peer"),  # another slot, made of the file's names
], ids=["peer_k", "src_slot", "src_slot_other_names"])
def test_a_plan_string_unlike_the_lowering_is_refused_unwritten(
        schedule: Path, index: int, key: str, payload: str, tmp_path: Path):
    plan = dump(schedule, tmp_path, "--world", "3")
    _set_attr(plan, index, key, payload)
    out = refused(from_plan(schedule, plan, tmp_path), "plan-mismatch")
    assert f"plan.Plan.steps[{index}].StepPlan.attrs['{key}'] is not what" in out
    assert not (tmp_path / "from_plan").exists()


@pytest.fixture(scope="module")
def peer_plan(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return dump(PEER, tmp_path_factory.mktemp("peer"), "--world", "3")


@pytest.mark.parametrize("edit, where", [
    # B2: a tuple whose head is unhashable (an internal TypeError before), its string
    # read like any other
    (lambda p: _attrs(steps(p)[4]).append(["bogus", {"tuple": [[1], "os.system("]}]),
     "at plan.Plan.steps[4].StepPlan.attrs: the string 'os.system('"),
    # R1: a condition's operator at a tuple's head outside attrs['when']
    (lambda p: _attrs(steps(p)[4]).append(["bogus", {"tuple": ["==", "a(", "b"]}]),
     "the string '=='"),
    (lambda p: _attrs(steps(p)[4]).append(["when", {"tuple": ["==", ["sym", "rank"], 1]}]),
     "at plan.Plan.steps[4].StepPlan.attrs['when']: not a condition's AST"),
    (lambda p: _attrs(steps(p)[4]).append(["when", {"tuple": [
        "==", {"tuple": ["sym", "os.system"]}, {"tuple": ["num", 1]}]}]),
     "attrs['when']: not a condition's AST"),
])
def test_a_malformed_attr_is_bad_plan(peer_plan: dict, tmp_path: Path, edit, where):
    plan = copy.deepcopy(peer_plan)
    edit(plan)
    assert where in refused(from_plan(PEER, plan, tmp_path), "bad-plan")


def test_an_unhashable_head_is_no_internal_error(peer_plan: dict, tmp_path: Path):
    """B2's plan as the review wrote it: well formed, but not the lowering's attrs."""
    plan = copy.deepcopy(peer_plan)
    _attrs(steps(plan)[4]).append(["bogus", {"tuple": [[1], 2]}])
    out = refused(from_plan(PEER, plan, tmp_path), "plan-mismatch")
    assert "plan.Plan.steps[4].StepPlan.attrs (its keys) is not what" in out


@pytest.mark.parametrize("field, value", [("view_of", "recv"), ("persist", True)])
def test_an_edited_lowering_buffer_is_refused(field: str, value, tmp_path: Path):
    plan = dump(ALL_REDUCE, tmp_path, "--world", "3")
    (added,) = [b["BufferPlan"] for b in plan["plan"]["Plan"]["buffers"]
                if b["BufferPlan"]["name"] == "total_recv"]  # the lowering's, not the file's
    added[field] = value
    out = refused(from_plan(ALL_REDUCE, plan, tmp_path), "plan-mismatch")
    assert "the plan's buffers is not what" in out
    assert f"BufferPlan.{field})" in out


def _tuning(plan: dict, index: int) -> list:
    return steps(plan)[index]["tuning"]["dict"]


def test_a_tuning_edit_in_bounds_is_emitted(kimi_plan: dict, tmp_path: Path):
    plain = invoke("compile", str(KIMI), "-o", str(tmp_path / "plain"))
    assert plain.exit_code == 0, plain.output
    plan = copy.deepcopy(kimi_plan)
    knobs = dict(_tuning(plan, 0))
    assert knobs["num_warps"] == 4 and knobs["block"] == 4096, knobs
    plan_tuning = _tuning(plan, 0)
    for pair in plan_tuning:
        pair[1] = {"programs": 3, "num_warps": 8, "block": 1024}[pair[0]]
    loaded = from_plan(KIMI, plan, tmp_path)
    assert loaded.exit_code == 0, loaded.output
    (module,) = (tmp_path / "plain").glob("*.py")
    before = module.read_text().splitlines()
    after = (tmp_path / "from_plan" / module.name).read_text().splitlines()
    changed = [(a, b) for a, b in zip(before, after, strict=True) if a != b]
    name = steps(plan)[0]["name"]
    assert changed == [(f'        "{name}": {{"programs": 128, "num_warps": 4, "block": 4096}},',
                        f'        "{name}": {{"programs": 3, "num_warps": 8, "block": 1024}},')]


@pytest.mark.parametrize("edit, where", [
    (lambda t: t[1].__setitem__(1, 3), "['num_warps']: 3 is out of bounds"),  # not 2**k
    (lambda t: t[1].__setitem__(1, 64), "['num_warps']: 64 is out of bounds"),
    (lambda t: t[0].__setitem__(1, 0), "['programs']: 0 is out of bounds"),
    (lambda t: t[2].__setitem__(1, 2**17), "['block']: 131072 is out of bounds"),
    (lambda t: t.append(["tiles_per_program", 2]), ": the knobs are the lowering's"),
    (lambda t: t.pop(), ": the knobs are the lowering's"),
])
def test_a_tuning_edit_out_of_bounds_is_refused(kimi_plan: dict, tmp_path: Path, edit, where):
    plan = copy.deepcopy(kimi_plan)
    edit(_tuning(plan, 0))
    out = refused(from_plan(KIMI, plan, tmp_path), "plan-mismatch")
    assert f"plan.Plan.steps[0].StepPlan.tuning{where}" in out
    assert not (tmp_path / "from_plan").exists()


@pytest.mark.parametrize("knob, value", [("num_warps", [2, 2]), ("programs", [1])])
def test_a_tuning_of_a_mesh_world_is_refused(kimi_plan: dict, tmp_path: Path, knob: str,
                                             value: list) -> None:
    """A MeshWorld reads as an int field's value (a world), but no knob takes one: it
    would be emitted as a tuple into the module's TUNING table."""
    plan = copy.deepcopy(kimi_plan)
    for pair in _tuning(plan, 0):
        if pair[0] == knob:
            pair[1] = {"MeshWorld": value}
    out = refused(from_plan(KIMI, plan, tmp_path), "plan-mismatch")
    assert f"plan.Plan.steps[0].StepPlan.tuning['{knob}']" in out
    assert not (tmp_path / "from_plan").exists()


def test_a_tuning_of_no_int_is_bad_plan(kimi_plan: dict, tmp_path: Path):
    plan = copy.deepcopy(kimi_plan)
    _tuning(plan, 0)[0][1] = True  # an int to Python, no knob's value
    out = refused(from_plan(KIMI, plan, tmp_path), "bad-plan")
    assert "at plan.Plan.steps[0].StepPlan.tuning: not a value of the field's kind" in out
