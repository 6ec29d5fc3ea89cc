"""Puts the shared anchors' folder on `sys.path`, so `from common import ...` finds their timing
helpers: ../shared/bench/anchors beside the checkout, or TRAINREC_ANCHORS_DIR. The scripts here
that are copies of a shared anchor import this first."""

import os
import sys

DIR = os.environ.get("TRAINREC_ANCHORS_DIR",
                     os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "shared", "bench",
                                  "anchors"))
if DIR not in sys.path:
    sys.path.insert(0, DIR)
