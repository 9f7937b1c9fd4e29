"""TVMScript's macro calls without a source lookup per Python frame.

Each ``@T.macro`` call in TVM 0.27 finds the parser that is running it by walking the callers'
frames with ``inspect.getouterframes``, which also reads every frame's source lines and looks up
its module by a scan of ``sys.modules``. Macros nest deep inside the parser, so the persistent
kernel's parse took 18 s of which 17 s went to that lookup (more, the more modules a process has
imported: PyTorch alone brings thousands). :func:`install` replaces the lookup with a walk up
``frame.f_back`` that checks the same frames' globals in the same order and returns the same parser.
"""

from __future__ import annotations

import sys

from tvm.script.parser.core.parser import ScriptMacro


def _find_parser_def(self):
    """The innermost running parser, as TVM's own lookup finds it, without the frames' sources."""
    frame = sys._getframe()
    while frame is not None:
        parser = frame.f_globals.get(ScriptMacro.parser_object_name)
        if parser is not None:
            return parser
        frame = frame.f_back
    raise RuntimeError(f"{ScriptMacro.parser_object_name} not available")


def install() -> None:
    """Use :func:`_find_parser_def` for every TVMScript macro from now on (idempotent)."""
    ScriptMacro._find_parser_def = _find_parser_def
