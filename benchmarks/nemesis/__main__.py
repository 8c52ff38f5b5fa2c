"""``python benchmarks/nemesis [--short] ...``: the nemesis's harness (:mod:`nemesis.run`)."""
import os
import sys

if not __package__:   # run as a directory: import it as the package it is, from benchmarks/
    sys.path[0] = os.path.dirname(os.path.abspath(sys.path[0]))

from nemesis.run import main  # noqa: E402

sys.exit(main())
