"""Shared fixtures: tiny random-weight models built once per test session. The hooks below give each xdist worker
a core of its own, and keep a run of the unit tier from importing the files whose every test it deselects."""
from __future__ import annotations

import ast
import functools
import gc
import itertools
import logging
import os
import re
from pathlib import Path

import pytest

# what holds a worker longest first (Ray's start, the default model, real processes, fuzzing, compiles)
HEAVIEST_FIRST = ("ray", "default_model", "server", "fuzz", "slow", "browser", "compat", "prometheus")


def pytest_configure(config: pytest.Config) -> None:
    # before anything imports torch or numba: both size their thread pools from the cores the process may use
    _core_of_its_own()
    # the tests make objects by the million (hypothesis, schemathesis, requests): the cyclic collector's young
    # generation every 10,000 allocations rather than every 700, and the older ones as often relative to it
    gc.set_threshold(10_000, 10, 10)
    if config.getoption("numprocesses", None) and not hasattr(config, "workerinput"):
        return  # pytest-xdist's controller runs no test: its workers start once it has configured
    import torch

    if not torch.cuda.is_available():  # Triton kernels (the CUDA decode path) run on CPU tensors in its interpreter
        os.environ.setdefault("TRITON_INTERPRET", "1")


def _core_of_its_own() -> None:
    """An xdist worker runs on one core, a core of its own while there are as many cores as workers. Two workers
    on two cores otherwise each ran their engines' kernels on two threads: four threads on two cores, every
    parallel region waiting for a thread that the other worker held (the unit tier took twice the CPU). What a
    worker starts (servers, engine processes, Ray) inherits its core: each worker's processes share one core,
    as the two workers share the machine's two."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if worker is None or count is None or int(count) > len(cores):
        return
    os.sched_setaffinity(0, {cores[int(worker.removeprefix("gw"))]})


def _never_selects(markexpr: str, marks: set[str]) -> bool:
    """Whether -m MARKEXPR deselects every test that carries `marks`, whatever other marks it carries (only the
    names in the expression matter, so each set of those is tried)."""
    expression, names = _compiled(markexpr)
    others = names - marks
    added = itertools.chain.from_iterable(itertools.combinations(others, n) for n in range(len(others) + 1))
    return not any(expression.evaluate(_carrying(marks | set(extra))) for extra in added)


def _carrying(marks: set[str]):
    return lambda name, **kwargs: name in marks


@functools.cache
def _compiled(markexpr: str):
    from _pytest.mark.expression import Expression  # what -m itself evaluates (private, stable since pytest 6)

    return Expression.compile(markexpr), set(re.findall(r"\w+", markexpr)) - {"and", "or", "not"}


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """A test file whose module-level `pytestmark` makes -m deselect each of its tests, whatever marks the tests
    add, is not imported: the unit tier does not import Ray, Playwright or schemathesis for files it would not
    run."""
    markexpr = config.getoption("markexpr")
    if (not markexpr or not collection_path.name.startswith("test_") or collection_path.suffix != ".py"
            or set(re.findall(r"(\w+)\s*\(", markexpr)) - {"not", "and", "or"}):
        return None  # (a marker's keyword arguments in -m are left to pytest)
    module_marks = _module_marks(collection_path)
    return True if module_marks and _never_selects(markexpr, module_marks) else None


def _module_marks(path: Path) -> set[str]:
    """The names in `pytestmark = pytest.mark.NAME` or a list of them (calls included) at a module's top level."""
    source = path.read_bytes()
    if b"pytestmark" not in source:  # most files: not parsed
        return set()
    try:
        tree = ast.parse(source, str(path))
    except (SyntaxError, ValueError):
        return set()  # pytest reports it when it collects the file
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark"
                                                for t in node.targets):
            values = node.value.elts if isinstance(node.value, (ast.List, ast.Tuple)) else [node.value]
            return {name for value in values if (name := _mark_name(value))}
    return set()


def _mark_name(node: ast.expr) -> str | None:
    node = node.func if isinstance(node, ast.Call) else node
    if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "mark"
            and isinstance(node.value.value, ast.Name) and node.value.value.id == "pytest"):
        return node.attr
    return None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files in the order pytest-xdist should hand them out (the Makefile turns its own reordering, by number of
    tests, off): files with the heaviest marker first, then files with more tests. A file of a few long tests
    handed out last would be the whole run's tail, one worker idle beside it. A file's tests keep their order."""
    files: dict[str, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::", 1)[0], []).append(item)

    def weight(tests: list[pytest.Item]) -> tuple[int, int]:
        marks = {mark.name for item in tests for mark in item.iter_markers()}
        return (min((HEAVIEST_FIRST.index(m) for m in marks & set(HEAVIEST_FIRST)), default=len(HEAVIEST_FIRST)),
                -len(tests))

    items[:] = [item for tests in sorted(files.values(), key=weight) for item in tests]
    for item in items:
        # fuzzing is volume, not reach: under coverage's line tracer (Python 3.11's sys.settrace) its thousands of
        # inputs cost half again their CPU. Coverage is the example tests' (docs/development.md, "Line coverage")
        if item.get_closest_marker("fuzz"):
            item.add_marker(pytest.mark.no_cover)


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    """What the imports and the collection made (torch's, transformers' and every test module's millions of
    objects) lives to the end: frozen, the cyclic collector stops walking it at each of its full passes during
    the tests (docs/development.md, "Where the time goes")."""
    gc.freeze()


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    # and at exit: the interpreter's last collections walked the whole heap for seconds in each process
    gc.freeze()


@pytest.fixture(autouse=True)
def _restore_root_log_handlers(request):
    """`gateway` main() (config-error tests) sets up logging with basicConfig(force=True): a root handler on the
    stderr pytest captured for that test (once pytest closes it, later tests' log lines would end in "--- Logging
    error ---"), and pytest's own handlers for the whole session gone (records logged between tests, by an engine
    thread, then reached logging's last resort: tracebacks in make test's output). Such handlers go, pytest's come
    back."""
    yield
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(getattr(handler, "stream", None), "closed", False):
            root.removeHandler(handler)
    plugin = request.config.pluginmanager.get_plugin("logging-plugin")
    for handler in (plugin.log_cli_handler, plugin.log_file_handler) if plugin else ():
        if handler not in root.handlers:
            root.addHandler(handler)


@pytest.fixture(scope="session", autouse=True)
def _responses_db_in_tmp(tmp_path_factory):
    """Apps built from settings that name no `responses_db` keep stored responses in this session's tmp folder,
    never in the user's cache folder."""
    path = tmp_path_factory.mktemp("responses") / "responses.sqlite3"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("gateway.response_store.default_db_path", lambda: path)
        yield


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    from bench.tiny_models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def k_quant_llama_dir(tmp_path_factory):
    """A tiny llama whose every K (hidden, intermediate, heads x dim) is whole 256-weight super-blocks."""
    from bench.tiny_models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama-256"), "llama", hidden_size=256,
                            intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory):
    from bench.tiny_models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory):
    from bench.tiny_models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), "qwen3")


@pytest.fixture(scope="session")
def tiny_tools_dir(tmp_path_factory):
    """A tiny Qwen2 whose chat template renders tools (Hermes <tool_call> format)."""
    from bench.tiny_models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-tools"), "qwen2", tools=True)


@pytest.fixture(scope="session")
def tiny_tiktoken_dir(tmp_path_factory):
    from bench.tiny_models import build_tiktoken_model

    return build_tiktoken_model(tmp_path_factory.mktemp("tiny-tiktoken"))
