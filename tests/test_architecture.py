"""The structure the rest of the code relies on: one registry entry per method, pure aggregation, declared ordering
and traffic enforced by the transport layer alone, and imports that follow the layers."""

from __future__ import annotations

import ast
import dataclasses
import importlib
from pathlib import Path

import pytest
import torch
from torch.futures import Future

from hosfl_dist import algorithms
from hosfl_dist.algorithms import AlgorithmSpec, algorithm_names, get_algorithm, register
from hosfl_dist.algorithms.base import ServerBase
from hosfl_dist.algorithms.exchange import aggregate
from hosfl_dist.algorithms.hosfl import SCALARS, HOSFLServer, HOSFLWorker, mean_over_clients
from hosfl_dist.config import load_config
from hosfl_dist.errors import ConfigError
from hosfl_dist.evaluation.server import EvalServer
from hosfl_dist.models import build_split_model
from hosfl_dist.runtime import control, server_group
from hosfl_dist.runtime.checks import load_run_config
from hosfl_dist.runtime.control import Handler, handles
from hosfl_dist.runtime.front import RunFront
from hosfl_dist.runtime.server_group import ServerGroup
from hosfl_dist.transport import done
from hosfl_dist.transport.client import ClientTransport
from hosfl_dist.transport.endpoint import ServerEndpoint
from hosfl_dist.transport.inprocess import LocalCollective
from hosfl_dist.transport.metered import MeteredTransport
from hosfl_dist.transport.stub import ServerStub
from hosfl_dist.transport.wire import (
    DOWNLINK_MODEL,
    DOWNLINK_SCALARS_SEEDS,
    PAPER_CATEGORIES,
    UPLINK_ACTIVATIONS,
    UPLINK_SCALARS,
    CommMeter,
    WireSpec,
    wire,
)
from tiny import TINY_OVERRIDES, run_in_process, server_of

PACKAGE = Path(__file__).resolve().parents[1] / "hosfl_dist"


# -- registry ------------------------------------------------------------------------------------------------------
def test_a_method_is_one_registry_entry_and_the_config_and_runtimes_find_it(monkeypatch, tmp_path):
    """Registering a spec is all a new method needs: the config accepts its name and the runtime builds it."""
    hosfl = get_algorithm("hosfl")
    alias = AlgorithmSpec("hosfl_alias", hosfl.server, hosfl.worker, True, hosfl.traffic)
    monkeypatch.setitem(algorithms._REGISTRY, "hosfl_alias", alias)
    with pytest.raises(ConfigError, match="invalid value for algorithm.name: 'nope'"):
        load_run_config(None, [*TINY_OVERRIDES, "algorithm.name=nope"])
    _, _, ref, _ = run_in_process([*TINY_OVERRIDES, f"job.out_dir={tmp_path / 'a'}"])
    _, _, got, _ = run_in_process([*TINY_OVERRIDES, "algorithm.name=hosfl_alias", f"job.out_dir={tmp_path / 'b'}"])
    assert got["algorithm"] == "hosfl_alias" and got["client_digests"] == ref["client_digests"]


def test_the_registry_lists_the_papers_methods_with_their_capabilities():
    assert algorithm_names() == ["frozen_client", "fsl_sage", "hosfl", "mu_splitfed", "sfl", "splitlora", "zo_sfl"]
    zo = {n for n in algorithm_names() if get_algorithm(n).zeroth_order_client}
    assert zo == {"hosfl", "zo_sfl", "mu_splitfed", "frozen_client"}  # frozen_client: HO-SFL's client forward
    assert get_algorithm("hosfl").server_parts == ("server",)  # the HO-SFL server never holds θc
    assert "client" in get_algorithm("sfl").server_parts  # model-exchanging servers keep θc^t
    assert get_algorithm("fsl_sage").worker_parts == ("client", "server") and get_algorithm("fsl_sage").families == (
        "vision",
    )
    with pytest.raises(ConfigError, match=r"fsl_sage.*implemented for vision models, not model.name=hf"):
        load_run_config(None, ["algorithm.name=fsl_sage", "model.name=hf", "model.source=tiny:llama", "data.name=sst2"])


def test_a_spec_whose_server_sends_traffic_outside_its_categories_is_refused():
    class Leaky(ServerBase):
        @wire(result={"params": DOWNLINK_MODEL})
        def download(self, t: int, client: int) -> dict:
            return {}

    with pytest.raises(ValueError, match=r"Leaky.download sends \['downlink_model'\] outside its traffic"):
        register(AlgorithmSpec("leaky", Leaky, HOSFLWorker, True, frozenset({UPLINK_ACTIVATIONS})))


def test_a_spec_whose_worker_calls_another_server_is_refused():
    from hosfl_dist.algorithms.sfl import SFLServer

    with pytest.raises(ValueError, match=r"HOSFLWorker calls HOSFLServer, not the registered server SFLServer"):
        AlgorithmSpec("crossed", SFLServer, HOSFLWorker, True, frozenset(PAPER_CATEGORIES))

    class Unnamed(HOSFLWorker):
        server_class = ServerBase  # what WorkerBase says: no declared call to make a stub of

    with pytest.raises(ValueError, match=r"Unnamed calls ServerBase, not the registered server HOSFLServer"):
        AlgorithmSpec("unnamed", HOSFLServer, Unnamed, True, frozenset(PAPER_CATEGORIES))


def test_a_worker_calls_its_server_through_a_stub_of_the_declared_methods():
    """``self.server.submit`` is the declared method, resolved once: its docstring and signature travel with it, its
    arguments are checked on the worker before anything is sent, and an undeclared name is refused by name."""
    sent = []

    class Recording:
        def call_async(self, method, **kwargs):
            sent.append((method, kwargs))
            return done({"seeds": torch.zeros(3)})

    stub = ServerStub(HOSFLServer, ClientTransport(Recording()))
    assert stub.sync.method is HOSFLServer.sync and stub.sync.__doc__ == HOSFLServer.sync.__doc__
    assert stub.sync(t=0, client=1, since=0)["seeds"].shape == (3,) and sent == [("sync", {"t": 0, "client": 1,
                                                                                             "since": 0})]  # fmt: skip
    with pytest.raises(TypeError, match="sync: missing a required argument: 'since'"):
        stub.sync.send(t=0, client=1, sinse=0)
    with pytest.raises(TypeError, match="sync: got an unexpected keyword argument 'sinse'"):
        stub.sync.prefetch_many([{"t": 0, "client": 1, "since": 0, "sinse": 0}])
    with pytest.raises(TypeError, match="submit: a gathered call needs labels"):
        stub.submit.send_many([{"t": 0, "client": 1, "act": {}}])
    with pytest.raises(AttributeError, match="HOSFLServer.sumbit is not a server method declared with @wire"):
        stub.sumbit  # noqa: B018
    assert len(sent) == 1  # nothing malformed left the worker


# -- pure aggregation ----------------------------------------------------------------------------------------------
def test_aggregation_functions_are_pure_and_one_line_checkable():
    assert torch.equal(mean_over_clients(torch.tensor([[1.0, 2.0], [3.0, 6.0]])), torch.tensor([2.0, 4.0]))
    assert torch.equal(
        aggregate([torch.zeros(2)], [[torch.ones(2)], [3 * torch.ones(2)]], [1, 3])[0], torch.full((2,), 2.5)
    )
    assert torch.equal(aggregate([torch.zeros(1)], [[torch.ones(1)]], [1], global_lr=0.3)[0], torch.tensor([0.3]))


def test_the_collective_counts_the_declared_exchange_per_contributing_client():
    meter = CommMeter()
    rows = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0], [5.0, 6.0, 7.0]])  # clients 4 and 9 are this worker's
    vbar = LocalCollective(meter).aggregate(SCALARS, rows, {4: 0, 9: 2}, mean_over_clients)
    assert torch.equal(vbar, torch.tensor([2.0, 8 / 3, 10 / 3]))
    assert meter.bytes[UPLINK_SCALARS] == 2 * 3 * 4  # P float32 scalars per contributing client
    assert meter.bytes[DOWNLINK_SCALARS_SEEDS] == 2 * 3 * 4  # v̄ back to each of them


# -- ordering and gathering, the endpoint's alone ------------------------------------------------------------------
class Toy:
    """A server declaring each ordering rule once."""

    def __init__(self) -> None:
        self.log: list[tuple] = []

    def expected_in_round(self, t: int) -> int:
        return 2

    @wire(args={"x": UPLINK_ACTIVATIONS}, result={"y": DOWNLINK_MODEL}, gather=True, closes_round=True)
    def up(self, t: int, batch: dict) -> dict:
        self.log.append(("up", t, list(batch)))
        if t == 9:
            raise RuntimeError("bad round")
        return {m: {"y": batch[m]["x"] * 2} for m in batch}

    @wire(result={"y": DOWNLINK_MODEL}, after_previous_round=True)
    def down(self, t: int, client: int) -> dict:
        self.log.append(("down", t, client))
        return {"y": torch.ones(1)}


def test_gathered_calls_run_once_in_client_order_and_close_the_round():
    toy = Toy()
    ep = ServerEndpoint(toy)
    held = ep.serve("down", {"t": 1, "client": 5})
    assert not held.done()  # round 0 is not closed
    first = ep.serve("up", {"t": 0, "client": 7, "x": torch.ones(1)})
    assert not first.done() and toy.log == []  # gathered: waits for the round's second client
    second = ep.serve("up", {"t": 0, "client": 3, "x": 3 * torch.ones(1)})
    assert toy.log[:2] == [("up", 0, [3, 7]), ("down", 1, 5)]  # one execution, client order; then the held call
    assert first.wait()["y"].item() == 2 and second.wait()["y"].item() == 6 and held.done()
    assert ep.stats()["calls"] == {"up": 1, "down": 1}
    failing = [ep.serve("up", {"t": 9, "client": m, "x": torch.ones(1)}) for m in (0, 1)]
    for f in failing:  # every client of a failed round gets its error
        with pytest.raises(RuntimeError, match="bad round"):
            f.wait()
    with pytest.raises(AttributeError, match="not a server method declared with @wire"):
        ep.serve("expected_in_round", {"t": 0}).wait()


def test_answers_are_counted_when_taken_so_metrics_rows_do_not_depend_on_timing():
    meter = CommMeter()

    class Inner:
        def call_async(self, method, **kwargs):
            return done({"y": torch.zeros(10)})

    reply = MeteredTransport(Inner(), Toy, meter).call_async("down", t=0, client=1)
    assert meter.bytes[DOWNLINK_MODEL] == 0  # arrived, not yet taken
    reply.wait()
    reply.wait()
    assert meter.bytes[DOWNLINK_MODEL] == 40  # counted once, when the client took it


# -- layers --------------------------------------------------------------------------------------------------------
def _imported(path: Path) -> set[str]:
    """Every hosfl_dist module ``path`` imports, wherever the import stands: at module level, inside a function or
    a branch (``ast.walk`` visits every node), relative imports resolved, ``importlib.import_module("...")`` with a
    literal name included."""
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # from .x import y / from .. import y
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
                names.update(f"{base}.{a.name}" for a in node.names)  # from . import x: the module .x, if it is one
            names.add(base)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            names.add(node.args[0].value)
    return {n for n in names if n == "hosfl_dist" or n.startswith("hosfl_dist.")}


def _imports(folder: str) -> dict[str, set[str]]:
    """File (relative to the package) -> the hosfl_dist modules it imports, for a folder or a single module."""
    where = PACKAGE / folder
    paths = sorted(where.rglob("*.py")) if where.is_dir() else [where]
    return {str(path.relative_to(PACKAGE)): _imported(path) for path in paths}


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


ABOVE_RUNTIME = ("hosfl_dist.cli", "hosfl_dist.measure", "hosfl_dist.centralized", "hosfl_dist.experiments",
                 "hosfl_dist.export", "hosfl_dist.run", "hosfl_dist.predict", "hosfl_dist.config_help")  # fmt: skip
"""The commands above the runtime: a run's command lines, measurements, centralised training, studies, the export."""
ABOVE_RUNFOLDER = ("hosfl_dist.transport", "hosfl_dist.algorithms", "hosfl_dist.evaluation", "hosfl_dist.runtime",
                   *ABOVE_RUNTIME)  # fmt: skip
"""What lies above runfolder/, the run folder's format that the runtime, the export and the studies read alike."""
ABOVE_MODELS = ("hosfl_dist.runfolder", *ABOVE_RUNFOLDER)
"""What lies above models/, data/ and tasks/ (docs/architecture.md, "Layers")."""


@pytest.mark.parametrize(
    ("folder", "allowed"),
    [
        ("config", ("hosfl_dist.config", "hosfl_dist.errors", "hosfl_dist.safe_yaml")),
        ("core", ("hosfl_dist.config", "hosfl_dist.core", "hosfl_dist.errors")),
        ("errors.py", ()),
        ("safe_yaml.py", ("hosfl_dist.errors",)),
        ("safe_files.py", ("hosfl_dist.errors",)),
    ],
)
def test_the_bottom_layer_imports_only_itself(folder, allowed):
    """The config tree and the pure math stand on nothing of the package but the errors and the YAML reader: a check
    that needs the algorithm registry (or a model) lives above it (hosfl_dist.runtime.checks)."""
    bad = {f: sorted(n for n in names if not _under(n, allowed)) for f, names in _imports(folder).items()}
    assert not {f: n for f, n in bad.items() if n}


@pytest.mark.parametrize(
    ("folder", "forbidden"),
    [
        ("core", ("hosfl_dist.data", "hosfl_dist.models", "hosfl_dist.tasks", *ABOVE_MODELS)),
        ("tasks", ("hosfl_dist.data", "hosfl_dist.models", *ABOVE_MODELS)),
        ("models", ("hosfl_dist.data", *ABOVE_MODELS)),
        ("data", ("hosfl_dist.models.lm", "hosfl_dist.models.hf_split", *ABOVE_MODELS)),
        ("runfolder", ABOVE_RUNFOLDER),
        ("transport", ("hosfl_dist.algorithms", "hosfl_dist.models", "hosfl_dist.data", "hosfl_dist.runtime")),
        ("algorithms", ("hosfl_dist.runtime", "hosfl_dist.measure", "hosfl_dist.evaluation")),
        ("evaluation", ("hosfl_dist.algorithms", "hosfl_dist.runtime", "hosfl_dist.measure", "hosfl_dist.data")),
        ("runtime", ABOVE_RUNTIME),
    ],
)
def test_imports_follow_the_layers(folder, forbidden):
    """No import runs upward, not even one inside a function (where it would hide from a reader and from a test
    that looked at module level only)."""
    bad = {f: sorted(n for n in names if _under(n, forbidden)) for f, names in _imports(folder).items()}
    assert not {f: n for f, n in bad.items() if n}


KEPT_COMMANDS = {
    "hosfl_dist.run": "hosfl_dist.cli.run",
    "hosfl_dist.predict": "hosfl_dist.cli.predict",
    "hosfl_dist.config_help": "hosfl_dist.cli.config_help",
    "hosfl_dist.experiments.pretrain": "hosfl_dist.centralized.pretrain",
    "hosfl_dist.experiments.centralized_lora": "hosfl_dist.centralized.lora",
    "hosfl_dist.experiments.zo_dimension": "hosfl_dist.measure.zo_dimension",
    "hosfl_dist.experiments.zo_precision": "hosfl_dist.measure.zo_precision",
}
"""Command lines users type whose code moved: the old module stays, a thin one that runs the new one's ``main``."""


@pytest.mark.parametrize(("kept", "moved"), sorted(KEPT_COMMANDS.items()))
def test_a_moved_command_keeps_its_command_line_in_a_thin_module(kept, moved):
    module = importlib.import_module(kept)
    assert module.main is importlib.import_module(moved).main
    assert len(Path(module.__file__).read_text().splitlines()) <= 10, kept
    assert _imported(Path(module.__file__)) == {moved}


def test_the_wire_starts_no_process_group_or_rpc_agent():
    """The wire (declarations, protocols, the client transport, metering, the in-process and emulated links) is what
    algorithms may see; RPC entry points, the token, the front and the process groups are the runtime's."""
    for path in (PACKAGE / "transport").rglob("*.py"):
        tree = ast.parse(path.read_text())
        modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        modules |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert not [m for m in modules if m.startswith("torch.distributed")], path


def test_the_import_reader_sees_imports_inside_functions_and_relative_ones(tmp_path, monkeypatch):
    fake = tmp_path / "hosfl_dist"
    (fake / "models").mkdir(parents=True)
    (fake / "models" / "m.py").write_text(
        "import importlib\n"
        "def build():\n"
        "    from hosfl_dist.algorithms import get_algorithm\n"
        "    if True:\n"
        "        from ..runtime import checks\n"
        "    importlib.import_module('hosfl_dist.transport.rpc')\n"
        "    from . import vision\n"
    )
    monkeypatch.setitem(globals(), "PACKAGE", fake)
    assert _imports("models")["models/m.py"] == {
        "hosfl_dist.algorithms",
        "hosfl_dist.runtime",
        "hosfl_dist.runtime.checks",
        "hosfl_dist.transport.rpc",
        "hosfl_dist.models",
        "hosfl_dist.models.vision",
    }


def test_the_transport_layer_names_no_algorithms_call():
    """Ordering is declared with @wire next to the calls; no transport module special-cases a method by name."""
    names = {name for n in algorithm_names() for name in _declared(get_algorithm(n).server)} | _declared(EvalServer)
    for path in (PACKAGE / "transport").rglob("*.py"):
        text = path.read_text()
        assert not [n for n in names if f'"{n}"' in text], path


def _declared(cls: type) -> set[str]:
    return {n for n in dir(cls) if hasattr(getattr(cls, n), "__wire__")}


def test_hosfl_declares_its_ordering_next_to_its_calls():
    specs = {n: getattr(HOSFLServer, n).__wire__ for n in _declared(HOSFLServer)}
    assert specs["sync"].after_previous_round and specs["eval_sync"].after_previous_round
    assert specs["submit"].gather and specs["finish_round"].closes_round


# -- algorithms hold state and math only ---------------------------------------------------------------------------
DISTRIBUTION = ("torch.distributed", "threading", "concurrent", "torch.futures", "multiprocessing", "queue")


def test_no_algorithm_module_touches_distribution_or_concurrency():
    """No process group, future, lock or thread under algorithms/: the runtime's step executor, the client transport
    and the trainer own them."""
    for path in (PACKAGE / "algorithms").rglob("*.py"):
        tree = ast.parse(path.read_text())
        modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        modules |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert not [m for m in modules if m.startswith(DISTRIBUTION)], path
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        assert not names & {"Future", "Lock", "RLock", "Thread", "Event", "group"}, path
        # an answer may be taken later in the same step, never kept on the object between calls
        for node in ast.walk(tree):
            if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                on_self = any("self" in {n.id for n in ast.walk(t) if isinstance(n, ast.Name)} for t in targets)
                sends = any(isinstance(n, ast.Attribute) and n.attr == "call_async" for n in ast.walk(node))
                assert not (on_self and sends), f"{path}:{node.lineno} keeps a pending answer on the object"


def test_a_wire_declaration_says_what_crosses_and_in_which_order_never_how_it_executes():
    """How a call runs (one rank, a server group) is the runtime's: a declaration holds traffic, ordering and the
    round's stages only (where a live round counts an arrival, which call takes its aggregate), and HO-SFL's gathered
    submit answers each client through any endpoint, with or without the runtime's executor."""
    assert {f.name for f in dataclasses.fields(WireSpec)} == {
        "args", "result", "after_previous_round", "gather", "closes_round", "arrives", "aggregates"
    }  # fmt: skip
    cfg = load_config(None, ["data.name=synthetic", "model.width=4", "clients.total=3", "clients.per_round=3"])
    server = server_of(cfg, build_split_model(cfg, {"num_classes": 4, "input_shape": (1, 8, 8)}, True), HOSFLServer)
    endpoint = ServerEndpoint(server)
    upload = {"act": {"z": torch.zeros(2, 4, 4, 4)}, "labels": torch.zeros(2).long()}
    futs = [endpoint.serve("submit", {"t": 0, "client": m, **upload}) for m in range(3)]
    answers = [f.wait() for f in futs]
    assert all(a["lam"].shape == (2, 4, 4, 4) and "skip" not in a for a in answers) and server.rounds_done == 1


def test_the_server_compute_is_stepped_once_per_forward_backward():
    """The compute's step follows its forward/backward: a server that stepped without one is refused, not silently
    stepped with stale gradients."""
    cfg = load_config(None, ["data.name=synthetic", "model.width=4", "clients.total=3", "clients.per_round=3"])
    server = server_of(cfg, build_split_model(cfg, {"num_classes": 4, "input_shape": (1, 8, 8)}, True), HOSFLServer)
    with pytest.raises(RuntimeError, match="step without a forward_backward"):
        server.compute.step(1)


# -- typed control -------------------------------------------------------------------------------------------------
def test_control_messages_are_dispatched_by_their_type():
    class Ping:
        pass

    class Pong:
        pass

    class Echo(Handler):
        @handles(Ping)
        def _ping(self, msg: Ping) -> str:
            return "pong"

    assert Echo().handle(Ping()) == "pong"
    with pytest.raises(TypeError, match="Echo handles no Pong message"):
        Echo().handle(Pong())
    # every message a client worker sends has its handler on the run's front; every announcement of rank 0 on the
    # other server ranks
    sent = {control.ResumeRequest, control.EvalReport, control.CheckpointPart, control.SaveCheckpoint,
            control.Stopped, control.FinalReport, control.FailureReport}  # fmt: skip
    assert set(RunFront._handlers) == sent
    assert set(ServerGroup._handlers) == {
        server_group.Execute,
        server_group.Digest,
        server_group.Memory,
        server_group.Save,
        server_group.Verify,
        server_group.Load,
    }  # Stop ends the loop


# -- the client end of the transport: posted and prefetched calls ---------------------------------------------------
class _Recorder:
    """A transport whose answers complete when the test says so."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, dict]] = []
        self.futures: list[Future] = []

    def call_async(self, method: str, **kwargs):
        self.sent.append((method, kwargs))
        fut: Future = Future()
        self.futures.append(fut)
        return fut


def test_a_prefetched_call_is_taken_by_the_identical_call_and_sent_once():
    inner = _Recorder()
    tr = ClientTransport(inner)
    tr.prefetch("sync", t=1, client=4, since=0)
    assert inner.sent == [("sync", {"t": 1, "client": 4, "since": 0})]
    other = tr.call_async("sync", t=1, client=4, since=1)  # another replica round: a call of its own
    taken = tr.call_async("sync", t=1, client=4, since=0)
    assert len(inner.sent) == 2 and taken is inner.futures[0] and other is inner.futures[1]
    assert tr.call_async("sync", t=1, client=4, since=0) is inner.futures[2]  # taken once only
    with pytest.raises(TypeError, match="plain values"):
        tr.prefetch("submit", t=0, act=torch.zeros(1))


class _Batcher(_Recorder):
    """A transport that sends several calls as one message."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[tuple[str, list[dict]]] = []

    def call_many(self, method: str, calls):
        self.messages.append((method, list(calls)))
        return [self.call_async(method, **kwargs) for kwargs in calls]


def test_calls_of_a_worker_s_clients_go_together_and_prefetched_ones_are_taken_not_sent_again():
    for inner in (_Batcher(), _Recorder()):  # one message where the transport can, else one call each
        tr = ClientTransport(inner)
        tr.prefetch_many("sync", [{"t": 1, "client": m, "since": 0} for m in (2, 4)])
        got = tr.call_many("sync", [{"t": 1, "client": m, "since": 0} for m in (1, 2, 3, 4)])
        assert got[1] is inner.futures[0] and got[3] is inner.futures[1]  # the prefetched two, taken
        assert got[0] is inner.futures[2] and got[2] is inner.futures[3]  # the other two, sent now
        assert [c["client"] for _, c in inner.sent] == [2, 4, 1, 3]
        if isinstance(inner, _Batcher):
            assert [(m, [c["client"] for c in calls]) for m, calls in inner.messages] == [("sync", [2, 4]),
                                                                                       ("sync", [1, 3])]  # fmt: skip
        assert tr.call_many("sync", []) == [] and len(inner.sent) == 4  # nothing to send: no message
        with pytest.raises(TypeError, match="plain values"):
            tr.prefetch_many("submit", [{"t": 0, "act": torch.zeros(1)}])
        with pytest.raises(RuntimeError, match="the same call twice"):
            tr.prefetch_many("sync", [{"t": 2, "client": 1, "since": 1}] * 2)
        tr.prefetch_many("sync", [{"t": 2, "client": 1, "since": 1}])
        with pytest.raises(RuntimeError, match="prefetched already"):
            tr.prefetch_many("sync", [{"t": 2, "client": 1, "since": 1}])


class _MethodsBatcher(_Recorder):
    """A transport that sends calls of several methods as one message."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[list[tuple[str, int | None]]] = []

    def call_batch(self, calls):
        self.messages.append([(m, kwargs.get("client")) for m, kwargs in calls])
        return [self.call_async(m, **kwargs) for m, kwargs in calls]


def test_posts_and_prefetches_made_together_leave_as_one_message_in_order():
    """ClientTransport.together: HO-SFL's leader sends its report of round t and round t+1's syncs as one message; a
    transport that cannot batch methods sends them as before (a post alone, the prefetches together)."""
    asks = [{"t": 1, "client": m, "since": 0} for m in (2, 4)]
    for inner in (_MethodsBatcher(), _Batcher(), _Recorder()):
        tr = ClientTransport(inner)
        with tr.together():
            tr.post("finish_round", t=0, scalars=torch.zeros(2))
            tr.prefetch_many("sync", asks)
            assert inner.sent == []  # nothing leaves before the block ends
        assert [(m, c.get("client")) for m, c in inner.sent] == [("finish_round", None), ("sync", 2), ("sync", 4)]
        if isinstance(inner, _MethodsBatcher):
            assert inner.messages == [[("finish_round", None), ("sync", 2), ("sync", 4)]]
        if isinstance(inner, _Batcher):
            got = [(m, [c.get("client") for c in calls]) for m, calls in inner.messages]
            assert got == [("finish_round", [None]), ("sync", [2, 4])]
        assert tr.call_many("sync", asks) == inner.futures[1:]  # the prefetched answers are taken, not sent again
        inner.futures[0].set_exception(RuntimeError("round 0 refused"))
        with pytest.raises(RuntimeError, match="round 0 refused"):
            tr.flush()  # the post's error surfaces as a lone post's would
    tr = ClientTransport(_MethodsBatcher())
    with pytest.raises(ValueError, match="stop"), tr.together():
        tr.post("finish_round", t=0, scalars=torch.zeros(2))
        raise ValueError("stop")
    assert tr.inner.sent == [] and tr._batch is None  # a block left by an error sends nothing
    with pytest.raises(RuntimeError, match="do not nest"), tr.together(), tr.together():
        pass
    with tr.together():
        pass  # an empty block sends no message
    assert tr.inner.messages == []


def test_a_call_made_together_leaves_with_the_blocks_message_and_its_answer_is_taken_after():
    """A live worker's round end and round t+1's syncs leave as one message (and come back in its one reply): a call
    made in a together() block is sent with the block, a prefetched one is still taken, not sent again."""
    inner = _MethodsBatcher()
    tr = ClientTransport(inner)
    tr.prefetch_many("sync", [{"t": 1, "client": 2, "since": 0}])
    with tr.together():
        taken, fresh = tr.call_many("sync", [{"t": 1, "client": 2, "since": 0}, {"t": 1, "client": 4, "since": 0}])
        closing = tr.call_async("close", t=0)
        tr.prefetch_many("sync", [{"t": 2, "client": 4, "since": 1}])
        assert inner.messages == [] and not closing.done()
        with pytest.raises(RuntimeError, match="has not sent it"):
            closing.wait()  # waited for inside its block: it would never leave
    assert inner.messages == [[("sync", 4), ("close", None), ("sync", 4)]]
    assert taken is inner.futures[0]  # the prefetch, sent in a message of its own before the block
    inner.futures[2].set_result({"closed": 0})
    assert closing.done() and closing.wait() == {"closed": 0}
    inner.futures[1].set_result("fresh")
    assert fresh.wait() == "fresh"
    with pytest.raises(ValueError, match="stop"), tr.together():
        lost = tr.call_async("close", t=1)
        raise ValueError("stop")
    with pytest.raises(RuntimeError, match="has not sent it"):
        lost.wait()  # its block failed: nothing was sent


def test_a_post_is_waited_for_before_the_next_post_and_at_a_flush_and_its_error_surfaces():
    inner = _Recorder()
    tr = ClientTransport(inner)
    tr.post("finish_round", t=0, scalars=torch.zeros(2))
    inner.futures[0].set_exception(RuntimeError("round 0 refused"))
    with pytest.raises(RuntimeError, match="round 0 refused"):
        tr.post("finish_round", t=1, scalars=torch.zeros(2))  # the previous post is waited for first
    assert len(inner.sent) == 1
    tr.post("finish_round", t=1, scalars=torch.zeros(2))
    inner.futures[1].set_result(None)
    tr.flush()
    tr.flush()  # nothing left to wait for
