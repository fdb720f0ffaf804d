"""Imported first by the forkserver of :mod:`miles_multilora.child_process`: its children do not run
the parent's main script again.

multiprocessing prepares every child it starts (forkserver or spawn) by running the parent's main
script as ``__mp_main__``, unless the child's ``__main__`` already has that script's path. A
benchmark or driver script that imports the model stack at its top made every reward process and
spec check start in seconds (3 s each on a 2-core CPU) instead of milliseconds. The parent names
its main script in :data:`~miles_multilora.child_process.PARENT_MAIN_ENV` before it starts the
forkserver; this module gives the forkserver's ``__main__`` that path, which every child then
inherits, so the preparation skips it.
Children only run library functions on library objects, which never need the parent's ``__main__``.
"""

from __future__ import annotations

import os
import sys

from miles_multilora.child_process import PARENT_MAIN_ENV

_path = os.environ.get(PARENT_MAIN_ENV)
if _path:
    sys.modules["__main__"].__file__ = _path
