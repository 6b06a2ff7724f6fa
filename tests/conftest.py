"""Shared test setup: Triton runs in the CPU interpreter when there is no GPU, every test is
seeded, and kernel outputs are NaN-poisoned before each launch."""

import os
import random
import sys
import zlib

import torch

if not torch.cuda.is_available():
    # Must be set before any @triton.jit function is created (i.e. before kfused kernels load).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from kfused import _alloc  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get("KFUSED_BOUNDS_CHECK", "1") != "0":
    # Every interpreted launch is bounds-checked: a load, store or atomic outside the span of
    # the launch's tensor arguments raises (kfused/triton_kernels/_bounds.py). KFUSED_BOUNDS_CHECK=0
    # turns it off.
    from kfused.triton_kernels import _bounds  # noqa: E402

    _bounds.install()

if os.environ.get("TRITON_INTERPRET") == "1":
    # Two caches the interpreter lacks (nested jit calls re-patching triton.language, a dtype
    # table rebuilt per call): same results, 16-33 % less time in the kernel test files measured
    # (kfused/triton_kernels/_interp_speed.py). KFUSED_INTERP_SPEED=0 turns them off.
    from kfused.triton_kernels import _interp_speed  # noqa: E402

    _interp_speed.install_unless_disabled()

if os.environ.get("KFUSED_GPU_CONFIGS") == "1" and not torch.cuda.is_available():
    # A test aid: the interpreter runs every kernel with the block sizes, grids and splits a
    # GPU would get (the compile check's switch), e.g. 128-column output tiles and their
    # low-rank packing instead of the interpreter's 32 — code paths CI otherwise only
    # compiles. tests/test_gpu_configs.py runs a selection this way in every CI run.
    from kfused.triton_kernels import _common as _tk_common  # noqa: E402

    _tk_common._AOT_TARGET["on"] = True

# Shapes and data are drawn afresh each run; KFUSED_TEST_SEED=<n> replays a run (the seed is
# printed in the pytest header).
BASE_SEED = int(os.environ.get("KFUSED_TEST_SEED", random.SystemRandom().randrange(2**31)))
# processes started from this one (pytest-xdist's workers, subprocess tests) draw the same
# shapes: xdist refuses a run whose workers collected different parametrisations
os.environ["KFUSED_TEST_SEED"] = str(BASE_SEED)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def seed_for(nodeid: str) -> int:
    """The seed a test runs under: KFUSED_TEST_SEED mixed with the test's node id."""
    return (BASE_SEED + zlib.crc32(nodeid.encode())) % (2**31)


@pytest.fixture(autouse=True)
def _seed_and_poison(request):
    seed = seed_for(request.node.nodeid)
    random.seed(seed)
    torch.manual_seed(seed)
    old = _alloc.set_poisoning(True)
    yield
    _alloc.set_poisoning(old)


_TORCH_THREADS = torch.get_num_threads()
# pytest-xdist workers (the README's test command runs two): each holds a core of its own
_XDIST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)


def _background_busy() -> bool:
    """A background run (the GPU-config files, the structural compile run) holds a core."""
    bg = sys.modules.get("tests._background")
    helpers = sys.modules.get("tests._perf_helpers")
    return bool((bg is not None and bg.running())
                or (helpers is not None and helpers.structure_running()))


@pytest.fixture(autouse=True)
def _torch_threads():
    # While a background run holds one of CI's 2 cores, torch's pool of two intra-op threads
    # waits at every parallel region for the thread that has no core: a test of many small
    # CPU ops ran 10 s alone and 155 s beside the background runs. One thread then; torch's
    # default again once they are done. (Each test starts from the count chosen here, also
    # when an earlier one changed it.)
    want = 1 if _XDIST_WORKERS > 1 or _background_busy() else _TORCH_THREADS
    if torch.get_num_threads() != want:
        torch.set_num_threads(want)
    yield


@pytest.fixture
def seed(request):
    """This test's seed (for generators and hypothesis); replayed by KFUSED_TEST_SEED."""
    return seed_for(request.node.nodeid)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Every failure names the seed that replays it."""
    outcome = yield
    rep = outcome.get_result()
    if rep.failed and os.environ.get("KFUSED_FAILURE_LOG"):
        # written as it happens: a run cut by a time limit (the lent GPU's device calls) has
        # printed no failure report yet, only the test's name
        try:
            with open(os.environ["KFUSED_FAILURE_LOG"], "a") as f:
                f.write(f"==== {item.nodeid} ({rep.when}; KFUSED_TEST_SEED={BASE_SEED})\n"
                        f"{rep.longreprtext[-6000:]}\n")
        except OSError:
            pass
    if rep.failed:
        rep.sections.append((
            "kfused seed",
            f"KFUSED_TEST_SEED={BASE_SEED} (this test's seed {seed_for(item.nodeid)}); replay "
            f"with: KFUSED_TEST_SEED={BASE_SEED} python3 -m pytest '{item.nodeid}'"))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if terminalreporter.stats.get("failed") or terminalreporter.stats.get("error"):
        terminalreporter.write_line(f"kfused: failures above ran with KFUSED_TEST_SEED={BASE_SEED}; "
                                    "set it to replay them")


# The structural compile run of the perf tests (tests/_perf_helpers.py) takes about 9 minutes
# on a fresh machine: start it as soon as a test that needs it is collected, so it runs beside
# the interpreter tests instead of after them.
_STRUCTURE_TESTS = ("test_perf_structure.py", "test_triton_sm90_compile.py")


# The kernel files under the GPU's block sizes (tests/test_gpu_configs.py), about 13 minutes of
# child pytest runs: started at collection too, one after another beside the main run.
_GPU_CONFIG_TEST = "test_kernel_tests_pass_with_gpu_block_sizes"


def _start_gpu_config_runs(items) -> None:
    # (a pytest-xdist worker collects every test but runs a share: its tests run their own)
    if torch.cuda.is_available() or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    runs = [(item.callspec.params["name"], seed_for(item.nodeid)) for item in items
            if getattr(item, "originalname", None) == _GPU_CONFIG_TEST
            and os.path.basename(str(item.fspath)) == "test_gpu_configs.py"]
    if runs:
        from tests import _background

        _background.start(runs)


@pytest.hookimpl(trylast=True)        # after -k / -m deselection
def pytest_collection_modifyitems(session, config, items):
    if config.option.collectonly:
        return
    _start_gpu_config_runs(items)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # every worker collects every test, one runs the structure tests (their xdist_group):
        # it starts the run when its first structure test asks (structure_report())
        return
    if not any(os.path.basename(str(item.fspath)) in _STRUCTURE_TESTS for item in items):
        return
    try:
        import triton.backends.nvidia  # noqa: F401  (the tests skip without it)
    except ImportError:
        return
    from tests._perf_helpers import start_structure_report

    start_structure_report()


def pytest_sessionfinish(session, exitstatus):
    helpers = sys.modules.get("tests._perf_helpers")
    if helpers is not None:
        helpers.stop_structure_report()
    background = sys.modules.get("tests._background")
    if background is not None:
        background.stop()


@pytest.fixture
def launches(monkeypatch):
    """``launches(module, name)`` -> a list that records the grid of every launch of the
    Triton kernel ``module.name`` made from then on (the kernel still runs)."""
    def spy(module, name):
        grids = []
        real = getattr(module, name)

        class Spy:
            def __getitem__(self, grid):
                grids.append(grid)
                return real[grid]

        monkeypatch.setattr(module, name, Spy())
        return grids
    return spy


@pytest.fixture
def device():
    return DEVICE


def pytest_report_header(config):
    from kfused.triton_kernels._common import _AOT_TARGET

    gpu_cfg = "; GPU block sizes (KFUSED_GPU_CONFIGS=1)" if _AOT_TARGET["on"] else ""
    from kfused.triton_kernels import _bounds

    bounds = "; bounds-checked launches" if _bounds.installed() else ""
    from kfused.triton_kernels import _interp_speed

    speed = "; interpreter caches" if _interp_speed.installed() else ""
    return (f"kfused tests on {DEVICE}; TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '0')}; "
            f"torch {torch.__version__}; KFUSED_TEST_SEED={BASE_SEED}{gpu_cfg}{bounds}{speed}")
