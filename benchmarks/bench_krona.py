"""KronA benchmark entry script; the cases live in :mod:`kfused.cases.krona`.

    python benchmarks/bench_krona.py --fold-numerics   # the fold's numerics table (CPU)

`kfused bench krona` runs the benchmark cases through the shared harness.
"""

import sys

from kfused.cases.krona import fold_numerics

if __name__ == "__main__":
    if "--fold-numerics" in sys.argv:
        fold_numerics()
    else:
        print(__doc__)
