"""``querator worker MODULE:FUNCTION --queue Q``: run a handler as a worker process.

The runner itself (options, import by path, burst mode, signals) lives with the
Worker, in ``querator._worker.runner``; this module only registers the command.
"""

from __future__ import annotations

from .._worker import runner
from ._common import Commands


def register(commands: Commands) -> None:
    runner.add_arguments(commands.leaf("worker", runner.run, runner.HELP))
