"""What the composition root hands down to lower layers, so that they never import the layers above them.

Torch-free and in core's lowest layer, so filling it costs nothing (listing plugins or templates loads no torch):

- the plugins' weight formats: ``dgpp.plugins.manager()`` provides its ``dgpp_quant_formats`` hook when it builds
  the process-wide plugin manager; ``dgpp.quant.registry`` reads it on a lookup;
- the demo checkpoint builder: each entry point (``dgpp.cli.main``, ``dgpp.bench.cli.main``) provides
  ``dgpp.demo.ensure_demo_checkpoint`` through ``dgpp.demo.enable_demo_checkpoints``; ``dgpp.checkpoint.resolve``
  calls it for a ``dgpp-demo/*`` model id.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

# every plugin's answer to ``dgpp_quant_formats`` (a list of QuantFormat or None), in the manager's call order
FormatAnswers = Callable[[], Iterable[Iterable[Any] | None]]
# ``dgpp-demo/<name>`` -> the directory of that demo checkpoint, built on first use
DemoBuilder = Callable[[str], Path]

_format_answers: FormatAnswers | None = None
_demo_builder: DemoBuilder | None = None


def provide_plugin_formats(answers: FormatAnswers) -> None:
    """Called by the plugin manager's builder; ``answers()`` runs on the registry's first lookup, not here."""
    global _format_answers
    _format_answers = answers


def plugin_format_answers() -> FormatAnswers | None:
    """What the plugin manager handed in (None before it was built)."""
    return _format_answers


def provide_demo_builder(builder: DemoBuilder) -> None:
    """Called by an entry point: ``dgpp-demo/*`` ids resolve through ``builder`` from now on."""
    global _demo_builder
    _demo_builder = builder


def demo_builder() -> DemoBuilder | None:
    """What the entry point handed in (None when the program enabled no demo checkpoints)."""
    return _demo_builder
