"""Fixtures of the end-to-end suite: real servers on the CPU, started the way these tests need.

Every server of this suite runs with `--sleep-on-idle` and OMP_NUM_THREADS=1 (unless the caller's
environment sets it): on CPU an idle sglang scheduler otherwise busy-polls a whole core, and on the
shared 2-core test machine a 2-thread OpenMP pool in each server made batches 5-30x slower. Neither
changes what the server computes beyond float summation order, which TOPLOC tolerates by design.
`toploc_server` overrides the fixture of test/conftest.py for this directory only.

Servers come from the session's pool (e2e_servers.py): each one is started once per session,
ahead of the tests that need it, and stopped after the last of them. The modules run grouped by
the servers many of them share (`SHARED_FIRST`), so those are stopped early.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from e2e_servers import POOL, USES_SERVERS, Spec, server_fixture, server_keys
from hidden_states_fixtures import (  # noqa: F401 - fixtures
    disabled_server, engine_results, hf, hf_model, hs_noradix_server, hs_server, random_hf, refusal_server)

toploc_server = server_fixture(
    Spec("toploc", ("--toploc-verification", "--enable-metrics", "--log-level", "info")),
    doc="The main test server: --toploc-verification, radix cache on, default chunked prefill; "
        "sglang's --enable-metrics and INFO logs (test_toploc_metrics_endpoint reads both).")

plain_server = server_fixture(
    Spec("plain"),
    doc="The plugin loaded (through its entry point) but no sglang-rl flag given (the k-CBS tests "
        "use it too: k-CBS is asked for per request).")


@pytest.fixture(scope="session")
def tokenizer(model_path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


# --------------------------------------------------------------------------------------------
# the pool follows the run: which servers the remaining tests need


_index: dict[str, int] = {}
_HERE = Path(__file__).resolve().parent

# Servers that many modules share, in the order their modules run: the modules using the first run
# first, then those using the second, and so on (the rest last, each in file order), so the pool
# stops each of them early and the memory it holds goes to starting the next servers ahead.
SHARED_FIRST = ("hs-radix-chunked", "hs-noradix", "disabled", "plain")


# A server at most this many modules use is "few-shared": its modules run next to each other
# (more users, like the main toploc server, are up for most of the run anyway).
FEW_USERS = 3


def module_rank(keys: set) -> int:
    """Where a module whose tests need the servers `keys` runs among the e2e modules."""
    return next((rank for rank, key in enumerate(SHARED_FIRST) if key in keys), len(SHARED_FIRST))


def module_order(needs: dict) -> list:
    """The modules (dict order = file order) grouped by rank (`module_rank`); a module that needs
    none of SHARED_FIRST joins the group of the modules it shares a few-shared server with. Within a
    group, the users of a few-shared server run together, last in their group when that server's
    other users come in a later group, which then starts with them (so the server is up for
    adjacent modules, not for all the modules between)."""
    paths = list(needs)
    users: dict = {}
    for path in paths:
        for key in needs[path] - set(SHARED_FIRST):
            users.setdefault(key, []).append(path)
    few = {key: group for key, group in users.items() if 1 < len(group) <= FEW_USERS}
    rank = {path: module_rank(needs[path]) for path in paths}
    for path in paths:
        if rank[path] == len(SHARED_FIRST):
            rank[path] = min([rank[other] for key in few if path in few[key] for other in few[key]] + [rank[path]])

    def place(path) -> tuple:
        mine = [key for key in few if path in few[key]]
        head = any(rank[other] < rank[path] for key in mine for other in few[key])
        tail = any(rank[other] > rank[path] for key in mine for other in few[key])
        cluster = min([paths.index(few[key][0]) for key in mine] + [paths.index(path)])
        # within a group, a module that also needs a later group's shared server runs after the
        # others, as late as that server starts (the pool starts them in that order)
        latest = max([i for i, key in enumerate(SHARED_FIRST) if key in needs[path]] + [rank[path]])
        return rank[path], 0 if head else 2 if tail else 1, latest, cluster, paths.index(path)

    return sorted(paths, key=place)


# `make test` runs the e2e modules as two pytest runs side by side (`--e2e-part`): on 2 cores one
# run leaves a core idle while its test waits on one single-threaded server. The "toploc" part is
# the modules that need only these servers; the "main" part is every other module.
TOPLOC_PART_SERVERS = frozenset({"toploc", "noisy", "bf16"})
PARTS = ("all", "main", "toploc")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--e2e-part", choices=PARTS, default="all",
                     help="run only the end-to-end modules of this part (make test runs 'main' and 'toploc' "
                          "side by side): 'toploc' = the modules that need only the servers "
                          f"{', '.join(sorted(TOPLOC_PART_SERVERS))}; 'main' = the others")


def module_part(keys: set) -> str:
    """The part (`--e2e-part`) of a module whose tests need the servers `keys`."""
    return "toploc" if keys and keys <= TOPLOC_PART_SERVERS else "main"


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list) -> None:
    """Run the e2e modules grouped by the shared servers they need (`module_order`); other
    tests first, and every module's tests in their own order. With `--e2e-part`, only the modules
    of that part (the rest are deselected)."""
    modules: dict = {}
    for item in items:
        modules.setdefault(item.path, []).append(item)
    e2e = [path for path in modules if _HERE in Path(path).resolve().parents]
    needs = {path: set().union(*(server_keys(item) for item in modules[path])) for path in e2e}
    part = config.getoption("--e2e-part")
    if part != "all":
        other = [path for path in needs if module_part(needs[path]) != part]
        config.hook.pytest_deselected(items=[item for path in other for item in modules[path]])
        for path in other:
            del needs[path], modules[path]
    ordered = [path for path in modules if path not in needs] + module_order(needs)
    items[:] = [item for path in ordered for item in modules[path]]


def pytest_configure(config: pytest.Config) -> None:
    import torch

    torch.set_num_threads(1)  # the test process's own forwards beside busy servers (test/unit/conftest.py)
    config.addinivalue_line("markers", f"{USES_SERVERS}(*fixture_names): server fixtures a test gets other than "
                                       "as arguments (for the server pool's plan)")


def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.option.collectonly or getattr(session.config.option, "setupplan", False):
        return
    _index.clear()
    _index.update({item.nodeid: i for i, item in enumerate(session.items)})
    POOL.set_plan([server_keys(item) for item in session.items])


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.nodeid in _index:
        POOL.at_item(_index[item.nodeid])


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem):
    try:
        return (yield)
    finally:
        if item.nodeid in _index:
            POOL.after_item(_index[item.nodeid])


def pytest_sessionfinish(session: pytest.Session) -> None:
    POOL.close()


def pytest_terminal_summary(terminalreporter) -> None:
    lines = POOL.summary()
    if lines:
        terminalreporter.write_sep("-", "e2e servers (e2e_servers.POOL)")
        for line in lines:
            terminalreporter.write_line(line)
