"""Test-wide settings."""

import functools
import os
import shutil
import tempfile

import pytest

# Loads in tests neither read nor write the prepacked cache (~/.cache/quill) unless a test asks for it
# (tests/test_prepacked.py): a kernel a test patches must not meet a layout an earlier run cached.
os.environ["QUILL_CACHE"] = "0"
# The cache tests write files of at most ~130 MB into tmp dirs: they keep 256 MB free on the disk, not the 2 GB a
# user's cache keeps, and no user limit applies, so a nearly full test host does not turn every cache hit into
# a miss (a CI run with 1.1 GB free failed 21 tests that way).  Tests of the limits set their own.
os.environ["QUILL_CACHE_MIN_FREE"] = "256M"
os.environ.pop("QUILL_CACHE_MAX_SIZE", None)


def _cache_gguf_name_maps() -> None:
    """transformers' GGUF loader (an oracle here) builds gguf-py's TensorNameMap for every tensor it renames
    (~400 times per load, ~15 s on a 2-core machine): the map is a pure function of (architecture, layer
    count), so the tests keep one per key."""
    try:
        import gguf
    except ImportError:
        return
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map)


def pytest_configure(config):
    """Under pytest-xdist each worker runs on its own CPU: two workers on two cores, each process sized to
    one (quill's threads, torch's pool, the native team), instead of two teams of two spinning against
    each other on the same cores."""
    worker = getattr(config, "workerinput", {}).get("workerid")
    if worker is None:  # the run's own process (pytest-xdist's workers inherit the variable)
        config._quill_tools = os.environ["QUILL_TEST_TOOLS"] = tempfile.mkdtemp(prefix="quill-tools-")
    if worker is not None and hasattr(os, "sched_setaffinity"):
        cpus = sorted(os.sched_getaffinity(0))
        os.environ["QUILL_TEST_CPUS"] = ",".join(map(str, cpus))  # for `unpinned`
        if len(cpus) > 1:
            os.sched_setaffinity(0, {cpus[int(worker.removeprefix("gw")) % len(cpus)]})
        os.environ["OMP_NUM_THREADS"] = "1"
    _cache_gguf_name_maps()  # after the pin: gguf imports numpy, whose BLAS sizes its threads on import


def pytest_unconfigure(config):
    """The run's llama.cpp tool outputs (tests/llamacpp_util.py) go with it."""
    if hasattr(config, "_quill_tools"):
        shutil.rmtree(config._quill_tools, ignore_errors=True)


# The modules that take longest (seconds on a 2-core Zen 3, one process), run first: pytest-xdist hands
# each worker one module at a time as it frees up (`--dist loadfile --no-loadscope-reorder`), so starting
# with the long ones lets the two workers finish together instead of one waiting on a late Ray module.
LONGEST_FIRST = ("test_ray_serve", "test_gguf_kquants", "test_gguf_default_model", "test_prepacked",
                 "test_serve_http", "test_serve", "test_bench", "test_native_step", "test_cli", "test_qwen3_5_gguf",
                 "test_speculative", "test_serve_fuzz", "test_gguf_tokenizer", "test_serve_faults", "test_lm_eval")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: a module's order stays


@pytest.fixture(scope="module")
def unpinned():
    """This worker (and what it starts: a Ray cluster, a server) on every CPU again for a module whose
    processes mostly wait on each other: Ray's dozen processes on one CPU took 340 s against 200."""
    cpus = os.environ.get("QUILL_TEST_CPUS")
    if not cpus:
        yield
        return
    pinned = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
    try:
        yield
    finally:
        os.sched_setaffinity(0, pinned)
