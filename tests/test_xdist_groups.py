"""The README's test command runs two pytest-xdist workers with ``--dist loadgroup``: the tests
that share one expensive run (the CUDA C++ compile of test_csrc_compile / test_csrc_sass, the
structural compile of test_perf_structure / test_triton_sm90_compile) carry an
``xdist_group`` mark so that one worker runs them all and the run happens once. When the
grouping is lost nothing fails, the run just happens on both workers (several CPU minutes
each). This checks that the mark reached the scheduler."""

import os

import pytest

pytestmark = pytest.mark.xdist_group("csrc")


def test_xdist_group_reaches_the_scheduler(request):
    # (on a worker, xdist keeps --dist loadgroup as option.loadgroup; its "dist" reads "no")
    if not (os.environ.get("PYTEST_XDIST_WORKER")
            and getattr(request.config.option, "loadgroup", False)):
        pytest.skip("checks pytest-xdist's --dist loadgroup (the README's test command)")
    nodeid = request.node.nodeid
    assert nodeid.endswith("@csrc"), (
        f"pytest-xdist did not group this test (node id {nodeid!r} has no '@csrc'): with "
        f"pytest {pytest.__version__} the xdist_group marks are ignored "
        "(pytest-dev/pytest-xdist#1386: pytest 9.2 no longer reads the node id xdist "
        "rewrites) and the grouped compile runs happen on every worker; install the pinned "
        "test dependencies: pip install -e \".[dev]\"")
