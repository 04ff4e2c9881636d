"""benchmarks/gpu_pending.py: which GPU conformance cases a committed result settles.
A clean record settles its case while what the GPU run executes is what ran clean (the
key: the module, the runtime, the harness, the reference; benchmarks/gpu_keys.py),
computed at the record's commit from git where the record has none, a part also
matching by a reviewed pair of shas (gpu_equivalent.json); where no key can be had,
while neither the file nor the device code changed since its commit. A failed record,
an unknown commit or a change keeps it pending with its reason, and the commands list
exactly the pending cases. The key's code parts hold every dcpc module a run imports."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks import gpu_keys as gk
from benchmarks import gpu_pending as gp

ROOT = Path(__file__).resolve().parents[2]
COPY, PULL = "schedules/ops/copy.yaml", "schedules/ops/pull.yaml"


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              check=True, timeout=60).stdout.strip()
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"no git history here ({exc})")


def _results(tmp_path: Path, commit: str, records: list[tuple[str, str, bool]],
             key: dict | None = None) -> Path:
    (tmp_path / f"gpu_conformance_{commit[:7]}.json").write_text(json.dumps({
        "commit": commit, "records": [{"ok": ok, "case": {"file": f, "world": w},
                                       **({"key": key} if key else {})}
                                      for f, w, ok in records]}))
    return tmp_path


def _rows(results: Path, root: Path = ROOT) -> dict[tuple[str, str], dict]:
    return {(r["file"], r["world"]): r
            for r in gp.pending(results, root=root, files=[COPY, PULL])}


@pytest.fixture(scope="module")
def head_clone(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """One clone of this checkout at HEAD for the tests of this file (its build/gpu_keys
    cache, the keys at HEAD computed once, shared), and HEAD."""
    head = _git("rev-parse", "HEAD")
    if _git("status", "--porcelain", "--", "dcpc", "templates", COPY):
        pytest.skip("this checkout has uncommitted dcpc code (a clean clone runs it)")
    root = tmp_path_factory.mktemp("clone") / "repo"
    subprocess.run(["git", "clone", "-q", "--shared", "--no-checkout", str(ROOT), str(root)],
                   check=True, timeout=120)
    subprocess.run(["git", "checkout", "-q", head], cwd=root, check=True, timeout=120)
    return root, head


@pytest.fixture
def clone(head_clone: tuple[Path, str]) -> Iterator[tuple[Path, str]]:
    """The shared clone with a working tree at HEAD to edit (its tracked files restored
    after the test; its cache under build/ kept)."""
    yield head_clone
    subprocess.run(["git", "checkout", "-q", "--", "."], cwd=head_clone[0], check=True,
                   timeout=120)


def test_a_clean_record_at_head_settles_its_case_only(clone: tuple[Path, str],
                                                      tmp_path: Path) -> None:
    """In the clone at HEAD, unedited (its keys at HEAD, computed here, stay in the
    clone's cache: the tests below share it, for time only)."""
    root, head = clone
    results = _results(tmp_path, head, [(COPY, "2", True), (PULL, "2", False)])
    (results / gp.KEYS_FILE).write_text("{}\n")
    rows = _rows(results, root)
    assert (results / gp.KEYS_FILE).read_text() == "{}\n"  # a report: the cache is build/
    assert json.loads((root / "build/gpu_keys" / gp.KEYS_FILE).read_text())[head][f"{COPY}@2"]
    assert rows[(COPY, "2")]["settled"] == head and rows[(COPY, "2")]["why"] is None
    assert rows[(COPY, "2")]["rule"] == "key"  # computed at the commit, from git
    assert rows[(COPY, "4")]["why"] == "never ran clean on a GPU"
    assert rows[(PULL, "2")]["why"] == "never ran clean on a GPU"  # a failed run
    lines = gp.commands(list(rows.values()))
    assert not any(COPY in line and "--worlds 2," in line for line in lines)
    assert any(COPY in line and "--worlds 4,8 " in line for line in lines), lines


def test_a_change_since_the_run_or_an_unknown_commit_keeps_it_pending(tmp_path: Path) -> None:
    if _git("rev-parse", "--is-shallow-repository") == "true":
        pytest.skip("a shallow clone: its first commit is not the project's")
    first = _git("rev-list", "--max-parents=0", "HEAD").splitlines()[0]
    rows = _rows(_results(tmp_path, first, [(COPY, "2", True)]))
    assert rows[(COPY, "2")]["settled"] is None
    assert rows[(COPY, "2")]["why"] in (f"ran clean at {first}; the file changed since",
                                        f"ran clean at {first}; device code changed since")
    (tmp_path / "other").mkdir()
    rows = _rows(_results(tmp_path / "other", "0" * 40, [(COPY, "2", True)]))
    assert rows[(COPY, "2")]["why"] == f"ran clean at {'0' * 40}, a commit this clone does not have"


def test_the_shard_plans_run_every_pending_case_once_urgent_first() -> None:
    """plans(): every pending (file, world) in exactly one line of one shard; a file named
    first and a file that never ran open their shards with all their worlds; the others
    run at their smallest pending world before any second world."""
    rows = [{"file": f, "world": w, "settled": None if pend else "abc1234",
             "why": why if pend else None}
            for f, w, pend, why in [
                ("a.yaml", "2", True, "ran clean at x; the file changed since"),
                ("a.yaml", "4", True, "ran clean at x; the file changed since"),
                ("b.yaml", "2", True, "never ran clean on a GPU"),
                ("b.yaml", "8", True, "never ran clean on a GPU"),
                ("c.yaml", "2", False, None),
                ("c.yaml", "4", True, "ran clean at x; device code changed since"),
                ("d.yaml", "2x2", True, "ran clean at x; device code changed since"),
                ("d.yaml", "4x2", True, "ran clean at x; device code changed since"),
                ("e.yaml", "2", True, "ran clean at x; device code changed since")]]
    shards = gp.plans(rows, 2, first=["e.yaml"])
    got = [(f, w) for lines in shards for line in lines
           for w in line.split()[0].split(",") for f in line.split()[1:]]
    assert sorted(got) == sorted((r["file"], r["world"]) for r in rows if r["settled"] is None)
    assert shards == [["2,8 b.yaml", "2 a.yaml", "2x2 d.yaml", "4x2 d.yaml"],
                      ["2 e.yaml", "4 c.yaml", "4 a.yaml"]]
    # a slow case (its newest record took SLOW_S or more) leaves the shards for slow.txt;
    # a slow case already settled is in neither
    slow = {("b.yaml", "8"): 120.0, ("d.yaml", "4x2"): 150.0, ("c.yaml", "2"): 300.0,
            ("a.yaml", "4"): 101.0}
    assert gp.plans(rows, 2, first=["e.yaml"], slow=frozenset(slow)) == [
        ["2 b.yaml", "2 a.yaml", "2x2 d.yaml"], ["2 e.yaml", "4 c.yaml"]]
    # slow.txt: files of the same slow worlds on one line (run SLOW_JOBS at once), the
    # lines naming a file of ``first`` first, then the longest first
    assert gp.slow_plan(rows, slow) == ["4x2 d.yaml", "8 b.yaml", "4 a.yaml"]
    assert gp.slow_plan(rows, slow, first=["a.yaml"]) == ["4 a.yaml", "4x2 d.yaml", "8 b.yaml"]
    slow |= {("e.yaml", "2"): 500.0, ("c.yaml", "4"): 100.0}
    assert gp.slow_plan(rows, slow, first=["c.yaml"]) == [
        "4 a.yaml c.yaml", "2 e.yaml", "4x2 d.yaml", "8 b.yaml"]


def test_a_case_is_as_slow_as_its_newest_record(tmp_path: Path) -> None:
    """case_seconds(): per (file, world) the wall_s of its record in the result of the
    newest commit (by commit time), failed records included (a rank timeout is a slow
    case's usual failure); a commit this clone lacks is the oldest; a record without
    wall_s counts for nothing."""
    head, first = _git("rev-parse", "HEAD"), _git("rev-list", "--max-parents=0", "HEAD")
    first = first.splitlines()[0]
    # the newest is neither the longest nor the shortest: a max or a min would fail
    for commit, recs in [(head, [("x.yaml", "8", True, 40.0), ("y.yaml", "2", False, 151.0)]),
                         (first, [("x.yaml", "8", True, 90.5), ("y.yaml", "2", True, 12.0),
                                  ("z.yaml", "4", True, None)]),
                         ("0" * 40, [("x.yaml", "8", True, 10.0), ("y.yaml", "2", True, 300.0),
                                     ("w.yaml", "2", True, 99.0)])]:
        (tmp_path / f"gpu_conformance_{commit[:7]}.json").write_text(json.dumps({
            "commit": commit, "records": [
                {"ok": ok, "case": {"file": f, "world": w}, **({"wall_s": s} if s else {})}
                for f, w, ok, s in recs]}))
    took = gp.case_seconds(tmp_path)
    if head == first:
        pytest.skip("one commit in this clone: no older result to compare with")
    assert took == {("x.yaml", "8"): 40.0, ("y.yaml", "2"): 151.0, ("w.yaml", "2"): 99.0}


def _edit(root: Path, rel: str, old: str, new: str) -> None:
    path = root / rel
    text = path.read_text()
    assert old in text, (rel, old)
    path.write_text(text.replace(old, new, 1))


def test_the_key_settles_what_the_gpu_would_run_and_names_what_changed(
        clone: tuple[Path, str], tmp_path: Path) -> None:
    """A clean record at HEAD, then edits in the clone's working tree: the CPU-only
    interpreter shim and a file no run imports (an engine adapter) keep it settled by key
    (device code to the commit rule); a template byte that reaches the module, a file
    the runtime imports from outside dcpc/runtime (topology), a harness file, an op
    module's comment (the reference) make it pending, naming what changed; a reviewed
    pair in gpu_equivalent.json settles that exact pair and no other."""
    root, head = clone
    results = _results(tmp_path, head, [(COPY, "2", True)])
    _edit(root, "dcpc/runtime/local.py", "    memo: dict[Any, Any] = {}\n",
          "    memo: dict[Any, Any] = {}  # CPU only\n    memo.clear()\n")
    _edit(root, "dcpc/engines/common.py", "\n", "\n# no GPU conformance run imports this\n")
    row = _rows(results, root)[(COPY, "2")]
    assert (row["settled"], row["rule"], row["equivalent"]) == (head, "key", []), row
    assert gp._commit_rule(head, COPY, root) == f"ran clean at {head}; device code changed since"
    assert not (results / gp.KEYS_FILE).exists()  # cached under build/, not beside results
    assert json.loads((root / "build/gpu_keys" / gp.KEYS_FILE).read_text())[head][f"{COPY}@2"]
    gp.pending(results, root=root, files=[COPY], update_cache=True)
    assert json.loads((results / gp.KEYS_FILE).read_text())[head][f"{COPY}@2"]  # asked for
    _edit(root, "templates/module.py.j2", "from __future__ import annotations",
          "from __future__ import annotations  # one byte more")
    row = _rows(results, root)[(COPY, "2")]
    assert (row["settled"], row["why"]) == (None, f"module changed since {head}"), row
    subprocess.run(["git", "checkout", "-q", "--", "templates"], cwd=root, check=True)
    _edit(root, "dcpc/topology.py", "\n", "\nTOPOLOGY_EDIT = 1\n")
    _edit(root, "dcpc/harness/launch.py", "\n", "\nLAUNCH_EDIT = 1\n")
    row = _rows(results, root)[(COPY, "2")]
    assert row["why"] == f"runtime and harness changed since {head}", row
    subprocess.run(["git", "checkout", "-q", "--", "dcpc/topology.py", "dcpc/harness"],
                   cwd=root, check=True)
    old = gk.code_keys(root)["reference"]
    _edit(root, "dcpc/ops/copy.py", "\n", "\n# a comment: no module changes\n")
    row = _rows(results, root)[(COPY, "2")]
    assert row["why"] == f"reference changed since {head}", row
    new = gk.code_keys(root)["reference"]
    (results / gp.EQUIVALENT_FILE).write_text(json.dumps(
        {"reference": {new: [[old, "why: reviewed in this test, a comment"]]},
         "harness": {old: [[new, "why: the other way round: no entry for this pair"]]}}))
    row = _rows(results, root)[(COPY, "2")]
    assert (row["settled"], row["rule"], row["equivalent"]) == (head, "key", ["reference"])
    _edit(root, "dcpc/ops/copy.py", "\n", "\n# the next edit: pending again\n")
    row = _rows(results, root)[(COPY, "2")]
    assert row["why"] == f"reference changed since {head}", row


def test_a_record_with_its_key_settles_without_git(clone: tuple[Path, str],
                                                   tmp_path: Path) -> None:
    """gpu_conformance's records carry their key: one of a commit this clone lacks
    settles by it while the key is the working tree's, else names the part."""
    root, _ = clone
    wanted = [(c["file"], c["world"]) for c in gp.cases([ROOT / COPY, ROOT / PULL])]
    now = gp.tree_keys(wanted, root)  # _rows' cases: their keys at HEAD computed once
    key = {"module": now["modules"][gk.case_id(COPY, "2")],
           **{part: now[part] for part in gk.CODE_PARTS}}
    row = _rows(_results(tmp_path, "0" * 40, [(COPY, "2", True)], key), root)[(COPY, "2")]
    assert (row["settled"], row["rule"]) == ("0" * 40, "key"), row
    other = tmp_path / "other"
    other.mkdir()
    row = _rows(_results(other, "0" * 40, [(COPY, "2", True)], {**key, "harness": "f" * 64}),
                root)[(COPY, "2")]
    assert row["why"] == f"harness changed since {'0' * 40}", row


def _is(test: ast.expr, device: str) -> bool:
    """Whether ``test`` is `<something> == device`."""
    return (isinstance(test, ast.Compare) and len(test.ops) == 1
            and isinstance(test.ops[0], ast.Eq) and isinstance(test.comparators[0], ast.Constant)
            and test.comparators[0].value == device)


def _uses(tree: ast.AST, names: set[str], modules: set[str]) -> list[ast.AST]:
    """Where ``tree`` names one of ``names`` (a name, an attribute, an import of it) or
    imports one of ``modules`` (`import m`, `from m import ...`, `from parent import
    last`)."""
    out: list[ast.AST] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id in names or \
                isinstance(node, ast.Attribute) and node.attr in names:
            out.append(node)
        elif isinstance(node, ast.Import) and any(a.name in modules for a in node.names):
            out.append(node)
        elif isinstance(node, ast.ImportFrom) and (
                node.module in modules or any(a.name in names for a in node.names)
                or any(f"{node.module}.{a.name}" in modules for a in node.names)):
            out.append(node)
    return out


def test_the_guard_sees_every_form_of_use() -> None:
    """_uses finds a left-out name as a name, an attribute, an imported name, and a
    left-out module by `import`, `from m import`, `from parent import m`."""
    names, modules = {"_shim"}, {"dcpc.harness.interpret"}
    for text in ("_shim()", "local._shim()", "from dcpc.runtime.local import _shim",
                 "import dcpc.harness.interpret", "from dcpc.harness.interpret import x",
                 "from dcpc.harness import interpret"):
        assert len(_uses(ast.parse(text), names, modules)) == 1, text
    assert not _uses(ast.parse("from dcpc.harness import worker\nshim()"), names, modules)


def test_the_cpu_only_code_left_out_of_the_key_runs_only_on_the_cpu() -> None:
    """Every use of what gpu_keys leaves out (CPU_ONLY_DEFS, CPU_ONLY_FILES) in dcpc/ sits
    under a test that the device is the CPU (`== "cpu"`, or the else of `== "cuda"`), or
    inside another of them: none runs in a GPU run."""
    names = {n for ns in gk.CPU_ONLY_DEFS.values() for n in ns}
    modules = {f[:-3].replace("/", ".") for f in gk.CPU_ONLY_FILES}
    uses = 0
    for path in sorted((ROOT / "dcpc").rglob("*.py")):
        tree = ast.parse(path.read_text())
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in _uses(tree, names, modules):
            uses += 1
            child, up, guarded = node, parents.get(node), False
            while up is not None and not guarded:
                if isinstance(up, ast.FunctionDef) and up.name in names:
                    guarded = True
                elif isinstance(up, ast.If):
                    conjuncts = up.test.values if isinstance(up.test, ast.BoolOp) and \
                        isinstance(up.test.op, ast.And) else [up.test]
                    guarded = (any(_is(t, "cpu") for t in conjuncts) and child in up.body
                               or _is(up.test, "cuda") and child in up.orelse)
                child, up = up, parents.get(up)
            assert guarded, f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}"
    assert uses >= 4  # worker's two imports, its call, LocalGroup's call


def _imported_files(code: str) -> set[str]:
    """The dcpc files a fresh interpreter has imported after running ``code``."""
    done = subprocess.run(
        [sys.executable, "-c", code + "\nimport json, sys\nprint(json.dumps(sorted("
         "m.__file__ for n, m in sys.modules.items() if n.split('.')[0] == 'dcpc' and "
         "getattr(m, '__file__', None))))"],
        cwd=ROOT, capture_output=True, text=True, check=True, timeout=300,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    return {Path(f).resolve().relative_to(ROOT).as_posix() for f in json.loads(done.stdout)}


def test_every_dcpc_module_a_run_imports_is_in_the_key() -> None:
    """Importing every runtime module (what a module imports) loads only files of the
    key's runtime part (dcpc.topology, dcpc.numerics, dcpc.exprs among them); importing
    what `python -m dcpc run` and the harness start from loads only files of the code
    parts, never the CPU-only interpreter; the commit rule compares all of them."""
    parts = gk.code_files(ROOT)
    runtime = [p.stem for p in sorted((ROOT / "dcpc/runtime").glob("*.py"))]
    got = _imported_files("".join(f"import dcpc.runtime.{m}\n" for m in runtime))
    assert {"dcpc/topology.py", "dcpc/numerics.py", "dcpc/exprs.py"} <= got
    assert got <= set(parts["runtime"]), got - set(parts["runtime"])
    harness = [p.stem for p in sorted((ROOT / "dcpc/harness").glob("*.py"))
               if p.name != "interpret.py"]
    got = _imported_files("import dcpc.cli, dcpc.ops\n" + "".join(
        f"import dcpc.harness.{m}\n" for m in harness))
    keyed = {f for files in parts.values() for f in files}
    assert got <= keyed, got - keyed
    assert "dcpc/harness/interpret.py" not in got | keyed
    assert {"dcpc/ops/copy.py", "dcpc/lang/expr.py", "dcpc/codegen/lower.py"} <= set(
        parts["reference"])
    assert set(gp.device_paths()) >= keyed | {"templates"}


def test_the_key_reads_single_files_and_trees_that_lack_a_part(tmp_path: Path) -> None:
    """files_key takes files, a missing one read as missing; a tree without dcpc/runtime
    (an old commit) has an empty runtime part, not an error."""
    (tmp_path / "dcpc/harness").mkdir(parents=True)
    (tmp_path / "dcpc/__init__.py").write_text("")
    (tmp_path / "dcpc/harness/run.py").write_text("from dcpc import gone\nimport dcpc.x\n")
    parts = gk.code_files(tmp_path)
    assert parts == {"runtime": [], "harness": ["dcpc/harness/run.py"],
                     "reference": ["dcpc/__init__.py"]}
    one = gk.files_key(tmp_path, ["dcpc/harness/run.py"])
    assert one != gk.files_key(tmp_path, ["dcpc/harness/run.py", "dcpc/gone.py"])
    assert gk.code_keys(tmp_path)["harness"] == one


def test_a_run_records_what_it_imported_and_the_key_holds_it(tmp_path: Path) -> None:
    """gpu_conformance on the CPU (the Triton interpreter): the record is clean and every
    dcpc module the run imported is in the key; a module outside the key is named, and
    on cuda the CPU-only interpreter too."""
    from benchmarks import gpu_conformance as gc

    case = next(c for c in gc.cases([ROOT / COPY]) if c["world"] == "2")
    records = gc.run_case(case, 1, 2, 20.0, 150.0, tmp_path, "cpu")
    assert [r["ok"] for r in records] == [True], records
    imports = tmp_path / "copy_2.imports.json"
    names = json.loads(imports.read_text())
    assert {"dcpc.cli", "dcpc.harness.worker", "dcpc.runtime.teams", "dcpc.topology",
            "dcpc.ops.copy"} <= set(names)
    assert gc.unkeyed_imports(imports, "cpu") == []
    assert gc.unkeyed_imports(imports, "cuda") == []  # no program order: no interpreter
    imports.write_text(json.dumps(names + ["dcpc.harness.interpret", "dcpc.engines.common"]))
    assert gc.unkeyed_imports(imports, "cpu") == ["dcpc.engines.common"]
    assert gc.unkeyed_imports(imports, "cuda") == ["dcpc.harness.interpret",
                                                   "dcpc.engines.common"]


def test_keys_written_beside_the_plans_are_read_only_for_their_tree(tmp_path: Path) -> None:
    """run_keys takes a module key from a keys file whose tree digest is this tree's,
    and compiles where the file names another tree."""
    from benchmarks import gpu_conformance as gc

    todo = [c for c in gc.cases([ROOT / COPY]) if c["world"] == "2"]
    real = gc.run_keys(todo)[(COPY, "2")]
    given = tmp_path / "keys.json"
    tree = gk.tree_digest(ROOT)
    given.write_text(json.dumps({**gk.code_keys(ROOT), "tree": tree,
                                 "modules": {gk.case_id(COPY, "2"): "f" * 64}}))
    assert gc.run_keys(todo, given)[(COPY, "2")] == {**real, "module": "f" * 64}
    given.write_text(json.dumps({**gk.code_keys(ROOT), "tree": "0" * 64,
                                 "modules": {gk.case_id(COPY, "2"): "f" * 64}}))
    assert gc.run_keys(todo, given)[(COPY, "2")] == real



def test_keys_out_of_time_are_an_error_and_nothing_is_cached(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """gpu_keys.py run past its limit (here a limit it cannot meet; the real child runs):
    an error naming the tree, not a "no key" that the tree cache would keep for good
    (a world no conformance case has, so no earlier run cached it)."""
    cache = ROOT / "build" / "gpu_keys"
    before = set(cache.glob("tree_*.json"))
    monkeypatch.setattr(gp, "wall_timeout", lambda seconds: 0.01)
    with pytest.raises(gp.KeysTimeout, match=r"1 module keys in .* took over 0 s"):
        gp.tree_keys([(COPY, "7")], root=ROOT)
    assert set(cache.glob("tree_*.json")) == before
